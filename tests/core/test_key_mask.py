"""Key masks (docs/numerics.md section 6, "Key masks"): a bool key-padding mask per batch element and key; each
element's result is, bit for bit, the unmasked call on its kept keys in their order, on every policy, eager and
compiled; other mask forms are refused naming the form. The kernels' runs: tests/kernels/test_key_mask_gpu.py."""

from __future__ import annotations

import pytest
import torch

import fp4vis
from fp4vis.call import AttentionCall


def _inputs(layout="bhsd", seed=0):
    g = torch.Generator().manual_seed(seed)
    b, h, sq, skv, d = 2, 3, 40, 70, 64
    shape = (b, h, sq, d) if layout == "bhsd" else (b, sq, h, d)
    kv_shape = (b, h, skv, d) if layout == "bhsd" else (b, skv, h, d)
    q = torch.randn(shape, generator=g)
    k, v = torch.randn(kv_shape, generator=g), torch.randn(kv_shape, generator=g)
    mask = torch.ones(b, skv, dtype=torch.bool)
    mask[0, 50:] = False          # padding at the end (diffusers' text masks)
    mask[1, ::3] = False          # and anywhere
    return q, k, v, mask


def _kept(t, keep, layout):
    return t[:, :, keep] if layout == "bhsd" else t[:, keep]


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("policy", ["fast", "wan_fast", "accurate", "guard", "nv_fp8", "bf16", "fast_fp8qk"])
def test_a_masked_call_is_the_unmasked_call_on_the_kept_keys(policy, layout):
    q, k, v, mask = _inputs(layout)
    out = fp4vis.attention(q, k, v, policy=policy, layout=layout, key_mask=mask)
    for b in range(q.shape[0]):
        keep = mask[b].nonzero().flatten()
        want = fp4vis.attention(q[b:b + 1], _kept(k[b:b + 1], keep, layout), _kept(v[b:b + 1], keep, layout),
                                policy=policy, layout=layout)
        assert torch.equal(out[b:b + 1], want), (policy, layout, b)


def test_sdpa_broadcast_form_and_an_all_true_mask():
    q, k, v, mask = _inputs()
    assert torch.equal(fp4vis.attention(q, k, v, key_mask=mask[:, None, None, :]),
                       fp4vis.attention(q, k, v, key_mask=mask))
    full = torch.ones_like(mask)
    assert torch.equal(fp4vis.attention(q, k, v, key_mask=full), fp4vis.attention(q, k, v))


@pytest.mark.parametrize("mask, exc, match", [
    ("float", TypeError, r"key_mask: dtype torch.float32; only a bool key-padding mask"),
    ("list", TypeError, r"key_mask: expected a bool tensor, got list"),
    ("per_query", ValueError,
     r"key_mask: expected shape \(B, Skv\) = \(2, 70\) or \(2, 1, 1, 70\), got \(2, 1, 40, 70\)"),
    ("empty_row", ValueError, r"key_mask: batch element 1 masks every key"),
])
def test_other_mask_forms_are_refused_naming_the_form(mask, exc, match):
    q, k, v, m = _inputs()
    given = {"float": m.float(), "list": m.tolist(), "per_query": m[:, None, None, :].expand(2, 1, 40, 70),
             "empty_row": torch.cat((m[:1], torch.zeros_like(m[1:])))}[mask]
    with pytest.raises(exc, match=match):
        fp4vis.attention(q, k, v, key_mask=given)


def test_the_kernels_take_key_masks():
    """Neither kernel backend refuses a call for its key mask (on this machine they refuse it for its device)."""
    hopper = pytest.importorskip("fp4vis.kernels.hopper.backend")
    q, k, v, mask = _inputs()
    call = AttentionCall(q, k, v, fp4vis.get_policy("fast"), 0.125, key_mask=mask)
    from fp4vis.kernels.blackwell import backend as blackwell
    for backend in (hopper.BACKEND, blackwell.BACKEND):
        reason = backend.supports(call)
        assert reason is None or "mask" not in reason, reason


def test_masked_keys_leave_the_range_report():
    """A masked key out of its format's range is not the call's: only kept keys are quantized."""
    q, k, v, mask = _inputs()
    k = k.clone()
    k[0, :, 60] = 1e6          # masked in element 0
    fp4vis.attention(q, k, v, policy="fast", key_mask=mask)
    k[1, :, 1] = 1e6           # kept in element 1
    with pytest.raises(fp4vis.RangeExceededError, match="blocks of k whose scale saturates"):
        fp4vis.attention(q, k, v, policy="fast", key_mask=mask)


def test_compiled_masked_call_gives_the_eager_bits():
    q, k, v, mask = _inputs()
    torch._dynamo.reset()
    for policy in ("fast", "bf16"):
        compiled = torch.compile(lambda q, k, v, m, p=policy: fp4vis.attention(q, k, v, policy=p, key_mask=m),
                                 fullgraph=True)
        got, eager = compiled(q, k, v, mask), fp4vis.attention(q, k, v, policy=policy, key_mask=mask)
        if policy == "bf16":   # SDPA with the mask, traced: the same attention, not the same summation
            torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(got, eager)


def test_straight_through_gradient_is_masked_attentions():
    q, k, v, mask = _inputs()
    q.requires_grad_(True)
    with pytest.warns(UserWarning, match="straight-through"):
        fp4vis.attention(q, k, v, policy="fast", key_mask=mask).sum().backward()
    want = q.detach().clone().requires_grad_(True)
    torch.nn.functional.scaled_dot_product_attention(want, k, v, attn_mask=mask[:, None, None, :]).sum().backward()
    torch.testing.assert_close(q.grad, want.grad)
