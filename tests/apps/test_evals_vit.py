"""ViT top-1 eval on tiny classifiers saved to disk and loaded back through the real loaders (timm
save_for_hf / local-dir:, transformers save_pretrained), CPU, reference backend."""

import json
import socket
import subprocess
import sys

import pytest
import torch
from apps.tiny_models import make_image_folder, make_tiny_hf_vit, make_tiny_timm_vit

from fp4vis.evals.common import AttentionRecorder, find_attention_modules
from fp4vis.evals.vit_top1 import VitEvalConfig, label_mapping, load_classifier, run_vit_eval
from fp4vis.services.usage import UsageError


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("vit")
    return {
        "timm": make_tiny_timm_vit(root / "timm_vit", num_classes=5),
        "hf": make_tiny_hf_vit(root / "hf_vit", num_classes=5),
        "data_index": make_image_folder(root / "data_index", classes=("1", "3"), per_class=2, size=40),
        "data_names": make_image_folder(root / "data_names", classes=("class2", "class4"), per_class=1, size=40),
    }


def test_timm_local_dir_other_resolution(assets, tmp_path):
    r = run_vit_eval(VitEvalConfig(str(assets["timm"]), assets["data_index"], policies="fast,accurate", resolution=64,
                                   batch_size=3, out_dir=tmp_path, progress=False, backend="reference"))
    # 64 px / patch 8 = 8x8 patches + cls token: the position embeddings were resampled on load
    assert r["tokens"] == 65 and r["resolution"] == 64 and r["native_resolution"] == 32
    assert r["images"] == 4 and r["labels"] == "index" and r["num_processes"] == 1
    assert r["layers"] == ["blocks.0.attn", "blocks.1.attn"]
    for name in ("fast", "accurate"):
        p = r["policies"][name]
        assert 0.0 <= p["top1"] <= 1.0 and 0.0 <= p["agreement_with_bf16"] <= 1.0
        # FP4 really ran (the logits moved) and stayed close to BF16
        assert 0 < p["logit_rel_l2_mean"] < 0.5 and p["logit_cosine_mean"] > 0.9
        assert len(p["per_layer"]["cosine_mean"]) == 2
        assert all(0.9 < c < 1.0 for c in p["per_layer"]["cosine_mean"])
        assert all(e > 0 for e in p["per_layer"]["rel_l2_mean"])
    data = json.loads((tmp_path / "vit_top1.json").read_text())
    assert data["policies"]["fast"]["agreement_with_bf16"] == r["policies"]["fast"]["agreement_with_bf16"]
    md = (tmp_path / "vit_top1.md").read_text()
    assert "| fast |" in md and "Per-layer attention error" in md and "65 tokens" in md


def test_deterministic_and_batch_independent(assets):
    kw = dict(policies="fast", progress=False, per_layer=False)
    a = run_vit_eval(VitEvalConfig(str(assets["timm"]), assets["data_index"], batch_size=4, **kw))
    b = run_vit_eval(VitEvalConfig(str(assets["timm"]), assets["data_index"], batch_size=4, **kw))
    timing = ("forward_s",)
    strip = lambda r: {k: v for k, v in r["policies"]["fast"].items() if k not in timing}  # noqa: E731
    assert strip(a) == strip(b)   # deterministic: the same run twice
    c = run_vit_eval(VitEvalConfig(str(assets["timm"]), assets["data_index"], batch_size=1, **kw))
    for key in ("logit_rel_l2_mean", "logit_cosine_mean", "agreement_with_bf16", "top1"):   # batch-independent
        assert c["policies"]["fast"][key] == pytest.approx(a["policies"]["fast"][key], rel=1e-3, abs=1e-6), key
    assert a["policies"]["fast"]["per_layer"] is None


def test_transformers_vit_names_labels_and_interpolation(assets):
    r = run_vit_eval(VitEvalConfig(str(assets["hf"]), assets["data_names"], policies="fast", resolution=48,
                                   batch_size=2, progress=False))
    assert r["model_kind"] == "transformers" and r["labels"] == "names" and r["tokens"] == 37
    assert r["policies"]["fast"]["logit_cosine_mean"] > 0.9
    assert len(r["layers"]) == 2 and all(n.endswith(".attention") for n in r["layers"])


def test_random_weights_from_timm_registry_name(assets):
    r = run_vit_eval(VitEvalConfig("timm:vit_tiny_patch16_224", assets["data_names"], policies="fast", resolution=32,
                                   random_weights=True, labels="none", progress=False, per_layer=False))
    assert r["random_weights"] and r["labels"] == "none" and r["policies"]["fast"]["top1"] is None
    assert r["tokens"] == 5


def test_label_mapping_modes(assets):
    clf = load_classifier(str(assets["hf"]))
    assert label_mapping(["0", "4"], clf) == ([0, 4], "index")
    assert label_mapping(["class1", "CLASS3"], clf) == ([1, 3], "names")
    assert label_mapping(["cats", "dogs"], clf) == (None, "none")
    assert label_mapping(["cats", "dogs"], clf, "order") == ([0, 1], "order")
    imagenet = load_classifier("timm:vit_tiny_patch16_224", random_weights=True, resolution=32)
    assert label_mapping(["n01440764", "n15075141"], imagenet) == ([0, 999], "names")  # ImageNet synsets
    with pytest.raises(UsageError, match="class index"):
        label_mapping(["9"], clf)
    with pytest.raises(UsageError, match="match no label"):
        label_mapping(["cats"], clf, "names")


def test_attention_recorder_reruns_layers_in_isolation(assets):
    clf = load_classifier(str(assets["timm"]), dtype=torch.float32)
    assert [n for n, _ in find_attention_modules(clf.model)] == ["blocks.0.attn", "blocks.1.attn"]
    x = torch.randn(2, 3, 32, 32)
    rec = AttentionRecorder(clf.model)
    with rec, torch.no_grad():
        clf(x)
    reruns = rec.rerun()
    assert sorted(reruns) == ["blocks.0.attn", "blocks.1.attn"]
    for new, old in reruns.values():  # no patch active: the exact same computation
        assert new.shape == old.shape == (2, 17, 64)
        torch.testing.assert_close(new, old)


def test_errors(assets, tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        run_vit_eval(VitEvalConfig(str(tmp_path / "nope"), assets["data_index"], progress=False))
    with pytest.raises(UsageError, match="does not exist"):
        run_vit_eval(VitEvalConfig(str(assets["timm"]), tmp_path / "no_data", progress=False))
    (tmp_path / "flat").mkdir()
    with pytest.raises(UsageError, match="no images .* give an ImageFolder"):
        run_vit_eval(VitEvalConfig(str(assets["timm"]), tmp_path / "flat", progress=False))
    with pytest.raises(UsageError, match="unknown policy"):
        run_vit_eval(VitEvalConfig(str(assets["timm"]), assets["data_index"], policies="fastest", progress=False))
    # a headless transformers ViT (an encoder) would get a random classifier: refused before the run
    from transformers import ViTConfig, ViTModel
    ViTModel(ViTConfig(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                       intermediate_size=64)).save_pretrained(tmp_path / "encoder")
    with pytest.raises(UsageError, match="no classification head .*classifier.weight"):
        run_vit_eval(VitEvalConfig(str(tmp_path / "encoder"), assets["data_index"], progress=False))


def test_sharded_over_two_processes_matches_one(assets, tmp_path):
    """Two CPU processes (torchrun, as accelerate launch does on GPUs): 3 images split 2 + 1, the
    padding duplicate dropped, the same numbers as one process."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["eval", "vit", "--model", str(assets["timm"]), "--data", str(assets["data_index"]), "--policies",
            "fast", "--batch-size", "1", "--limit", "3", "--device", "cpu", "--no-progress"]
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                        "127.0.0.1", "--master_port", str(port), "-m", "fp4vis.cli", *args, "--out-dir",
                        str(tmp_path / "two")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("fast: top-1") == 1  # only the main process reports
    two = json.loads((tmp_path / "two" / "vit_top1.json").read_text())
    one = run_vit_eval(VitEvalConfig(str(assets["timm"]), assets["data_index"], policies="fast", batch_size=1, limit=3,
                                     device="cpu", progress=False))
    assert two["num_processes"] == 2 and two["images"] == 3
    assert two["policies"]["fast"]["logit_rel_l2_mean"] == pytest.approx(one["policies"]["fast"]["logit_rel_l2_mean"])
    for key in ("cosine_mean", "rel_l2_mean"):
        assert two["policies"]["fast"]["per_layer"][key] == pytest.approx(one["policies"]["fast"]["per_layer"][key])
