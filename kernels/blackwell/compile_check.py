"""Compile the Blackwell kernel for a target without a GPU and prove from PTX/SASS what it runs.

Per variant (``KernelConfig``) and arch: the FP4 block-scaled MMAs are there (sm_100a/sm_103a:
``tcgen05.mma ... kind::mxf4nvf4.block_scale`` for Q·Kᵀ with E4M3 scales per 16 and
``kind::mxf4.block_scale`` for P·V with E8M0 per 32; sm_120a: ``mma.sync ... kind::mxf4nvf4.
block_scale`` with ue4m3 / ue8m0 scales), the FP4 operands are not upcast before the MMA (no
``fp4_to_fp`` / ``upcast_mxfp`` in the TTGIR, no BF16/FP16 MMA in the PTX), the P codes use the
hardware ``cvt.rn.satfinite.relu.e2m1x2.f32`` where the arch has it, and there is no local memory
(no ``.local`` in the PTX, no LDL/STL in the SASS: no spills). The sm_90a build (the H200
verification route) is reported too, and fails the FP4 check by design: its MMA is the BF16 wgmma
of the exact upcast.

CLI: ``python -m fp4vis.kernels.blackwell.compile_check --arch sm_100a [--head-dim 128] [--json]``
prints the MMA instruction kinds found and exits non-zero when the FP4 block-scaled MMA is absent
(or any other check fails) for a Blackwell arch.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

from .config import ARCHS, HW_CVT_ARCHS, KernelConfig

ARCH_BY_NAME = {name: cap for cap, name in ARCHS.items()}
MMA_PTX = re.compile(r"(tcgen05\.mma[\w.:]*|mma\.sync\.aligned[\w.:]*|wgmma\.mma_async[\w.:]*)")
SASS_OP = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s*(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)", re.M)


@dataclass
class Report:
    variant: str
    arch: str
    compile_s: float
    mma_ptx: dict = field(default_factory=dict)      # distinct PTX MMA instruction -> count
    sass_mma: dict = field(default_factory=dict)     # SASS MMA mnemonics -> count
    e2m1_cvt: int = 0                                # cvt.rn.satfinite(.relu).e2m1x2.f32 in PTX
    fma_x2: int = 0                                  # fma.rn.f32x2 in PTX (the packed code argument)
    ttgir_upcasts: int = 0                           # fp4_to_fp / upcast_mxfp ops before the MMA
    local_ptx: int = 0                               # .local declarations / ld.local / st.local
    sass_local: int = 0                              # LDL / STL
    loops: list = field(default_factory=list)        # SASS instructions of each innermost loop
    steady_loop: int = 0         # the main loop without its forward-branch regions (the tail tile's mask)
    steady_mix: dict = field(default_factory=dict)   # mnemonic (no modifiers) -> count in steady_loop
    steady_special: dict = field(default_factory=dict)  # MUFU / F2FP / MMA / TMEM ops in steady_loop
    steady_roles: dict = field(default_factory=dict)    # steady_loop by role (STEADY_ROLES)
    per_score: float = 0.0       # thread instructions per score of the steady loop
    sass_total: int = 0
    sass_counts: dict = field(default_factory=dict)  # selected mnemonics (MUFU.EX2, F2FP, ...) -> count
    shared: int = 0
    tmem_columns: int = 0        # tcgen05.alloc columns per CTA (of 512 per SM)
    registers: int = 0           # registers per thread (the cubin's EIATTR_REGCOUNT)
    mma_commits: int = 0         # UTCBAR (MMA group commits) in steady_loop
    mma_waits: int = 0           # SYNCS.PHASECHK (mbarrier waits) in steady_loop
    failures: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures


def _nvdisasm() -> str:
    import shutil

    import triton
    for cand in (shutil.which("nvdisasm"),
                 os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")):
        if cand and os.path.exists(cand):
            return cand
    raise RuntimeError("nvdisasm not found (Triton bundles one; or pip install nvidia-cuda-nvdisasm)")


def sass_of(cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([_nvdisasm(), "-c", f.name], capture_output=True, text=True, check=True).stdout


# what the steady loop's instructions do, by mnemonic (first match in this order; the rest is "other")
STEADY_ROLES = {
    "register moves": ("IMAD.MOV", "MOV"),   # here mostly the 64 copies of the zero Q·Kᵀ accumulator (_qk_scores)
    "Direct-P arithmetic": ("FFMA", "FADD", "FMUL", "FMNMX", "FSETP", "FSEL", "FRND", "F2I", "F2FP", "MUFU",
                            "SEL", "I2F"),
    "MMA issue and sync": ("UMOV", "BAR", "FENCE", "SYNCS", "UIADD3", "BRA", "USHF", "UTC", "ELECT", "NOP", "VOTEU",
                           "UISETP", "MEMBAR", "UPLOP3", "ISETP", "PLOP3", "BSSY", "BSYNC"),
    "loads and addresses": ("LDGSTS", "LDGDEPBAR", "DEPBAR", "LDG", "IADD3", "VIADD", "LEA", "SHF", "LDC", "IMAD",
                            "LOP3"),
    "operand layout (TMEM, shared)": ("LDS", "STS", "STTM", "LDTM", "PRMT", "SHFL", "REDUX", "CREDUX"),
}


def steady_roles(ops: list[str]) -> dict:
    """Steady-loop instructions per role (``STEADY_ROLES``)."""
    roles = Counter()
    for op in ops:
        roles[next((role for role, prefixes in STEADY_ROLES.items() if op.startswith(prefixes)), "other")] += 1
    return dict(roles)


_EIATTR_REGCOUNT = 0x2F   # .nv.info attribute: (function symbol, registers per thread)


def register_count(cubin: bytes) -> int:
    """Registers per thread of the cubin's kernel: EIATTR_REGCOUNT in its ELF ``.nv.info`` section (0: none)."""
    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names = headers[shstrndx][4]
    for h in headers:
        if cubin[names + h[0]:cubin.index(b"\0", names + h[0])] != b".nv.info":
            continue
        i, end = h[4], h[4] + h[5]
        while i < end:   # entries: format byte, attribute byte, then (format 4) a u16 size and the payload
            fmt, attr = cubin[i], cubin[i + 1]
            size = struct.unpack_from("<H", cubin, i + 2)[0] if fmt == 4 else 0
            if fmt == 4 and attr == _EIATTR_REGCOUNT:
                return struct.unpack_from("<II", cubin, i + 4)[1]
            i += 4 + size
    return 0


def _labels(lines: list[str]) -> dict[str, int]:
    return {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"\s*(\.L_x_\d+):", line))}


def innermost_spans(sass: str) -> list[tuple[int, int]]:
    """(first, last) line of each SASS loop that contains no other loop (a backward branch to a label)."""
    lines = sass.splitlines()
    labels = _labels(lines)
    spans = [(labels[m.group(1)], i) for i, line in enumerate(lines)
             if (m := re.search(r"BRA[^`]*`\((\.L_x_\d+)\)", line)) and labels.get(m.group(1), i) < i]
    return [(a, b) for a, b in spans if not any(a <= c < d <= b and (c, d) != (a, b) for c, d in spans)]


def innermost_loops(sass: str) -> list[int]:
    """Instruction counts of the SASS loops that contain no other loop."""
    lines = sass.splitlines()
    return [sum(1 for line in lines[a:b + 1] if re.match(r"\s*/\*[0-9a-f]{4,}\*/", line))
            for a, b in innermost_spans(sass)]


def sass_op(line: str) -> str | None:
    m = SASS_OP.match(line)
    return m.group(1) if m else None


def steady_loop(sass: str) -> tuple[list[str], int]:
    """(instructions of the largest innermost loop that run on every iteration, instructions skipped
    by its forward branches): the loop minus the regions a forward branch inside it jumps over
    (here: the key mask, executed only on the tile past the last key)."""
    lines = sass.splitlines()
    labels = _labels(lines)
    inner = innermost_spans(sass)
    if not inner:
        return [], 0
    a, b = max(inner, key=lambda span: span[1] - span[0])
    skipped = set()
    for i in range(a, b + 1):
        m = re.search(r"@!?U?P\w+\s+BRA[^`]*`\((\.L_x_\d+)\)", lines[i])
        if m and i < labels.get(m.group(1), -1) <= b:
            skipped.update(range(i + 1, labels[m.group(1)]))
    ops = [op for i in range(a, b + 1) if i not in skipped and (op := sass_op(lines[i]))]
    return ops, sum(1 for i in skipped if sass_op(lines[i]))


def inspect(cfg: KernelConfig, keep_dir: str | None = None) -> Report:
    """Compile ``cfg`` for its arch (no GPU) and check it; the Report lists any failures."""
    from .kernel import compile_for_target
    t0 = time.perf_counter()
    k = compile_for_target(cfg)
    rep = Report(cfg.tag(), cfg.arch_name, time.perf_counter() - t0, shared=k.metadata.shared)
    ptx, ttgir, cubin = k.asm["ptx"], k.asm["ttgir"], k.asm["cubin"]
    if keep_dir:
        os.makedirs(keep_dir, exist_ok=True)
        for ext, data in (("ptx", ptx), ("ttgir", ttgir)):
            with open(os.path.join(keep_dir, f"{cfg.tag()}.{ext}"), "w") as f:
                f.write(data)
    rep.mma_ptx = dict(Counter(MMA_PTX.findall(ptx)))
    rep.e2m1_cvt = len(re.findall(r"cvt\.rn\.satfinite(?:\.relu)?\.e2m1x2\.f32", ptx))
    rep.fma_x2 = len(re.findall(r"fma\.rn\.f32x2", ptx))
    rep.ttgir_upcasts = len(re.findall(r"ttg\.fp4_to_fp|ttg\.upcast_mxfp|tt\.fp4_to_fp", ttgir))
    rep.local_ptx = len(re.findall(r"\.local\b", ptx))
    sass = sass_of(cubin)
    if keep_dir:
        with open(os.path.join(keep_dir, f"{cfg.tag()}.sass"), "w") as f:
            f.write(sass)
    ops = SASS_OP.findall(sass)
    rep.sass_total = len(ops)
    counts = Counter(ops)
    rep.sass_mma = {op: n for op, n in counts.items() if "MMA" in op}
    rep.sass_local = sum(n for op, n in counts.items() if op.split(".")[0] in ("LDL", "STL"))
    rep.sass_counts = {op: n for op, n in sorted(counts.items())
                       if op.split(".")[0] in ("MUFU", "F2FP", "F2F", "FMNMX", "FSETP", "FFMA", "FMUL", "FADD", "SHFL",
                                               "I2F", "F2I", "FRND", "LOP3", "PRMT", "SEL", "FSEL", "IMAD", "IADD3",
                                               "LDS", "STS", "LDG", "STG", "LDSM", "STTM", "LDTM", "UTCBAR")}
    rep.loops = innermost_loops(sass)
    ops_steady, _ = steady_loop(sass)
    rep.steady_loop = len(ops_steady)
    rep.steady_mix = dict(Counter(op.split(".")[0] for op in ops_steady).most_common())
    rep.steady_special = dict(Counter(op for op in ops_steady if op.startswith(("MUFU", "F2FP", "UTC", "STTM", "LDTM",
                                                                                  "HMMA", "OMMA", "QMMA", "HGMMA"))))
    rep.steady_roles = steady_roles(ops_steady)
    rep.per_score = rep.steady_loop * 32 * cfg.num_warps / (cfg.block_m * cfg.block_n)
    rep.tmem_columns = max((int(n) for n in re.findall(r"tcgen05\.alloc[\w.:]*\s+\[[^\]]+\],\s*(\d+);", ptx)),
                           default=0)
    rep.registers = register_count(cubin)
    rep.mma_commits = sum(1 for op in ops_steady if op.startswith("UTCBAR"))
    rep.mma_waits = sum(1 for op in ops_steady if op.startswith("SYNCS.PHASECHK"))
    _judge(cfg, rep)
    return rep


def _judge(cfg: KernelConfig, rep: Report) -> None:
    kinds = " ".join(rep.mma_ptx)
    f = rep.failures
    if cfg.arch in (100, 103):
        if not re.search(r"tcgen05\.mma[\w.:]*kind::mxf4nvf4\.block_scale", kinds):
            f.append("no tcgen05.mma kind::mxf4nvf4.block_scale (NVFP4 Q·Kᵀ)")
        if not re.search(r"tcgen05\.mma[\w.:]*kind::mxf4(?:nvf4)?\.block_scale\.block32", kinds):
            f.append("no tcgen05.mma kind::mxf4 block_scale with 32-element E8M0 blocks (MXFP4 P·V)")
        if re.search(r"kind::(?:f16|tf32|f8f6f4)\b", kinds):
            f.append("a non-FP4 tcgen05 MMA kind on the dot path")
    if cfg.arch == 120:
        if not re.search(r"mma\.sync[\w.:]*kind::mxf4nvf4\.block_scale[\w.:]*ue4m3", kinds):
            f.append("no mma.sync kind::mxf4nvf4.block_scale with ue4m3 scales (NVFP4 Q·Kᵀ)")
        if not re.search(r"mma\.sync[\w.:]*kind::mxf4(?:nvf4)?\.block_scale[\w.:]*ue8m0", kinds):
            f.append("no mma.sync block_scale with ue8m0 scales (MXFP4 P·V)")
    if cfg.arch == 90:
        f.append("no FP4 block-scaled MMA: sm_90a has none (the verification build upcasts FP4 exactly to BF16 "
                 "for wgmma, by design)")
    else:
        if re.search(r"(bf16|f16)\.(bf16|f16)", kinds) or "wgmma" in kinds:
            f.append("a BF16/FP16 MMA on the dot path (FP4 upcast)")
        if rep.ttgir_upcasts:
            f.append(f"{rep.ttgir_upcasts} FP4 upcasts in the TTGIR")
    if cfg.arch in HW_CVT_ARCHS and not rep.e2m1_cvt:
        f.append("P codes not through cvt.rn.satfinite.relu.e2m1x2.f32")
    if cfg.fma_x2 and not rep.fma_x2:
        f.append("code argument not through fma.rn.f32x2")
    if rep.local_ptx or rep.sass_local:
        f.append(f"local memory: {rep.local_ptx} in PTX, {rep.sass_local} LDL/STL in SASS (spills)")


# ---------------------------------------------------------------------------------------------
# performance MODEL (not a measurement: nobody here has run this kernel on Blackwell)
# ---------------------------------------------------------------------------------------------

# Per SM per clock; issue: 4 schedulers x 1 warp instruction per clock; MUFU.EX2: 16/clk/SM (the CUDA guide's
# figure for recent architectures); the E2M1 conversion's rate is not published: a range, 16 to 64 per clock.
# B200 (sm_100a): the vendor's dense FP4 / BF16 rates (18 and 4.5 PFLOPS with sparsity, i.e. 9 and 2.25 dense)
# over 148 SMs at ~1.86 GHz -> 32768 and 8192 FLOP/clk/SM; 512 TMEM columns, 65536 registers, 232448 B of
# shared memory for CTAs. The MMAs are issued per CTA (tcgen05) and run beside its warps' instructions.
B200 = dict(name="B200", sms=148, clock_ghz=1.86, fp4_flop_clk=32768, bf16_flop_clk=8192, issue_warp_clk=4,
            ex2_clk=16, cvt_clk_low=16, cvt_clk_high=64, bf16_fa_efficiency=0.71, tmem_columns=512,
            registers=65536, shared_bytes=232448)
# The BF16 FlashAttention it is compared with runs at 71 % of that BF16 peak.
# RTX 5090 (sm_120a): the vendor's dense FP4 rate 1676 TFLOPS (3352 "AI TOPS" with sparsity; the accumulate mode of
# that figure is not stated beside it) over 170 SMs at 2.407 GHz -> 4096 FLOP/clk/SM. Its BF16 side is a published
# measurement instead of a peak: FlashAttention2's forward at 212 TFLOP/s on this GPU (SageAttention3, arXiv
# 2505.11594, its headline kernel comparison, one figure for every head dim; GeForce parts' FP32-accumulate tensor
# rate, which FlashAttention needs, is not the FP16 one) -> 518 FLOP/clk/SM, taken at efficiency 1. FP4 at its
# peak against a measured BF16: the ratios are upper bounds. No TMEM; 65536 registers, 102400 B
# of shared memory per SM. Its MMAs (mma.sync) are warp instructions: each warp waits for its own results, and
# the other warps on its scheduler fill the gap.
RTX5090 = dict(name="RTX 5090", sms=170, clock_ghz=2.407, fp4_flop_clk=4096, bf16_flop_clk=212e3 / (170 * 2.407),
               issue_warp_clk=4, ex2_clk=16, cvt_clk_low=16, cvt_clk_high=64, bf16_fa_efficiency=1.0,
               tmem_columns=None, registers=65536, shared_bytes=102400)
# the GPU each arch is modelled on (sm_103a's B300 has other rates, not modelled)
MODEL_GPUS = {100: B200, 120: RTX5090}
SCHEDULERS = 4


def gpu_model(cfg: KernelConfig, rep: Report) -> dict:
    """Cycles per SM for one (block_m x block_n) tile of the steady loop on ``MODEL_GPUS[cfg.arch]``, with the
    overlap this build's schedule has, and the modelled ratio to a BF16 FlashAttention at ``bf16_fa_efficiency``
    of that GPU's ``bf16_flop_clk``.

    The overlap, from the SASS. sm_100a: where every MMA group the loop commits (UTCBAR) is waited on in the same
    iteration (SYNCS.PHASECHK), one CTA's MMAs do not overlap its own instructions, so its tile takes issue +
    tensor cycles, and the other CTAs on the SM (as many as TMEM, registers and shared memory let in) fill the
    gaps. sm_120a: each warp waits for its own mma.sync results, and the other warps on its scheduler fill the
    gaps. With n such streams: max(issue, tensor, (issue + tensor) / n). MUFU.EX2 and the E2M1 conversion (its
    slow end) are pipe limits beside them. ``needed_steady`` is the steady-loop length (SASS instructions per
    thread and tile) at which this schedule would reach 2.0x (D128) / 1.2x (D64)."""
    gpu = MODEL_GPUS[cfg.arch]
    scores = cfg.block_m * cfg.block_n
    warps = cfg.num_warps
    threads = 32 * warps
    flops = 2 * scores * cfg.head_dim * 2 + 2 * scores * 16        # QK, PV, and the denominator MMA
    special = rep.steady_special
    ex2 = sum(n for op, n in special.items() if op.startswith("MUFU.EX2")) * threads
    cvt = sum(n for op, n in special.items() if op.startswith("F2FP") and "E2M1" in op) * threads   # not the MMAs
    issue = rep.steady_loop * warps / gpu["issue_warp_clk"]
    tensor = flops / gpu["fp4_flop_clk"]
    ctas = min(gpu["registers"] // max(rep.registers * threads, 1), gpu["shared_bytes"] // max(rep.shared, 1))
    if gpu["tmem_columns"]:
        ctas = min(ctas, gpu["tmem_columns"] // max(rep.tmem_columns, 1))
        serial = rep.mma_waits >= rep.mma_commits > 0
        streams = ctas
    else:
        serial = True   # mma.sync: a warp's results are waited on by that warp
        streams = max(ctas, 1) * warps / SCHEDULERS
    overlapped = (issue + tensor) / max(streams, 1) if serial else 0.0
    cyc = {"tensor_fp4": tensor, "issue": issue, "ex2": ex2 / gpu["ex2_clk"],
           "e2m1_cvt": [cvt / gpu["cvt_clk_high"], cvt / gpu["cvt_clk_low"]], "schedule": overlapped}
    bound = max(tensor, issue, cyc["ex2"], cyc["e2m1_cvt"][1], overlapped)
    bf16 = 2 * scores * cfg.head_dim * 2 / gpu["bf16_flop_clk"] / gpu["bf16_fa_efficiency"]
    target = 2.0 if cfg.head_dim == 128 else 1.2
    # issue cycles allowed at the target: bf16/target, and where the MMAs are waited on, (issue + tensor)/streams
    # within it too
    allowed = bf16 / target
    if serial:
        allowed = min(allowed, allowed * max(streams, 1) - tensor)
    # attention FLOP per tile (4 x scores x D, the usual count) at the bound, over the GPU's SMs and clock
    tflops = 4 * scores * cfg.head_dim / bound * gpu["sms"] * gpu["clock_ghz"] * 1e-3
    return {"gpu": gpu["name"], "cycles_per_tile": cyc, "bound_cycles": bound, "bf16_fa_cycles": bf16,
            "modelled_tflops": tflops,
            "ctas_per_sm": ctas, "mma_streams": streams, "mma_serialised": serial,
            "modelled_speedup_vs_bf16": bf16 / bound, "per_score_instructions": rep.per_score, "target": target,
            "needed_steady": max(allowed, 0.0) * gpu["issue_warp_clk"] / warps}


def variants(arch: int, head_dims=(128, 64)) -> list[KernelConfig]:
    """The policy classes of one arch: (affine, m = 0) = fast/wan_fast, (native, anchored) =
    accurate/guard, per head dim (BF16 out; the FP16 build differs in the final store only)."""
    return [KernelConfig(d, "bf16", native, native, arch) for d in head_dims for native in (False, True)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fp4vis.kernels.blackwell.compile_check",
                                 description="Compile the Blackwell Direct-P kernel on the CPU and check its PTX/SASS.")
    ap.add_argument("--arch", default="sm_100a", choices=sorted(ARCH_BY_NAME))
    ap.add_argument("--head-dim", type=int, choices=(64, 128), action="append")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--keep", metavar="DIR", help="write PTX/TTGIR/SASS here")
    ap.add_argument("--model", action="store_true",
                    help="print the performance MODEL from the counts (sm_100a: B200, sm_120a: RTX 5090)")
    a = ap.parse_args(argv)
    arch = ARCH_BY_NAME[a.arch]
    reports = [inspect(cfg, a.keep) for cfg in variants(arch, tuple(a.head_dim or (128, 64)))]
    if a.json:
        print(json.dumps([dict(asdict(r), ok=r.ok) for r in reports], indent=1))
    else:
        for r in reports:
            print(f"{r.variant}: {'ok' if r.ok else 'FAIL'}  ({r.compile_s:.1f} s, shared {r.shared} B, "
                  f"{r.sass_total} SASS instructions, innermost loops {r.loops})")
            for k, n in r.mma_ptx.items():
                print(f"  PTX  {k}  x{n}")
            print(f"  SASS MMA {r.sass_mma}  e2m1x2 cvt x{r.e2m1_cvt}  fma.rn.f32x2 x{r.fma_x2}  "
                  f"LDL/STL {r.sass_local}")
            print(f"  steady loop {r.steady_loop} instructions ({r.per_score:.1f} per score): "
                  f"{dict(list(r.steady_mix.items())[:8])}; {r.steady_special}")
            print(f"  steady loop by role: {r.steady_roles}")
            if a.model and arch in MODEL_GPUS:
                cfg = next(c for c in variants(arch, tuple(a.head_dim or (128, 64))) if c.tag() == r.variant)
                m = gpu_model(cfg, r)
                c = m["cycles_per_tile"]
                waits = (f"MMAs {'waited in the loop' if m['mma_serialised'] else 'overlapped'} ({r.mma_commits} "
                         f"commits, {r.mma_waits} waits), {m['ctas_per_sm']} CTA/SM (TMEM {r.tmem_columns} cols, "
                         if r.tmem_columns else f"mma.sync waited per warp, {m['ctas_per_sm']} CTA/SM, "
                         f"{m['mma_streams']:.0f} warps per scheduler (")
                print(f"  MODEL ({m['gpu']}, not measured): cycles/tile tensor {c['tensor_fp4']:.0f}, "
                      f"issue {c['issue']:.0f}, ex2 {c['ex2']:.0f}, e2m1 cvt {c['e2m1_cvt'][0]:.0f}-"
                      f"{c['e2m1_cvt'][1]:.0f}; {waits}{r.registers} regs, {r.shared} B) -> schedule "
                      f"{c['schedule']:.0f} ({m['modelled_tflops']:.0f} TFLOP/s); BF16 FA {m['bf16_fa_cycles']:.0f} -> "
                      f"{m['modelled_speedup_vs_bf16']:.2f}x; "
                      f"{m['target']}x needs a steady loop <= {m['needed_steady']:.0f} instructions")
            elif a.model:
                print(f"  MODEL: none for {a.arch} (its GPU's rates are not modelled)")
            for msg in r.failures:
                print(f"  FAIL {msg}")
    return 0 if all(r.ok for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
