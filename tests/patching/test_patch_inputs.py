"""What ``fp4vis.patch`` and guard-plan files refuse: a ``guard=`` that is no plan, path or "auto" (``open`` would
take it as a file descriptor), and the names of modules that have none (the model itself); what a model without
attention gets (nothing to patch)."""

from __future__ import annotations

import os
from contextlib import nullcontext

import pytest
import torch

timm = pytest.importorskip("timm")

import fp4vis  # noqa: E402
from fp4vis.patching.guard_plan import GuardPlan  # noqa: E402


def _vit():
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=64,
                             depth=2, num_heads=2, num_classes=10).eval()


@pytest.fixture()
def plan_file(tmp_path):
    plan = GuardPlan(model_id="m", policy=fp4vis.get_policy("fast"), guard_policy=fp4vis.get_policy("guard"))
    path = tmp_path / "plan.json"
    plan.save(path)
    return path


def test_guard_is_a_plan_a_path_or_auto(plan_file):
    """A file descriptor (an int, a bool) is refused, never read as a plan nor closed: guard=False used to read
    stdin and close it, guard=True to close stdout."""
    vit = _vit()
    with open(plan_file, encoding="utf-8") as f:
        fd = f.fileno()
        with pytest.raises(TypeError, match=r"^guard: expected a GuardPlan, a path .* got int$"):
            fp4vis.patch(vit, "fast", guard=fd)
        with pytest.raises(TypeError, match=r"GuardPlan.load: path: expected a path \(str or os.PathLike\), got int"):
            GuardPlan.load(fd)
        os.fstat(fd)                  # still open
        assert f.read().startswith("{")
    for bad in (True, False, 1.5, b"plan.json", ["plan.json"]):
        with pytest.raises(TypeError, match=f"guard: .*got {type(bad).__name__}$"):
            fp4vis.patch(vit, "fast", guard=bad)
    with pytest.raises(TypeError, match="GuardPlan.load: path: .*got bool"):
        GuardPlan.load(False)
    with pytest.raises(TypeError, match="GuardPlan.save: path: .*got int"):
        GuardPlan.load(plan_file).save(1)
    assert not any(hasattr(m, "_fp4vis_state") for m in vit.modules())   # nothing was patched
    # what guard= takes: a str or os.PathLike path, a GuardPlan, "auto", None
    for good in (str(plan_file), plan_file, GuardPlan.load(plan_file), "auto", None):
        with pytest.warns(RuntimeWarning, match="calibrated on 'm'") if good not in ("auto", None) else nullcontext():
            fp4vis.patch(vit, "fast", guard=good).remove()


def test_the_model_itself_is_named_root():
    """A model that is itself an attention module has the name "" in named_modules(): messages and the handle
    call it <root>, not an empty name."""
    with pytest.raises(NotImplementedError, match=r"unsupported attention modules: <root> \(MultiheadAttention\)"):
        fp4vis.patch(torch.nn.MultiheadAttention(16, 2))
    attn = timm.layers.Attention(64, num_heads=2).eval()
    with fp4vis.patch(attn, "fast", backend="reference") as h:
        assert h.policies == {"<root>": "fast"}
        with pytest.warns(fp4vis.FallbackWarning, match="layer '<root>' keeps exact attention: gradients"):
            attn(torch.randn(1, 5, 64))       # a fallback's warning names it
        with torch.no_grad(), pytest.raises(ValueError, match="layer '<root>': q"):   # so does an error inside
            attn(torch.full((1, 5, 64), float("nan")))


@torch.no_grad()
def test_a_model_without_attention_is_nothing_to_patch():
    """A model without any attention layer (a plain MLP; a diffusers VAE without its attention block) is left as it
    is: one FallbackWarning saying there is nothing to patch and an empty handle, not an error."""
    diffusers = pytest.importorskip("diffusers")
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU())
    vae = diffusers.AutoencoderKL(block_out_channels=(8,), norm_num_groups=4, latent_channels=2,
                                  mid_block_add_attention=False).eval()
    for model, x in ((mlp, torch.randn(2, 4)), (vae, torch.randn(1, 3, 8, 8))):
        ref = model(x)
        with pytest.warns(fp4vis.FallbackWarning, match=f"{type(model).__name__} has no attention layer: nothing to "
                                                        "patch"):
            h = fp4vis.patch(model, "fast", strict=True)
        assert h.layers == {} and h.policies == {}
        assert torch.equal(_sample(model(x)), _sample(ref))
        h.remove()


def _sample(out):
    return out.sample if hasattr(out, "sample") else out
