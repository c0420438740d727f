"""The method's protocols as presets (fp4vis.evals.paper_protocols) and the data layouts they read
(fp4vis.evals.datasets), on tiny models and data written here: the paper presets hold the published
settings and figures; each protocol runner runs its runs with the protocol's seeds and sizes and sets
the measured rows beside the published ones; CIFAR-10's own format and a flat folder of images load;
the CLI's protocol errors are one line."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
import torch
from apps.tiny_models import make_image_folder, make_tiny_hf_vit

from fp4vis.cli import main
from fp4vis.evals import paper_protocols as protocols
from fp4vis.evals.datasets import open_images, sample_indices
from fp4vis.evals.report import fmt

CIFAR_NAMES = ["class0", "class1", "class2"]


def write_cifar(root, n=12, seed=0):
    """A CIFAR-10-format test set (cifar-10-batches-py/test_batch + batches.meta) of n 32 px images."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
    with open(folder / "test_batch", "wb") as f:
        pickle.dump({"data": data, "labels": [i % 3 for i in range(n)]}, f)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": CIFAR_NAMES}, f)
    return root, data


def test_paper_presets_hold_the_published_protocol():
    vit, mae, wan = protocols.PAPER["vit"], protocols.PAPER["mae"], protocols.PAPER["wan"]
    assert vit.model == "nateraw/vit-base-patch16-224-cifar10" and vit.seed == 20260728
    assert [(r.label, r.resolution, r.images) for r in vit.runs] == [("S256", 224, 1000), ("S1024", 496, 200),
                                                                      ("S4096", 1008, 200)]
    assert vit.published["S1024"] == {"bf16": 96.5, "fast": 95.0, "accurate": 97.0}
    assert (mae.model, mae.images, mae.seed, mae.mask_ratio, mae.published_bf16) == (
        "facebook/vit-mae-base", 100, 20260805, 0.75, 23.9165)
    assert mae.published_diff == {"fast": (-0.020, 0.026), "accurate": (-0.024, 0.021)}
    assert (wan.height, wan.width, wan.frames, wan.guidance_scale, wan.seed, wan.steps) == (
        512, 768, 17, 5.0, 20260805, (1, 4, 20))
    assert wan.published["14B"]["fast"][20] == (0.8496, 0.5337)
    assert wan.size_of("Wan-AI/Wan2.1-T2V-1.3B-Diffusers") == "1.3B" and wan.size_of("/x/wan2.1_t2v_14B") == "14B"
    assert wan.size_of("my-wan") is None


def test_data_layouts_and_seeded_draws(tmp_path):
    root, data = write_cifar(tmp_path / "c")
    ds = open_images(root)
    img, label = ds[4]
    assert ds.layout == "cifar10" and ds.classes == CIFAR_NAMES and len(ds) == 12 and label == 1
    assert np.array_equal(np.asarray(img), data[4].reshape(3, 32, 32).transpose(1, 2, 0))
    assert open_images(root / "cifar-10-batches-py").layout == "cifar10"
    flat = make_image_folder(tmp_path / "f", classes=("x",), per_class=3, size=20) / "x"
    ds = open_images(flat)
    assert ds.layout == "flat" and ds.classes == [] and ds.labels == [-1] * 3 and ds.names[0] == "img0.png"
    assert open_images(tmp_path / "f").layout == "imagefolder"
    draw = sample_indices(100, 5, 20260728)
    assert draw == sample_indices(100, 5, 20260728) != sample_indices(100, 5, 1) and len(set(draw)) == 5
    assert draw == sorted(torch.randperm(100, generator=torch.Generator().manual_seed(20260728))[:5].tolist())
    assert sample_indices(10, 3, None) == [0, 1, 2] and sample_indices(4, None, 3) == [0, 1, 2, 3]


def test_vit_protocol_sets_rows_beside_the_published(tmp_path):
    model = make_tiny_hf_vit(tmp_path / "vit", num_classes=3)
    data, _ = write_cifar(tmp_path / "cifar")
    proto = protocols.VitProtocol(model=str(model), seed=7, policies=("fast",),
                                  runs=(protocols.VitRun("S16", 32, 5), protocols.VitRun("S36", 48, 3)),
                                  published={"S16": {"bf16": 50.0, "fast": 40.0}})
    r = protocols.run_vit_protocol(data, protocol=proto, out_dir=tmp_path / "out", device="cpu", dtype="float32",
                                   progress=False)
    run = r["runs"]["S16"]
    assert run["images"] == 5 and run["tokens"] == 17 and r["runs"]["S36"]["tokens"] == 37
    assert set(run["top1_percent"]) == {"bf16", "fast"} and 0 <= run["top1_percent"]["fast"] <= 100
    per_run = json.loads((tmp_path / "out" / "vit_paper_S16.json").read_text())
    assert per_run["image_files"] == [f"test_batch[{i}]" for i in sample_indices(12, 5, 7)]
    assert per_run["labels"] == "names"
    md = (tmp_path / "out" / "vit_paper.md").read_text()
    assert f"| S16 | 32 | 5 | fast | {fmt(run['top1_percent']['fast'], 2)} | 40 |" in md
    assert "| S36 | 48 | 3 | fast |" in md and "| n/a | n/a |" in md   # no published figure for S36


def test_mae_protocol_on_a_flat_folder(tmp_path, tiny_mae):
    flat = make_image_folder(tmp_path / "imgs", classes=("x",), per_class=4, size=36) / "x"
    proto = protocols.MaeProtocol(model=str(tiny_mae), images=3, seed=5, policies=("fast",))
    r = protocols.run_mae_protocol(flat, protocol=proto, out_dir=tmp_path / "out", device="cpu", dtype="float32",
                                   progress=False)
    assert r["images"] == 3 and r["mask_ratio"] == 0.75 and r["published_bf16_masked_psnr"] == 23.9165
    diff = r["policies"]["fast"]["masked_psnr_diff_vs_bf16"]
    assert diff["n"] == 3 and r["policies"]["fast"]["published_diff"] == (-0.020, 0.026)
    assert "| fast |" in (tmp_path / "out" / "mae_paper.md").read_text()


def test_wan_protocol_runs_each_length(tmp_path, tiny_wan):
    proto = protocols.WanProtocol(model=str(tiny_wan), height=32, width=32, frames=5, steps=(1, 2))
    r = protocols.run_wan_protocol(protocol=proto, out_dir=tmp_path / "out", device="cpu", dtype="float32",
                                   progress=False)
    assert set(r["steps"]) == {1, 2} and r["model_size"] is None
    one = r["steps"][1]["fast"]
    assert one["published"] is None and 0 < one["latent_cosine"] <= 1 and one["latent_rel_l2"] >= 0
    assert "no published rows for this model" in (tmp_path / "out" / "wan_paper.md").read_text()


@pytest.mark.parametrize("argv, expected", [
    (["eval", "wan", "--protocol", "paper", "--speed-only", "1.3B"], "--protocol: needs the real weights"),
    (["eval", "vit", "--data", "."], "--model: required (or --protocol paper"),
])
def test_protocol_cli_errors(argv, expected, capsys, tmp_path):
    code = main([*argv, "--out-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and expected in err and "Traceback" not in err, err
