"""The FP8 P/V softmax's 2^x on the FMA pipe (``kernels/hopper/ptx.py``: ``ex2_poly``, ``EXP2_POLY``): its
coefficients are the minimax fit they say they are, and its instruction sequence, emulated step by step in float32,
keeps the stated relative error over the scores the kernel feeds it. CPU only."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("cutlass")
from fp4vis.kernels.hopper.ptx import EXP2_POLY  # noqa: E402

STATED_ERROR = 7.5e-5   # ptx.py's bound on the relative error
ROUND_BIAS = np.float32(1.5 * 2**23)   # adding it rounds a float32 to an integer (in its low mantissa bits)


def _minimax_relative(degree: int = 3, iterations: int = 30) -> tuple[np.ndarray, float]:
    """The polynomial of ``degree`` with the least largest relative error against 2^f on [-1/2, 1/2] (Remez
    exchange: the error alternates in sign at degree + 2 points)."""
    grid = np.linspace(-0.5, 0.5, 200001)
    exact = 2.0 ** grid
    points = np.sort(0.5 * np.cos(np.pi * np.arange(degree + 2) / (degree + 1)))
    for _ in range(iterations):
        rows = np.vander(points, degree + 1, increasing=True) / (2.0 ** points)[:, None]
        signs = (-1.0) ** np.arange(degree + 2)
        solution = np.linalg.solve(np.column_stack([rows, signs]), np.ones(degree + 2))
        coeffs = solution[:-1]
        err = np.vander(grid, degree + 1, increasing=True) @ coeffs / exact - 1
        segments = np.split(np.arange(grid.size), np.flatnonzero(np.diff(np.sign(err))) + 1)
        points = np.array([grid[s[np.argmax(np.abs(err[s]))]] for s in segments])
    return coeffs, float(np.abs(err).max())


def _ex2_poly(x: np.ndarray) -> np.ndarray:
    """``ex2_poly``'s PTX, one instruction a line, in float32 (an FMA as one rounding of the float64 result: the
    product of two float32 is exact in float64)."""
    c0, c1, c2, c3 = (np.float32(c) for c in EXP2_POLY)
    x = x.astype(np.float32)
    y = np.where(np.isnan(x), x, np.maximum(x, np.float32(-120.0)))            # max.NaN
    r = (y + ROUND_BIAS).astype(np.float32)
    n = (r - ROUND_BIAS).astype(np.float32)
    f = (y - n).astype(np.float32)

    def fma(a, b, c):
        return (a.astype(np.float64) * b + c).astype(np.float32)

    p = fma(fma(fma(f, c3, c2), f, c1), f, c0)
    shifted = (r.view(np.int32).astype(np.int64) << 23).astype(np.uint32).view(np.int32)   # shl.b32: wraps
    return (p.view(np.int32) + shifted).view(np.float32)


def test_the_coefficients_are_the_minimax_fit():
    coeffs, error = _minimax_relative()
    assert np.allclose(coeffs, EXP2_POLY, rtol=0, atol=5e-9)   # as written: 8 decimals
    assert error < STATED_ERROR


def test_the_sequence_keeps_its_error_over_the_softmax_scores():
    # the kernel's scores t - m + 8 lie at or below 8; 2^-120 and below are the clamp's
    x = np.concatenate([np.linspace(-120.0, 8.0, 2_000_001, dtype=np.float32),
                        np.float32([-0.5, 0.5, 0.0, -1.5, 7.5, -119.5])])
    got = _ex2_poly(x).astype(np.float64)
    rel = np.abs(got / np.exp2(x.astype(np.float64)) - 1)
    assert rel.max() < STATED_ERROR * 1.01   # the float32 steps add a few ulps to the polynomial's own 7.48e-5


def test_far_below_the_clamp_nan_and_whole_numbers():
    assert np.all(_ex2_poly(np.float32([-200.0, -1e30, -np.inf])) == np.float32(2.0**-120 * EXP2_POLY[0]))
    assert np.isnan(_ex2_poly(np.float32([np.nan]))[0])
    whole = np.arange(-120, 9, dtype=np.float32)
    assert np.allclose(_ex2_poly(whole), np.exp2(whole) * np.float32(EXP2_POLY[0]), rtol=1e-7, atol=0)
