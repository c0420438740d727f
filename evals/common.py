"""Helpers shared by the evals, the Wan pipeline and the CLI: devices and dtypes, model-source
checks with clear errors, applying a policy through the patch API, per-layer attention errors,
per-sample metrics, ImageFolder datasets (and the scikit-image photos used by the real runs).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fp4vis.policy import POLICIES, Policy, get_policy


class UsageError(ValueError):
    """A user-facing error (bad option, missing path, GPU-only option without a GPU). The CLI prints
    its message without a traceback and exits with status 2."""


# --------------------------------------------------------------------------------------------------
# devices, dtypes, policies


DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
          "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32}


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """'auto' -> the first CUDA GPU when one is visible, else the CPU; 'cuda' without a GPU raises."""
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
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
    """GPU-only backends need a CUDA device (the reference and 'auto' work everywhere)."""
    known = ("auto", "reference", "hopper")
    if backend not in known:
        raise UsageError(f"backend: unknown backend {backend!r}; use one of {', '.join(known)}")
    if backend == "hopper" and device.type != "cuda":
        raise UsageError(f"backend {backend!r} runs only on a CUDA GPU (device here: {device}); "
                         "use --backend auto or --backend reference on the CPU")
    return backend


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
    from fp4vis.guard import GuardPlan

    return GuardPlan.load(p)


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
    from fp4vis.patch import patch

    handle = patch(model, policy=pol, layers=layers, guard=guard, backend=backend, **patch_kwargs)
    try:
        yield handle
    finally:
        handle.remove()


class WarningLog:
    """Collect the warnings raised inside a block (fallbacks to the reference or to exact attention,
    range warnings) so that reports can state them; each distinct message is kept once and echoed
    once to stderr. Deprecation noise from the libraries is left out."""

    def __init__(self, echo: bool = True, limit: int = 20):
        self.echo, self.limit = echo, limit
        self.messages: list[str] = []

    def __enter__(self) -> WarningLog:
        import warnings

        self._ctx = warnings.catch_warnings(record=True)
        self._records = self._ctx.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc) -> None:
        import sys

        self._ctx.__exit__(*exc)
        for w in self._records:
            if issubclass(w.category, (DeprecationWarning, FutureWarning)):
                continue
            msg = f"{w.category.__name__}: {w.message}"
            if msg not in self.messages and len(self.messages) < self.limit:
                self.messages.append(msg)
                if self.echo:
                    print(f"warning: {msg}", file=sys.stderr)


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
# attention layers and per-layer errors


def find_attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost modules whose class name ends in 'Attention' (timm ``Attention``, transformers
    ``ViTAttention``/``ViTMAEAttention``, diffusers ``Attention``/``WanAttention``), in model order."""
    found: list[tuple[str, nn.Module]] = []
    for name, mod in model.named_modules():
        if not type(mod).__name__.endswith("Attention"):
            continue
        if any(name.startswith(prev + ".") for prev, _ in found):
            continue
        found.append((name, mod))
    return found


def _first_tensor(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out:
        return _first_tensor(out[0])
    if hasattr(out, "to_tuple"):
        return _first_tensor(out.to_tuple())
    raise TypeError(f"attention module returned {type(out).__name__}, expected a tensor")


class AttentionRecorder:
    """Records the inputs and outputs of every attention module during one forward pass, so that
    each layer can be re-run in isolation under another policy (same inputs: per-layer error
    without the drift accumulated by the layers before it)."""

    def __init__(self, model: nn.Module):
        self.modules = find_attention_modules(model)
        self.calls: dict[str, tuple[tuple, dict, torch.Tensor]] = {}
        self._handles: list[Any] = []

    def __enter__(self) -> AttentionRecorder:
        for name, mod in self.modules:
            def hook(m, args, kwargs, out, _name=name):
                self.calls[_name] = (args, dict(kwargs), _first_tensor(out).detach())
            self._handles.append(mod.register_forward_hook(hook, with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    @torch.no_grad()
    def rerun(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Re-run each recorded layer on its recorded inputs (under whatever patch is active now):
        {layer name: (new output, recorded output)}."""
        out = {}
        for name, mod in self.modules:
            if name not in self.calls:
                continue
            args, kwargs, ref = self.calls[name]
            out[name] = (_first_tensor(mod(*args, **kwargs)).detach(), ref)
        return out


def per_sample(metric: Callable[[torch.Tensor, torch.Tensor], Any], a: torch.Tensor,
               ref: torch.Tensor) -> list[float]:
    """Apply an ``fp4vis.metrics`` function to each sample (first dimension) separately."""
    return [float(metric(a[i].float(), ref[i].float())) for i in range(a.shape[0])]


def error_metrics() -> tuple[Callable, Callable]:
    """(cosine, rel_l2) from fp4vis.metrics (the one implementation of these in the project)."""
    from fp4vis.metrics import cosine, rel_l2

    return cosine, rel_l2


# --------------------------------------------------------------------------------------------------
# images


IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")

# photographs that scikit-image ships inside its package (no download); used by the real-config runs
SKIMAGE_PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "immunohistochemistry", "hubble_deep_field",
                  "camera", "coins", "moon", "colorwheel")


def check_image_folder(root: str | os.PathLike) -> Path:
    """An ImageFolder root: class sub-folders holding images. Raises a clear UsageError otherwise."""
    p = Path(os.path.expanduser(str(root)))
    if not p.is_dir():
        raise UsageError(f"data: directory {str(root)!r} does not exist")
    classes = [d for d in p.iterdir() if d.is_dir()]
    if not classes:
        raise UsageError(f"data: {str(root)!r} has no class sub-folders; the layout is ImageFolder's: "
                         "ROOT/<class>/<image>.jpg (put unlabeled images in one folder, e.g. ROOT/images/)")
    if not any(f.suffix.lower() in IMAGE_EXTENSIONS for d in classes for f in d.iterdir()):
        raise UsageError(f"data: no images ({', '.join(IMAGE_EXTENSIONS)}) under {str(root)!r}")
    return p


def export_skimage_photos(dest: str | os.PathLike, names: Sequence[str] = SKIMAGE_PHOTOS,
                          class_name: str = "photos") -> Path:
    """Write the RGB photos that scikit-image ships into an ImageFolder at ``dest/<class_name>/``
    (grayscale ones are converted to RGB). Needs scikit-image (not a dependency of fp4vis)."""
    import numpy as np
    import skimage.data
    from PIL import Image

    folder = Path(dest) / class_name
    folder.mkdir(parents=True, exist_ok=True)
    written = 0
    for name in names:
        try:
            img = np.asarray(getattr(skimage.data, name)())
        except Exception:  # a photo that needs a download is skipped
            continue
        if img.dtype == bool:
            continue
        if img.ndim == 2:
            img = np.stack([img] * 3, axis=-1)
        img = img[..., :3].astype("uint8")
        Image.fromarray(img).save(folder / f"{name}.png")
        written += 1
    if written == 0:
        raise RuntimeError("no scikit-image photo could be loaded")
    return Path(dest)


def image_list(dataset: Any, root: Path, limit: int | None, max_items: int = 100) -> list[str] | None:
    """The image files an eval uses, relative to the ImageFolder root (None above ``max_items``)."""
    samples = dataset.samples[: limit if limit is not None else len(dataset.samples)]
    if len(samples) > max_items:
        return None
    return [str(Path(path).relative_to(root)) for path, _ in samples]


def images_markdown(files: list[str] | None) -> str:
    if not files or len(files) > 20:
        return ""
    return " Images: " + ", ".join(f"`{f}`" for f in files) + "."
