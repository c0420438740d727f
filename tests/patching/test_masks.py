"""fp4vis.patching.masks: which SDPA-form attention masks are key-padding masks (fp4vis.attention's key_mask)."""

from __future__ import annotations

import pytest
import torch

from fp4vis.patching.masks import key_padding_mask

B, H, S = 2, 3, 5
Q = torch.zeros(B, H, S, 8)


def _keep() -> torch.Tensor:
    keep = torch.ones(B, S, dtype=torch.bool)
    keep[1, 3:] = False
    return keep


@pytest.mark.parametrize("form", ["bool_b11s", "bool_b1ss", "bool_bhss_expanded", "zero_neg_inf", "zero_min"])
def test_key_padding_forms_give_the_key_mask(form):
    keep = _keep()
    mask = {
        "bool_b11s": keep[:, None, None, :],
        "bool_b1ss": keep[:, None, None, :].expand(B, 1, S, S).clone(),
        "bool_bhss_expanded": keep[:, None, None, :].expand(B, H, S, S),
        "zero_neg_inf": torch.zeros(B, 1, 1, S).masked_fill(~keep[:, None, None, :], float("-inf")),
        "zero_min": torch.zeros(B, 1, S, S).masked_fill(~keep[:, None, None, :], torch.finfo(torch.float32).min),
    }[form]
    key_mask, reason = key_padding_mask(mask, Q, Q)
    assert reason is None and key_mask.dtype == torch.bool and torch.equal(key_mask, keep)


def test_masks_that_remove_no_key_are_dropped():
    assert key_padding_mask(None, Q, Q) == (None, None)
    assert key_padding_mask(torch.ones(S, S, dtype=torch.bool), Q, Q) == (None, None)
    assert key_padding_mask(torch.zeros(B, 1, 1, S), Q, Q) == (None, None)


def test_a_mask_shared_by_the_batch_broadcasts():
    keep = torch.tensor([True, True, False, True, True])
    key_mask, reason = key_padding_mask(keep.expand(S, S), Q, Q)
    assert reason is None and torch.equal(key_mask, keep.expand(B, S))


@pytest.mark.parametrize("mask, words", [
    (torch.ones(S, S, dtype=torch.bool).tril(), "differs between queries or heads"),
    (torch.randn(1, 1, S, S), "additive attention bias of shape 1x1x5x5"),
    (torch.randn(1, H, S, S), "per-head attention bias of shape 1x3x5x5"),
    (torch.ones(1, H, S, S, dtype=torch.bool), "per-head attention mask"),
    (torch.ones(B, 1, S, S, dtype=torch.bool).index_fill(0, torch.tensor([1]), False),
     "removes every key of batch element 1"),
    (torch.ones(B, 1, 1, S, dtype=torch.int64), "dtype torch.int64"),
    (torch.ones(B, 1, 1, S + 1, dtype=torch.bool), "shape 2x1x1x6 for 2x3x5x5 attention"),
    ("causal", "type str"),
])
def test_other_masks_give_the_reason(mask, words):
    key_mask, reason = key_padding_mask(mask, Q, Q)
    assert key_mask is None and words in reason


def test_a_broadcast_bool_mask_is_read_by_its_shape():
    """(B, 1, 1, Skv), or expanded over heads and queries: the key mask is a view, no value is read."""
    mask = _keep()[:, None, None, :].expand(B, H, S, S)
    key_mask, reason = key_padding_mask(mask, Q, Q)
    assert reason is None and key_mask.data_ptr() == mask.data_ptr() and torch.equal(key_mask, _keep())


def test_the_answer_is_reused_for_the_same_unchanged_mask():
    mask = _keep()[:, None, None, :].expand(B, 1, S, S).clone()   # materialised, as transformers hands it
    first, _ = key_padding_mask(mask, Q, Q)
    assert key_padding_mask(mask, Q, Q)[0] is first   # the layers of one forward share the mask: one check
    mask[1] = True   # changed in place: checked again
    assert key_padding_mask(mask, Q, Q) == (None, None)
    shared = _keep()[1:, None, None, :].expand(1, 1, S, S).clone()   # one mask for the whole batch
    assert key_padding_mask(shared, Q, Q)[0].shape == (B, S)
    assert key_padding_mask(shared, Q[:1], Q[:1])[0].shape == (1, S)   # another batch: checked again


def test_inference_mode_masks_are_read_each_time():
    with torch.inference_mode():
        mask = _keep()[:, None, None, :].expand(B, 1, S, S).clone()
        assert torch.equal(key_padding_mask(mask, Q, Q)[0], _keep())
        mask[1] = True   # no version counter to show this: the mask is read again
        assert key_padding_mask(mask, Q, Q) == (None, None)
