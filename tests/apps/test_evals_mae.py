"""MAE PSNR eval on a tiny ViTMAE saved with save_pretrained and loaded back (CPU, reference)."""

import json
import math

import pytest
import torch
from apps.tiny_models import make_tiny_mae

from fp4vis.evals.mae_psnr import MaeEvalConfig, load_mae, masking_noise, run_mae_eval
from fp4vis.services.usage import UsageError


@pytest.fixture(scope="module")
def assets(tmp_path_factory, tiny_mae, image_folder):
    root = tmp_path_factory.mktemp("mae")
    return {"mae": tiny_mae, "mae_norm": make_tiny_mae(root / "mae_norm", norm_pix_loss=True), "data": image_folder}


def test_masked_psnr_same_masks_and_interval(assets, tmp_path):
    r = run_mae_eval(MaeEvalConfig(str(assets["mae"]), assets["data"], policies="fast,accurate", batch_size=3,
                                   out_dir=tmp_path, progress=False, backend="reference"))
    assert r["images"] == 4 and r["mask_ratio"] == 0.75 and r["image_index"] == [0, 1, 2, 3]
    bf16 = r["bf16"]["masked_psnr_per_image"]
    for name in ("fast", "accurate"):
        p = r["policies"][name]
        d = p["masked_psnr_diff_vs_bf16"]
        # the paired difference is the mean of the per-image differences, with a t-interval around it
        diffs = [a - b for a, b in zip(p["masked_psnr_per_image"], bf16)]
        assert d["n"] == 4 and d["mean"] == pytest.approx(sum(diffs) / 4)
        assert d["ci95_low"] <= d["mean"] <= d["ci95_high"]
        assert abs(d["mean"]) < 1.0  # FP4 attention barely moves a reconstruction
        assert p["recon_psnr_vs_bf16"]["mean"] > 25 and math.isfinite(p["recon_psnr_vs_bf16"]["mean"])
        assert p["recon_psnr_vs_bf16"]["mean"] < 200  # but it did change something
        assert 0 < p["pred_rel_l2_mean"] < 0.5
        assert all(math.isfinite(x) for x in p["full_psnr_per_image"])
    md = (tmp_path / "mae_psnr.md").read_text()
    assert "data_range = 1.0" in md and "PER IMAGE".lower() in md.lower() and "95 % t-interval" in md
    assert json.loads((tmp_path / "mae_psnr.json").read_text())["psnr_reduction"] == r["psnr_reduction"]


def test_masks_do_not_depend_on_batching(assets):
    kw = dict(policies="fast", progress=False, limit=3)
    a = run_mae_eval(MaeEvalConfig(str(assets["mae"]), assets["data"], batch_size=1, **kw))
    b = run_mae_eval(MaeEvalConfig(str(assets["mae"]), assets["data"], batch_size=3, **kw))
    assert a["bf16"]["masked_psnr_per_image"] == pytest.approx(b["bf16"]["masked_psnr_per_image"], abs=1e-3)
    n1 = masking_noise(torch.tensor([2]), 16, seed=5)
    n2 = masking_noise(torch.tensor([0, 1, 2]), 16, seed=5)[2:]
    assert torch.equal(n1, n2) and not torch.equal(n1, masking_noise(torch.tensor([2]), 16, seed=6))


def test_norm_pix_loss_and_decoder(assets):
    r = run_mae_eval(MaeEvalConfig(str(assets["mae_norm"]), assets["data"], policies="fast", decoder=True,
                                   progress=False, limit=2, batch_size=2, resolution=48))
    assert r["norm_pix_loss"] and r["decoder_patched"] and r["resolution"] == 48 and r["native_resolution"] == 32
    assert r["policies"]["fast"]["recon_psnr_vs_bf16"]["mean"] > 15


def test_random_weights_and_errors(assets, tmp_path):
    model, mean, std, rw = load_mae(str(assets["mae"]), random_weights=True, dtype=torch.float32)
    assert rw and model.config.hidden_size == 64 and len(mean) == 3
    with pytest.raises(UsageError, match="does not exist"):
        run_mae_eval(MaeEvalConfig(str(tmp_path / "missing"), assets["data"], progress=False))
    with pytest.raises(UsageError, match="mask ratio"):
        run_mae_eval(MaeEvalConfig(str(assets["mae"]), assets["data"], mask_ratio=1.5, progress=False))
