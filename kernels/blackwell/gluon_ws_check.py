"""The compile-level check of the warp-specialised Gluon kernel (``gluon_ws.py``): what its sm_100a SASS says per
partition (``inspect_ws``), the B200 MODEL of that schedule (``ws_model``, ``compile_check``'s constants), and the
float32 operations of its Direct-P loop against ``kernel.py``'s (``direct_p_float_ops``).

CLI: ``python -m fp4vis.kernels.blackwell.gluon_ws_check [--keep DIR] [--json] [--out-dtype fp16] [--key-lengths]``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections import Counter

from . import compile_check as cc
from .compile_check import B200
from .gluon_ws import compile_for_target

# ---------------------------------------------------------------------------------------------
# what the SASS says, per partition, and the B200 MODEL of it (compile_check's constants)
# ---------------------------------------------------------------------------------------------

# per partition: warps, tiles per loop iteration (the MMA loop is unrolled by two), tiles it handles of each
# tile (the two Direct-P warpgroups alternate: each runs its loop on every other tile)
PARTITIONS = {"direct_p": (4, 1, 0.5), "mma": (1, 2, 1.0), "load": (1, 1, 1.0)}


def _role(ops: list[str]) -> str | None:
    if any(op.startswith("LDTM") for op in ops) and any("E2M1" in op for op in ops):
        return "direct_p"
    if any(op.startswith("UTCOMMA") or op.startswith("UTCQMMA") for op in ops):
        return "mma"
    if any(op.startswith("UTMALDG") for op in ops):
        return "load"
    return None


def inspect_ws(head_dim: int, keep_dir: str | None = None, out_dtype: str = "bf16", key_lengths: bool = False,
               kernel=None) -> dict:
    """Compile for sm_100a (or take ``kernel``, the CompiledKernel of these arguments) and read the facts the model
    needs from PTX/SASS (compile_check's helpers)."""


    t0 = time.perf_counter()
    k = kernel if kernel is not None else compile_for_target(head_dim, out_dtype=out_dtype, key_lengths=key_lengths)
    ptx, cubin = k.asm["ptx"], k.asm["cubin"]
    sass = cc.sass_of(cubin)
    if keep_dir:
        os.makedirs(keep_dir, exist_ok=True)
        for ext, text in (("ptx", ptx), ("ttgir", k.asm["ttgir"]), ("sass", sass)):
            tag = f"d{head_dim}_{out_dtype}" + ("_key_lengths" if key_lengths else "")
            with open(os.path.join(keep_dir, f"gluon_ws_{tag}.{ext}"), "w") as f:
                f.write(text)
    lines = sass.splitlines()
    parts = []
    for a, b in cc.innermost_spans(sass):
        ops = [op for i in range(a, b + 1) if (op := cc.sass_op(lines[i]))]
        role = _role(ops)
        if role is None:
            continue
        warps, tiles_per_iter, share = PARTITIONS[role]
        parts.append(dict(
            role=role, warps=warps, loop=len(ops), tiles_per_iteration=tiles_per_iter, share_of_tiles=share,
            per_tile=len(ops) / tiles_per_iter, roles=cc.steady_roles(ops),
            mix=dict(Counter(op.split(".")[0] for op in ops).most_common()),
            special=dict(Counter(op for op in ops if op.startswith(("MUFU", "F2FP", "UTC", "STTM", "LDTM", "UTMA",
                                                                   "SYNCS.PHASECHK", "SYNCS.ARRIVE")))),
            local=sum(1 for op in ops if op.split(".")[0] in ("LDL", "STL")),
            mma_waits=sum(1 for op in ops if op.startswith("SYNCS.PHASECHK")),
            mma_commits=sum(1 for op in ops if op.startswith("UTCBAR"))))
    all_ops = cc.SASS_OP.findall(sass)
    return dict(
        head_dim=head_dim, out_dtype=out_dtype, key_lengths=key_lengths, compile_s=time.perf_counter() - t0,
        mma_ptx=dict(Counter(cc.MMA_PTX.findall(ptx))),
        mma_a_from_tmem=len(re.findall(r"tcgen05\.mma[\w.:]*kind::mxf4\.block_scale[\w.:]*\s+\[[^\]]+\],\s*\[", ptx)),
        e2m1_cvt=len(re.findall(r"cvt\.rn\.satfinite\.relu\.e2m1x2\.f32", ptx)),
        fma_x2=len(re.findall(r"fma\.rn\.f32x2", ptx)),
        local_ptx=len(re.findall(r"\.local\b", ptx)),
        sass_local=sum(1 for op in all_ops if op.split(".")[0] in ("LDL", "STL")),
        sass_total=len(all_ops),
        registers=cc.register_count(cubin),
        setmaxnreg=sorted({int(n, 16) for n in re.findall(r"USETMAXREG\.\w+\.CTAPOOL (?:U?P\d+, )?0x([0-9a-f]+)",
                                                           sass)}),
        num_warps=k.metadata.num_warps, tmem_columns=k.metadata.tmem_size, shared=k.metadata.shared,
        partitions=parts)


def ws_model(rep: dict) -> dict:
    """compile_check.gpu_model's B200 constants applied to the warp-specialised schedule, per 128 x 128 tile:
    tensor (the MMAs' FLOPs at the FP4 rate), issue (every partition's loop instructions per tile, times its
    warps, over 4 schedulers), MUFU.EX2, the E2M1 conversion (16-64/clk: the unpublished rate; the bound takes
    the slow end, as gpu_model does) and the Direct-P chain (one warpgroup runs a tile's loop with one warp
    per scheduler: at best one instruction a clock, and the two warpgroups alternate tiles: loop / 2).
    No (issue + tensor) / CTAs term: the MMAs are issued by their own warp and the Direct-P warps wait only for
    S of their tile (which QK_{j+2} computes while they work on tile j), never for the P·V MMAs they feed."""

    d = rep["head_dim"]
    scores = 128 * 128
    n_pv = 128 if d == 64 else d + 16      # D = 64: V and the 1.0 block in one N = 128 MMA; D = 128: N = 128 + 16
    flops = 2 * scores * d + 2 * scores * n_pv
    tensor = flops / B200["fp4_flop_clk"]
    warp_instr = sum(p["per_tile"] * p["warps"] * p["share_of_tiles"] for p in rep["partitions"])
    # the Direct-P loops: two warpgroups, each its own loop; per tile one of them runs
    dp = [p for p in rep["partitions"] if p["role"] == "direct_p"]
    issue = warp_instr / B200["issue_warp_clk"]
    threads_dp = 128
    ex2 = sum(n for p in dp for op, n in p["special"].items() if op.startswith("MUFU.EX2")) / len(dp) * threads_dp
    cvt = sum(n for p in dp for op, n in p["special"].items() if "E2M1" in op) / len(dp) * threads_dp
    chain = max(p["loop"] for p in dp) / 2
    cyc = {"tensor_fp4": tensor, "issue": issue, "ex2": ex2 / B200["ex2_clk"],
           "e2m1_cvt": [cvt / B200["cvt_clk_high"], cvt / B200["cvt_clk_low"]], "direct_p_chain": chain}
    bound = max(tensor, issue, cyc["ex2"], cyc["e2m1_cvt"][1], chain)
    bound_fast_cvt = max(tensor, issue, cyc["ex2"], cyc["e2m1_cvt"][0], chain)
    bf16 = 2 * scores * d * 2 / B200["bf16_flop_clk"] / B200["bf16_fa_efficiency"]
    names = {tensor: "tensor", issue: "issue", cyc["e2m1_cvt"][1]: "e2m1 cvt at 16/clk", chain: "Direct-P chain",
             cyc["ex2"]: "MUFU.EX2"}
    return {"cycles_per_tile": cyc, "warp_instructions_per_tile": warp_instr, "bound_cycles": bound,
            "bound_by": names[bound], "bound_cycles_cvt_64": bound_fast_cvt, "bf16_fa_cycles": bf16,
            "modelled_speedup_vs_bf16": bf16 / bound, "modelled_speedup_cvt_64": bf16 / bound_fast_cvt,
            "target": 2.0 if d == 128 else 1.2, "flops_per_tile": flops}


def direct_p_float_ops(ptx: str) -> tuple[dict, set]:
    """Float32 operations of the Direct-P loop in PTX: (opcode -> count per score, the float32 immediates the loop
    uses). A packed ``.f32x2`` op counts as two lanes of its scalar opcode (its constants come through registers,
    hence the immediates as one set). The loop is the innermost PTX loop holding the E2M1 conversion; a thread's
    scores are its conversions x 2. Compares this kernel's Direct-P with kernel.py's: the same operations in the
    same number, the same constants, the same contractions into fma."""
    lines = ptx.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^(\$L__BB\d+_\d+):", line))}
    body = None
    for i, line in enumerate(lines):
        m = re.search(r"bra(?:\.uni)?\s+(\$L__BB\d+_\d+);", line)
        if m and labels.get(m.group(1), i) < i:
            cand = lines[labels[m.group(1)]:i + 1]
            if any("e2m1x2" in x for x in cand) and (body is None or len(cand) < len(body)):
                body = cand
    op_re = re.compile(r"^\s*(?:@%p\d+\s+)?((?:max|min|fma|add|sub|mul|cvt|selp|setp|neg|abs)\.[\w.]*f32[\w.]*)\s")
    counts = Counter()
    for line in body or ():
        if m := op_re.match(line):
            op = m.group(1)
            packed = op.endswith("f32x2") and "e2m1x2" not in op
            counts[op[:-2] if packed else op] += 2 if packed else 1
    scores = 2 * counts.get("cvt.rn.satfinite.relu.e2m1x2.f32", 0)
    imms = {x for line in body or () for x in re.findall(r"0f[0-9A-F]{8}", line)}
    return ({k: n / scores for k, n in counts.items()} if scores else {}), imms


def main(argv=None) -> int:
    """``python -m fp4vis.kernels.blackwell.gluon_ws_check [--keep DIR] [--out-dtype fp16] [--key-lengths]``: compile
    both head dims, print the SASS figures per partition and the MODEL."""
    ap = argparse.ArgumentParser(prog="python -m fp4vis.kernels.blackwell.gluon_ws_check")
    ap.add_argument("--keep", metavar="DIR")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out-dtype", choices=("bf16", "fp16"), default="bf16")
    ap.add_argument("--key-lengths", action="store_true", help="the key-masked build (per-batch key counts)")
    a = ap.parse_args(argv)
    out = []
    for d in (128, 64):
        rep = inspect_ws(d, a.keep, a.out_dtype, a.key_lengths)
        rep["model"] = ws_model(rep)
        out.append(rep)
        if a.json:
            continue
        m = rep["model"]
        c = m["cycles_per_tile"]
        build = f"D{d} {a.out_dtype}" + (" key lengths" if a.key_lengths else "")
        print(f"gluon_ws fast {build}: {rep['compile_s']:.1f} s, {rep['num_warps']} warps, {rep['registers']} regs "
              f"(setmaxnreg {rep['setmaxnreg']}), TMEM {rep['tmem_columns']} cols, shared {rep['shared']} B, "
              f"LDL/STL {rep['sass_local']} (in loops {sum(p['local'] for p in rep['partitions'])})")
        for k_, n in rep["mma_ptx"].items():
            print(f"  PTX  {k_}  x{n}")
        print(f"  P·V / denominator MMAs with A (P) in TMEM: {rep['mma_a_from_tmem']}; e2m1x2 cvt x{rep['e2m1_cvt']}; "
              f"fma.rn.f32x2 x{rep['fma_x2']}")
        for p in rep["partitions"]:
            print(f"  {p['role']:9s} {p['warps']} warps: loop {p['loop']} instr / {p['tiles_per_iteration']} tile(s) "
                  f"-> {p['per_tile']:.1f} per tile, runs on {p['share_of_tiles']:.0%} of tiles; waits "
                  f"{p['mma_waits']}, commits {p['mma_commits']}; {p['roles']}")
        print(f"  MODEL (B200, not measured): warp-instructions/tile {m['warp_instructions_per_tile']:.0f} -> issue "
              f"{c['issue']:.0f}; tensor {c['tensor_fp4']:.0f}; ex2 {c['ex2']:.0f}; e2m1 cvt {c['e2m1_cvt'][0]:.0f}-"
              f"{c['e2m1_cvt'][1]:.0f}; Direct-P chain {c['direct_p_chain']:.0f} -> bound {m['bound_cycles']:.0f} "
              f"({m['bound_by']}); BF16 FA {m['bf16_fa_cycles']:.0f} -> {m['modelled_speedup_vs_bf16']:.2f}x "
              f"({m['modelled_speedup_cvt_64']:.2f}x with the conversion at 64/clk); target {m['target']}x")
    if a.json:
        print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
