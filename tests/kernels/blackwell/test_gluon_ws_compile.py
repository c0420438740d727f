"""CPU compile checks of the warp-specialised Gluon Direct-P kernel (kernels/blackwell/gluon_ws.py; no GPU):
compiled for sm_100a, its PTX must hold the block-scaled FP4 tcgen05 MMAs (NVFP4 Q·Kᵀ, MXFP4 P·V with P in
TMEM), the hardware E2M1 conversion and the packed FMA, no local memory (no LDL/STL anywhere), and the SASS
must hold the four partitions the schedule relies on (two Direct-P warpgroups, an MMA warp, a load warp)."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

TRITON_38 = tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 8)
pytestmark = pytest.mark.skipif(not TRITON_38, reason="Gluon tcgen05_mma_scaled / warp_specialize as of Triton 3.8")


@pytest.fixture(scope="module", params=[128, 64], ids=["d128", "d64"])
def report(request):
    from fp4vis.kernels.blackwell import gluon_ws
    return gluon_ws.inspect_ws(request.param)


def test_block_scaled_fp4_mmas(report):
    kinds = " ".join(report["mma_ptx"])
    assert "tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale.block16" in kinds   # Q·Kᵀ, E4M3 per 16
    assert "tcgen05.mma.cta_group::1.kind::mxf4.block_scale.block32" in kinds       # P·V, E8M0 per 32
    assert not any(k in kinds for k in ("kind::f16", "kind::tf32", "kind::f8f6f4"))
    # every MXFP4 MMA takes P from tensor memory (the A operand the Direct-P warps store)
    n_mxf4 = sum(n for k, n in report["mma_ptx"].items() if "kind::mxf4.block_scale" in k)
    assert report["mma_a_from_tmem"] == n_mxf4 > 0


def test_direct_p_instructions(report):
    assert report["e2m1_cvt"] > 0 and report["fma_x2"] > 0
    dp = [p for p in report["partitions"] if p["role"] == "direct_p"]
    for p in dp:   # 128 scores per thread: 64 conversions of two, 64 packed FMAs of the code argument
        assert p["special"].get("F2FP.SATFINITE.RELU.E2M1.F32.PACK_AB_MERGE_C") == 64
        assert p["mix"].get("FFMA2", 0) >= 64
        assert not any(op.startswith("MUFU") for op in p["special"])   # fast: no exp2


def test_partitions_and_no_spills_in_loops(report):
    roles = sorted(p["role"] for p in report["partitions"])
    assert roles == ["direct_p", "direct_p", "load", "mma"]
    assert report["local_ptx"] == 0 and report["sass_local"] == 0
    assert all(p["local"] == 0 for p in report["partitions"])
    # the Direct-P loops wait on two mbarriers (S ready, P buffer free) and commit no MMA; the MMA warp commits
    dp = [p for p in report["partitions"] if p["role"] == "direct_p"]
    assert all(p["mma_commits"] == 0 and p["mma_waits"] == 2 for p in dp)
    mma = next(p for p in report["partitions"] if p["role"] == "mma")
    assert mma["mma_commits"] > 0
    assert report["tmem_columns"] <= 512 and report["num_warps"] == 12


def test_model_reads_the_schedule(report):
    from fp4vis.kernels.blackwell import gluon_ws
    m = gluon_ws.ws_model(report)
    c = m["cycles_per_tile"]
    assert c["tensor_fp4"] == m["flops_per_tile"] / 32768
    assert m["bound_cycles"] == max(c["tensor_fp4"], c["issue"], c["ex2"], c["e2m1_cvt"][1], c["direct_p_chain"])
    assert m["modelled_speedup_vs_bf16"] == pytest.approx(m["bf16_fa_cycles"] / m["bound_cycles"])


@pytest.mark.parametrize("head_dim", [128, 64])
def test_direct_p_float_ops_match_kernel_py(head_dim):
    """The same float32 operations per score as kernel.py's fast build (same constants, the same contractions into
    fma, the same saturation compare e + 127 > 254 per block), but for the count of the saturated blocks, which this
    kernel keeps in float32 (a select of 1.0 and an add per block; kernel.py's is an int32 sum)."""
    from fp4vis.kernels.blackwell import gluon_ws, kernel
    from fp4vis.kernels.blackwell.config import KernelConfig
    ref, ref_imm = gluon_ws.direct_p_float_ops(
        kernel.compile_for_target(KernelConfig(head_dim, "bf16", False, False, 100)).asm["ptx"])
    ws, ws_imm = gluon_ws.direct_p_float_ops(gluon_ws.compile_for_target(head_dim).asm["ptx"])
    assert ref["setp.gt.f32"] == ws["setp.gt.f32"] == 1 / 32
    ref["selp.f32"] += 1 / 32
    ref["add.f32"] += 1 / 32
    assert ws == ref
    assert ws_imm == ref_imm | {"0f3F800000"}   # the count's 1.0


def _fake_operands(head_dim, heads=2, sq=256, skv=384):
    import torch

    from fp4vis.kernels.blackwell.prepass import Operands
    g = torch.Generator().manual_seed(head_dim)

    def rnd(*shape):
        return torch.randint(0, 255, shape, generator=g, dtype=torch.uint8)
    return Operands(rnd(heads, sq, head_dim // 2), rnd(heads, sq, head_dim // 16).view(torch.float8_e4m3fn),
                    rnd(heads, skv, head_dim // 2), rnd(heads, skv, head_dim // 16).view(torch.float8_e4m3fn),
                    rnd(heads, head_dim, skv // 2), rnd(heads, head_dim, skv // 32), sq - 5, sq, skv, skv - 7)


def _kernel_view(unit):
    """What ``gluon_ws._scales_2d`` makes of one TMA box (1, U, K4, 2, 256): the same reshape/permute in torch."""
    u, k4 = unit.shape[1], unit.shape[2]
    return unit.reshape(u, k4, 32, 4, 4).permute(0, 3, 2, 1, 4).reshape(u * 128, k4 * 4)


@pytest.mark.parametrize("head_dim", [128, 64])
def test_host_scale_order_is_what_the_kernel_reads(head_dim):
    """The host's packed-block scales, cut into the kernel's TMA boxes and viewed as the kernel views them, are
    the pre-pass scales of each tile (Q and K rows x D/16; V's D rows x 4 blocks per key tile, D = 64 padded
    with 127)."""
    import torch

    from fp4vis.kernels.blackwell import gluon_ws
    ops = _fake_operands(head_dim)
    t = gluon_ws.operands(ops)
    g, d = ops.vc.shape[0], head_dim
    for name, src, rows in (("qs_desc", ops.qs, ops.rows_q), ("ks_desc", ops.ks, ops.keys)):
        packed = t[name].view(torch.uint8)
        for gi in range(g):
            for r0 in range(0, rows, 128):
                box = packed[:, (gi * rows + r0) // 128:(gi * rows + r0) // 128 + 1]   # the kernel's coordinate
                assert torch.equal(_kernel_view(box), src.view(torch.uint8)[gi, r0:r0 + 128])
    dp = max(d, 128)
    for gi in range(g):
        for j in range(ops.keys // 128):
            box = t["vs_desc"][:, gi * (dp // 128):(gi + 1) * (dp // 128), j:j + 1]
            view = _kernel_view(box)
            assert torch.equal(view[:d], ops.vs[gi, :, 4 * j:4 * j + 4])
            assert bool((view[d:] == 127).all())


@pytest.mark.parametrize("head_dim", [128, 64])
def test_host_descriptors_match_the_compiled_signature(head_dim):
    from fp4vis.kernels.blackwell import gluon_ws
    desc = gluon_ws.descriptors(_fake_operands(head_dim))
    sig = gluon_ws.signature(head_dim)
    assert {name: dsc.__mangle__() for name, dsc in desc.items()} == {name: sig[name] for name in desc}
