"""CPU compile checks of the Blackwell kernel (no GPU): compiled here for sm_100a, sm_103a and
sm_120a, its PTX/SASS must show the FP4 block-scaled MMAs, no BF16 upcast on the dot path, the
hardware E2M1 conversion, and no local memory."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from fp4vis.kernels.blackwell import compile_check  # noqa: E402
from fp4vis.kernels.blackwell.config import KernelConfig  # noqa: E402

TRITON_38 = tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 8)
needs_38 = pytest.mark.skipif(not TRITON_38, reason="Triton >= 3.8 compiles NVFP4 tl.dot_scaled")



@needs_38
@pytest.mark.parametrize("arch", [100, 103, 120])
@pytest.mark.parametrize("native", [False, True], ids=["fast", "native"])
def test_blackwell_build_uses_fp4_block_scaled_mma(arch, native):
    rep = compile_check.inspect(KernelConfig(128, "bf16", native, native, arch))
    assert rep.ok, rep.failures
    kinds = " ".join(rep.mma_ptx)
    if arch in (100, 103):
        assert "kind::mxf4nvf4.block_scale" in kinds and "kind::mxf4.block_scale.block32" in kinds
        assert any(op.startswith("UTC") and "MMA" in op for op in rep.sass_mma)
    else:
        assert "mma.sync.aligned" in kinds and "kind::mxf4nvf4.block_scale" in kinds
        assert any("MMA" in op for op in rep.sass_mma)
    assert not any("bf16" in k or "wgmma" in k for k in rep.mma_ptx)
    assert rep.e2m1_cvt > 0 and rep.ttgir_upcasts == 0 and rep.sass_local == 0 and rep.local_ptx == 0
    if arch in (100, 103):   # the code argument two lanes at a time
        assert rep.fma_x2 > 0 and rep.steady_mix.get("FFMA2", 0) > 0
        # what the model's schedule reads: TMEM columns, registers, the MMA groups committed and waited on
        assert rep.tmem_columns in (256, 512) and 0 < rep.registers <= 255 and rep.mma_commits > 0


@needs_38
def test_compile_check_cli(capsys):
    assert compile_check.main(["--arch", "sm_100a", "--head-dim", "64"]) == 0
    out = capsys.readouterr().out
    assert "kind::mxf4nvf4.block_scale" in out and "FAIL" not in out
    # the sm_90a build has no FP4 MMA (exact BF16 upcast): the check must say so and fail
    assert compile_check.main(["--arch", "sm_90a", "--head-dim", "64"]) == 1
    assert "no FP4 block-scaled MMA" in capsys.readouterr().out


def test_judge_catches_missing_mma_and_spills():
    cfg = KernelConfig(128, "bf16", False, False, 100)
    rep = compile_check.Report(cfg.tag(), cfg.arch_name, 0.0,
                               mma_ptx={"wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16": 4}, sass_local=2)
    compile_check._judge(cfg, rep)
    text = " ".join(rep.failures)
    assert not rep.ok and "mxf4nvf4" in text and "BF16" in text and "spills" in text and "e2m1x2" in text
    assert "f32x2" in text


def test_b200_model_serialises_waited_mmas_and_counts_ctas():
    cfg = KernelConfig(64, "bf16", False, False, 100)
    rep = compile_check.Report(cfg.tag(), cfg.arch_name, 0.0, steady_loop=300, shared=13824, tmem_columns=256,
                               registers=128, mma_commits=3, mma_waits=3)
    m = compile_check.gpu_model(cfg, rep)
    # issue 300 x 8 warps / 4 = 600 cycles; tensor (2 x 128 x 128 x (64 x 2 + 16)) / 32768 = 144; two CTAs fit
    assert m["mma_serialised"] and m["ctas_per_sm"] == 2
    assert m["cycles_per_tile"]["schedule"] == (600 + 144) / 2 and m["bound_cycles"] == 600
    assert round(m["needed_steady"]) == 300   # 1.2x: issue <= 721/1.2
    rep.registers = 136   # one CTA: a tile costs issue + tensor
    m = compile_check.gpu_model(cfg, rep)
    assert m["ctas_per_sm"] == 1 and m["bound_cycles"] == 744


def test_rtx5090_model_waits_per_warp():
    """sm_120a: mma.sync results are waited on by their own warp; the warps on a scheduler fill each other's gaps,
    and the E2M1 count is the conversions', not the MMAs' (whose names carry E2M1 too)."""
    cfg = KernelConfig(128, "bf16", False, False, 120)
    rep = compile_check.Report(cfg.tag(), cfg.arch_name, 0.0, steady_loop=600, shared=33792, registers=252,
                               steady_special={"OMMA.SF.16864.F32.E2M1.E2M1.E8": 36,
                                               "F2FP.SATFINITE.RELU.E2M1.F32.PACK_AB_MERGE_C": 32})
    m = compile_check.gpu_model(cfg, rep)
    # issue 600 x 8 / 4 = 1200; tensor 2 x 128 x 128 x (128 x 2 + 16) / 4096 = 2176; one CTA, 2 warps per scheduler
    assert m["gpu"] == "RTX 5090" and m["mma_serialised"] and m["ctas_per_sm"] == 1 and m["mma_streams"] == 2
    assert m["cycles_per_tile"]["schedule"] == (1200 + 2176) / 2 and m["bound_cycles"] == 2176
    assert m["cycles_per_tile"]["e2m1_cvt"] == [32 * 256 / 64, 32 * 256 / 16]
    # BF16 FlashAttention at its published 212 TFLOP/s on 170 SMs at 2.407 GHz
    assert m["bf16_fa_cycles"] == pytest.approx(2 * 128 * 128 * 128 * 2 / (212e12 / 170 / 2.407e9))
    assert 103 not in compile_check.MODEL_GPUS   # B300's rates: not modelled


def test_steady_roles_first_match_wins():
    roles = compile_check.steady_roles(["IMAD.MOV.U32", "IMAD.X", "FFMA2", "BAR.SYNC", "STTM.x64", "XYZ"])
    assert roles == {"register moves": 1, "loads and addresses": 1, "Direct-P arithmetic": 1, "MMA issue and sync": 1,
                     "operand layout (TMEM, shared)": 1, "other": 1}
