"""``fp4vis.services`` and ``fp4vis.files``: writes that never leave half a file, output paths checked
before any work, user errors with the option's name, the one filter of warnings."""

from __future__ import annotations

import json
import subprocess
import sys
import types

import numpy as np
import pytest
import torch

from fp4vis import files
from fp4vis.services.console import WarningLog, library_warnings
from fp4vis.services.environment import environment
from fp4vis.services.outputs import check_output_dir, check_output_file, machine_tag, new_result_path, write_json
from fp4vis.services.runtime import resolve_device
from fp4vis.services.usage import UsageError


def _full_disk(fd):
    raise OSError(28, "No space left on device")


def test_atomic_write_keeps_the_old_file_when_the_disk_is_full(tmp_path, monkeypatch):
    path = tmp_path / "r.json"
    write_json(path, {"a": 1})
    monkeypatch.setattr("fp4vis.files.os.fsync", _full_disk)
    with pytest.raises(OSError, match="No space left"):
        write_json(path, {"a": 2, "big": list(range(10000))})
    monkeypatch.undo()
    assert json.loads(path.read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_atomic_write_under_a_file_size_limit(tmp_path):
    """A write cut off by the process's file-size limit (RLIMIT_FSIZE) raises and leaves the good file."""
    path = tmp_path / "report.md"
    path.write_text("good\n")
    code = (f"import resource, signal\nsignal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
            f"resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))\n"
            f"from fp4vis.files import atomic_write\natomic_write({str(path)!r}, 'x' * 100000)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "File too large" in r.stderr, r.stderr
    assert path.read_text() == "good\n"
    assert [p.name for p in tmp_path.iterdir()] == ["report.md"]


def test_atomic_write_gives_the_mode_of_a_plain_write(tmp_path):
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    made = files.atomic_write(tmp_path / "made.txt", "x")
    assert made.stat().st_mode == plain.stat().st_mode
    plain.chmod(0o640)
    files.atomic_write(plain, "y")
    assert plain.stat().st_mode & 0o777 == 0o640 and plain.read_text() == "y"


def test_atomic_folder_is_the_old_folder_or_the_whole_new_one(tmp_path):
    model = tmp_path / "model"
    with files.atomic_folder(model) as tmp:
        (tmp / "weights").write_text("v1")
        assert not model.exists()              # nothing there until the block ends
    plain = tmp_path / "plain"
    plain.mkdir()
    assert (model / "weights").read_text() == "v1" and model.stat().st_mode == plain.stat().st_mode
    with pytest.raises(RuntimeError, match="training failed"), files.atomic_folder(model) as tmp:
        (tmp / "weights").write_text("half of v2")
        raise RuntimeError("training failed")
    assert (model / "weights").read_text() == "v1"
    with files.atomic_folder(model) as tmp:
        (tmp / "other").write_text("v2")
    assert sorted(p.name for p in model.iterdir()) == ["other"]   # replaced whole, not merged
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "plain"]


def test_atomic_path_removes_the_partial_file_on_an_exception(tmp_path):
    path = tmp_path / "v.mp4"
    with pytest.raises(RuntimeError, match="mid-write"), files.atomic_path(path) as tmp:
        tmp.write_bytes(b"half a video")
        raise RuntimeError("mid-write")
    assert list(tmp_path.iterdir()) == []


def test_save_mp4_is_atomic_and_takes_batched_frames(tmp_path, monkeypatch):
    pytest.importorskip("imageio_ffmpeg")
    from fp4vis.pipelines import media_files as mf

    frames = np.random.default_rng(0).random((1, 3, 16, 16, 3), dtype=np.float32)   # diffusers' (1, F, H, W, 3)
    out = mf.save_mp4(frames, tmp_path / "a.mp4")
    assert out.stat().st_size > 0
    good = out.read_bytes()

    import imageio.v2 as imageio
    real = imageio.get_writer

    class Failing:
        def __init__(self, *a, **kw):
            self.w = real(*a, **kw)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.w.close()

        def append_data(self, f):
            raise RuntimeError("encoder died")

    monkeypatch.setattr(imageio, "get_writer", Failing)
    with pytest.raises(RuntimeError, match="encoder died"):
        mf.save_mp4(frames[0], out)
    assert out.read_bytes() == good and [p.name for p in tmp_path.iterdir()] == ["a.mp4"]
    with pytest.raises(ValueError, match="frames: expected"):
        mf.save_mp4(frames[0, 0], tmp_path / "b.mp4")


def test_output_paths_are_checked(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "f").write_text("x")
    with pytest.raises(UsageError, match="--output: .* is a directory"):
        check_output_file(tmp_path / "d", "--output")
    with pytest.raises(UsageError, match="--output: .* is a file, not a directory"):
        check_output_file(tmp_path / "f" / "v.mp4", "--output")
    with pytest.raises(UsageError, match="--out-dir: .* is a file"):
        check_output_dir(tmp_path / "f", "--out-dir")
    assert check_output_dir(tmp_path / "new" / "deeper", "--out-dir").is_dir()
    assert check_output_file(tmp_path / "new2" / "v.mp4", "--output").parent.is_dir()


def test_a_new_result_takes_the_days_next_run_letter_and_this_machine(tmp_path, monkeypatch):
    """benchmarks/results/README.md's names: the UTC date, the first run letter after that day's (or the round's,
    given), the machine (h200 / h100 by the CUDA device's name, cpu without one), what made it, its variant; a field
    that would break the scheme is refused."""
    import datetime as dt

    now = dt.datetime(2026, 12, 7, 23, 59, tzinfo=dt.UTC)
    assert new_result_path("kernel", results_dir=tmp_path, machine="h100", now=now) == \
        tmp_path / "20261207a_h100_kernel.json"
    for name in ("20261207a_h100_kernel.json", "20261207c_h200_tests_x.log", "20261208z_cpu_kernel.json"):
        (tmp_path / name).write_text("")
    assert new_result_path("kernel", "fa3", results_dir=tmp_path, machine="h100", now=now).name == \
        "20261207d_h100_kernel_fa3.json"
    (tmp_path / "20261207z_cpu_x.json").write_text("")
    with pytest.raises(ValueError, match="a-z of 20261207"):
        new_result_path("kernel", results_dir=tmp_path, machine="cpu", now=now)
    assert new_result_path("kernel", "fa3", results_dir=tmp_path, machine="h100", run="c", now=now).name == \
        "20261207c_h100_kernel_fa3.json"   # a round's later file: the round's letter
    for bad in (dict(what="kernel_grid"), dict(what="kernel", variant="Quick Run"), dict(what="k", machine="h1_00"),
                dict(what="k", run="cd")):
        with pytest.raises(ValueError, match="not a results name field"):
            new_result_path(**{"machine": "cpu", **bad}, results_dir=tmp_path, now=now)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for device, tag in (("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"), ("NVIDIA B200", "b200"),
                        ("NVIDIA GH200 480GB", "gh200480gb"), ("NVIDIA GeForce RTX 4090", "geforcertx4090")):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, d=device: d)
        assert machine_tag() == tag
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert machine_tag() == "cpu"


def test_labels_say_what_runs(monkeypatch):
    """Progress bars and headers name the backend that computes a policy's attention, auto's pick included."""
    from fp4vis.services import policies

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert policies.backend_in_use("auto", cpu) == "reference" and policies.backend_in_use("hopper", cpu) == "hopper"
    assert policies.attention_label("bf16", "auto", cpu) == "bf16, the model's attention"
    assert policies.attention_label("guard", "auto", cpu, guard=object()) == "guard + guard plan, reference"

    class Kernel:
        reason = None

        def unavailable_reason(self):
            return self.reason

    kernel = Kernel()
    monkeypatch.setattr(policies, "kernel_backend_name", lambda device: "hopper")
    monkeypatch.setattr(policies, "get_backend", lambda name: kernel)
    assert policies.attention_label("fast", "auto", gpu) == "fast, hopper"
    kernel.reason = "CuTe DSL is not installed"
    assert policies.attention_label("fast", "auto", gpu) == "fast, reference"


def test_bad_device_names_the_option():
    with pytest.raises(UsageError, match="device: 'bogus' is not a device"):
        resolve_device("bogus")


# ---------------------------------------------------------------------------------------------------
# the warning filter of the commands (WarningLog): fp4vis' warnings printed, the libraries' counted


def _module(name: str, source: str) -> types.ModuleType:
    """A module named ``name`` as if installed (its code's ``__name__`` and a site-packages path), without
    touching sys.modules: the filter tells issuers apart by the module whose code calls warnings.warn."""
    module = types.ModuleType(name)
    exec(compile(source, f"/venv/lib/python3.11/site-packages/{name.replace('.', '/')}.py", "exec"), module.__dict__)
    return module


# the shapes of what flash-attn-4 prints on every Wan eval: CuTe DSL's argument warning while it compiles
# flash-attn-4's kernel (stacklevel into the caller's code) and its loop-size hint (a category of its own)
CUTE_DSL = _module("cutlass.base_dsl.dsl", """
import warnings
class DSLOptimizationWarning(Warning):
    pass
def compile_kernel():
    warnings.warn("Argument aux_data (position 17) cannot be converted to a JitArgument for function "
                  "'flash_fwd_sm90'. Its type `<class 'flash_attn.cute.utils.AuxData'>` is not supported.",
                  UserWarning, stacklevel=3)
    warnings.warn("This static loop has 64 iterations, which may be very slow to compile", DSLOptimizationWarning,
                  stacklevel=2)
""")
FLASH_ATTN = _module("flash_attn.cute.interface", "def flash_attn_func(compile_kernel):\n    compile_kernel()\n")
# fp4vis code calling it: the argument warning is attributed to this module's line
BASELINE = _module("fp4vis.evals.baselines_like", "def call(fa4, dsl):\n    fa4.flash_attn_func(dsl.compile_kernel)\n")
# a library calling fp4vis: fp4vis' range warning is attributed to the library's line (its stacklevel)
PROCESSOR = _module("diffusers.models.attention_processor", "def attend(fp4vis, q, k, v):\n"
                    "    return fp4vis.attention(q, k, v, policy='fast', range_check='warn')\n")


def _saturating():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 64, 64, generator=g) for _ in range(3))
    return q * 30, k * 30, v


def test_library_warnings_are_counted_fp4vis_warnings_printed(capsys):
    import fp4vis
    from fp4vis.evals.report import environment_markdown

    q, k, v = _saturating()
    with WarningLog() as outer:
        for _ in range(3):
            BASELINE.call(FLASH_ATTN, CUTE_DSL)
        with WarningLog() as run:   # an eval's run inside the command's log
            PROCESSOR.attend(fp4vis, q, k, v)
            PROCESSOR.attend(fp4vis, q, k, v)
            BASELINE.call(FLASH_ATTN, CUTE_DSL)
            assert len(run.messages) == 1 and [r["count"] for r in run.library.values()] == [1, 1]
        env = environment()
    err = capsys.readouterr().err
    assert err.count("warning: RuntimeWarning: policy 'fast' went past its representable range") == 1, err
    assert "aux_data" not in err and "static loop" not in err, err
    assert outer.messages == run.messages
    library = {(w["module"], w["category"]): (w["count"], w["where"]) for w in env["library_warnings"]}
    assert library == {("cutlass.base_dsl.dsl", "UserWarning"): (4, "fp4vis/evals/baselines_like.py:2"),
                       ("cutlass.base_dsl.dsl", "DSLOptimizationWarning"): (4, "flash_attn/cute/interface.py:2")}
    assert library_warnings() == []   # nothing open, nothing counted
    md = environment_markdown(env)
    assert "Library warnings (not printed during the run): cutlass.base_dsl.dsl UserWarning x4: Argument aux_data" in md


def test_every_command_runs_inside_the_filter(tmp_path, monkeypatch, capsys):
    """fp4vis.cli.main runs each command inside a WarningLog: its JSON records the library's warnings, the
    user sees fp4vis' own once and no library warning."""
    import fp4vis
    from fp4vis.cli import info, main

    def command(args):
        for _ in range(2):
            BASELINE.call(FLASH_ATTN, CUTE_DSL)
            PROCESSOR.attend(fp4vis, *_saturating())
        write_json(tmp_path / "r.json", {"environment": environment()})
        return 0

    monkeypatch.setattr(info, "run", command)
    assert main(["info"]) == 0
    err = capsys.readouterr().err
    shown = [line for line in err.splitlines() if "Warning" in line]
    assert len(shown) == 1 and shown[0].startswith("warning: RuntimeWarning: policy 'fast' went past"), err
    recorded = json.loads((tmp_path / "r.json").read_text())["environment"]["library_warnings"]
    assert sorted((w["category"], w["count"]) for w in recorded) == [("DSLOptimizationWarning", 2),
                                                                      ("UserWarning", 2)]


def test_a_command_on_the_cpu_says_once_that_it_runs_the_reference():
    """The README's promise for backend="auto": a fallback to the reference warns; the CPU has no kernel, so
    a command says it (fp4vis.attention stays silent per CPU call)."""
    import warnings

    import torch

    from fp4vis.services.policies import warn_reference_fallback

    cpu = torch.device("cpu")
    with pytest.warns(UserWarning, match="runs on the reference emulation"):
        assert warn_reference_fallback("auto", cpu, "fast", "fp4vis generate")
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # no warning where nothing falls back
        assert not warn_reference_fallback("reference", cpu, "fast", "x")     # asked for the reference
        assert not warn_reference_fallback("auto", cpu, "bf16", "x")          # exact attention: no FP4 at all
        assert not warn_reference_fallback("auto", torch.device("cuda"), "fast", "x")   # the registry decides


def test_reports_show_no_absolute_path(tmp_path, monkeypatch):
    from fp4vis.services.sources import display_source

    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "vit").mkdir(parents=True)
    assert display_source(str(tmp_path / "models" / "vit")) == "models/vit"
    assert display_source("./models/vit") == "models/vit"
    elsewhere = tmp_path.parent / "elsewhere_model"
    assert display_source(str(elsewhere)) == "elsewhere_model"
    assert display_source("fp4vis:digits-wan") == "fp4vis:digits-wan"
    assert display_source("Wan-AI/Wan2.1-T2V-1.3B-Diffusers") == "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"


def test_run_sections_keeps_what_ran_before_a_failing_section(tmp_path):
    """A benchmark's sections (fp4vis.services.timing.run_sections): each one's output or its traceback under its
    name, written after every section, skipped ones left out."""
    from fp4vis.services.timing import run_sections

    out = tmp_path / "r.json"
    r = run_sections({"env": "x"}, (("ok", lambda: 3), ("bad", lambda: 1 / 0), ("later", lambda: [1])), out,
                     skip=("later",))
    on_disk = json.loads(out.read_text())
    assert on_disk["ok"] == 3 and "ZeroDivisionError" in on_disk["bad"]["error"] and "later" not in on_disk
    assert set(r["walls_s"]) == {"ok", "bad"} and r["env"] == "x"
