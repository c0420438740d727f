"""``fp4vis.services`` and ``fp4vis.files``: writes that never leave half a file, output paths checked
before any work, user errors with the option's name."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from fp4vis import files
from fp4vis.services import UsageError, check_output_dir, check_output_file, resolve_device, write_json


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
    from fp4vis.pipelines import wan_video as wv

    frames = np.random.default_rng(0).random((1, 3, 16, 16, 3), dtype=np.float32)   # diffusers' (1, F, H, W, 3)
    out = wv.save_mp4(frames, tmp_path / "a.mp4")
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
        wv.save_mp4(frames[0], out)
    assert out.read_bytes() == good and [p.name for p in tmp_path.iterdir()] == ["a.mp4"]
    with pytest.raises(ValueError, match="frames: expected"):
        wv.save_mp4(frames[0, 0], tmp_path / "b.mp4")


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


def test_bad_device_names_the_option():
    with pytest.raises(UsageError, match="device: 'bogus' is not a device"):
        resolve_device("bogus")


def test_a_command_on_the_cpu_says_once_that_it_runs_the_reference():
    """The README's promise for backend="auto": a fallback to the reference warns; the CPU has no kernel, so
    a command says it (fp4vis.attention stays silent per CPU call)."""
    import warnings

    import torch

    from fp4vis.services import warn_reference_fallback

    cpu = torch.device("cpu")
    with pytest.warns(UserWarning, match="runs on the reference emulation"):
        assert warn_reference_fallback("auto", cpu, "fast", "fp4vis generate")
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # no warning where nothing falls back
        assert not warn_reference_fallback("reference", cpu, "fast", "x")     # asked for the reference
        assert not warn_reference_fallback("auto", cpu, "bf16", "x")          # exact attention: no FP4 at all
        assert not warn_reference_fallback("auto", torch.device("cuda"), "fast", "x")   # the registry decides


def test_reports_show_no_absolute_path(tmp_path, monkeypatch):
    from fp4vis.services import display_source

    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "vit").mkdir(parents=True)
    assert display_source(str(tmp_path / "models" / "vit")) == "models/vit"
    assert display_source("./models/vit") == "models/vit"
    elsewhere = tmp_path.parent / "elsewhere_model"
    assert display_source(str(elsewhere)) == "elsewhere_model"
    assert display_source("fp4vis:digits-wan") == "fp4vis:digits-wan"
    assert display_source("Wan-AI/Wan2.1-T2V-1.3B-Diffusers") == "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
