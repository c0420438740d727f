"""The shipped models (fp4vis.zoo): loaded through the real loaders, the weights and the data the ones
their training records name, and their quality on the shipped held-out digits, in BF16 and under
FP4 attention, within stated margins (CPU, reference backend)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fp4vis import zoo
from fp4vis.evals.mae_psnr import MaeEvalConfig, load_mae, run_mae_eval
from fp4vis.evals.vit_top1 import VitEvalConfig, load_classifier, run_vit_eval
from fp4vis.services.usage import UsageError
from fp4vis.zoo.digits import (
    HELDOUT_FILE,
    NUM_CLASSES,
    VIT_SIZE,
    array_checksum,
    file_checksum,
    load_heldout,
    model_pixels,
    write_image_folder,
)

# the quality the shipped models must keep (scripts/train_digits.py reached more; see training.json)
VIT_MIN_TOP1 = 0.95                 # float32, all 500 held-out digits
VIT_FAST_MARGIN = 0.03              # FP4 `fast` top-1 at most 3 points below BF16 on 100 digits
VIT_FAST_MIN_AGREEMENT = 0.95
MAE_MIN_GAIN_OVER_TRIVIAL_DB = 3.0  # masked PSNR above predicting the mean training image
MAE_FAST_MARGIN_DB = 0.5            # FP4 `fast` masked PSNR at most 0.5 dB below BF16 (paired mean)


@pytest.fixture(scope="module")
def digits_folder(tmp_path_factory):
    return write_image_folder(load_heldout().head(100), tmp_path_factory.mktemp("zoo") / "digits")


IMAGE_MODELS = ("digits-mae", "digits-vit")   # the video model has its own tests (test_zoo_wan.py)


def test_registry_names_and_errors():
    assert set(zoo.MODELS) == {"digits-vit", "digits-mae", "digits-wan"}
    assert zoo.get("fp4vis:digits-vit") is zoo.get("digits-vit")
    assert zoo.resolve_source("fp4vis:digits-mae") == str(zoo.MODELS["digits-mae"].path)
    assert zoo.resolve_source("facebook/vit-mae-base") == "facebook/vit-mae-base"
    with pytest.raises(UsageError, match=r"--model: 'fp4vis:nope' is not a model fp4vis ships.*fp4vis:digits-vit"):
        zoo.get("fp4vis:nope", "--model")
    monkeypatched = {**zoo.NOT_SHIPPED, "digits-xl": "a larger model"}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(zoo, "NOT_SHIPPED", monkeypatched)
        with pytest.raises(UsageError, match="not shipped yet"):
            zoo.get("fp4vis:digits-xl")


def test_heldout_digits_are_the_recorded_ones():
    d = load_heldout()
    assert d.images.shape == (500, 28, 28) and d.images.dtype == np.uint8
    assert np.bincount(d.labels, minlength=NUM_CLASSES).tolist() == [50] * NUM_CLASSES
    assert d.labels[:NUM_CLASSES].tolist() == list(range(NUM_CLASSES))  # round-robin: any prefix is balanced
    assert len(set(d.source_index.tolist())) == 500 and d.source_index.max() < 5000
    for name in IMAGE_MODELS:
        data = zoo.metadata(name)["data"]
        assert data["heldout_arrays_sha256"] == array_checksum(d.images, d.labels)
        assert data["heldout_file_sha256"] == file_checksum(HELDOUT_FILE)
        assert data["train_images"] + data["heldout_images"] == data["source_images"] == 5000


@pytest.mark.parametrize("name", IMAGE_MODELS)
def test_weights_match_training_record(name):
    meta = zoo.verify(name)
    assert {"seed", "command", "training", "log", "final", "data", "environment"} <= set(meta)
    assert (zoo.MODELS[name].path / zoo.WEIGHTS_FILE).stat().st_size == meta["weights_bytes"] < 4 * 2**20
    assert meta["log"] and meta["log"][-1]["epoch"] == meta["training"]["epochs"]


def test_verify_detects_other_weights(tmp_path, monkeypatch):
    meta = zoo.metadata("digits-vit")
    monkeypatch.setattr(zoo, "metadata", lambda name: {**meta, "weights_sha256": "0" * 64})
    with pytest.raises(RuntimeError, match="training record says"):
        zoo.verify("digits-vit")


def test_vit_loads_through_the_real_loaders():
    clf = load_classifier(str(zoo.model_path("digits-vit")), dtype=torch.float32)
    assert (clf.kind, clf.resolution, clf.tokens, clf.num_classes) == ("timm", VIT_SIZE, 49, 10)
    assert clf.crop_pct == 1.0 and clf.mean == pytest.approx((0.1307,) * 3)
    assert clf.label_names == [str(i) for i in range(10)]
    model = zoo.load("digits-vit")
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in clf.model.parameters())


def test_vit_top1_float32_reproduces_training_record():
    d = load_heldout()
    model = zoo.load("digits-vit")
    mean, std = torch.tensor(model.pretrained_cfg["mean"]).view(1, 3, 1, 1), torch.tensor(
        model.pretrained_cfg["std"]).view(1, 3, 1, 1)
    with torch.no_grad():
        pred = model((model_pixels(d.images, VIT_SIZE) - mean) / std).argmax(-1)
    top1 = float((pred == torch.from_numpy(d.labels)).float().mean())
    assert top1 >= VIT_MIN_TOP1
    assert top1 == pytest.approx(zoo.metadata("digits-vit")["final"]["heldout_top1"], abs=0.005)


def test_random_weights_fail_the_quality_bar(digits_folder):
    """The bar can fail: the same architecture untrained is far below it."""
    clf = load_classifier(str(zoo.model_path("digits-vit")), random_weights=True, dtype=torch.float32)
    d = load_heldout().head(100)
    mean, std = torch.tensor(clf.mean).view(1, 3, 1, 1), torch.tensor(clf.std).view(1, 3, 1, 1)
    x = (model_pixels(d.images, VIT_SIZE) - mean) / std
    with torch.no_grad():
        top1 = float((clf(x).argmax(-1) == torch.from_numpy(d.labels)).float().mean())
    assert top1 < 0.5


def test_vit_fast_within_margin_of_bf16(digits_folder):
    r = run_vit_eval(VitEvalConfig(str(zoo.model_path("digits-vit")), digits_folder, policies="fast", batch_size=50,
                                   labels="index", device="cpu", backend="reference", per_layer=False, progress=False))
    assert r["images"] == 100 and r["tokens"] == 49
    bf16, fast = r["bf16"]["top1"], r["policies"]["fast"]
    assert bf16 >= VIT_MIN_TOP1 - 0.02   # BF16 inference of the float32-trained model, 100 digits
    assert fast["top1"] >= bf16 - VIT_FAST_MARGIN
    assert fast["agreement_with_bf16"] >= VIT_FAST_MIN_AGREEMENT
    assert 0 < fast["logit_rel_l2_mean"] < 0.5   # FP4 ran: the logits moved


def test_mae_psnr_finite_and_within_margin(digits_folder):
    meta = zoo.metadata("digits-mae")
    mae, mean, _, random = load_mae(str(zoo.model_path("digits-mae")))
    assert mean == pytest.approx((0.1307,) * 3) and not random   # the shipped preprocessor was read
    # the fixed sin-cos positions were saved and read back (a model built from its config has zeros there)
    assert mae.vit.embeddings.position_embeddings.abs().sum() > 0 and mae.decoder.decoder_pos_embed.abs().sum() > 0
    r = run_mae_eval(MaeEvalConfig(str(zoo.model_path("digits-mae")), digits_folder, policies="fast", batch_size=50,
                                   limit=50, device="cpu", backend="reference", progress=False))
    bf16 = r["bf16"]["masked_psnr"]["mean"]
    fast = r["policies"]["fast"]
    assert np.isfinite(bf16) and np.isfinite(fast["masked_psnr"]["mean"])
    assert bf16 >= meta["final"]["trivial_mean_image_masked_psnr_db"] + MAE_MIN_GAIN_OVER_TRIVIAL_DB
    assert fast["masked_psnr_diff_vs_bf16"]["mean"] >= -MAE_FAST_MARGIN_DB
    assert fast["pred_rel_l2_mean"] > 0   # FP4 ran
