"""CPU checks of the Hopper kernel (no GPU needed; CI runs these).

* every kernel variant compiles for sm_90a with fake tensors; ptxas reports no spills and no stack
  frame; the SASS has HGMMA (the tensor cores) and no local-memory traffic; the exp-free policies
  have no MUFU.EX2 (nvdisasm from the nvidia-cuda-nvdisasm wheel);
* the kernel's pre-pass computes bit-for-bit the operands the reference emulation uses;
* the backend module imports and registers on a machine without a GPU, and says why it cannot run.
"""

import dataclasses
import importlib
import json
import math
import os

import pytest
import torch

os.environ.setdefault("CUTE_DSL_NO_CACHE", "1")

cutlass = pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl not installed")

from fp4vis.policy import POLICIES  # noqa: E402
from fp4vis.reference import quantize_operands  # noqa: E402
from fp4vis.settings import setting  # noqa: E402

compile_check = importlib.import_module("fp4vis.kernels.hopper.compile_check")
prepass_torch = importlib.import_module("fp4vis.kernels.hopper.prepass_torch")

VARIANTS = compile_check.variants()
EXP_FREE = {"fast", "wan_fast", "fast_overlap", "wan_fast_overlap", "fast_serial_scalar",
            "fast_bf16round", "fast_3wg", "fast_scalar", "fast_none", "fast_timing_scales", "fast_timing_codes",
            "fast_packed_alu", "fast_serial_1wg", "fast_fp8qk", "fast_lane", "fast_fp8qk_lane", "fast_short",
            "fast_fp8qk_short", "fast_record", "fast_fp8qk_short_record", "fast_klen", "fast_fp8qk_short_klen"}
SMEM_LIMIT = 227 * 1024     # dynamic shared memory per block on sm_90


@pytest.fixture(scope="module")
def nvdisasm():
    exe = compile_check.find_nvdisasm()
    if exe is None:
        pytest.skip("nvdisasm not found (pip install nvidia-cuda-nvdisasm, a dev dependency)")
    return exe


@pytest.mark.parametrize("name,cfg", VARIANTS, ids=[f"{n}-D{c.head_dim}-N{c.tile_n}" for n, c in VARIANTS])
def test_variant_compiles_clean(name, cfg, nvdisasm):
    rep = compile_check.compile_variant(cfg)
    assert rep.registers is not None, f"no ptxas report captured:\n{rep.ptxas_log}"
    assert rep.spill_store_bytes == 0 and rep.spill_load_bytes == 0, rep.ptxas_log
    assert rep.stack_frame_bytes == 0, rep.ptxas_log
    assert not rep.wgmma_serialized, rep.ptxas_log
    c = rep.counts
    # BF16 products on HGMMA, FP8 ones on QGMMA: QK^T with FP8 Q/K, P V with the FP8 P/V softmax
    assert (c.get("HGMMA", 0) > 0) == (not (cfg.qk_fp8 and cfg.pv_fp8)), c
    assert (c.get("QGMMA", 0) > 0) == (cfg.qk_fp8 or cfg.pv_fp8), c
    assert c.get("LDL", 0) == 0 and c.get("STL", 0) == 0, c
    assert rep.shared_bytes is not None and rep.shared_bytes <= SMEM_LIMIT, rep.shared_bytes
    # the host-side size (stage count of the short variant, benchmarks) is the layout's
    kernel_cls = importlib.import_module("fp4vis.kernels.hopper.kernel").DirectPAttentionSm90
    assert rep.shared_bytes == kernel_cls(cfg).dynamic_smem_bytes(), rep.shared_bytes
    if name in EXP_FREE:
        assert c.get("MUFU.EX2", 0) == 0, c
    else:
        assert c.get("MUFU.EX2", 0) > 0, c
    hf = importlib.import_module("fp4vis.kernels.hopper.config")
    if cfg.ctas_per_sm == 2:   # two CTAs fit an SM: 128 registers at launch, half the shared memory
        assert rep.registers == 65536 // (2 * 256) and rep.shared_bytes <= hf.SMEM_2CTA, (rep.registers,
                                                                                            rep.shared_bytes)
        assert rep.setmaxnreg == [("DEALLOC", hf.REGS_2CTA[0]), ("TRY_ALLOC", hf.REGS_2CTA[1])], rep.setmaxnreg
    else:
        assert rep.setmaxnreg == [("DEALLOC", hf.REGS_PRODUCER), ("TRY_ALLOC", hf.REGS_CONSUMER[cfg.num_wg])], \
            rep.setmaxnreg


def test_range_record_costs_the_loop_almost_nothing(nvdisasm, tmp_path):
    """The range record counts saturated blocks inside the key loop (an exponent compare per (row,
    block) pair the thread owns) and writes only in the epilogue: the ping-pong loop of the default
    ``fast`` kernel grows by at most 1 % (measured: 734 -> 739 instructions), and only the record
    variant has the global reductions that add its counts."""
    from fp4vis.kernels.hopper.config import KernelConfig
    plain = KernelConfig.from_policy(POLICIES["fast"], 128, "bf16")
    loops, reds = [], []
    for i, cfg in enumerate((plain, dataclasses.replace(plain, range_record=True))):
        rep = compile_check.compile_variant(cfg, keep_dir=str(tmp_path / str(i)))
        sass = compile_check.sass_text(open(rep.cubin, "rb").read())
        loops.append(max(len(body) for body in compile_check.innermost_loops(sass)))
        reds.append(rep.counts.get("REDG", 0) + rep.counts.get("RED", 0) + rep.counts.get("REDUX", 0))
    assert loops[0] < loops[1] <= 1.01 * loops[0], loops
    assert reds[0] == 0 < reds[1], reds


def test_range_record_leaves_the_fp8_softmax_loop_alone(nvdisasm, tmp_path):
    """The FP8 P/V softmax counts nothing in its key loop (no P saturates; the counts are taken in the epilogue), so
    the record leaves that loop's SASS as it is: the product kernel at D = 64 (three consumer warpgroups), 526
    instructions either way. There the decision on the pre-pass's scale range runs after the epilogue of CTA 0's
    first consumer thread (``KernelConfig.decide_after_epilogue``): in the producer's idle warp it made ptxas
    schedule this loop in 583."""
    from fp4vis.kernels.hopper.config import product_config
    params = POLICIES["fp8"].kernel_params(64, 0.125)
    loops = []
    for record in (False, True):
        cfg = product_config(params, 64, "bf16", False, record)
        assert cfg.decide_after_epilogue
        rep = compile_check.compile_variant(cfg, keep_dir=str(tmp_path / str(record)))
        sass = compile_check.sass_text(open(rep.cubin, "rb").read())
        loops.append(max(len(body) for body in compile_check.innermost_loops(sass)))
    assert loops[0] == loops[1], loops
    for name, d in (("fp8", 128), ("fp8pv", 128), ("fast", 64), ("fast_fp8qk", 128)):   # the producer's thread
        assert not product_config(POLICIES[name].kernel_params(d, 0.125), d, "bf16", False, True).decide_after_epilogue


def _inputs(b, h, sq, skv, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, sq, d, generator=g).to(dtype)
    k = torch.randn(b, h, skv, d, generator=g).to(dtype)
    v = torch.randn(b, h, skv, d, generator=g).to(dtype)
    # a few outlier channels and a wide dynamic range
    k[..., 3] *= 30
    v[..., 5] *= 1e3
    v[..., :7, 9] *= 1e-6
    return q, k, v


@pytest.mark.parametrize("policy", ["fast", "accurate", "guard"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prepass_matches_reference_operands(policy, dtype):
    pol = POLICIES[policy]
    b, h, sq, skv, d = 1, 2, 40, 161, 64
    q, k, v = _inputs(b, h, sq, skv, d, dtype)
    qh, kh, v6, *_ = prepass_torch.kernel_operands(q, k, v, pol.qk_layout(d), pol.anchor)
    ops = quantize_operands(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), pol, 0.125)
    assert qh.dtype == kh.dtype == v6.dtype == torch.bfloat16
    assert torch.equal(qh.flatten(0, 1).float(), ops.q)
    assert torch.equal(kh.flatten(0, 1).float(), ops.k[:, :skv])
    assert torch.equal(v6.flatten(0, 1).float(), ops.v6[:, :skv])


@pytest.mark.parametrize("anchor", [0, 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_kernel_operands_decode_to_the_reference_operands(anchor, dtype):
    """What the FP8 kernel reads (E4M3 bytes times their row / key-block scales, as the kernel folds
    them) is exactly the reference's decoded Q-hat and K-hat, in the physical (anchor-permuted) order;
    k_scale covers whole 128-key tiles."""
    from fp4vis.kernels.hopper.fp8_key_scales import fp8_key_scale_blocks
    pol = POLICIES["fast_fp8qk"].replace(name="fp8_test", anchor=anchor, margin=4.0 if anchor else 0.0)
    b, h, sq, skv, d = 1, 2, 40, 161, 64
    q, k, v = _inputs(b, h, sq, skv, d, dtype)
    q8, k8, v6, qs, ks, *_ = prepass_torch.kernel_operands(q, k, v, pol.qk_layout(d), pol.anchor)
    ops = quantize_operands(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), pol, 0.125)
    assert q8.dtype == k8.dtype == torch.float8_e4m3fn and qs.dtype == ks.dtype == torch.float32
    assert ks.shape[-1] == fp8_key_scale_blocks(skv) == 8
    assert torch.equal((q8.float() * qs[..., None]).flatten(0, 1), ops.q)
    k_dec = k8.float() * ks.repeat_interleave(32, -1)[..., :skv, None]
    assert torch.equal(k_dec.flatten(0, 1), ops.k[:, :skv])
    assert torch.equal(v6.flatten(0, 1).float(), ops.v6[:, :skv])
    assert bool((ks[..., -(ks.shape[-1] - 6):] == 1.0).all())   # padding past the 6 blocks of 161 keys


def test_fp8_config_plumbing():
    """The policy's FP8 Q/K reaches the kernel configuration (the benchmark once built kernels without
    a policy field), and the combination the kernel lacks is refused by name."""
    from fp4vis.kernels.hopper.config import KernelConfig
    from fp4vis.policy import KernelParams
    assert KernelConfig.from_policy(POLICIES["fast_fp8qk"], 128, "bf16").qk_fp8
    assert not KernelConfig.from_policy(POLICIES["fast"], 128, "bf16").qk_fp8
    assert KernelConfig.from_policy(POLICIES["fast_bf16round"], 128, "bf16").code_rounding == "bf16"
    with pytest.raises(ValueError, match="qk_fp8 with anchors"):
        KernelConfig.make(KernelParams(0.18, 44.0, 1.5, 1.2, 16, False, 32, "fp8_e4m3", "exact"), 128, "bf16")


def test_block_scales_config_plumbing():
    """block_scales: "quad" by default with 128-key tiles, "lane" selectable (in the key, from the
    benchmark's variant syntax and the custom op's argument), "lane" wherever 64-key tiles are used."""
    from fp4vis.evals.kernel_bench import split_variant
    from fp4vis.kernels.hopper.config import KernelConfig, product_config
    from fp4vis.kernels.hopper.kernel import DirectPAttentionSm90
    fast = POLICIES["fast"]
    quad = KernelConfig.from_policy(fast, 128, "bf16")
    lane = KernelConfig.from_policy(fast, 128, "bf16", block_scales="lane")
    assert quad.block_scales == "quad" and lane.block_scales == "lane" and quad.key() != lane.key()
    assert KernelConfig.from_policy(fast, 128, "bf16", schedule="overlap").block_scales == "lane"
    assert KernelConfig.from_policy(fast, 128, "bf16", num_wg=3).block_scales == "lane"
    for p_path in ("none", "timing_codes"):   # no block scales to share
        assert KernelConfig.from_policy(fast, 128, "bf16", p_path=p_path).block_scales == "lane"
    with pytest.raises(ValueError, match="block_scales"):   # built directly, past make's choice
        DirectPAttentionSm90(dataclasses.replace(quad, tile_n=64))
    with pytest.raises(ValueError, match="block_scales"):
        KernelConfig.from_policy(fast, 128, "bf16", block_scales="warp")
    base, kw = split_variant("hopper_kernel@///lane")
    assert base == "hopper_kernel" and kw == {"block_scales": "lane"}
    assert KernelConfig.from_policy(fast, 128, "bf16", **kw).key() == lane.key()
    assert product_config(fast.kernel_params(128, 0.1), 128, "bf16", False, False).key() == quad.key()


def test_short_variant_config_plumbing():
    """ctas_per_sm = 2 (two CTAs per SM): make fills in its schedule and warpgroups and refuses others by
    name; it is in the key; the kernel fits its register and shared-memory budget by construction (fewer
    K/V stages at D = 128); the benchmark's variant syntax selects it."""
    from fp4vis.evals.kernel_bench import split_variant
    from fp4vis.kernels.hopper import config as hf
    from fp4vis.kernels.hopper.kernel import DirectPAttentionSm90
    fast = POLICIES["fast"]
    default = hf.KernelConfig.from_policy(fast, 128, "bf16")
    short = hf.KernelConfig.from_policy(fast, 128, "bf16", ctas_per_sm=2)
    assert default.ctas_per_sm == 1 and default.key() != short.key()
    assert (short.ctas_per_sm, short.schedule, short.num_wg) == (2, "serial", 1)
    assert hf.KernelConfig.from_policy(fast, 128, "bf16", schedule="serial", num_wg=1, ctas_per_sm=2) == short
    for bad in (dict(schedule="pingpong"), dict(num_wg=2), dict(schedule="overlap", num_wg=1)):
        with pytest.raises(ValueError, match="ctas_per_sm"):
            hf.KernelConfig.from_policy(fast, 128, "bf16", ctas_per_sm=2, **bad)
    with pytest.raises(ValueError, match="ctas_per_sm"):
        hf.KernelConfig.from_policy(fast, 128, "bf16", ctas_per_sm=3)
    with pytest.raises(ValueError, match="ctas_per_sm"):   # built directly, past make's checks
        DirectPAttentionSm90(dataclasses.replace(default, ctas_per_sm=2))
    # 128 registers per thread at launch (64K per SM, 2 CTAs of 256 threads): the two warpgroups share 2 x 128
    assert sum(hf.REGS_2CTA) == 2 * (65536 // (2 * 256)) and all(r % 8 == 0 for r in hf.REGS_2CTA)
    for d, fp8, stages in ((128, False, 3), (128, True, 3), (64, False, 4), (64, True, 4)):
        cfg = hf.KernelConfig.from_policy(POLICIES["fast_fp8qk" if fp8 else "fast"], d, "bf16", ctas_per_sm=2)
        kern = DirectPAttentionSm90(cfg)
        assert (kern.kv_stages, kern.regs_producer, kern.regs_consumer) == (stages, *hf.REGS_2CTA)
    assert DirectPAttentionSm90(default).kv_stages == 4
    assert split_variant("hopper_kernel@////2") == ("hopper_kernel", {"ctas_per_sm": 2})
    assert split_variant("hopper_kernel@serial//1//1")[1] == {"schedule": "serial", "num_wg": 1, "ctas_per_sm": 1}


def test_short_variant_dispatch(monkeypatch, fp4vis_settings):
    """The backend's launcher picks the short-sequence variant when both sequences are at most SHORT_SEQ, keeps
    the default kernel for long queries over short keys, never swaps a variant handed to it, and
    FP4VIS_HOPPER_SHORT=0 turns it off. The pre-pass and the launch are replaced (no GPU)."""
    from fp4vis.call import AttentionCall
    from fp4vis.kernels.hopper import launch as hb
    from fp4vis.kernels.hopper.config import KernelConfig, product_config
    seen = []
    monkeypatch.setattr(hb, "kernel_operands", lambda call, params, settings: None)
    monkeypatch.setattr(hb, "launch", lambda cfg, *a: seen.append(cfg))
    pol = POLICIES["fast"]

    def ctas(skv, sq=8, config=None):
        q = torch.randn(1, 1, sq, 64, dtype=torch.bfloat16)
        kv = torch.randn(1, 1, skv, 64, dtype=torch.bfloat16)
        hb.attention(AttentionCall(q, kv, kv, pol, 0.125), config)
        return seen[-1].ctas_per_sm

    assert hb.SHORT_SEQ == 768
    assert ctas(768, sq=768) == 2 and ctas(769) == 1 and ctas(40, sq=769) == 1
    assert ctas(40, config=KernelConfig.from_policy(pol, 64, "bf16", p_path="scalar")) == 1
    assert ctas(2000, config=KernelConfig.from_policy(pol, 64, "bf16", ctas_per_sm=2)) == 2
    assert seen[0].key() == product_config(pol.kernel_params(64, 0.125), 64, "bf16", True, False).key()
    fp4vis_settings(FP4VIS_HOPPER_SHORT="0")
    assert ctas(40) == 1


def test_launcher_decides_where_no_kernel_does(monkeypatch):
    """The kernel decides on the scale range its pre-pass recorded (kernels/scale_record.py); where it does not
    (a variant that records nothing, a launch or pre-pass that raises) the launcher runs the decision itself, so that
    no call's words reach the next call; a recording kernel that ran leaves it to the kernel. No GPU: the pre-pass,
    the launch and the decision are replaced."""
    from fp4vis.call import AttentionCall, RecordSlot
    from fp4vis.kernels.hopper import launch as hb
    from fp4vis.kernels.hopper.config import KernelConfig
    decided, fail = [], []
    monkeypatch.setattr(hb, "kernel_operands", lambda call, params, settings: None)
    monkeypatch.setattr(hb, "decide", decided.append)

    def launch(cfg, *a):
        if fail:
            raise RuntimeError("launch failed")
    monkeypatch.setattr(hb, "launch", launch)
    pol = POLICIES["fast"]
    q = torch.randn(1, 1, 8, 64, dtype=torch.bfloat16)
    slot = RecordSlot(torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), 5)
    recording = KernelConfig.from_policy(pol, 64, "bf16", range_record=True)
    timing = KernelConfig.from_policy(pol, 64, "bf16", p_path="timing_codes", range_record=True)
    assert recording.range_record and not timing.range_record
    hb.attention(AttentionCall(q, q, q, pol, 0.125, record=slot), recording)
    hb.attention(AttentionCall(q, q, q, pol, 0.125), timing)
    assert decided == []
    hb.attention(AttentionCall(q, q, q, pol, 0.125, record=slot), timing)
    assert decided == [slot]
    fail.append(True)
    with pytest.raises(RuntimeError, match="launch failed"):
        hb.attention(AttentionCall(q, q, q, pol, 0.125, record=slot), recording)
    assert decided == [slot, slot]


_TRITON_CHECK = r"""
import torch
from fp4vis.formats import nvfp4_qdq
from fp4vis.kernels.hopper.prepass import cached_anchor_permutation
from fp4vis.kernels.hopper.prepass_torch import kernel_operands
from fp4vis.kernels.hopper import prepass_launch as tp
g = torch.Generator().manual_seed(0)
for dtype, d, layout, anchor in ((torch.bfloat16, 128, "folded64_mse", 128), (torch.float16, 64, "block16", 32)):
    b, h, s = 1, 2, 45
    q = torch.randn(b, h, s, d, generator=g).to(dtype)
    k = (torch.randn(b, h, s, d, generator=g) * 3).to(dtype)
    v = torch.randn(b, h, s, d, generator=g).to(dtype)
    k[..., 3] *= 30
    v[..., 5] *= 1e3
    v[..., :7, 9] *= 1e-6
    qh, kh, v6, *_ = kernel_operands(q, k, v, layout, anchor)
    perm = cached_anchor_permutation(s, anchor, q.device, torch.int32)
    # the fused pre-pass sums the folded-K64 MSE exactly (float64)
    qx = nvfp4_qdq(q, layout).to(torch.bfloat16)
    kx = nvfp4_qdq(k[:, :, perm.long()], layout).to(torch.bfloat16)
    assert torch.equal(tp.nvfp4_qdq(q, layout), qx)
    assert torch.equal(tp.nvfp4_qdq(k, layout, perm), kx)
    assert torch.equal(tp.mxfp4_v6(v, perm), v6)
    if layout == "block16":
        assert torch.equal(qx, qh) and torch.equal(kx, kh)
print("OK")
"""


def test_triton_prepass_matches_torch_prepass_interpreted():
    """The fused Triton pre-pass, run by Triton's CPU interpreter, is bit-equal to the PyTorch one."""
    import subprocess
    import sys
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", _TRITON_CHECK], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0 and "OK" in res.stdout, res.stdout + res.stderr


@pytest.mark.parametrize("anchor", [0, 32])
def test_prepass_turns_non_finite_inputs_into_nan(anchor):
    """The quantizers saturate Inf to a finite code; the pre-pass must hand the kernel NaN instead
    (the kernel propagates it, fp4vis.attention then names the input), exactly where the input was
    non-finite (after the anchor permutation), and change nothing else."""
    q, k, v = _inputs(1, 2, 64, 64, 128, torch.bfloat16, seed=4)
    k[0, 1, 3, 5] = math.inf
    v[0, 0, 7, 2] = -math.nan
    q[0, 1, 9, 100] = -math.inf
    qh, kh, vh, *_ = prepass_torch.kernel_operands(q, k, v, "folded64_mse", anchor)
    for hat in (qh, kh, vh):
        assert int(torch.isnan(hat).sum()) == 1 and not torch.isinf(hat).any()
    assert torch.isnan(qh[0, 1, 9, 100])
    assert torch.equal(torch.isnan(kh).nonzero()[:, [0, 1, 3]], torch.tensor([[0, 1, 5]]))
    assert torch.equal(torch.isnan(vh).nonzero()[:, [0, 1, 3]], torch.tensor([[0, 0, 2]]))


def test_kernel_output_check_names_the_input():
    from fp4vis.attention import _check_kernel_output
    q, k, v = _inputs(1, 1, 8, 8, 64, torch.float32)
    _check_kernel_output(torch.zeros(3), q, k, v, "hopper")   # finite output: nothing to say
    bad = torch.tensor([0.0, math.nan])
    k[0, 0, 1, 1] = math.inf
    with pytest.raises(ValueError, match="k: contains Inf"):
        _check_kernel_output(bad, q, k, v, "hopper")
    with pytest.raises(RuntimeError, match="non-finite output from finite inputs"):
        _check_kernel_output(bad, q, q, q, "hopper")


def _grid_round(y: torch.Tensor, fma_constant: bool) -> torch.Tensor:
    """The kernel's ``e2m1_grid_eighths`` in float32 arithmetic (torch's float32 add rounds to nearest
    even, as add.rn.f32 does; the FFMA constant is exact in float64 and rounded once)."""
    bits = y.view(torch.int32)
    c = bits & 0x7F800000
    if fma_constant:
        big = (c.view(torch.float32).double() * 2.0 ** 22 + (2.0 ** 19 - 2.0 ** 16)).float()
    else:
        big = torch.clamp(c + 0x0B000000, min=0x49000000).view(torch.float32)
    return (y + big) - big


def test_e2m1_grid_rounding_constant_forms_agree():
    """The FFMA rounding constant of the default packed P path gives the E2M1 grid (RNE) for every
    y8 = y/8 in [0, 1], as the integer form does: exhaustive over the binades where the grid
    steps differ (y8 >= 2^-8), sampled below; ``FP4VIS_EXHAUSTIVE=1`` checks every float32 in
    [0, 1] (1.07e9 values)."""
    from fp4vis.formats import e2m1_round

    mant = torch.arange(1 << 23, dtype=torch.int32)
    everything = setting("FP4VIS_EXHAUSTIVE")   # all of [0, 1]: about a minute
    g = torch.Generator().manual_seed(0)
    chunks = [torch.tensor([0, 1, 0x3F800000], dtype=torch.int32)]   # 0, a subnormal, 1.0
    for e in range(-127, 0):   # -127: the subnormals
        exhaustive = everything or e >= -8
        m = mant if exhaustive else torch.randint(0, 1 << 23, (1 << 14,), generator=g, dtype=torch.int32)
        chunks.append(((e + 127) << 23) | m)
    for bits in chunks:
        y = bits.view(torch.float32)
        want = e2m1_round(8.0 * y) / 8.0
        for fma_constant in (True, False):
            got = torch.clamp(_grid_round(y, fma_constant), max=0.75)   # the kernel saturates on pairs
            assert torch.equal(got, want), f"fma_constant={fma_constant}: {(got != want).sum()} mismatches"


def test_fp8_pv_config_ignores_direct_p_fields():
    """The FP8 P/V softmax reads none of Direct-P's fields: policies that differ only there share one compiled
    kernel (``KernelConfig.key()``), and the named ``fp8`` keeps the product's."""
    from fp4vis.kernels.hopper.config import KernelConfig
    from fp4vis.policy import Policy
    named = KernelConfig.from_policy(POLICIES["fp8"], 128, "bf16")
    custom = Policy("mine", method="fp8_pv", qk_format="fp8_e4m3", affine_a=1.7, affine_b=0.9, shift=9)
    assert KernelConfig.from_policy(custom, 128, "bf16").key() == named.key()
    assert named.pv_fp8 and named.qk_fp8 and not KernelConfig.from_policy(POLICIES["fp8pv"], 128, "bf16").qk_fp8


@pytest.mark.parametrize("d", [64, 128])
def test_fp8_pv_row_sums_where_the_contract_sums_the_rounded_p(d, tmp_path):
    """The FP8 P/V kernel sums its denominator on the tensor cores exactly where the contract sums the rounded P
    (``key_positions.softmax_sums_rounded_p``: D = 64): one m64n8k32 QGMMA per 32-key block beside each P V product,
    none at D = 128, whose loop keeps its additions on the ALUs."""
    import re

    from fp4vis.kernels.hopper.config import KernelConfig
    from fp4vis.key_positions import softmax_sums_rounded_p
    for name in ("fp8", "fp8pv"):
        cfg = KernelConfig.from_policy(POLICIES[name], d, "bf16")
        assert cfg.row_sums_mma == softmax_sums_rounded_p(d) == (d == 64)
        rep = compile_check.compile_variant(cfg, keep_dir=str(tmp_path / name))
        sass = compile_check.sass_text(open(rep.cubin, "rb").read())
        sums = len(re.findall(r"QGMMA\.64x8x32\.", sass))
        products = len(re.findall(rf"QGMMA\.64x{d}x32\.", sass))   # P V: the N of its WGMMA is the head dim
        assert sums == (products if d == 64 else 0), (sums, products)


def test_fp8_pv_key_tile_is_the_contracts():
    """The FP8 P/V kernel runs the contract's key tile (``key_positions.softmax_tile``: 192 at D = 128, 128 at D = 64,
    the short-sequence variant too), takes the others of ``PV_FP8_TILES`` as measurement variants, refuses tiles the
    registers or the 32-key blocks do not allow, and keeps at least two K/V stages in shared memory."""
    from fp4vis.kernels.hopper.config import PV_FP8_TILES, SMEM_1CTA, SMEM_2CTA, KernelConfig
    from fp4vis.kernels.hopper.kernel import DirectPAttentionSm90
    from fp4vis.key_positions import softmax_tile
    for name in ("fp8", "fp8pv"):
        pol = POLICIES[name]
        for d in (64, 128):
            for short in (None, 2):
                cfg = KernelConfig.from_policy(pol, d, "bf16", ctas_per_sm=short)
                assert cfg.tile_n == softmax_tile(d) == (192 if d == 128 else 128)
                kernel = DirectPAttentionSm90(cfg)
                assert kernel.kv_stages >= 2
                assert kernel.dynamic_smem_bytes() <= (SMEM_2CTA if short else SMEM_1CTA)
        for tile in PV_FP8_TILES:
            assert KernelConfig.from_policy(pol, 128, "bf16", tile_n=tile).tile_n == tile
        for bad in (96, 256):
            with pytest.raises(ValueError, match="key tiles"):
                KernelConfig.from_policy(pol, 128, "bf16", tile_n=bad)
        with pytest.raises(ValueError, match="three consumer warpgroups"):
            KernelConfig.from_policy(pol, 64, "bf16", tile_n=192)
        with pytest.raises(ValueError, match="two CTAs per SM"):
            KernelConfig.from_policy(pol, 128, "bf16", tile_n=224, ctas_per_sm=2)


def test_schedule_report_gives_the_key_loop(nvdisasm, capsys):
    """``compile_check --schedule --json`` reports ptxas's static schedule with the innermost loop's length (the key
    loop's body, which docs/hopper_kernel.md quotes), inside the loop between the barriers."""
    assert compile_check.main(["--policy", "fp8", "--head-dim", "64", "--schedule", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    sched = next(r["direct_p_schedule"] for r in rows if r["policy"] == "fp8")
    assert 0 < sched["instructions"] < sched["innermost_loop"] <= sched["loop_instructions"], sched


def test_loop_opcodes_counts_the_key_loop_of_any_cubin(nvdisasm, tmp_path, capsys):
    """``compile_check --loop-opcodes CUBIN`` (what docs/hopper_kernel.md compares with FlashAttention-3's cubin): per
    kernel, its longest innermost loop (the schedule report's ``innermost_loop``) and that loop's opcodes; for the
    FP8 P/V kernel at D = 128 the QGMMAs of a key tile (4 for Q K^T, 6 for P V) and the exponentials."""
    from fp4vis.kernels.hopper.config import KernelConfig
    from fp4vis.policy import POLICIES

    cfg = KernelConfig.from_policy(POLICIES["fp8"], 128, "bf16")
    rep = compile_check.compile_variant(cfg, keep_dir=str(tmp_path))
    sass = compile_check.sass_text(open(rep.cubin, "rb").read())
    [(name, n, ops)] = compile_check.loop_opcodes(rep.cubin)
    assert "DirectPAttentionSm90" in name and n == max(map(len, compile_check.innermost_loops(sass)))
    assert sum(ops.values()) == n and ops["QGMMA"] == 10 and ops["MUFU"] > 0
    assert compile_check.main(["--loop-opcodes", rep.cubin]) == 0
    assert f"kernel 0 {name[:60]}...{name[-30:]}: loop {n}: " in capsys.readouterr().out


def test_loop_opcodes_keeps_each_kernels_loops_apart():
    """A listing of two kernels (nvdisasm's ``.text.<name>:`` sections): each one's own longest innermost loop, none
    of the other's; a kernel without a loop counts 0."""
    def kernel(name, loops):   # every loop: a label, its instructions, a backward branch to the label
        lines, pc = [f"        .text.{name}:"], 0
        for k, ops in enumerate(loops):
            lines.append(f".L_x_{k}:")   # the same labels in every kernel: only the split keeps them apart
            for op in ops + [f"@P0 BRA `(.L_x_{k})"]:
                lines.append(f"        /*{pc:04x}*/                   {op} ;")
                pc += 16
        return "\n".join(lines)
    sass = "\n".join(["//-- header", kernel("ka", [["FFMA", "FFMA", "MUFU.EX2"], ["FADD"]]), kernel("kb", [["IMAD"]]),
                      kernel("kc", [])])
    [(a, na, ops_a), (b, nb, ops_b), (c, nc, _)] = compile_check.sass_loop_opcodes(sass)
    assert (a, b, c) == ("ka", "kb", "kc") and (na, nb, nc) == (4, 2, 0)
    assert ops_a == {"FFMA": 2, "MUFU": 1, "BRA": 1} and ops_b == {"IMAD": 1, "BRA": 1}
