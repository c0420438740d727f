"""The reference emulation: docs/numerics.md sections 2-4 as executable PyTorch, on any device.

Every kernel is tested against this module. It favours being exactly the specification over speed:
- Q and K are NVFP4-quantized and decoded (``fp4vis.formats``), so ``raw = Q̂ K̂ᵀ`` is a float32
  matrix product of values that are exact in BF16 (exact up to FP32 summation order);
- the Direct-P element math (block maxima, exponent selection, the affine or exp2 code, E2M1
  rounding) runs in float64 from the float32 ``raw``: it is the formula of docs/numerics.md evaluated without
  intermediate float32 rounding, so a kernel's codes may differ only where its float32 arithmetic
  lands on the other side of an E2M1 rounding boundary;
- the numerator ``Σ (α'q)(αc)`` of P̃V̂ accumulates in float32 over operands that are exact in
  float32 (and in BF16), like a tensor-core accumulator, so an FP32 overflow shows up here too; the
  denominator ``l = Σ α'·c_B`` (exact code sums) accumulates in float64; the two 1/6 factors are
  applied once at the end: ``O = num / (6 l)``.
Nothing of size S×S is materialised: queries, keys and head groups are processed in chunks of at
most ``CHUNK_ELEMENTS`` scores, and with a fixed row reference no rescaling between key chunks is
needed (the point of Direct-P). The same property lets ``DirectPAccumulator`` take the keys piece by
piece (the key shards of ring attention), bit-identical to one call on the whole sequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fp4vis.formats import (
    ScaleRange,
    check_no_nan,
    e2m1_round,
    e4m3_round,
    fp8_channel_quantize,
    fp8_channel_scale_counts,
    fp8_pow2_qdq,
    fp8_pow2_scale_counts,
    mxfp4_quantize,
    nvfp4_quantize,
)
from fp4vis.key_positions import (
    KEY_BLOCK,
    P_E4M3_LOG2,
    anchor_permutation,
    native_positions,
    softmax_sums_rounded_p,
    softmax_tile,
)
from fp4vis.policy import LOG2E, Policy
from fp4vis.range_report import RangeReport

LOG2_6 = math.log2(6.0)
LOG2_1P5 = math.log2(1.5)
MAX_EXP_BYTE = 254
CHUNK_ELEMENTS = 1 << 22  # scores per chunk: float64 temporaries of 32 MiB each
KEY_CHUNK = 4096  # keys per chunk (a multiple of 32)


# ---------------------------------------------------------------------------------------------
# Operands
# ---------------------------------------------------------------------------------------------

@dataclass
class QuantizedOperands:
    """Decoded FP4 operands in the physical key order, flattened to G = B*H head groups.

    q: (G, Sq, Dqk) float32 NVFP4-decoded; k: (G, Skv_pad, Dqk) likewise, anchor-permuted and
    zero-padded to a multiple of 32 keys; v6: (G, Skv_pad, Dv) float32 ``α·c`` (MXFP4 decoded
    times 6, exact in BF16); num_keys: the valid keys; s: ``scale·log2(e)`` with the per-tensor
    scales folded in; perm: the physical key order (None when not permuted); tensor_scale: the
    product of Q's and K's per-tensor decode scales (1.0 unless ``qk_global_scale``); scale_ranges: the
    ``ScaleRange`` of q, k and v."""

    q: torch.Tensor
    k: torch.Tensor
    v6: torch.Tensor
    num_keys: int
    s: float
    perm: torch.Tensor | None
    tensor_scale: float = 1.0
    scale_ranges: tuple[ScaleRange, ScaleRange, ScaleRange] = (ScaleRange(),) * 3


def pad_last(x: torch.Tensor, multiple: int, value: float = 0.0) -> torch.Tensor:
    """Pad the last dim to a multiple with ``value`` (zeros change no dot product; -inf no maximum)."""
    pad = (-x.shape[-1]) % multiple
    return F.pad(x, (0, pad), value=value) if pad else x


def quantize_qk(q: torch.Tensor, k: torch.Tensor,
                policy: Policy) -> tuple[torch.Tensor, torch.Tensor, float, tuple[ScaleRange, ScaleRange]]:
    """Decoded NVFP4 Q̂ and K̂ (float32, D padded to a multiple of 16) without their per-tensor decode
    scales, the product of those scales (folded into ``s`` by the callers, once: docs/numerics.md
    section 1) and the ``ScaleRange`` of each. ``fp8_e4m3``: E4M3 with power-of-two scales per query row
    and per 32-key block of k (in its physical order), decoded (exact in float32)."""
    qd, q_scale, q_range = quantize_qk_operand(q, policy, "q")
    kd, k_scale, k_range = quantize_qk_operand(k, policy, "k")
    return qd, kd, q_scale * k_scale, (q_range, k_range)


def quantize_qk_operand(x: torch.Tensor, policy: Policy, name: str) -> tuple[torch.Tensor, float, ScaleRange]:
    """One operand of ``quantize_qk`` (``name`` "q" or "k"): decoded values without the per-tensor
    decode scale, that scale, and the blocks whose scale left its format's range. Without
    ``qk_global_scale`` every row of q and every 32-key block of k is quantized on its own, so the keys
    of a sequence can be quantized piece by piece."""
    if policy.qk_fp8:
        check_no_nan(x, name)
        rows = 1 if name == "q" else KEY_BLOCK
        return fp8_pow2_qdq(x, rows), 1.0, ScaleRange.of(fp8_pow2_scale_counts(x, rows))
    x = pad_last(x, 16)
    xq = nvfp4_quantize(x, policy.qk_layout(x.shape[-1]), policy.qk_global_scale, name=name)
    return xq.dequantize(tensor_scale=False), xq.tensor_scale, xq.scale_range


def quantize_operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, policy: Policy,
                      scale: float) -> QuantizedOperands:
    """Everything a Direct-P backend consumes, from (G, S, D) inputs: anchor permutation, NVFP4
    Q/K, MXFP4 V over 32-token blocks of the permuted order, keys padded to whole blocks."""
    num_keys = k.shape[-2]
    perm = None
    if policy.anchor > 0:
        perm = anchor_permutation(num_keys, policy.anchor, device=k.device)
        k, v = k[:, perm], v[:, perm]
    qd, kd, tensor_scale, qk_ranges = quantize_qk(q, k, policy)
    vq = mxfp4_quantize(pad_last(v, 2), name="v")
    v6 = vq.dequantize(times_six=True)[..., : v.shape[-1]]
    key_pad = (-num_keys) % KEY_BLOCK
    if key_pad:
        kd = F.pad(kd, (0, 0, 0, key_pad))
        v6 = F.pad(v6, (0, 0, 0, key_pad))
    return QuantizedOperands(qd, kd, v6, num_keys, scale * tensor_scale * LOG2E, perm, tensor_scale,
                             (*qk_ranges, vq.scale_range))


# ---------------------------------------------------------------------------------------------
# Direct-P
# ---------------------------------------------------------------------------------------------

def row_reference(q: torch.Tensor, k: torch.Tensor, num_keys: int, s: float, policy: Policy,
                  tensor_scale: float = 1.0) -> torch.Tensor:
    """m_i (raw units, float64, shape (G, Sq, 1)) for decoded queries q (G, Sq, D) against the
    physically ordered keys k (G, Skv, D): 0, or the anchor maximum plus the margin. ``raw`` is the
    product of operands decoded without their per-tensor scales (``tensor_scale``, their product,
    is in ``s``): the code-units margin M ln 2, stated for the true scores, is M ln 2 / tensor_scale here."""
    if policy.anchor == 0:
        return torch.zeros(*q.shape[:-1], 1, dtype=torch.float64, device=q.device)
    n = min(policy.anchor, num_keys)
    a = (q @ k[:, :n].mT).amax(-1, keepdim=True).double()
    return a + policy.margin_raw(s, tensor_scale)


@dataclass
class DirectPBlock:
    """Direct-P of one chunk of scores: ``p_scaled = α'·q`` (float32, exact), ``weighted_sum`` =
    Σ_B α'·c_B per row (float64), the codes ``q`` (float64 E2M1 values) and ``u`` (block bytes)."""

    p_scaled: torch.Tensor
    weighted_sum: torch.Tensor
    codes: torch.Tensor
    u: torch.Tensor
    saturated_blocks: int


def _code(y: torch.Tensor, policy: Policy) -> torch.Tensor:
    """docs/numerics.md section 2, step 5: E2M1_rne_sat(max(0, y)); with ``code_rounding="bf16"``, y is first
    rounded to BF16 (through float32, as the kernel computes it)."""
    if policy.code_rounding == "bf16":
        y = y.float().bfloat16().double()
    return e2m1_round(y, relu=True)


def direct_p_block(raw: torch.Tensor, m: torch.Tensor, s: float, policy: Policy,
                   valid: torch.Tensor, native: torch.Tensor | None) -> DirectPBlock:
    """docs/numerics.md section 2, steps 1-7, for raw scores (..., Sq, nk) with nk a multiple of 32 whose
    first key is at a physical position that is a multiple of 32. ``m`` (..., Sq, 1) is the row
    reference; ``valid`` (nk,) marks real keys, ``native`` (nk,) the native exp2 positions (None:
    all affine). Per element this is one multiply-add in float64 and one E2M1 rounding."""
    nb = raw.shape[-1] // KEY_BLOCK
    vmask = valid.view(nb, KEY_BLOCK)
    all_valid = bool(valid.all())
    blocks = raw.unflatten(-1, (nb, KEY_BLOCK))
    if not all_valid:
        blocks = blocks.masked_fill(~vmask, -math.inf)
    g = (blocks.amax(-1).double() - m) * s  # (..., Sq, nb); -inf for an all-masked block
    finite = torch.isfinite(g)
    e = torch.floor(torch.where(finite, g, torch.zeros_like(g)) + 1 - LOG2_1P5)
    u = torch.where(finite, (e + 127).clamp(0, MAX_EXP_BYTE), torch.zeros_like(e))
    saturated = int(((e + 127 > MAX_EXP_BYTE) & finite).sum())
    u_work = u.clamp(min=policy.shift + 1)
    # x = (raw - m) s + log2 6 - e_bar = raw * s + offset; blocks with u = 0 get offset -inf (q = 0)
    offset = torch.where(u == 0, -math.inf, LOG2_6 - (u_work - 127) - m * s).unsqueeze(-1)
    r = blocks.double()  # masked keys are -inf: they give q = 0 on both paths
    a, b = policy.affine_a, policy.affine_b
    # affine: E2M1(max(0, A x + B)) with A x + B = raw * (A s) + (A offset + B)
    codes = _code(torch.addcmul(offset * a + b, r, torch.tensor(a * s, dtype=torch.float64)), policy)
    if native is not None:
        pattern = native.view(nb, KEY_BLOCK)
        for blk in range(min(nb, 4)):  # the native pattern repeats every 4 blocks (quarter = block % 4)
            sl = (..., slice(blk, None, 4), pattern[blk].nonzero().flatten())
            codes[sl] = _code(torch.exp2(r[sl] * s + offset[..., blk::4, :]), policy)
    alpha = torch.exp2(u_work - policy.shift - 127)  # exact powers of two >= 2**-126
    p_scaled = (codes * alpha.unsqueeze(-1)).flatten(-2).float()
    weighted_sum = (codes.sum(-1) * alpha).sum(-1)
    return DirectPBlock(p_scaled, weighted_sum, codes, u.to(torch.int32), saturated)


def _chunks(total: int, size: int):
    for start in range(0, total, size):
        yield start, min(start + size, total)


def _chunk_sizes(groups: int, sq: int, nk: int, align: int) -> tuple[int, int, int]:
    """(head groups, queries, keys) per chunk with at most CHUNK_ELEMENTS scores."""
    ck = min(nk, max(align, (KEY_CHUNK // align) * align))
    cq = min(sq, max(1, CHUNK_ELEMENTS // ck))
    cg = min(groups, max(1, CHUNK_ELEMENTS // (cq * ck)))
    return cg, cq, ck


def direct_p_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, policy: Policy,
                       scale: float, score_product=None) -> tuple[torch.Tensor, RangeReport]:
    """Direct-P attention of (G, S, D) tensors: float32 output (G, Sq, Dv) and a RangeReport.

    ``score_product(q_hat, k_hat)``: how ``raw = Q̂ K̂ᵀ`` is formed from chunks of the decoded
    operands (default: the float32 matrix product). A test passes the GPU's FP8 tensor-core product
    to tell accumulation error apart from a kernel's own."""
    ops = quantize_operands(q, k, v, policy, scale)
    groups, sq, nkp = ops.q.shape[0], ops.q.shape[1], ops.k.shape[1]
    valid = torch.arange(nkp, device=q.device) < ops.num_keys
    native = native_positions(nkp, device=q.device) if policy.native_exp2 else None
    out = torch.empty(groups, sq, ops.v6.shape[-1], dtype=torch.float32, device=q.device)
    report = RangeReport()
    report.add_scale_ranges(ops.scale_ranges, ops.s)
    cg, cq, ck = _chunk_sizes(groups, sq, nkp, KEY_BLOCK)
    for g0, g1 in _chunks(groups, cg):
        for q0, q1 in _chunks(sq, cq):
            qc = ops.q[g0:g1, q0:q1]
            m = row_reference(qc, ops.k[g0:g1], ops.num_keys, ops.s, policy, ops.tensor_scale)
            num = torch.zeros(g1 - g0, q1 - q0, ops.v6.shape[-1], dtype=torch.float32, device=q.device)
            den = torch.zeros(g1 - g0, q1 - q0, dtype=torch.float64, device=q.device)
            for k0, k1 in _chunks(nkp, ck):
                kc = ops.k[g0:g1, k0:k1]
                raw = qc @ kc.mT if score_product is None else score_product(qc, kc)
                blk = direct_p_block(raw, m, ops.s, policy, valid[k0:k1],
                                     None if native is None else native[k0:k1])
                num += blk.p_scaled @ ops.v6[g0:g1, k0:k1]
                den += blk.weighted_sum
                report.saturated_blocks += blk.saturated_blocks
            if ops.num_keys:
                report.empty_rows += int((den == 0).sum())
            out[g0:g1, q0:q1] = (num.double() / (6.0 * den.unsqueeze(-1))).float()
    report.nonfinite_outputs = int((~torch.isfinite(out)).sum())
    return out, report


def key_stream_reason(policy: Policy) -> str | None:
    """Why Direct-P under ``policy`` cannot take its keys piece by piece (None when it can).

    A fixed row reference is what lets key shards add: with ``m = 0`` every P block depends on its
    own 32 keys alone, and the numerator and denominator of disjoint key ranges add, with no
    rescaling. An anchored row reference samples the whole key sequence and moves the samples to
    the front of the physical key order (so blocks are made of keys from all over the sequence); a
    per-tensor scale (``qk_global_scale``) needs the amax of every key."""
    if not policy.is_direct_p:
        return f"policy {policy.name!r} is not a Direct-P policy (method {policy.method!r})"
    if policy.anchor > 0:
        return (f"policy {policy.name!r} anchors each row on {policy.anchor} samples of the whole key sequence, "
                "placed first in the physical key order")
    if policy.qk_global_scale:
        return f"policy {policy.name!r} scales q and k by their amax over the whole tensor (qk_global_scale)"
    return None


class DirectPAccumulator:
    """Direct-P attention of fixed queries over keys that arrive in order, piece by piece (the key
    shards of ring attention), for policies with a fixed row reference (``fast``, ``wan_fast``,
    ``fast_fp8qk``; ``key_stream_reason`` says why others cannot).

    With ``m = 0`` the numerator ``Σ (α'q)(αc)`` and the denominator ``Σ α'·c_B`` of disjoint key
    ranges add exactly, with no rescaling; only the float32 order of the numerator's sums could
    differ. To keep that order too, keys are processed in the chunks ``direct_p_attention`` uses
    (``KEY_CHUNK`` keys from the first key of the whole sequence, so every 32-key P block and MXFP4 V
    block is the same): a piece that ends inside a chunk waits, at most one chunk of keys, for the
    next. Fed the whole key sequence in order, in pieces of any sizes, ``result()`` is bit-identical
    to ``reference_attention`` on the whole sequence.

        acc = DirectPAccumulator(q, policy, scale, num_keys=S)   # q: (G, Sq, D)
        for k, v in shards:                                       # (G, n, D), (G, n, Dv), in key order
            acc.add(k, v)
        out, report = acc.result()                                # q's dtype, a RangeReport
    """

    def __init__(self, q: torch.Tensor, policy: Policy, scale: float, num_keys: int):
        reason = key_stream_reason(policy)
        if reason is not None:
            raise ValueError(f"DirectPAccumulator: {reason}; attend to the whole key sequence at once")
        if q.dim() != 3:
            raise ValueError(f"q: expected (G, Sq, D), got shape {tuple(q.shape)}")
        if not (isinstance(num_keys, int) and num_keys > 0):
            raise ValueError(f"num_keys: expected a positive number of keys, got {num_keys!r}")
        _check_finite(q, "q")
        self.policy, self.num_keys, self.dtype = policy, num_keys, q.dtype
        self.q, _, q_range = quantize_qk_operand(q, policy, "q")
        self.scale_ranges = (q_range, ScaleRange(), ScaleRange())   # q, k, v: keys add as they come
        self.head_dim = q.shape[-1]
        self.s = scale * LOG2E  # no per-tensor scales (key_stream_reason)
        self.padded_keys = num_keys + (-num_keys) % KEY_BLOCK
        groups, sq = q.shape[:2]
        self.chunks = _chunk_sizes(groups, sq, self.padded_keys, KEY_BLOCK)
        self.native = native_positions(self.padded_keys, device=q.device) if policy.native_exp2 else None
        self.numerator: torch.Tensor | None = None      # (G, Sq, Dv) float32, once the first key arrives
        self.denominator = torch.zeros(groups, sq, dtype=torch.float64, device=q.device)
        self.saturated_blocks = 0
        self.keys_added = 0       # keys given to add()
        self.keys_done = 0        # keys whose partial sums are in numerator / denominator
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []   # keys added, not yet a whole chunk

    def add(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """The next keys of the sequence, in order: k (G, n, D), v (G, n, Dv)."""
        g = self.q.shape[0]
        if k.dim() != 3 or v.dim() != 3 or k.shape[0] != g or v.shape[0] != g or k.shape[1] != v.shape[1]:
            raise ValueError(f"k, v: expected (G, n, D) and (G, n, Dv) with G = {g}, got shapes "
                             f"{tuple(k.shape)} and {tuple(v.shape)}")
        if k.shape[-1] != self.head_dim:
            raise ValueError(f"k: head dim {k.shape[-1]} differs from q's {self.head_dim}")
        if k.dtype != self.dtype or v.dtype != self.dtype:
            raise TypeError(f"k, v: dtypes {k.dtype}/{v.dtype} differ from q's {self.dtype}")
        if self.keys_added + k.shape[1] > self.num_keys:
            raise ValueError(f"k: {self.keys_added + k.shape[1]} keys added, more than num_keys = {self.num_keys}")
        _check_finite(k, "k")
        _check_finite(v, "v")
        self._pending.append((k, v))
        self.keys_added += k.shape[1]
        chunk = self.chunks[2]
        while self.keys_added - self.keys_done >= chunk or (
                self.keys_added == self.num_keys and self.keys_done < self.num_keys):
            self._process(min(chunk, self.keys_added - self.keys_done))

    def _process(self, n: int) -> None:
        """Quantize the next ``n`` pending keys (a whole chunk, or the last keys) and add their sums."""
        ks, vs, taken = [], [], 0
        while taken < n:
            k, v = self._pending[0]
            use = min(n - taken, k.shape[1])
            ks.append(k[:, :use])
            vs.append(v[:, :use])
            if use == k.shape[1]:
                self._pending.pop(0)
            else:
                self._pending[0] = (k[:, use:], v[:, use:])
            taken += use
        k, v = torch.cat(ks, 1), torch.cat(vs, 1)
        # the same per-row / per-block quantizers as quantize_operands, on whole 32-key blocks
        kd, _, k_range = quantize_qk_operand(k, self.policy, "k")
        vq = mxfp4_quantize(pad_last(v, 2), name="v")
        v6 = vq.dequantize(times_six=True)[..., : v.shape[-1]]
        q_range, k_total, v_total = self.scale_ranges
        self.scale_ranges = (q_range, k_total + k_range, v_total + vq.scale_range)
        k0 = self.keys_done
        pad = (-n) % KEY_BLOCK
        if pad:   # only the last keys: pad to a whole block, as quantize_operands pads the sequence
            kd, v6 = F.pad(kd, (0, 0, 0, pad)), F.pad(v6, (0, 0, 0, pad))
        k1 = k0 + n + pad
        valid = torch.arange(k0, k1, device=kd.device) < self.num_keys
        native = None if self.native is None else self.native[k0:k1]
        groups, sq = self.q.shape[:2]
        if self.numerator is None:
            self.numerator = torch.zeros(groups, sq, v6.shape[-1], dtype=torch.float32, device=kd.device)
        cg, cq, _ = self.chunks
        for g0, g1 in _chunks(groups, cg):
            for q0, q1 in _chunks(sq, cq):
                qc = self.q[g0:g1, q0:q1]
                m = torch.zeros(g1 - g0, q1 - q0, 1, dtype=torch.float64, device=kd.device)
                blk = direct_p_block(qc @ kd[g0:g1].mT, m, self.s, self.policy, valid, native)
                self.numerator[g0:g1, q0:q1] += blk.p_scaled @ v6[g0:g1]
                self.denominator[g0:g1, q0:q1] += blk.weighted_sum
                self.saturated_blocks += blk.saturated_blocks
        self.keys_done += n

    def result(self) -> tuple[torch.Tensor, RangeReport]:
        """``O = num / (6 l)`` in q's dtype and the RangeReport, once every key has been added."""
        if self.keys_done != self.num_keys:
            raise RuntimeError(f"DirectPAccumulator: {self.keys_added} of {self.num_keys} keys added; add the "
                               "rest before result()")
        report = RangeReport(saturated_blocks=self.saturated_blocks,
                             empty_rows=int((self.denominator == 0).sum()))
        report.add_scale_ranges(self.scale_ranges, self.s)
        out = (self.numerator.double() / (6.0 * self.denominator.unsqueeze(-1))).float().to(self.dtype)
        report.nonfinite_outputs = int((~torch.isfinite(out)).sum())
        return out, report


def _check_finite(t: torch.Tensor, name: str) -> None:
    if not bool(torch.isfinite(t).all()):
        bad = "NaN" if bool(torch.isnan(t).any()) else "Inf"
        raise ValueError(f"{name}: contains {bad}; attention inputs must be finite")


# ---------------------------------------------------------------------------------------------
# Controls (docs/numerics.md section 3)
# ---------------------------------------------------------------------------------------------

def nv_fp8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, policy: Policy,
                     scale: float) -> tuple[torch.Tensor, RangeReport]:
    """NVFP4 (block16) Q/K, standard max-subtracted softmax with the row max over all keys, P and
    V cast to FP8 E4M3 with no block scale; the denominator sums the unquantized P (as FlashAttention
    -3's FP8 path does). Float32 output (G, Sq, Dv) and a RangeReport of Q's and K's block scales."""
    qd, kd, tensor_scale, qk_ranges = quantize_qk(q, k, policy.replace(qk_format="block16"))
    report = RangeReport()
    s = scale * tensor_scale * LOG2E
    report.add_scale_ranges((*qk_ranges, ScaleRange()), s)
    v8 = e4m3_round(v.float())
    groups, sq, nk = qd.shape[0], qd.shape[1], kd.shape[1]
    out = torch.empty(groups, sq, v.shape[-1], dtype=torch.float32, device=q.device)
    cg, cq, ck = _chunk_sizes(groups, sq, max(nk, 1), 1)
    for g0, g1 in _chunks(groups, cg):
        for q0, q1 in _chunks(sq, cq):
            qc = qd[g0:g1, q0:q1]
            row_max = torch.stack([(qc @ kd[g0:g1, k0:k1].mT).amax(-1) for k0, k1 in _chunks(nk, ck)]).amax(0)
            num = torch.zeros(g1 - g0, q1 - q0, v.shape[-1], dtype=torch.float32, device=q.device)
            den = torch.zeros(g1 - g0, q1 - q0, dtype=torch.float32, device=q.device)
            for k0, k1 in _chunks(nk, ck):
                p = torch.exp2((qc @ kd[g0:g1, k0:k1].mT - row_max.unsqueeze(-1)) * s)
                den += p.sum(-1)
                num += e4m3_round(p) @ v8[g0:g1, k0:k1]
            out[g0:g1, q0:q1] = num / den.unsqueeze(-1)
    return out, report


def fp8_pv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, policy: Policy,
                     scale: float, score_product=None) -> tuple[torch.Tensor, RangeReport]:
    """The FP8 P/V softmax (docs/numerics.md section 7): Q/K in the policy's format (decoded, exact in float32),
    V in E4M3 with a power-of-two scale per channel (``fp8_channel_quantize``), and per row an online maximum
    updated once per ``softmax_tile(D)`` physical keys: t = raw * s, m_j = max(m_{j-1}, max of tile j's t),
    P = 2^(t - m_j) for tile j's keys, numerator sum_j 2^(m_j - m_n) sum E4M3(2^8 P) V8 (float32), denominator
    the same sum of the E4M3(2^8 P) the numerator weighs V with (of the unrounded 2^8 P where
    ``softmax_sums_rounded_p`` says so: D = 128), O = numerator / denominator * 2^Ev. Float32 output (G, Sq, Dv) and a
    RangeReport of Q's, K's and V's scale ranges. ``score_product`` as in ``direct_p_attention`` (it gets the keys
    zero-padded to whole 32-key blocks)."""
    qd, kd, tensor_scale, qk_ranges = quantize_qk(q, k, policy)
    report = RangeReport()
    s = scale * tensor_scale * LOG2E
    report.add_scale_ranges((*qk_ranges, ScaleRange.of(fp8_channel_scale_counts(v))), s)
    v8, v_scale = fp8_channel_quantize(v)
    groups, sq, nk = qd.shape[0], qd.shape[1], kd.shape[1]
    out = torch.empty(groups, sq, v.shape[-1], dtype=torch.float32, device=q.device)
    tile = softmax_tile(qd.shape[-1])
    rounded_sum = softmax_sums_rounded_p(qd.shape[-1])
    cg, cq, ck = _chunk_sizes(groups, sq, max(nk, 1), tile)
    p_scale = float(2 ** P_E4M3_LOG2)
    for g0, g1 in _chunks(groups, cg):
        for q0, q1 in _chunks(sq, cq):
            qc = qd[g0:g1, q0:q1]
            m = torch.full((g1 - g0, q1 - q0), -math.inf, dtype=torch.float32, device=q.device)
            num = torch.zeros(g1 - g0, q1 - q0, v.shape[-1], dtype=torch.float32, device=q.device)
            den = torch.zeros(g1 - g0, q1 - q0, dtype=torch.float32, device=q.device)
            for k0, k1 in _chunks(nk, ck):   # ck: whole tiles, so tiles start where the kernel's do
                kc = kd[g0:g1, k0:k1]
                if score_product is None:
                    raw = qc @ kc.mT
                else:
                    raw = score_product(qc, F.pad(kc, (0, 0, 0, (-kc.shape[1]) % KEY_BLOCK)))[..., : kc.shape[1]]
                t = pad_last(raw * s, tile, -math.inf)
                t = t.unflatten(-1, (-1, tile))                       # (g, q, tiles, keys)
                run = torch.maximum(torch.cummax(t.amax(-1), -1).values, m.unsqueeze(-1))   # m_j per tile
                p = torch.exp2(t - run.unsqueeze(-1)) * p_scale
                last = run[..., -1]
                weight = torch.exp2(run - last.unsqueeze(-1)).unsqueeze(-1)   # 2^(m_j - m_last)
                p8 = (e4m3_round(p) * weight).flatten(-2)[..., : k1 - k0]
                corr = torch.exp2(m - last)                                   # 0 for the first chunk
                num = num * corr.unsqueeze(-1) + p8 @ v8[g0:g1, k0:k1]
                den = den * corr + (p8.sum(-1) if rounded_sum else (p * weight).sum((-2, -1)))
                m = last
            out[g0:g1, q0:q1] = num / den.unsqueeze(-1) * v_scale[g0:g1]
    return out, report


def exact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax attention as SDPA computes it, in the input dtype, chunked over head groups. Where
    finite inputs give scores that overflow (q = k = 1e20: SDPA returns NaN), the call is recomputed
    in float64, whose range holds every product of BF16/FP16/FP32 values: the output, an average of
    V rows, is then finite (docs/numerics.md section 6)."""
    groups = q.shape[0]
    per_group = max(1, q.shape[1] * k.shape[1])
    step = max(1, CHUNK_ELEMENTS // per_group)

    def sdpa(dtype):
        return torch.cat([F.scaled_dot_product_attention(q[g0:g1].to(dtype), k[g0:g1].to(dtype), v[g0:g1].to(dtype),
                                                         scale=scale).to(q.dtype)
                          for g0, g1 in _chunks(groups, step)])

    out = sdpa(q.dtype)
    if not bool(torch.isfinite(out).all()):
        out = sdpa(torch.float64)
    return out


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, policy: Policy,
                        scale: float) -> tuple[torch.Tensor, RangeReport]:
    """The reference for any policy, on validated (G, S, D) tensors; output in q's dtype."""
    if policy.method == "exact":
        return exact_attention(q, k, v, scale), RangeReport()
    if policy.method == "nv_fp8":
        out, report = nv_fp8_attention(q, k, v, policy, scale)
    elif policy.is_fp8_pv:
        out, report = fp8_pv_attention(q, k, v, policy, scale)
    else:
        out, report = direct_p_attention(q, k, v, policy, scale)
    out = out.to(q.dtype)
    # counted in the output dtype: a float32 value beyond FP16's range is an Inf the caller gets
    report.nonfinite_outputs = int((~torch.isfinite(out)).sum())
    return out, report


def check_key_mask_keeps_keys(key_mask: torch.Tensor) -> None:
    """A ValueError where a batch element of a bool (B, Skv) key mask keeps no key (a host synchronisation)."""
    kept = key_mask.any(-1)
    if not bool(kept.all()):
        b = int((~kept).nonzero()[0, 0])
        raise ValueError(f"key_mask: batch element {b} masks every key; attention needs at least one key")


def masked_reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor,
                               policy: Policy, scale: float) -> tuple[torch.Tensor, RangeReport]:
    """``reference_attention`` of (B, H, S, D) tensors under a bool (B, Skv) key mask (docs/numerics.md section 6,
    "Key masks"): each batch element is the unmasked call on its kept keys, in their order, so a masked key
    contributes to nothing (row reference, anchors, block scales, denominator). Output (B, H, Sq, Dv), q's dtype;
    the reports of the elements added."""
    outs, total = [], RangeReport()
    for b in range(q.shape[0]):
        keep = key_mask[b].nonzero().flatten()
        out, report = reference_attention(q[b], k[b][:, keep], v[b][:, keep], policy, scale)
        outs.append(out)
        total.add(report)
    return torch.stack(outs), total
