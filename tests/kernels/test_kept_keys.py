"""Key masks on the kernels (``kernels/kept_keys.py``): each element's kept keys gathered first, in the physical
order of the unmasked call on them, zeros after; the operands both kernels' pre-passes make from them are, on the
kept keys, those of the unmasked call on the kept keys (the zeros stand in for the unmasked call's padding). The
kernels' own runs are checked on the GPU (tests/core/test_key_mask.py) and, for the Blackwell kernel, under Triton's
interpreter (tests/kernels/blackwell/test_blackwell_cpu.py)."""

from __future__ import annotations

import pytest
import torch

from fp4vis.kernels.kept_keys import anchor_positions, kept_keys
from fp4vis.key_positions import anchor_indices, anchor_permutation
from fp4vis.policy import POLICIES


@pytest.mark.parametrize("n", [2, 32, 64, 128])
def test_anchor_positions_are_the_layouts_for_every_length(n):
    lengths = torch.arange(n + 1, 4097)
    got = anchor_positions(lengths, n)
    want = torch.stack([anchor_indices(int(s), n) for s in lengths])
    assert torch.equal(got, want)


def _masked(b=3, h=2, skv=300, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(b, h, skv, d, generator=g), torch.randn(b, h, skv, d + 8, generator=g)
    mask = torch.rand(b, skv, generator=g) > 0.4
    mask[1, 200:] = False          # padding at the end
    mask[-1] = True                # nothing masked
    return k, v, mask


@pytest.mark.parametrize("anchor", [0, 32, 128])
def test_kept_keys_first_in_the_unmasked_calls_physical_order_then_zeros(anchor):
    k, v, mask = _masked()
    k[0, :, ~mask[0]] = float("nan")      # what a masked key holds never reaches the kernel
    kept = kept_keys(k, v, mask, anchor)
    for b in range(k.shape[0]):
        keep = mask[b].nonzero().flatten()
        n = len(keep)
        perm = anchor_permutation(n, anchor) if anchor else torch.arange(n)
        assert int(kept.lengths[b]) == n and kept.lengths.dtype == torch.int32
        assert torch.equal(kept.k[b, :, :n], k[b][:, keep][:, perm])
        assert torch.equal(kept.v[b, :, :n], v[b][:, keep][:, perm])
        assert bool((kept.k[b, :, n:] == 0).all()) and bool((kept.v[b, :, n:] == 0).all())


def test_an_element_masking_every_key_attends_to_one_zero_key():
    k, v, mask = _masked()
    mask[0] = False
    kept = kept_keys(k, v, mask)
    assert int(kept.lengths[0]) == 1 and bool((kept.k[0] == 0).all()) and bool((kept.v[0] == 0).all())


def _gathered(policy: str):
    """D = 64 inputs of ``_masked``, a query, ``policy``'s kernel parameters and the gathered kept keys."""
    k, v, mask = _masked(d=64)
    v = v[..., :64]
    q = torch.randn(k.shape[0], k.shape[1], 20, 64, generator=torch.Generator().manual_seed(1))
    params = POLICIES[policy].kernel_params(64, 0.125)
    return q, k, v, mask, params, kept_keys(k, v, mask, params.anchor)


@pytest.mark.parametrize("policy", ["fast", "accurate", "guard", "fast_fp8qk"])
def test_hopper_operands_of_kept_keys_are_the_unmasked_calls(policy):
    """The Hopper pre-pass (its PyTorch statement, which the interpreted tests hold the Triton one to) of the
    gathered keys, without a permutation, equals on the kept keys the unmasked call's with its permutation."""
    from fp4vis.kernels.hopper import prepass_torch
    q, k, v, mask, params, kept = _gathered(policy)
    ops = prepass_torch.kernel_operands(q, kept.k, kept.v, params.qk_layout, 0)
    for b in range(k.shape[0]):
        keep = mask[b].nonzero().flatten()
        n = len(keep)
        want = prepass_torch.kernel_operands(q[b:b + 1], k[b:b + 1, :, keep], v[b:b + 1, :, keep], params.qk_layout,
                                             params.anchor)
        assert torch.equal(ops.q[b:b + 1].view(torch.uint8), want.q.view(torch.uint8))
        assert torch.equal(ops.k[b:b + 1, :, :n].view(torch.uint8), want.k.view(torch.uint8))
        assert torch.equal(ops.v6[b:b + 1, :, :n], want.v6)
        if want.k_scale is not None:   # per 32 keys: the blocks holding kept keys
            blocks = -(-n // 32)
            assert torch.equal(ops.k_scale[b:b + 1, :, :blocks], want.k_scale[..., :blocks])


@pytest.mark.parametrize("policy", ["fast", "guard"])
def test_blackwell_operands_of_kept_keys_are_the_unmasked_calls(policy):
    from fp4vis.kernels.blackwell import prepass
    q, k, v, mask, params, kept = _gathered(policy)
    ops = prepass.kernel_operands(q, kept.k, kept.v, params.qk_layout, 0, 128, 128, fused=False)
    h = k.shape[1]
    for b in range(k.shape[0]):
        keep = mask[b].nonzero().flatten()
        n = len(keep)
        want = prepass.kernel_operands(q[b:b + 1], k[b:b + 1, :, keep], v[b:b + 1, :, keep], params.qk_layout,
                               params.anchor, 128, 128, fused=False)
        rows = slice(b * h, (b + 1) * h)
        assert torch.equal(ops.qc[rows], want.qc) and torch.equal(ops.qs[rows].view(torch.uint8),
                                                                  want.qs.view(torch.uint8))
        assert torch.equal(ops.kc[rows, :n], want.kc[:, :n])
        assert torch.equal(ops.ks[rows, :n].view(torch.uint8), want.ks[:, :n].view(torch.uint8))
        assert torch.equal(ops.vc[rows, :, :n // 2], want.vc[:, :, :n // 2])
        assert torch.equal(ops.vs[rows, :, :-(-n // 32)], want.vs[:, :, :-(-n // 32)])
