"""FP4 formats as plain encode/decode functions (docs/numerics.md section 1). No kernel code lives here.

Element formats
    E2M1   the FP4 payload: magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6} and a sign. A *code* is a uint8
           holding 4 bits ``s e e m`` (bit 3 the sign, bits 0-2 the magnitude index 0..7); packed
           storage puts two codes in a byte, the even element in the LOW nibble.
    E4M3   OCP FP8 e4m3fn (max 448, subnormals down to 2**-9); stored as its uint8 bit pattern.
    E8M0   a biased power-of-two exponent byte u: value 2**(u-127); u = 255 is NaN.

Block formats (all quantizers return a small dataclass with the storage tensors and a
``dequantize()``; the storage layout is what kernels read)
    NVFP4 (Q and K): blocks along the last (head) dimension D.
        ``block16``:      codes (..., D/2) packed uint8, scales (..., D/16) E4M3 bytes.
        ``folded64_mse``: codes (..., D/2), scales (..., D/32) E4M3 bytes; scale j serves
                          16-element blocks j and j + D/32 (docs/numerics.md: block i shares with i + nb/2).
    MXFP4 (V): blocks of 32 consecutive tokens (dim -2) for each feature column.
        codes (..., S, D/2) packed along D, scales (..., ceil(S/32), D) E8M0 bytes; decode is
        ``alpha * c / 6`` (the scale stores the block amplitude, docs/numerics.md section 1).
    FP8 with power-of-two group scales (Q and K of the Hopper FP8 policy, docs/numerics.md section 7): groups of
        rows (one query row, or 32 consecutive keys) share ``2**E``; the values ``x / 2**E`` are
        E4M3. ``fp8_pow2_quantize`` returns both (float32), ``fp8_pow2_qdq`` their product.

All rounding is round-to-nearest-even with saturation. Everything is vectorised torch and runs on
any device; values are computed in float32 (float64 inputs stay float64 where noted).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

E2M1_MAX = 6.0
E4M3_MAX = 448.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude index -> value
NVFP4_BLOCK = 16
MXFP4_BLOCK = 32
# docs/numerics.md section 1: MSE candidates for the folded-K64 scale, m = 1.0 first, then the list in order.
FOLDED_MSE_MULTIPLIERS = (1.0, 0.25, 0.3125, 0.375, 0.4375, 0.5, 0.625, 0.75, 0.875, 1.0, 1.125, 1.25)
# The candidates that can be chosen (indices into FOLDED_MSE_MULTIPLIERS) in a group where no candidate
# saturates E4M3: every other one is never strictly better than one of these, or only as good and later, so
# the first least-error candidate among them is the full search's choice. Index 6 (m = 0.625) is needed only
# where its scale is an E4M3 subnormal, fl32(amax/6 * 0.625) < 2**-6. Proved for every BF16 group maximum
# and every BF16 value below it (tests/core/test_formats.py); kernels use it, fp4vis.formats does not.
FOLDED_MSE_CONTENDERS = (0, 6, 7, 8, 10, 11)
FOLDED_MSE_SUBNORMAL_CONTENDER = 6
MXFP4_ZERO_AMAX = 1e-38  # blocks at or below this amax get u = 0
# an NVFP4 scale amax/6 above this saturates E4M3 (RNE rounds it past 448, the largest value): the block's
# values clip (docs/numerics.md section 1, "Scale range")
E4M3_SATURATION = 464.0
# the smallest float32 magnitudes that round (to nearest even) to Inf in an output dtype: half an ulp
# above its largest finite value, whose odd significand rounds the tie up (the kernels' range record)
OVERFLOW_BF16 = 3.3961775292304740e38   # 0x7F7F8000: BF16 max 0x7F7F plus half an ulp
OVERFLOW_FP16 = 65520.0                  # FP16 max 65504 plus half an ulp (16)


# ---------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------

def check_no_nan(x: torch.Tensor, name: str) -> None:
    """Raise ValueError naming ``name`` when ``x`` has NaN (FP4 cannot represent NaN)."""
    if x.is_floating_point() and bool(torch.isnan(x).any()):
        raise ValueError(f"{name}: contains NaN, which FP4/FP8 formats cannot represent")


# ---------------------------------------------------------------------------------------------
# Exact powers of two and generic minifloat rounding
# ---------------------------------------------------------------------------------------------

def pow2(e: torch.Tensor) -> torch.Tensor:
    """Exact float32 ``2**e`` for integer ``e`` in [-149, 127], built from the bit pattern
    (subnormals included), so no library ``pow`` rounding can creep in."""
    e = e.to(torch.int32)
    normal = ((e + 127).clamp(1, 254) << 23).view(torch.float32)
    subnormal = (torch.ones_like(e) << (e + 149).clamp(0, 22)).view(torch.float32)
    return torch.where(e >= -126, normal, subnormal)


def round_minifloat(x: torch.Tensor, mantissa_bits: int, min_normal_exp: int, max_value: float) -> torch.Tensor:
    """Round to the nearest value of a sign-magnitude minifloat (ties to even), saturating at
    ``max_value``. Exact for float32/float64 inputs: only power-of-two scalings and one
    ``torch.round`` (which rounds half to even) are involved. NaN stays NaN."""
    mag = x.abs()
    _, exp = torch.frexp(mag)  # mag = f * 2**exp, f in [0.5, 1)
    exp = (exp - 1).clamp(min=min_normal_exp)  # floor(log2 mag), floored at the subnormal binade
    ulp = torch.ldexp(torch.ones_like(mag), exp - mantissa_bits)
    rounded = torch.round(mag / ulp) * ulp
    return torch.copysign(rounded.clamp(max=max_value), x)


# ---------------------------------------------------------------------------------------------
# E2M1
# ---------------------------------------------------------------------------------------------

# Rounding boundaries between consecutive E2M1 magnitudes; a tie goes to the even magnitude index,
# i.e. down at 0.25, 1.25, 2.5, 5 and up at 0.75, 1.75, 3.5.
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E2M1_TIE_UP = (False, True, False, True, False, True, False)


@functools.cache
def _e2m1_tables(dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(magnitudes, boundaries b) for one dtype and device, made once (no host-to-device copy per
    call, so CUDA-graph capture works): the magnitude index is the number of b strictly below |x|
    (the definition ``e2m1_round`` is tested against)."""
    mid = torch.tensor(_E2M1_MIDPOINTS, dtype=dtype, device=device)
    below = torch.nextafter(mid, torch.zeros_like(mid))
    bounds = torch.where(torch.tensor(_E2M1_TIE_UP, device=device), below, mid)
    return torch.tensor(E2M1_VALUES, dtype=dtype, device=device), bounds


def e2m1_round(x: torch.Tensor, relu: bool = False) -> torch.Tensor:
    """Values of ``E2M1_rne_sat(x)`` (``cvt.rn.satfinite[.relu].e2m1x2.f32``), same dtype as x
    (float32 or float64). ``relu`` maps negatives to +0. NaN is not representable (callers that
    encode check for it); here it saturates like a large value.

    The E2M1 magnitudes are the multiples of 0.5 below 2, of 1 from 2 to 4 and of 2 from 4 to 6, so
    the magnitude is scaled onto the integers (x 2, x 1, x 0.5: exact in binary floating point, x 0.5
    only from 4 up, far from subnormals), rounded half to even (``torch.round``: a tie goes to the even
    integer, which is the even E2M1 code: down at 0.25, 1.25, 2.5, 5, up at 0.75, 1.75, 3.5) and scaled
    back; a boundary between two spacings rounds onto it (1.75 -> 2, 3.5 -> 4) under either. Then
    saturation at 6 (NaN included). The same values as the nearest-boundary table ``_e2m1_tables``
    (``test_e2m1_round_is_the_boundary_table``), at under half its CPU time (no binary search)."""
    mag = torch.where(x <= 0, 0.0, x) if relu else x.abs()   # relu: negatives, -0 and -inf to +0; NaN stays
    scale = torch.where(mag < 2, 2.0, torch.where(mag < 4, 1.0, 0.5))
    out = torch.round(mag * scale) / scale
    out = torch.where(out < 6, out, 6.0).to(x.dtype)   # not below 6 (or NaN): saturated
    return out if relu else torch.copysign(out, x)


# the E2M1 code (0-7, sign apart) of each magnitude m, indexed by 2 m (0, 0.5, ..., 6 -> 0 .. 12); -1: off the grid
E2M1_INDEX_OF_TWICE_MAG = torch.tensor([0, 1, 2, 3, 4, -1, 5, -1, 6, -1, -1, -1, 7], dtype=torch.uint8)


def e2m1_encode(x: torch.Tensor, relu: bool = False, name: str = "x") -> torch.Tensor:
    """E2M1 codes (uint8, one per element, 0..15) of ``x``, round-to-nearest-even, saturating.
    The sign bit follows the input's sign (so -0.1 encodes as -0, code 0x8)."""
    check_no_nan(x, name)
    r = e2m1_round(x.float(), relu=relu)
    index = E2M1_INDEX_OF_TWICE_MAG.to(x.device)[(r.abs() * 2).to(torch.long)]
    sign = torch.signbit(r).to(torch.uint8) << 3
    return index | sign


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of E2M1 codes (uint8, low 4 bits used)."""
    mags = _e2m1_tables(torch.float32, codes.device)[0]
    return torch.cat((mags, -mags))[(codes & 0xF).to(torch.long)]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes two per byte along the last dim (even element in the low nibble)."""
    if codes.shape[-1] % 2:
        raise ValueError(f"codes: last dim must be even to pack two per byte, got {codes.shape[-1]}")
    c = codes.to(torch.uint8) & 0xF
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_fp4``: (..., n) bytes -> (..., 2n) codes."""
    lo, hi = packed & 0xF, packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


# ---------------------------------------------------------------------------------------------
# E4M3 and E8M0
# ---------------------------------------------------------------------------------------------

def e4m3_round(x: torch.Tensor) -> torch.Tensor:
    """Values of OCP E4M3 (e4m3fn) round-to-nearest-even with saturation to +-448."""
    return round_minifloat(x, mantissa_bits=3, min_normal_exp=-6, max_value=E4M3_MAX)


def e4m3_encode(x: torch.Tensor, name: str = "x") -> torch.Tensor:
    """E4M3 bit patterns (uint8) of ``x``, RNE, saturating (``cvt.rn.satfinite.e4m3x2.f32``)."""
    check_no_nan(x, name)
    return e4m3_round(x.float()).to(torch.float8_e4m3fn).view(torch.uint8)


def e4m3_decode(bits: torch.Tensor) -> torch.Tensor:
    """float32 values of E4M3 bit patterns (0x7F/0xFF decode to NaN)."""
    return bits.to(torch.uint8).view(torch.float8_e4m3fn).float()


def e8m0_decode(u: torch.Tensor) -> torch.Tensor:
    """float32 values ``2**(u-127)`` of E8M0 bytes; u = 255 decodes to NaN."""
    u = u.to(torch.int32)
    return torch.where(u == 255, torch.full_like(u, math.nan, dtype=torch.float32), pow2(u - 127))


def e8m0_nearest_pow2(amax: torch.Tensor) -> torch.Tensor:
    """E8M0 byte of the power of two nearest to ``amax`` in the linear sense (MXFP4, docs/numerics.md section 1):
    with e = floor(log2 amax), take e + 1 when amax > 1.5 * 2**e, or amax == 1.5 * 2**e and e is
    odd. amax <= 1e-38 gives u = 0. Returns uint8."""
    amax = amax.float()
    _, exp = torch.frexp(amax)
    e = exp - 1
    mid = 1.5 * torch.ldexp(torch.ones_like(amax), e)
    up = (amax > mid) | ((amax == mid) & (e % 2 != 0))
    u = (e + up.to(e.dtype) + 127).clamp(0, 254)
    u = torch.where(amax <= MXFP4_ZERO_AMAX, torch.zeros_like(u), u)
    return u.to(torch.uint8)


# ---------------------------------------------------------------------------------------------
# NVFP4 (Q and K)
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ScaleRange:
    """Blocks of one quantized operand whose scale left its format's range (docs/numerics.md section 1,
    "Scale range"): ``underflow``, blocks holding a nonzero value that their scale cannot represent (all
    their values flush to zero); ``overflow``, blocks whose scale saturated (their values clip). What the
    underflows can change: ``flushed``, for q and k the largest over rows (tokens) of the row's flushed values
    times their largest magnitude (a bound on the row's lost L1 norm), for v the largest flushed block's amax;
    ``amax``, the operand's largest magnitude. Added, the counts add and the magnitudes take their maximum."""

    underflow: int = 0
    overflow: int = 0
    flushed: float = 0.0
    amax: float = 0.0

    def __add__(self, other: ScaleRange) -> ScaleRange:
        return ScaleRange(self.underflow + other.underflow, self.overflow + other.overflow,
                          max(self.flushed, other.flushed), max(self.amax, other.amax))

    @classmethod
    def of(cls, counts: torch.Tensor) -> ScaleRange:
        """From the int32 words of a ``*_scale_counts`` function (a host synchronisation)."""
        under, over, flushed, amax = counts.tolist()
        return cls(under, over, _float_of_bits(flushed), _float_of_bits(amax))


def _float_of_bits(bits: int) -> float:
    return torch.tensor(bits, dtype=torch.int32).view(torch.float32).item()


def _scale_words(under: torch.Tensor, over: torch.Tensor, flushed: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """The int32 words (underflow, overflow, flushed, amax) of a ``*_scale_counts`` function: the counts of the
    boolean tensors ``under`` and ``over``, and the largest of the non-negative float32 ``flushed`` and ``amax`` as
    their bit patterns (non-negative floats order as their bits do: the range record takes their maxima with
    integer atomics)."""
    def top(x):
        return x.float().amax().view(torch.int32) if x.numel() else torch.zeros((), dtype=torch.int32,
                                                                                 device=x.device)
    return torch.stack((under.sum(dtype=torch.int32), over.sum(dtype=torch.int32), top(flushed), top(amax)))


@dataclass(frozen=True)
class NVFP4Tensor:
    """NVFP4 storage: ``codes`` (..., D/2) packed E2M1, ``scales`` E4M3 bytes, (..., D/16) for
    ``block16`` or (..., D/32) for ``folded64_mse``; ``tensor_scale`` is the per-tensor FP32
    *decode* factor (1.0 unless the global encode scale was asked for); ``scale_range`` counts the blocks
    whose scale left E4M3's range."""

    codes: torch.Tensor
    scales: torch.Tensor
    layout: str
    tensor_scale: float = 1.0
    scale_range: ScaleRange = ScaleRange()

    def block_scales(self) -> torch.Tensor:
        """float32 scale of every 16-element block, (..., D/16), folded layouts expanded."""
        sc = e4m3_decode(self.scales)
        return torch.cat((sc, sc), dim=-1) if self.layout == "folded64_mse" else sc

    def dequantize(self, tensor_scale: bool = True) -> torch.Tensor:
        """float32 values ``c * sc * tensor_scale`` (exact in BF16 when tensor_scale is 1);
        ``tensor_scale=False`` leaves the per-tensor factor out (``c * sc``, exact in BF16: what a
        kernel multiplies, with the factor folded into the softmax scale, docs/numerics.md section 1)."""
        vals = e2m1_decode(unpack_fp4(self.codes))
        blocks = (vals.unflatten(-1, (-1, NVFP4_BLOCK)) * self.block_scales().unsqueeze(-1)).flatten(-2)
        return blocks * self.tensor_scale if tensor_scale else blocks


def _codes_for_scale(blocks: torch.Tensor, sc: torch.Tensor) -> torch.Tensor:
    """E2M1 values of ``x / sc`` for scale broadcast over the block's last dim; sc = 0 -> 0."""
    safe = torch.where(sc == 0, torch.ones_like(sc), sc)
    return torch.where(sc == 0, torch.zeros_like(blocks), e2m1_round(blocks / safe))


def nvfp4_global_encode_scale(x: torch.Tensor) -> float:
    """The optional per-tensor encode scale ``G = 6 * 448 / amax(x)`` (1.0 for an all-zero x)."""
    amax = float(x.abs().max()) if x.numel() else 0.0
    return E2M1_MAX * E4M3_MAX / amax if amax > 0 else 1.0


_QUANT_ROWS_PER_CHUNK = 1 << 16


def nvfp4_quantize(x: torch.Tensor, layout: str = "block16", global_scale: bool = False,
                   name: str = "x") -> NVFP4Tensor:
    """NVFP4-quantize ``x`` along its last dim (docs/numerics.md section 1).

    Inputs are first cast to BF16 (both layouts). ``block16``: per 16-block ``sc = E4M3(amax/6)``.
    ``folded64_mse`` (D a multiple of 32): blocks i and i + D/32 share one scale chosen among
    ``E4M3(amax32/6 * m)`` by least squared error (m = 1.0 first; later candidates win only when
    strictly better). A zero scale gives zero codes. ``global_scale`` multiplies x by
    ``G = 6*448/amax`` first and records ``1/G`` as ``tensor_scale``.
    """
    check_no_nan(x, name)
    d = x.shape[-1]
    if layout not in ("block16", "folded64_mse"):
        raise ValueError(f"layout: must be 'block16' or 'folded64_mse', got {layout!r}")
    if d % NVFP4_BLOCK:
        raise ValueError(f"{name}: last dim must be a multiple of 16 for NVFP4, got {d}")
    if layout == "folded64_mse" and d % 32:
        raise ValueError(f"{name}: folded64_mse needs the last dim to be a multiple of 32, got {d}")
    xf = x.to(torch.bfloat16).float()
    tensor_scale = 1.0
    if global_scale:
        g = nvfp4_global_encode_scale(xf)
        xf, tensor_scale = xf * g, 1.0 / g
    vals, scales = nvfp4_chunked(xf, layout)
    codes = pack_fp4(e2m1_encode(vals, name=name))
    return NVFP4Tensor(codes, e4m3_encode(scales), layout, tensor_scale,
                       ScaleRange.of(nvfp4_scale_counts(xf, scales, layout)))


def nvfp4_qdq(x: torch.Tensor, layout: str = "block16") -> torch.Tensor:
    """NVFP4 quantize-dequantize: float32 ``c * sc`` of ``nvfp4_quantize(x, layout)`` without the
    storage round trip, the checks or a host synchronisation (what a kernel's pre-pass computes).
    The caller guarantees finite input and a valid last dim."""
    return _nvfp4_decoded(*nvfp4_chunked(x.to(torch.bfloat16).float(), layout), layout)


def nvfp4_qdq_counted(x: torch.Tensor, layout: str = "block16") -> tuple[torch.Tensor, torch.Tensor]:
    """``nvfp4_qdq`` and the ``nvfp4_scale_counts`` of its scales, without a host synchronisation."""
    xf = x.to(torch.bfloat16).float()
    vals, scales = nvfp4_chunked(xf, layout)
    return _nvfp4_decoded(vals, scales, layout), nvfp4_scale_counts(xf, scales, layout)


def _nvfp4_decoded(vals: torch.Tensor, scales: torch.Tensor, layout: str) -> torch.Tensor:
    """float32 ``c * sc`` from E2M1 values (..., D) and their scales (..., D/16 or D/32)."""
    if layout == "folded64_mse":
        scales = torch.cat((scales, scales), dim=-1)
    return (vals.unflatten(-1, (-1, NVFP4_BLOCK)) * scales.unsqueeze(-1)).flatten(-2)


def nvfp4_scale_counts(xf: torch.Tensor, scales: torch.Tensor, layout: str) -> torch.Tensor:
    """The blocks of NVFP4 storage whose scale leaves E4M3's range, as the int32 words (underflow, overflow,
    flushed, amax) of a ``ScaleRange``, without a host synchronisation: ``xf`` the BF16-valued float32 values that
    were quantized (times the per-tensor scale, if any), ``scales`` their float32 scales (..., D/16 or D/32).
    Underflow: a scale group (16 values, or the 32 of a folded pair) with a nonzero value and a zero scale;
    ``flushed``, the largest over rows of (the row's values in such groups) x (their largest magnitude), exact in
    float32. Overflow: a group whose amax/6 exceeds ``E4M3_SATURATION`` (infinite values are non-finite inputs, not
    counted)."""
    blocks = xf.unflatten(-1, (-1, NVFP4_BLOCK))
    if layout == "folded64_mse":
        half = blocks.shape[-2] // 2
        blocks = torch.cat((blocks[..., :half, :], blocks[..., half:, :]), dim=-1)
    amax = blocks.abs().amax(-1)
    under = (scales == 0) & (amax > 0)
    over = (_over_six(amax) > E4M3_SATURATION) & (amax < math.inf)
    flushed_values = under.sum(-1, dtype=torch.int32).float() * blocks.shape[-1]
    return _scale_words(under, over, flushed_values * torch.where(under, amax, 0.0).amax(-1), amax)


def nvfp4_chunked(xf: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """E2M1 values (..., D) and float32 scales (..., D/16 or D/32) of BF16-valued float32 ``xf``,
    in chunks of rows (bounds the memory of the MSE search)."""
    lead, d = xf.shape[:-1], xf.shape[-1]
    rows = xf.reshape(-1, d)
    if rows.shape[0] <= _QUANT_ROWS_PER_CHUNK:
        vals, scales = _nvfp4_rows(rows, layout)
    else:
        parts = [_nvfp4_rows(rows[i:i + _QUANT_ROWS_PER_CHUNK], layout)
                 for i in range(0, rows.shape[0], _QUANT_ROWS_PER_CHUNK)]
        vals, scales = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    return vals.reshape(*lead, d), scales.reshape(*lead, -1)


@functools.cache
def _mse_multipliers(device: torch.device) -> torch.Tensor:
    return torch.tensor(FOLDED_MSE_MULTIPLIERS, dtype=torch.float32, device=device)


def _over_six(amax: torch.Tensor) -> torch.Tensor:
    """float32 ``amax / 6``, correctly rounded on every device (CUDA turns a float32 division by a
    Python scalar into a multiply by float32(1/6), which moves exact E4M3 ties; float64 does not)."""
    return (amax.double() / E2M1_MAX).float()


def _nvfp4_rows(xf: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """E2M1 values (N, D) and float32 scales of rows (N, D) of BF16-valued float32."""
    blocks = xf.unflatten(-1, (-1, NVFP4_BLOCK))  # (N, nb, 16)
    if layout == "block16":
        sc = e4m3_round(_over_six(blocks.abs().amax(-1, keepdim=True)))
        return _codes_for_scale(blocks, sc).flatten(-2), sc.squeeze(-1)
    half = blocks.shape[-2] // 2
    pair = torch.cat((blocks[..., :half, :], blocks[..., half:, :]), dim=-1)  # (N, nb/2, 32)
    index, cands = _folded_mse_choice(pair)
    sc = cands.gather(-1, index)
    pv = _codes_for_scale(pair, sc)
    return torch.cat((pv[..., :16], pv[..., 16:]), dim=-2).flatten(-2), sc.squeeze(-1)  # back to block order


_HUGE_RATIO = 48.0  # a group with amax >= 48 * (largest candidate scale) takes the largest scale


def _folded_mse_choice(pair: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(index (..., 1) of the chosen candidate, candidate scales (..., 12)) for float32 groups
    (..., 32): the first candidate with the least squared error (docs/numerics.md section 1), found exactly.

    err(sc) = sum (P - |x|)^2 = sum x^2 + sum P (P - 2|x|) with P = |c| * sc, c = E2M1(x / sc). The
    first sum is the same for every candidate and is dropped; the second is computed in float64, where
    it is EXACT in any summation order (so every device picks the same candidate, ties included):
    * Write sc = s * 2^(E-3), s in 8..15, E = floor(log2 sc) >= -9 (E4M3 has 4 significant bits);
      c in {k/2}, k <= 12, so P is a multiple of 2^(E-4) with k*s < 2^8 units. A term with c != 0
      has |x| > sc/4 >= 2^(E-2), so the float32 x (24 significant bits) is a multiple of 2^(E-25).
      Hence P - 2|x| is a multiple of 2^(E-24), P (P - 2|x|) one of U = 2^(2E-28); terms with c = 0
      are 0.
    * Size: unless the group is huge (below), |x| < 48 sc for every candidate sc > 0: E4M3 rounding
      of y = b m (m >= 1/4, y within 2^-23 of amax m / 6) keeps sc >= (15/16) y, or >= y / 1.5 when
      subnormal, so |x| <= amax < 37 sc, unless it saturates: then sc = 448 = sc_max and the group
      not being huge means amax < 48 * 448. So |P - 2|x|| < 96 sc < 2^(E+8), i.e. < 2^32 units, exact;
      the product with P has < 2^40 units of U, exact; 32 of them sum to < 2^45 U: every partial sum,
      in any order, is exact.
    * Huge groups, amax >= 48 * sc_max (only when a candidate saturates E4M3, or when every candidate
      is 0 and all errors are equal anyway): for candidate scales
      a < b (distinct E4M3 values, so b - a >= b/16), the element x_h = amax gives c = 6 under both
      and err_h(a) - err_h(b) = 6 (b - a)(2|x_h| - 6a - 6b) >= (6/16) b (96 b - 12 b) = 31.5 b^2,
      while any other element changes by at most b^2 in the other direction (x with |x| > 6b also
      has c = 6 under both and moves the same way; otherwise its error at b is at most b^2, the
      half-gap between 4b and 6b). So the error strictly decreases with the scale: the first
      candidate with the largest scale wins, which is what the key -sc selects.
    ``argmin`` returns the first minimal index, so a later candidate wins only when strictly better.
    """
    amax = pair.abs().amax(-1, keepdim=True)
    # b = amax/6 and b*m are float32 values (a float32 GPU pre-pass computes the same), then E4M3
    cands = e4m3_round(_over_six(amax) * _mse_multipliers(pair.device))  # (..., n_cand)
    two_ax = pair.abs().double() * 2
    errs = []
    for i in range(cands.shape[-1]):
        sc = cands[..., i:i + 1]
        p = (_codes_for_scale(pair, sc).abs() * sc).double()  # exact: at most 6 significant bits
        errs.append((p * (p - two_ax)).sum(-1, keepdim=True))
    errs = torch.cat(errs, dim=-1)
    huge = amax >= _HUGE_RATIO * cands.amax(-1, keepdim=True)
    errs = torch.where(huge, -cands.double(), errs)
    return errs.argmin(-1, keepdim=True), cands


# ---------------------------------------------------------------------------------------------
# MXFP4 (V, blocks along tokens)
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MXFP4Tensor:
    """MXFP4 storage for V: ``codes`` (..., S, D/2) packed E2M1 (pairs along D), ``scales``
    (..., ceil(S/32), D) E8M0 bytes, one per 32-token block and feature column; ``seq_len`` = S;
    ``scale_range`` counts the blocks whose scale left E8M0's range."""

    codes: torch.Tensor
    scales: torch.Tensor
    seq_len: int
    scale_range: ScaleRange = ScaleRange()

    def dequantize(self, *, times_six: bool = False) -> torch.Tensor:
        """float32 values ``alpha * c / 6`` (or ``alpha * c`` with ``times_six``, exact in BF16)."""
        c = e2m1_decode(unpack_fp4(self.codes))
        alpha = e8m0_decode(self.scales).repeat_interleave(MXFP4_BLOCK, dim=-2)[..., : self.seq_len, :]
        prod = alpha * c
        return prod if times_six else (prod.double() / E2M1_MAX).float()  # same rounding on every device


def mxfp4_quantize(v: torch.Tensor, name: str = "v") -> MXFP4Tensor:
    """MXFP4-quantize ``v`` (..., S, D) in blocks of 32 tokens per column (docs/numerics.md section 1):
    ``alpha`` = power of two nearest to the block amax, codes ``E2M1(6 v / alpha)``. A partial last
    block is padded with zeros. D must be even (codes pack along D)."""
    check_no_nan(v, name)
    s, d = v.shape[-2], v.shape[-1]
    if d % 2:
        raise ValueError(f"{name}: last dim must be even for packed MXFP4, got {d}")
    vals, u = mxfp4_blocks(v)
    codes = e2m1_encode(vals, name=name).flatten(-3, -2)[..., :s, :]
    return MXFP4Tensor(pack_fp4(codes), u, s, ScaleRange.of(mxfp4_scale_counts(v)))


def mxfp4_qdq(v: torch.Tensor, *, times_six: bool = False) -> torch.Tensor:
    """MXFP4 quantize-dequantize of ``v`` (..., S, D): float32 ``alpha * c / 6`` (``alpha * c`` with
    ``times_six``, exact in BF16), without storage, checks or host synchronisation."""
    vals, u = mxfp4_blocks(v)
    prod = (vals * pow2(u.to(torch.int32) - 127).unsqueeze(-2)).flatten(-3, -2)[..., : v.shape[-2], :]
    return prod if times_six else (prod.double() / E2M1_MAX).float()


# ---------------------------------------------------------------------------------------------
# FP8 E4M3 with power-of-two group scales (Q and K of the FP8 policy; docs/numerics.md section 7)
# ---------------------------------------------------------------------------------------------

# The group maximum is scaled into [2**7, 2**8): E4M3 never saturates (max 448) and keeps all 3 mantissa
# bits down to 2**-6, i.e. for elements up to 13 binades below their group's maximum.
FP8_GROUP_TOP_EXP = 7
FP8_MIN_GROUP_EXP = -126  # 2**-E must be a normal float32 too


def fp8_group_exponent(amax: torch.Tensor) -> torch.Tensor:
    """int32 E = max(floor(log2 amax) - 7, -126) of float32 group maxima, read off the exponent field
    (subnormal maxima count as 2**-127, infinities and NaN as 2**128: their groups become NaN in the kernel's
    pre-pass anyway); E = 0 for an all-zero group, whose values decode to 0 under any scale: the Hopper kernel
    multiplies scores by its scales, and 2**-126 for a zero key block (the padding of a key-masked call) times a
    tiny query row's scale would round to 0 and turn the block's masked -inf scores into NaN."""
    field = (amax.float().view(torch.int32) >> 23) & 0xFF
    e = (field - 127 - FP8_GROUP_TOP_EXP).clamp(min=FP8_MIN_GROUP_EXP)
    return torch.where(amax == 0, torch.zeros_like(e), e)


def fp8_pow2_quantize(x: torch.Tensor, group_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 values ``x / 2**E`` (float32, shape of x) and scales ``2**E`` (float32, (..., ceil(S/g), 1))
    of ``x`` (..., S, D), one scale per ``group_rows`` consecutive rows (1: per token; 32: per key
    block). The scaling is exact and the group's largest element lands in [2**7, 2**8), so one E4M3
    rounding (RNE) is the only error: relative 2**-4 at most for elements within 13 binades of their
    group's maximum. Limits: a value that rounds up to 256 * 2**120 (|x| >= ~3.3e38, far beyond
    attention activations) decodes to inf; groups below 2**-119 lose bits to the E = -126 floor.
    (In the Hopper kernel, scales fold into products s * 2**(Eq+Ek), exact while those stay normal
    float32: score scales between about 2**-100 and 2**100.)"""
    s = x.shape[-2]
    groups = _padded_groups(x, group_rows)                          # (..., ng, g, D)
    e = fp8_group_exponent(groups.abs().amax(dim=(-2, -1)))         # (..., ng)
    vals = e4m3_round(groups * pow2(-e)[..., None, None]).flatten(-3, -2)[..., :s, :]
    return vals, pow2(e).unsqueeze(-1)


def fp8_channel_quantize(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 values ``v / 2**E`` (float32, shape of v) and scales ``2**E`` (float32, (..., 1, D)) of V (..., S, D)
    for the FP8 P/V policies (docs/numerics.md section 7): one power-of-two scale per channel over all S tokens,
    E by ``fp8_group_exponent``, so the channel's largest element lands in [2**7, 2**8) and E4M3 never saturates
    (448 is above 2**8); the scale factors out of the sum over keys, exactly, and multiplies the output column."""
    xf = v.float()
    e = fp8_group_exponent(xf.abs().amax(dim=-2, keepdim=True))
    return e4m3_round(xf * pow2(-e)), pow2(e)


def fp8_pow2_qdq(x: torch.Tensor, group_rows: int) -> torch.Tensor:
    """float32 ``2**E * E4M3(x / 2**E)`` of ``fp8_pow2_quantize`` (exact in float32)."""
    vals, scales = fp8_pow2_quantize(x, group_rows)
    return vals * scales.repeat_interleave(group_rows, dim=-2)[..., : x.shape[-2], :]


def _padded_groups(x: torch.Tensor, rows: int) -> torch.Tensor:
    """float32 x (..., S, D) as (..., ceil(S/rows), rows, D), the last group zero-padded."""
    xf = x.float()
    pad = (-xf.shape[-2]) % rows
    if pad:
        xf = torch.nn.functional.pad(xf, (0, 0, 0, pad))
    return xf.unflatten(-2, (-1, rows))


def mxfp4_scale_counts(v: torch.Tensor) -> torch.Tensor:
    """The blocks of ``mxfp4_quantize(v)`` whose scale leaves E8M0's range, as the int32 words (underflow,
    overflow, flushed, amax) of a ``ScaleRange``, without a host synchronisation: underflow, a 32-token block of a
    column with a nonzero value and amax <= ``MXFP4_ZERO_AMAX`` (u = 0: its codes are 0, or clip where amax is near
    1e-38; ``flushed``, the largest such amax); overflow, a finite block whose nearest power of two is above 2**127
    (u clamps at 254: its values clip)."""
    amax = _padded_groups(v, MXFP4_BLOCK).abs().amax(-2)
    under = (amax > 0) & (amax <= MXFP4_ZERO_AMAX)
    # u = e + 1 + 127 = 255 before the clamp (the tie too: e = 127 is odd)
    over = (amax >= 1.5 * 2.0**127) & (amax < math.inf)
    return _scale_words(under, over, torch.where(under, amax, 0.0), amax)


def fp8_channel_scale_counts(v: torch.Tensor) -> torch.Tensor:
    """``fp8_pow2_scale_counts`` for ``fp8_channel_quantize(v)``'s groups, a channel of each head group over all
    tokens: ``flushed`` is the largest floored channel's maximum, as for v's blocks; no overflow (E reaches 120)."""
    amax = v.float().abs().amax(dim=-2)
    under = _fp8_exponent_floored(amax)
    return _scale_words(under, torch.zeros_like(under), torch.where(under, amax, 0.0), amax)


def fp8_pow2_scale_counts(x: torch.Tensor, group_rows: int) -> torch.Tensor:
    """The groups of ``fp8_pow2_quantize(x, group_rows)`` whose scale leaves its range, as the int32 words
    (underflow, overflow, flushed, amax) of a ``ScaleRange``, without a host synchronisation: underflow, a group
    with a nonzero maximum below 2**-119, whose exponent E is floored at -126 (its values lose bits, the smallest
    flush; ``flushed``, the largest D x such a maximum: each row of the group loses at most that much of its L1
    norm); no overflow is counted (a value that decodes to Inf gives a non-finite output, which is reported as
    such)."""
    amax = _padded_groups(x, group_rows).abs().amax(dim=(-2, -1))
    under = _fp8_exponent_floored(amax)
    return _scale_words(under, torch.zeros_like(under), torch.where(under, amax * x.shape[-1], 0.0), amax)


def _fp8_exponent_floored(amax: torch.Tensor) -> torch.Tensor:
    """Where a nonzero float32 group maximum is below 2**-119, whose E ``fp8_group_exponent`` floors at -126."""
    field = (amax.view(torch.int32) >> 23) & 0xFF
    return (amax > 0) & (field - 127 - FP8_GROUP_TOP_EXP < FP8_MIN_GROUP_EXP)


def mxfp4_blocks(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E2M1 values (..., nblk, 32, D) of ``6 v / alpha`` and the E8M0 bytes u (..., nblk, D)."""
    blocks = _padded_groups(v, MXFP4_BLOCK)  # (..., nblk, 32, D)
    u = e8m0_nearest_pow2(blocks.abs().amax(-2))  # (..., nblk, D)
    inv_alpha = pow2(127 - u.to(torch.int32)).unsqueeze(-2)  # exact: u in [0, 254]
    # v / alpha is exact (a power of two); 6 (v / alpha) is exact in float64, not always in float32
    # (an FP32 v has 24 significant bits), so the E2M1 rounding sees the exact value
    return e2m1_round((blocks * inv_alpha).double() * E2M1_MAX).float(), u
