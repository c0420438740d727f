"""Services of the apps (CLI, pipelines, evals, benchmarks): user errors, devices and dtypes, policy and
backend names from the user, model sources, guard-plan files, environment metadata for results,
atomic file writes, and timers. Nothing below the apps imports this module.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import importlib.metadata
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from fp4vis.backends import AUTO, REFERENCE, backend_names, get_backend, kernel_backend_name
from fp4vis.files import atomic_write
from fp4vis.patching import GuardPlan, GuardPlanError, patch
from fp4vis.policy import POLICIES, Policy, get_policy


class UsageError(ValueError):
    """A user-facing error (bad option, missing path, GPU-only option without a GPU). The CLI prints
    its message without a traceback and exits with status 2."""


# --------------------------------------------------------------------------------------------------
# devices, dtypes, policies, backends, guard plans


# how the apps torch.compile a pipeline's transformers (fp4vis.pipelines.wan_video.compile_transformers):
# diffusers' regional compilation (compile_repeated_blocks) or the whole model (ModelMixin.compile)
COMPILE_MODES = ("regional", "full")
DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
          "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32}


# the seeds torch's generators accept (torch.Generator.manual_seed, torch.manual_seed); a negative one counts
# modulo 2**64
SEED_MIN, SEED_MAX = -(2 ** 63), 2 ** 64 - 1


def derived_seed(seed: int, offset: int) -> int:
    """``seed + offset`` as torch's generators take it: modulo 2**64, as they count a negative seed, so a
    seed derived from the user's (a prompt's, an image's) never overflows (the last seed plus one is 0)."""
    return (int(seed) + int(offset)) % 2 ** 64


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """'auto' -> the first CUDA GPU when one is visible, else the CPU; 'cuda' without a GPU raises."""
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise UsageError(f"device: {str(device)!r} is not a device; use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"device {str(device)!r} needs a CUDA GPU, but none is visible here "
                         "(torch.cuda.is_available() is False); use --device cpu or --device auto")
    return dev


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[str(dtype).lower()]
    except KeyError:
        raise UsageError(f"dtype: unknown dtype {dtype!r}; use one of bfloat16, float16, float32") from None


def check_backend(backend: str, device: torch.device) -> str:
    """A known backend name; the kernel backends need a CUDA device (the reference and 'auto' work
    everywhere)."""
    known = backend_names()
    if backend not in known:
        raise UsageError(f"backend: unknown backend {backend!r}; use one of {', '.join(known)}")
    if backend not in (AUTO, REFERENCE) and device.type != "cuda":
        raise UsageError(f"backend {backend!r} runs only on a CUDA GPU (device here: {device}); "
                         "use --backend auto or --backend reference on the CPU")
    return backend


def backend_in_use(backend: str, device: torch.device) -> str:
    """The backend that computes FP4 attention on ``device`` under the option ``backend``: a named one itself;
    ``auto``'s pick there, the kernel for this GPU where it loads and can run, else the reference. For labels:
    a call the kernel does not support still falls back to the reference, with its warning."""
    if backend != AUTO:
        return backend
    kernel = kernel_backend_name(torch.device(device))
    loaded = get_backend(kernel) if kernel is not None else None
    return kernel if loaded is not None and loaded.unavailable_reason() is None else REFERENCE


def attention_label(policy: str | Policy, backend: str, device: torch.device, guard: Any = None) -> str:
    """What a run under ``policy`` computes its attention with, as progress bars and headers say it: the
    model's own attention for the exact baseline (``bf16, the model's attention``), else the policy and the
    backend that runs it (``fast, hopper``; ``wan_fast + guard plan, reference``)."""
    pol = get_policy(policy)
    if pol.method == "exact" and guard is None:   # policy_applied leaves the model as it is
        return f"{pol.name}, the model's attention"
    return f"{pol.name}{' + guard plan' if guard is not None else ''}, {backend_in_use(backend, device)}"


def warn_reference_fallback(backend: str, device: torch.device, policy: str | Policy, command: str) -> bool:
    """The warning the README promises where ``backend="auto"`` falls back to the reference, for a command
    on a device without an FP4 kernel (the CPU): ``fp4vis.attention`` itself stays silent for CPU tensors
    (every call would warn; no kernel exists for a CPU), so the command says it once. True when it warned."""
    if backend != AUTO or device.type == "cuda" or get_policy(policy).method == "exact":
        return False
    import warnings

    warnings.warn(f"{command}: no FP4 attention kernel runs on the {device.type.upper()}; policy "
                  f"{get_policy(policy).name!r} runs on the reference emulation (exact numerics, slow); "
                  "--backend reference chooses it and silences this", UserWarning, stacklevel=2)
    return True


def resolve_policies(names: str | Sequence[str], *, allow_bf16: bool = True) -> list[Policy]:
    """Policy names (comma-separated string or a list) -> Policy objects, with a clear error."""
    if isinstance(names, str):
        names = [n for n in names.split(",") if n.strip()]
    out = []
    for n in names:
        n = n.strip() if isinstance(n, str) else n
        try:
            p = get_policy(n)
        except ValueError as e:
            raise UsageError(str(e)) from None
        if not allow_bf16 and p.method == "exact":
            continue
        out.append(p)
    if not out:
        raise UsageError(f"no policy given; known policies are {', '.join(sorted(POLICIES))}")
    return out


def load_guard_plan(path: str | os.PathLike | None) -> Any:
    """Load a GuardPlan JSON written by ``fp4vis calibrate`` (None passes through)."""
    if path is None:
        return None
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"guard plan: file {str(path)!r} does not exist (write one with `fp4vis calibrate`)")
    try:
        return GuardPlan.load(p)
    except GuardPlanError as exc:
        raise UsageError(str(exc)) from None


def _check_writable_dir(d: Path, option: str) -> None:
    try:
        d.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=d):
            pass
    except OSError as exc:
        raise UsageError(f"{option}: cannot write in {str(d)!r} ({exc.strerror or exc})") from None


def check_output_file(path: str | os.PathLike, option: str) -> Path:
    """Before any work: ``path`` can be written as a file (not a directory; its folder exists or can be
    made, and is writable). Raises UsageError naming the option."""
    p = Path(os.path.expanduser(str(path)))
    if p.is_dir():
        raise UsageError(f"{option}: {str(path)!r} is a directory; give a file name")
    if p.parent.exists() and not p.parent.is_dir():
        raise UsageError(f"{option}: {str(p.parent)!r} is a file, not a directory")
    _check_writable_dir(p.parent, option)
    return p


def check_output_dir(path: str | os.PathLike, option: str) -> Path:
    """Before any work: ``path`` is a writable directory, or can be made one. Raises UsageError."""
    p = Path(os.path.expanduser(str(path)))
    if p.exists() and not p.is_dir():
        raise UsageError(f"{option}: {str(path)!r} is a file, not a directory")
    _check_writable_dir(p, option)
    return p


def plan_for(plan: Any, policy: str | Policy) -> Any:
    """The guard plan where it was calibrated for ``policy`` (by name), else None: an eval over several
    policies guards only the one its plan protects (the plan's thresholds are that policy's range)."""
    if plan is None:
        return None
    return plan if get_policy(policy).name == plan.policy.name else None


def check_plan_policy(plan: Any, policy: str | Policy, option: str = "--guard-plan") -> None:
    """A single-policy run (generate) with a plan calibrated for another policy is a user error."""
    if plan is not None and get_policy(policy).name != plan.policy.name:
        raise UsageError(f"{option}: the plan was calibrated for policy {plan.policy.name!r}, not "
                         f"{get_policy(policy).name!r}: pass that policy, or calibrate for this one")


def guard_plan_summary(plan: Any) -> Any:
    """A JSON-able view of a guard plan for sidecars and reports."""
    if plan is None:
        return None
    for attr in ("to_dict", "as_dict"):
        if hasattr(plan, attr):
            return getattr(plan, attr)()
    import dataclasses

    if dataclasses.is_dataclass(plan):
        return dataclasses.asdict(plan)
    return str(plan)


@contextlib.contextmanager
def policy_applied(model: Any, policy: str | Policy, *, guard: Any = None, backend: str = "auto",
                   layers: Any = None, **patch_kwargs: Any) -> Iterator[Any]:
    """Run a block with ``model`` (a module or a diffusers pipeline) under an attention policy.

    ``bf16`` without a guard plan leaves the model untouched: it is the baseline, the model's own
    attention (SDPA). Every other policy goes through ``fp4vis.patch`` and is removed afterwards;
    ``patch_kwargs`` (``decoder=True``, ``cross_attention=True``, ``range_check=...``) pass through.
    """
    pol = get_policy(policy)
    if pol.method == "exact" and guard is None:
        yield None
        return
    handle = patch(model, policy=pol, layers=layers, guard=guard, backend=backend, **patch_kwargs)
    try:
        yield handle
    finally:
        handle.remove()


# The warnings of every command pass through one filter, WarningLog: fp4vis' own (a fallback to the reference
# or to exact attention, a range warning, the CPU-size warning) are printed, once per message: they are the
# visible fallback the project promises. Those the libraries underneath issue on their own (flash-attn-4's CuTe
# DSL argument warning, CuTe DSL's loop-size hint, deprecation notes) are not the user's doing: they are counted
# and recorded in the run's JSON and Markdown (``environment()["library_warnings"]``), not printed.
OWN_MODULES = ("fp4vis", "__main__")   # issuers whose warnings are shown: fp4vis, and the user's own script
_ACTIVE: list[WarningLog] = []          # the logs open now, outermost first (the CLI's, then an eval run's)


def _issuer(frame: Any) -> str:
    """The module whose code called ``warnings.warn``: the first frame above the warnings machinery. Not the
    module a warning is attributed to, which ``stacklevel`` moves (fp4vis' fallback warnings point at the
    caller's code, a library's may point into fp4vis')."""
    while frame is not None and frame.f_globals.get("__name__") == "warnings":
        frame = frame.f_back
    return "?" if frame is None else str(frame.f_globals.get("__name__", "?"))


def _is_own(module: str) -> bool:
    return any(module == m or module.startswith(m + ".") for m in OWN_MODULES)


def _short_path(filename: str) -> str:
    """A source path without the machine's prefix: from the package folder on where it is installed."""
    parts = Path(filename).parts
    for anchor in ("site-packages", "dist-packages"):
        if anchor in parts:
            return "/".join(parts[parts.index(anchor) + 1:])
    return Path(filename).name


class WarningLog:
    """The warnings raised inside a block, sorted by who issued them (the module that called
    ``warnings.warn``, whatever its ``stacklevel``). fp4vis' own are kept in ``messages`` (each distinct
    message once, at most ``limit``) for the reports and printed to stderr the first time any open log sees
    them; a library's are counted in ``library`` and not printed. Logs nest (the CLI's around a command, an
    eval's around each run): an inner log passes what it kept to the one around it when it closes. With
    Python's -W option or PYTHONWARNINGS set, library warnings are shown as Python shows them, and counted."""

    def __init__(self, echo: bool = True, limit: int = 20):
        self.echo, self.limit = echo, limit
        self.messages: list[str] = []
        self.library: dict[tuple[str, str, str], dict[str, Any]] = {}   # (module, category, message) -> record

    def __enter__(self) -> WarningLog:
        import warnings

        self._ctx = warnings.catch_warnings()
        self._ctx.__enter__()
        self._shown_by_python = warnings.showwarning if sys.warnoptions else None
        # after the filters already set (Python's defaults ignore DeprecationWarning outside __main__, libraries
        # silence their own notes): everything else reaches ``_show`` at every occurrence, so counts are counts
        warnings.filterwarnings("always", append=True)
        warnings.showwarning = self._show
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE.remove(self)
        self._ctx.__exit__(*exc)
        if _ACTIVE:
            outer = _ACTIVE[-1]
            outer.messages += [m for m in self.messages if m not in outer.messages][: outer.limit - len(outer.messages)]
            for key, rec in self.library.items():
                outer._count(key, rec["where"], rec["count"])

    def _show(self, message, category, filename, lineno, file=None, line=None) -> None:
        module = _issuer(sys._getframe(1))
        if not _is_own(module):
            self._count((module, category.__name__, str(message)), f"{_short_path(filename)}:{lineno}", 1)
            if self._shown_by_python is not None:
                self._shown_by_python(message, category, filename, lineno, file, line)
            return
        msg = f"{category.__name__}: {message}"
        if self.echo and not any(msg in log.messages for log in _ACTIVE):
            from tqdm import tqdm

            tqdm.write(f"warning: {msg}", file=sys.stderr)   # between progress bars, not through one
        if msg not in self.messages and len(self.messages) < self.limit:
            self.messages.append(msg)

    def _count(self, key: tuple[str, str, str], where: str, times: int) -> None:
        rec = self.library.setdefault(key, {"module": key[0], "category": key[1], "message": key[2],
                                            "where": where, "count": 0})
        rec["count"] += times


def library_warnings() -> list[dict[str, Any]]:
    """The library warnings the open logs have counted so far (module, category, message, where, count),
    in the order they first came: what ``environment()`` records for a run's report."""
    merged: dict[tuple[str, str, str], dict[str, Any]] = {}
    for log in _ACTIVE:
        for key, rec in log.library.items():
            merged.setdefault(key, {**rec, "count": 0})["count"] += rec["count"]
    return list(merged.values())


@contextlib.contextmanager
def loading_bars(enabled: bool) -> Iterator[None]:
    """The loading and download bars of transformers, diffusers and huggingface_hub on or off, through their
    own switches, and restored after (``--no-progress`` hides them with fp4vis' own bars)."""
    if enabled:
        yield
        return
    import diffusers.utils.logging as diffusers_logging
    import huggingface_hub.utils as hub_utils
    import transformers.utils.logging as transformers_logging

    was = (transformers_logging.is_progress_bar_enabled(), diffusers_logging.is_progress_bar_enabled(),
           not hub_utils.are_progress_bars_disabled())
    transformers_logging.disable_progress_bar()
    diffusers_logging.disable_progress_bar()
    hub_utils.disable_progress_bars()
    try:
        yield
    finally:
        for on, lib in zip(was, (transformers_logging, diffusers_logging)):
            if on:
                lib.enable_progress_bar()
        if was[2]:
            hub_utils.enable_progress_bars()


def require(module: str, pip_name: str | None = None, what: str = "this command") -> None:
    """Import check with an install hint (optional dependencies: torchvision, matplotlib, skimage)."""
    import importlib

    try:
        importlib.import_module(module)
    except ImportError:
        raise UsageError(f"{what} needs {pip_name or module}: pip install {pip_name or module}") from None


# --------------------------------------------------------------------------------------------------
# model sources


def is_local_path(source: str) -> bool:
    """True when ``source`` names a local path rather than a Hub id (``org/name``)."""
    if os.path.exists(source):
        return True
    if source.startswith(("/", "./", "../", "~", ".\\")) or os.path.isabs(source):
        return True
    return source.count("/") > 1 or "\\" in source


def display_source(source: str) -> str:
    """A model source as reports show it: a shipped name (``fp4vis:digits-wan``) or a Hub id as given, a
    local folder relative to the working directory, or by its name where it lies outside it (no
    absolute path of this machine in a report)."""
    if not isinstance(source, str) or source.startswith("fp4vis:") or not is_local_path(source):
        return source
    path = Path(os.path.expanduser(source)).resolve()
    try:
        return str(path.relative_to(Path.cwd().resolve()))
    except ValueError:
        return path.name


def check_model_source(source: str, what: str = "model") -> tuple[str, bool]:
    """Validate a hub id or local path; returns (source, is_local). A missing local path raises."""
    if not source:
        raise UsageError(f"{what}: give a Hugging Face Hub id (org/name) or a local directory")
    expanded = os.path.expanduser(source)
    if is_local_path(source):
        if not os.path.exists(expanded):
            raise UsageError(f"{what}: local path {source!r} does not exist (weights are never downloaded "
                             "implicitly for a path; pass an existing directory or a Hub id such as org/name)")
        return expanded, True
    return source, False


_NETWORK_ERRORS = ("LocalEntryNotFoundError", "OfflineModeIsEnabled", "RepositoryNotFoundError",
                   "HfHubHTTPError", "HTTPError", "ConnectionError", "ConnectError", "Timeout", "GatedRepoError")


def is_network_error(err: BaseException) -> bool:
    """True when a load failed because the Hub could not be reached or the repo is unknown."""
    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if any(t.__name__ in _NETWORK_ERRORS for t in type(e).__mro__):
            return True
        msg = str(e)
        if "huggingface.co" in msg or "offline mode" in msg.lower() or "Hub" in msg:
            return True
        e = e.__cause__ or e.__context__
    return False


def hub_error(source: str, err: Exception) -> UsageError:
    """Turn a failed Hub load into an error that says what to do."""
    return UsageError(f"could not load {source!r} from the Hugging Face Hub ({type(err).__name__}: "
                      f"{str(err).splitlines()[0] if str(err) else ''}). Without network access, download "
                      "the weights elsewhere and pass the local directory instead.")


# --------------------------------------------------------------------------------------------------
# environment metadata and files


_PACKAGES = ("fp4vis", "torch", "triton", "diffusers", "transformers", "timm", "torchmetrics", "accelerate",
             "torchvision", "imageio", "imageio-ffmpeg", "nvidia-cutlass-dsl", "numpy", "flash-attn-4",
             "sageattention")


def fp4vis_version() -> str:
    try:
        return importlib.metadata.version("fp4vis")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def package_versions(packages: Iterable[str] = _PACKAGES) -> dict[str, str | None]:
    """Installed version of each package (None when it is not installed)."""
    out: dict[str, str | None] = {}
    for name in packages:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def git_commit() -> str | None:
    """The commit of the fp4vis checkout (None outside a git work tree), with '+dirty' if modified."""
    root = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        if sha.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
        return sha.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def gpu_info() -> dict[str, Any]:
    """CUDA devices seen by torch (empty list without CUDA)."""
    info: dict[str, Any] = {"cuda_available": bool(torch.cuda.is_available()),
                            "cuda_version": torch.version.cuda, "devices": []}
    if info["cuda_available"]:
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            info["devices"].append({"index": i, "name": p.name, "capability": f"{p.major}.{p.minor}",
                                    "sm_count": p.multi_processor_count,
                                    "memory_gib": round(p.total_memory / 2**30, 1)})
        with contextlib.suppress(Exception):
            info["cudnn"] = torch.backends.cudnn.version()
    return info


def environment() -> dict[str, Any]:
    """Everything a result needs to be reproduced: versions, GPU, platform, commit, time (UTC), and the
    library warnings the run's open ``WarningLog`` counted (not printed). The one metadata record of every
    JSON the project writes (evals, pipelines, benchmarks)."""
    return {
        "timestamp_utc": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "git_commit": git_commit(),
        "versions": package_versions(),
        "gpu": gpu_info(),
        "command": " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]),   # no path of this machine
        "library_warnings": library_warnings(),
    }


def _jsonable(obj: Any) -> Any:
    """Convert tensors, numpy values, paths, dataclasses and non-finite floats to plain JSON."""
    import dataclasses

    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _jsonable(dataclasses.asdict(obj))
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else str(obj)  # "nan", "inf" stay readable
    if hasattr(obj, "tolist"):  # torch / numpy scalars and arrays
        return _jsonable(obj.tolist())
    if isinstance(obj, (str, int, bool)) or obj is None:
        return obj
    return str(obj)


def write_json(path: str | os.PathLike, data: dict[str, Any]) -> Path:
    """``data`` as indented JSON (tensors, paths, non-finite floats made plain), written atomically."""
    return atomic_write(path, json.dumps(_jsonable(data), indent=2, sort_keys=False) + "\n")


# --------------------------------------------------------------------------------------------------
# timers


class Timer:
    """Wall-clock timer that synchronizes CUDA around the measured block (when CUDA is in use).

    >>> with Timer() as t: ...
    >>> t.seconds
    """

    def __init__(self, sync_cuda: bool = True):
        self.sync_cuda = sync_cuda
        self.seconds = float("nan")

    def _sync(self) -> None:
        if not self.sync_cuda:
            return
        try:
            import torch
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()
        except ImportError:  # pragma: no cover
            pass

    def __enter__(self) -> Timer:
        self._sync()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self._sync()
        self.seconds = time.perf_counter() - self._t0


def run_sections(result: dict[str, Any], sections: Sequence[tuple[str, Callable[[], Any]]],
                 out: str | os.PathLike, skip: Iterable[str] = ()) -> dict[str, Any]:
    """A benchmark's named sections, run in order (those in ``skip`` left out): each one's output, or its
    traceback where it fails, under its name in ``result``, its wall time in ``result["walls_s"]``, and
    ``result`` written to ``out`` after every section, so that a failing or interrupted section loses
    nothing that ran before it (a device run's time is short). Returns ``result``."""
    skip = set(skip)
    walls = result.setdefault("walls_s", {})
    for name, fn in sections:
        if name in skip:
            continue
        t0 = time.perf_counter()
        try:
            result[name] = fn()
        except Exception:   # the next sections still run; the JSON carries the traceback
            import traceback

            result[name] = {"error": traceback.format_exc()}
            print(result[name]["error"], file=sys.stderr, flush=True)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        walls[name] = time.perf_counter() - t0
        write_json(out, result)
    return result


def reps_within_budget(fn: Callable[[int], object], n_inputs: int, warmup: int, reps: int, min_reps: int,
                       budget_s: float) -> int:
    """Warm ``fn`` up, time one synchronised call and return how many calls (between ``min_reps`` and
    ``reps``) fit ``budget_s`` seconds: the shared front half of the benchmarks' timers."""
    for i in range(warmup):
        fn(i % n_inputs)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn(0)
    torch.cuda.synchronize()
    est = max(time.perf_counter() - t0, 1e-6)
    return max(min(reps, min_reps), min(reps, int(budget_s / est)))


def time_cuda(fn: Callable[[int], object], n_inputs: int, warmup: int = 3, reps: int = 30,
              budget_s: float = 2.0) -> list[float]:
    """Per-call milliseconds of ``fn(i)`` (i selects the input copy), CUDA events, after warm-up."""
    reps = reps_within_budget(fn, n_inputs, warmup, reps, 3, budget_s)
    times = []
    for r in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(r % n_inputs)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def time_cpu(fn: Callable[[int], object], n_inputs: int, reps: int = 3) -> list[float]:
    fn(0)
    times = []
    for r in range(reps):
        t0 = time.perf_counter()
        fn(r % n_inputs)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


# Benchmark timers: the same measurement for every backend, so that no backend's host overhead counts
# for or against another (CUDA events over rotated inputs; the host path alone; GPU time from a graph).
L2_BYTES = 50 * 2**20   # the H200's L2
GRAPH_CALLS = 8         # calls per captured CUDA graph (time_graph)
HOST_BUDGET_S = 1.0     # wall time per host timing (fewer than 200 calls where a call's GPU work is long)


def input_copies(nbytes: int) -> int:
    """How many copies of a call's inputs of ``nbytes`` to rotate over so that they exceed the L2 three
    times (2 to 64)."""
    return max(2, min(64, math.ceil(3 * L2_BYTES / max(nbytes, 1))))


def time_events(fn, n_inputs: int, budget: float = 0.25) -> float:
    """Median ms of fn(i) by CUDA events, i rotating over the inputs."""
    return statistics.median(time_cuda(fn, n_inputs, reps=2000, budget_s=budget))


def time_host(fn, n_inputs: int, reps: int = 200, sync: bool = False, budget: float | None = None) -> float:
    """Median microseconds of the Python call fn(i) (sync: including the wait for the GPU); at most
    ``reps`` calls, fewer (at least 32) where they would take more than ``budget`` seconds of wall
    time (default HOST_BUDGET_S; the synchronisations below make each call cost its GPU time)."""
    reps = reps_within_budget(fn, n_inputs, 5, reps, 32, HOST_BUDGET_S if budget is None else budget)
    ts = []
    for i in range(reps):
        if not sync and i % 16 == 0:
            torch.cuda.synchronize()   # keep the launch queue short: measure the host path alone
        t0 = time.perf_counter()
        fn(i % n_inputs)
        if sync:
            torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def time_graph(fn, calls: int = GRAPH_CALLS, budget: float = 0.25, n_inputs: int = 1) -> float:
    """Median ms per call of ``fn(i % n_inputs)`` replayed from one CUDA graph of ``calls`` calls: the GPU
    time of the call without its host work (warmed up, so compiled and cached, on a side stream first, as
    torch.cuda.graphs asks). With one input (the default) the same inputs every call, so L2-warm where they
    fit in it: compare with another ``time_graph`` figure (SDPA's), not with ``time_events`` over rotated
    inputs; with ``n_inputs`` copies that exceed the L2 (``input_copies``), every call reads from memory."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(3):
            fn(i % n_inputs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i % n_inputs)
    return time_events(lambda i: graph.replay(), 1, budget) / calls
