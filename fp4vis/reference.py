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
needed (the point of Direct-P).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fp4vis.formats import check_no_nan, e2m1_round, e4m3_round, fp8_pow2_qdq, mxfp4_quantize, nvfp4_quantize
from fp4vis.layout import KEY_BLOCK, LN2, LOG2E, anchor_permutation, native_positions, qk_layout
from fp4vis.policy import Policy

LOG2_6 = math.log2(6.0)
LOG2_1P5 = math.log2(1.5)
MAX_EXP_BYTE = 254
CHUNK_ELEMENTS = 1 << 22  # scores per chunk: float64 temporaries of 32 MiB each
KEY_CHUNK = 4096  # keys per chunk (a multiple of 32)


class RangeExceededError(FloatingPointError):
    """A Direct-P policy was driven past its representable range (docs/numerics.md section 2)."""


@dataclass
class RangeReport:
    """What went past a Direct-P policy's representable range in one call.

    saturated_blocks: (row, key block) pairs whose exponent clamped at the top (u = 254): logits
        more than ~127 binades above the row reference, where P codes saturate.
    empty_rows: rows with valid keys whose probabilities all fell below the floor (l = 0).
    nonfinite_outputs: output elements that are NaN or Inf.
    """

    saturated_blocks: int = 0
    empty_rows: int = 0
    nonfinite_outputs: int = 0

    @property
    def ok(self) -> bool:
        return not (self.saturated_blocks or self.empty_rows or self.nonfinite_outputs)

    def describe(self, policy: Policy) -> str:
        """The error message: what went past the range, and advice that fits the cause. The guard
        helps where logits leave the window above a fixed row reference (saturated blocks, empty
        rows) and the policy is not already anchored; it cannot help an output that overflows on
        its own (a huge V, or an output beyond the dtype's range)."""
        parts = []
        if self.saturated_blocks:
            parts.append(f"{self.saturated_blocks} saturated P blocks (logits z*log2(e) more than ~127 above "
                         "the row reference)")
        if self.empty_rows:
            parts.append(f"{self.empty_rows} rows whose probabilities all underflowed (l = 0)")
        if self.nonfinite_outputs:
            parts.append(f"{self.nonfinite_outputs} non-finite output elements")
        if (self.saturated_blocks or self.empty_rows) and policy.anchor == 0:
            advice = "use policy='guard' for this layer (or a guard plan from fp4vis.calibrate)"
        elif self.saturated_blocks:
            advice = (f"the anchored policy's margin (M = {policy.margin:g}) does not cover these logits: use a "
                      "guard policy with a larger margin (fp4vis.guard_policy(margin, shift); M + L <= 126, so "
                      f"lower L = {policy.shift} to make room) or policy='bf16' for this layer")
        elif self.empty_rows:
            advice = (f"the anchored policy's row reference sits too far above these rows' scores: use a smaller "
                      f"margin (M = {policy.margin:g}) or a lower shift (L = {policy.shift}) with "
                      "fp4vis.guard_policy(margin, shift), or policy='bf16' for this layer")
        else:
            advice = ("the logits are in range, so the guard does not help: the values overflow (V too large "
                      "for FP4/FP8 blocks, or an output beyond its dtype's range); scale V down, compute in "
                      "float32, or use policy='bf16' for this layer")
        return (f"policy {policy.name!r} went past its representable range: {'; '.join(parts)}. "
                f"{advice[0].upper() + advice[1:]}; or range_check='warn'/'off' to accept the result.")


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
    product of Q's and K's per-tensor decode scales (1.0 unless ``qk_global_scale``)."""

    q: torch.Tensor
    k: torch.Tensor
    v6: torch.Tensor
    num_keys: int
    s: float
    perm: torch.Tensor | None
    tensor_scale: float = 1.0


def pad_last(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """Zero-pad the last dim to a multiple (zeros change no dot product)."""
    pad = (-x.shape[-1]) % multiple
    return F.pad(x, (0, pad)) if pad else x


def quantize_qk(q: torch.Tensor, k: torch.Tensor, policy: Policy) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Decoded NVFP4 Q̂ and K̂ (float32, D padded to a multiple of 16) without their per-tensor decode
    scales, and the product of those scales (folded into ``s`` by the callers, once: docs/numerics.md
    section 1). ``fp8_e4m3``: E4M3 with power-of-two scales per query row and per
    32-key block of k (in its physical order), decoded (exact in float32)."""
    if policy.qk_fp8:
        check_no_nan(q, "q")
        check_no_nan(k, "k")
        return fp8_pow2_qdq(q, 1), fp8_pow2_qdq(k, KEY_BLOCK), 1.0
    q, k = pad_last(q, 16), pad_last(k, 16)
    layout = qk_layout(policy, q.shape[-1])
    qq = nvfp4_quantize(q, layout, policy.qk_global_scale, name="q")
    kq = nvfp4_quantize(k, layout, policy.qk_global_scale, name="k")
    return qq.dequantize(tensor_scale=False), kq.dequantize(tensor_scale=False), qq.tensor_scale * kq.tensor_scale


def quantize_operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, policy: Policy,
                      scale: float) -> QuantizedOperands:
    """Everything a Direct-P backend consumes, from (G, S, D) inputs: anchor permutation, NVFP4
    Q/K, MXFP4 V over 32-token blocks of the permuted order, keys padded to whole blocks."""
    num_keys = k.shape[-2]
    perm = None
    if policy.anchor > 0:
        perm = anchor_permutation(num_keys, policy.anchor, device=k.device)
        k, v = k[:, perm], v[:, perm]
    qd, kd, tensor_scale = quantize_qk(q, k, policy)
    v6 = mxfp4_quantize(pad_last(v, 2), name="v").dequantize(times_six=True)[..., : v.shape[-1]]
    key_pad = (-num_keys) % KEY_BLOCK
    if key_pad:
        kd = F.pad(kd, (0, 0, 0, key_pad))
        v6 = F.pad(v6, (0, 0, 0, key_pad))
    return QuantizedOperands(qd, kd, v6, num_keys, scale * tensor_scale * LOG2E, perm, tensor_scale)


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
    if policy.margin_units == "code":
        return a + policy.margin * LN2 / tensor_scale
    return a + policy.margin / s  # M binary exponents of P: M ln2 / scale = M / (scale log2 e)


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


# ---------------------------------------------------------------------------------------------
# Controls (docs/numerics.md section 3)
# ---------------------------------------------------------------------------------------------

def nv_fp8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, policy: Policy,
                     scale: float) -> torch.Tensor:
    """NVFP4 (block16) Q/K, standard max-subtracted softmax with the row max over all keys, P and
    V cast to FP8 E4M3 with no block scale; the denominator sums the unquantized P (as FlashAttention
    -3's FP8 path does). Float32 output (G, Sq, Dv)."""
    qd, kd, tensor_scale = quantize_qk(q, k, policy.replace(qk_format="block16"))
    s = scale * tensor_scale * LOG2E
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
    return out


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
        out, report = nv_fp8_attention(q, k, v, policy, scale), RangeReport()
    else:
        out, report = direct_p_attention(q, k, v, policy, scale)
    out = out.to(q.dtype)
    # counted in the output dtype: a float32 value beyond FP16's range is an Inf the caller gets
    report.nonfinite_outputs = int((~torch.isfinite(out)).sum())
    return out, report
