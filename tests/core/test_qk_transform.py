"""fp4vis.qk_transform and ``fp4vis.attention(..., qk_transform=...)`` on the CPU: the transform's
PyTorch statement is diffusers' Wan arithmetic, and a backend that does not fuse it gets q and k
made by it (the same bits as passing them made)."""

import pytest
import torch

import fp4vis
from fp4vis.qk_transform import QKTransform, apply_rotary_emb


def _case(seed=0, b=1, s=24, h=2, d=16):
    g = torch.Generator().manual_seed(seed)
    q, k, v = ((torch.randn(b, s, h * d, generator=g) * 2).bfloat16() for _ in range(3))
    norm_q, norm_k = torch.nn.RMSNorm(h * d, eps=1e-6), torch.nn.RMSNorm(h * d, eps=None)
    with torch.no_grad():
        for n in (norm_q, norm_k):
            n.weight.copy_(1 + 0.3 * torch.randn(h * d, generator=g))
    norm_q, norm_k = norm_q.bfloat16(), norm_k.bfloat16()
    ang = torch.randn(1, s, 1, d, generator=g)
    return q, k, v, norm_q, norm_k, (ang.cos(), ang.sin()), (b, s, h, d)


@torch.no_grad()
def test_apply_is_the_layers_norms_and_rotary_embedding():
    q, k, v, norm_q, norm_k, rope, shape = _case()
    tr = QKTransform.from_norms(norm_q, norm_k, rope)
    assert tr.k_eps == torch.finfo(torch.float32).eps   # eps=None: what rms_norm takes
    qn, kn = tr.apply(q.view(shape), k.view(shape))
    assert torch.equal(qn, apply_rotary_emb(norm_q(q).view(shape), *rope))
    assert torch.equal(kn, apply_rotary_emb(norm_k(k).view(shape), *rope))
    assert QKTransform.from_norms(norm_q, torch.nn.LayerNorm(4), rope) is None   # not a norm it states
    ident = QKTransform.from_norms(torch.nn.Identity(), torch.nn.Identity(), None)
    assert ident.q_weight is None and ident.rope is None
    assert torch.equal(ident.apply(q.view(shape), k.view(shape))[1], k.view(shape))


@torch.no_grad()
@pytest.mark.parametrize("policy", ["wan_fast", "bf16"])
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_attention_with_a_transform_equals_attention_on_the_made_q_k(policy, layout):
    q, k, v, norm_q, norm_k, rope, shape = _case(1)
    tr = QKTransform.from_norms(norm_q, norm_k, rope)
    qs, ks, vs = (t.view(shape) for t in (q, k, v))
    qn, kn = tr.apply(qs, ks)
    if layout == "bhsd":
        qs, ks, vs, qn, kn = (t.transpose(1, 2) for t in (qs, ks, vs, qn, kn))
    got = fp4vis.attention(qs, ks, vs, policy=policy, layout=layout, backend="reference", qk_transform=tr)
    ref = fp4vis.attention(qn, kn, vs, policy=policy, layout=layout, backend="reference")
    assert torch.equal(got, ref)


def test_attention_rejects_a_transform_of_another_type():
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(TypeError, match="qk_transform"):
        fp4vis.attention(q, q, q, backend="reference", qk_transform=(1.0, 2.0))
