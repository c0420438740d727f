"""CPU compile checks of the warp-specialised Gluon Direct-P kernel (kernels/blackwell/gluon_ws.py; no GPU):
compiled for sm_100a, its PTX must hold the block-scaled FP4 tcgen05 MMAs (NVFP4 Q·Kᵀ, MXFP4 P·V with P in
TMEM), the hardware E2M1 conversion and the packed FMA, no local memory (no LDL/STL anywhere), and the SASS
must hold the four partitions the schedule relies on (two Direct-P warpgroups, an MMA warp, a load warp)."""

from __future__ import annotations

import functools
import re
import struct

import pytest

triton = pytest.importorskip("triton")

TRITON_38 = tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 8)
pytestmark = pytest.mark.skipif(not TRITON_38, reason="Gluon tcgen05_mma_scaled / warp_specialize as of Triton 3.8")


# every build the backend can ask for: head dim, output dtype, per-batch key counts
BUILDS = [(d, dt, kl) for d in (128, 64) for dt in ("bf16", "fp16") for kl in (False, True)]


def _build_id(build):
    d, dt, kl = build
    return f"d{d}-{dt}" + ("-key_lengths" if kl else "")


@functools.cache
def _compiled(head_dim, out_dtype="bf16", key_lengths=False):
    """Each build compiled once per test session (the tests below share them)."""
    from fp4vis.kernels.blackwell import gluon_ws
    return gluon_ws.compile_for_target(head_dim, out_dtype=out_dtype, key_lengths=key_lengths)


@functools.cache
def _report(build):
    from fp4vis.kernels.blackwell import gluon_ws_check
    d, dt, kl = build
    return gluon_ws_check.inspect_ws(d, out_dtype=dt, key_lengths=kl, kernel=_compiled(d, dt, kl))


@pytest.fixture(scope="module", params=[128, 64], ids=["d128", "d64"])
def report(request):
    return _report((request.param, "bf16", False))


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
    from fp4vis.kernels.blackwell import gluon_ws_check
    m = gluon_ws_check.ws_model(report)
    c = m["cycles_per_tile"]
    assert c["tensor_fp4"] == m["flops_per_tile"] / 32768
    assert m["bound_cycles"] == max(c["tensor_fp4"], c["issue"], c["ex2"], c["e2m1_cvt"][1], c["direct_p_chain"])
    assert m["modelled_speedup_vs_bf16"] == pytest.approx(m["bf16_fa_cycles"] / m["bound_cycles"])


@pytest.mark.parametrize("head_dim", [128, 64])
def test_direct_p_float_ops_match_kernel_py(head_dim):
    """The same float32 operations per score as kernel.py's fast build (same constants, the same contractions into
    fma, the same saturation compare e + 127 > 254 per block), but for the count of the saturated blocks, which this
    kernel keeps in float32 (a select of 1.0 and an add per block; kernel.py's is an int32 sum)."""
    from fp4vis.kernels.blackwell import gluon_ws_check, kernel
    from fp4vis.kernels.blackwell.config import KernelConfig
    ref, ref_imm = gluon_ws_check.direct_p_float_ops(
        kernel.compile_for_target(KernelConfig(head_dim, "bf16", False, False, 100)).asm["ptx"])
    ws, ws_imm = gluon_ws_check.direct_p_float_ops(_compiled(head_dim).asm["ptx"])
    assert ref["setp.gt.f32"] == ws["setp.gt.f32"] == 1 / 32
    ref["selp.f32"] += 1 / 32
    ref["add.f32"] += 1 / 32
    assert ws == ref
    assert ws_imm == ref_imm | {"0f3F800000"}   # the count's 1.0


def _fake_operands(head_dim, heads=2, sq=256, skv=384):
    import torch

    from fp4vis.kernels.blackwell.prepass import KernelOperands
    g = torch.Generator().manual_seed(head_dim)

    def rnd(*shape):
        return torch.randint(0, 255, shape, generator=g, dtype=torch.uint8)
    return KernelOperands(rnd(heads, sq, head_dim // 2), rnd(heads, sq, head_dim // 16).view(torch.float8_e4m3fn),
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


# ---------------------------------------------------------------------------------------------
# the builds the backend calls: range record, per-batch key counts, NUM_KEYS = 0, FP16 output
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("build", BUILDS, ids=_build_id)
def test_every_build_compiles_without_local_memory(build):
    """Each (head dim, output dtype, key counts) build: the four partitions, 12 warps, no LDL/STL anywhere, the
    output converted to its dtype (and not to the other), KEY_LENS read once where KEY_LENGTHS and never
    otherwise."""
    rep = _report(build)
    d, dt, kl = build
    assert sorted(p["role"] for p in rep["partitions"]) == ["direct_p", "direct_p", "load", "mma"]
    assert rep["num_warps"] == 12 and rep["tmem_columns"] <= 512
    assert rep["local_ptx"] == 0 and rep["sass_local"] == 0
    ptx = _compiled(*build).asm["ptx"]
    ptx_type = {"bf16": "bf16", "fp16": "f16"}
    other = {"bf16": "fp16", "fp16": "bf16"}[dt]
    assert re.search(rf"cvt\.rn\.{ptx_type[dt]}x2\.f32", ptx)
    assert not re.search(rf"cvt\.rn\.{ptx_type[other]}x2\.f32", ptx)
    # the one global load of the kernel (the operands come by TMA): this element's key count
    assert len(re.findall(r"ld\.global", ptx)) == (1 if kl else 0)


def test_sm103a_builds_too():
    """sm_103a (B300) is in WARP_SPECIALIZED_ARCHS: its build has the same block-scaled MMAs and no local memory."""
    from fp4vis.kernels.blackwell import gluon_ws
    from fp4vis.kernels.blackwell.config import WARP_SPECIALIZED_ARCHS

    assert 103 in WARP_SPECIALIZED_ARCHS
    k = gluon_ws.compile_for_target(128, arch=103)
    ptx = k.asm["ptx"]
    assert "kind::mxf4nvf4.block_scale.block16" in ptx and "kind::mxf4.block_scale.block32" in ptx
    assert ".local" not in ptx and ".target sm_103a" in ptx


def _param_of(ptx, name):
    """The PTX register holding the kernel's scalar argument ``name`` (ld.param of its index)."""
    from fp4vis.kernels.blackwell import gluon_ws
    names = list(gluon_ws.signature(128))
    # each descriptor argument is passed as many params; count from the end, where the scalars are
    index = re.findall(r"\.param \.\w+ direct_p_ws_fwd_param_(\d+)", ptx)
    last = max(int(i) for i in index)
    scalars = [n for n in names if not n.endswith("_desc") and n not in ("D", "KEY_LENGTHS")]
    pi = last - (len(scalars) - 1 - scalars.index(name))
    m = re.search(rf"ld\.param\.b32\s+(%r\d+), \[direct_p_ws_fwd_param_{pi}\];", ptx)
    assert m, (name, pi)
    return m.group(1)


def _blocks(ptx):
    """The kernel's PTX as basic blocks: label -> lines, and label -> successors (label, predicate, negated): the
    edge is taken where the predicate is true (negated: false); (label, None, False) an unconditional edge."""
    body = ptx[ptx.index("direct_p_ws_fwd("):]
    body = body[body.index("{"):]
    order, blocks, cur = [], {}, "entry"
    order.append(cur)
    blocks[cur] = []
    for line in body.splitlines():
        if m := re.match(r"^(\$L__BB\d+_\d+):|^// (%bb\.\d+):", line):   # a block without a label: a comment
            cur = m.group(1) or m.group(2)
            order.append(cur)
            blocks[cur] = []
        else:
            blocks[cur].append(line)
    # the workers' dispatch: brx.idx over a branch table, each target an unconditional edge
    tables = {m.group(1): re.findall(r"\$L__BB\d+_\d+", m.group(2))
              for m in re.finditer(r"(\$L_brx_\d+): \.branchtargets([^;]*);", body)}
    succ = {}
    for i, name in enumerate(order):
        edges, falls, cond = [], True, (None, False)
        for line in blocks[name]:
            if m := re.match(r"^\s*brx\.idx\s+%r\d+, (\$L_brx_\d+);", line):
                edges += [(target, None, False) for target in tables[m.group(1)]]
                falls = False
            elif m := re.match(r"^\s*(?:@(!?)(%p\d+)\s+)?bra(?:\.uni)?\s+(\$L__BB\d+_\d+);", line):
                neg, pred, target = m.groups()
                if pred is None:   # taken where the conditional branch before it (if any) is not
                    edges.append((target,) + cond)
                    falls = False
                else:
                    edges.append((target, pred, neg == "!"))
                    cond = (pred, neg != "!")
            elif re.match(r"^\s*(ret|exit);", line):
                falls = False
        if falls and i + 1 < len(order):
            edges.append((order[i + 1],) + cond)
        succ[name] = edges
    return blocks, succ


def _reachable(blocks, succ, known):
    """Blocks reachable from the entry where the predicates in ``known`` (register -> bool) have those values."""
    seen, todo = {"entry"}, ["entry"]
    while todo:
        b = todo.pop()
        for target, pred, neg in succ[b]:
            if pred in known and known[pred] == neg:   # a branch that is never taken
                continue
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


@pytest.mark.parametrize("build", [(128, "bf16", False), (64, "fp16", True)], ids=_build_id)
def test_record_atomics_guarded_by_call_and_thread_0(build):
    """The range record's writes are kernel.py's (three adds, a min of CALL, CALL stored into FLAG) and the
    pre-pass's scale-range decision (``kernels/scale_record.py``: the call's ten words taken, then per operand an
    add, a min of CALL and the flag), issued by thread 0 only, outside every loop, and unreachable where CALL = 0
    (the predicates that test CALL fixed, every other branch free), reachable where CALL > 0; the non-finite test
    uses the output dtype's overflow limit."""
    from fp4vis.formats import OVERFLOW_BF16, OVERFLOW_FP16
    d, dt, kl = build
    ptx = _compiled(*build).asm["ptx"]
    call = _param_of(ptx, "CALL")
    adds = re.findall(r"@(%p\d+) atom\.global\.gpu\.acq_rel\.add\.u32", ptx)
    mins = re.findall(rf"@(%p\d+) atom\.global\.gpu\.acq_rel\.min\.s32 %r\d+, \[ %rd\d+ \+ 0 \], {call};", ptx)
    flag = re.findall(rf"@(%p\d+) st\.global\.b32 \[ %rd\d+ \+ 0 \], \{{ {call} \}};", ptx)
    taken = re.findall(r"@(%p\d+) atom\.global\.gpu\.acq_rel\.exch\.b32", ptx)
    assert len(adds) == 3 + 3 and len(mins) == 1 + 3 and len(flag) == 1 + 3 and len(taken) == 10
    assert len(re.findall(r"\batom\.|\bred\.", ptx)) == 4 + 16
    (record,) = {*adds[:3], mins[0], flag[0]}   # kernel.py's writes: one predicate
    assert adds[3:] == mins[1:] == flag[1:]     # the decision's report: one predicate per operand
    for pred in {record, *taken}:
        tid = re.search(rf"setp\.eq\.[bs]32\s+{pred}, (%r\d+), 0;", ptx)
        assert tid and re.search(rf"mov\.u32 {tid.group(1)}, %tid\.x;", ptx)
    # the predicates on CALL, as CALL = 0 and CALL = 1 fix them
    blocks, succ = _blocks(ptx)
    where = {name for name, lines in blocks.items() if any("atom.global" in x for x in lines)}
    assert where
    assert not where & _reachable(blocks, succ, _fold(ptx, {call: 0}))
    assert where <= _reachable(blocks, succ, _fold(ptx, {call: 1}))
    limit = OVERFLOW_FP16 if dt == "fp16" else OVERFLOW_BF16
    assert f"0f{struct.unpack('<I', struct.pack('<f', limit))[0]:08X}" in ptx
    # no atomic or global store inside any loop (the steady loops record nothing)
    for p in _report(build)["partitions"]:
        assert not any(op.startswith(("ATOM", "RED", "STG")) for op in p["mix"]), p["role"]


_INT = re.compile(r"^\s*(add|sub|mul\.lo|mul\.wide|shl|shr|and|or|xor|not|min|max|div|rem|neg|mov|selp|setp\.\w+)"
                  r"(?:\.[a-z0-9]+)*\s+(%\w+),\s*([^;]+);")


def _fold(ptx, known):
    """Integer and predicate registers of the PTX whose values follow from ``known`` (register -> int): each
    register defined once, folded through add/sub/mul/shifts/logic/div/selp/setp/mov (a register defined more than
    once, e.g. a loop's, stays unknown); a word stored to shared memory at a fixed address and loaded back there
    (how a partition receives a captured value) keeps its value."""
    defs = {}
    for line in ptx.splitlines():
        for dst in re.findall(r"^\s*(?:@!?%p\d+\s+)?[a-z][\w.:]*\s+(%\w+)\s*,", line):
            defs[dst] = defs.get(dst, 0) + 1
        for dst in re.findall(r"\{\s*(%r\d+)\s*\}", line):   # inline asm results
            defs[dst] = defs.get(dst, 0) + 1
    vals = dict(known)
    st = re.finditer(r"st\.shared\.b32\s+\[(global_smem\+\d+)\],\s*(%r\d+);", ptx)
    stores = {m.group(2): m.group(1) for m in st}
    slot = {stores[r]: r for r in known if r in stores}
    ld = re.finditer(r"ld\.shared\.b32\s+(%r\d+),\s*\[(global_smem\+\d+)\];", ptx)
    loads = [(m.group(1), m.group(2)) for m in ld]

    def val(x):
        x = x.strip()
        if x in vals:
            return vals[x]
        if re.fullmatch(r"-?\d+", x):
            return int(x)
        if re.fullmatch(r"0x[0-9a-fA-F]+", x):
            return int(x, 16)
        return None

    lines = [m.groups() for line in ptx.splitlines() if (m := _INT.match(line))]
    # two 32-bit words packed into a 64-bit register and unpacked again
    packs = re.findall(r"mov\.b64\s+(%rd\d+),\s*\{(%r\d+),\s*(%r\d+)\};", ptx)
    unpacks = re.findall(r"mov\.b64\s+\{(%r\d+|_),\s*(%r\d+|_)\},\s*(%rd\d+);", ptx)
    for lo, hi, _ in unpacks:
        for r in (lo, hi):
            defs[r] = defs.get(r, 0) + 1
    for _ in range(8):
        for dst, addr in loads:
            if addr in slot and defs.get(dst) == 1:
                vals[dst] = vals[slot[addr]]
        for dst, lo, hi in packs:
            if defs.get(dst) == 1 and lo in vals and hi in vals:
                vals[dst] = (vals[lo], vals[hi])
        for lo, hi, src in unpacks:
            for i, r in enumerate((lo, hi)):
                if r != "_" and defs.get(r) == 1 and isinstance(vals.get(src), tuple):
                    vals[r] = vals[src][i]
        for op, dst, srcs in lines:
            if dst in vals or defs.get(dst) != 1:
                continue
            args = [val(x) for x in srcs.split(",")]
            if any(a is None for a in args):
                continue
            base = op.split(".")[0]
            r = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
                 "shl": lambda a, b: a << b, "and": lambda a, b: a & b, "or": lambda a, b: a | b,
                 "xor": lambda a, b: a ^ b, "min": min, "max": max, "mov": lambda a: a, "neg": lambda a: -a,
                 "not": (lambda a: not a) if dst.startswith("%p") else (lambda a: ~a)}.get(base)
            if base == "shr":
                r = (lambda a, b: a >> b) if ".s" in op or op.endswith("s32") else (lambda a, b: (a & 0xFFFFFFFF) >> b)
            elif base in ("div", "rem"):
                def r(a, b, base=base):
                    q = abs(a) // abs(b) * (1 if (a >= 0) == (b >= 0) else -1)
                    return q if base == "div" else a - q * b
            elif base == "selp":
                def r(a, b, c):
                    return a if c else b
            elif base == "setp":
                cmp = op.split(".")[1]
                r = {"lt": lambda a, b: a < b, "le": lambda a, b: a <= b, "gt": lambda a, b: a > b,
                     "ge": lambda a, b: a >= b, "eq": lambda a, b: a == b, "ne": lambda a, b: a != b}.get(cmp)
            if r is None:
                continue
            try:
                vals[dst] = bool(r(*args)) if dst.startswith("%p") else r(*args)
            except (TypeError, ZeroDivisionError):
                continue
    return {k: v for k, v in vals.items() if k.startswith("%p")}


def _num_keys_reg(ptx, key_lengths):
    if key_lengths:   # the value KEY_LENS gives (inline asm ld.global)
        m = re.search(r"ld\.global\.b32\s+\{\s*(%r\d+)\s*\}", ptx)
        assert m
        return m.group(1)
    return _param_of(ptx, "NUM_KEYS")


_ASYNC = re.compile(r"mbarrier\.try_wait|tcgen05\.mma|tcgen05\.commit|cp\.async\.bulk\.tensor|tcgen05\.cp")


@pytest.mark.parametrize("build", [(128, "bf16", False), (64, "bf16", True)], ids=_build_id)
def test_no_key_tile_does_nothing(build):
    """NUM_KEYS = 0 (an element whose mask keeps nothing): with the key count fixed at 0 (the argument, or the
    word read from KEY_LENS and the copies the partitions receive) and every other branch free, no block that
    waits on an mbarrier, issues a TMA load or a tcgen05 copy/MMA/commit is reachable, so no partition waits for
    loads that never come or a commit that never arrives; with keys they all are."""
    ptx = _compiled(*build).asm["ptx"]
    nk = _num_keys_reg(ptx, build[2])
    blocks, succ = _blocks(ptx)
    async_blocks = {name for name, lines in blocks.items() if any(_ASYNC.search(x) for x in lines)}
    assert async_blocks
    assert not async_blocks & _reachable(blocks, succ, _fold(ptx, {nk: 0}))
    # with keys, each of them is reachable for some key count (one tile, two, a peeled tile of either warpgroup)
    assert async_blocks <= set().union(*(_reachable(blocks, succ, _fold(ptx, {nk: n})) for n in (1, 200, 300, 4097)))
    # the epilogue's output of that case: den and acc by the tile count (selects on NUM_KEYS > 0), not from TMEM
    assert re.search(rf"setp\.(gt|lt)\.s32\s+%p\d+, {nk}, [01];", ptx)


# ---------------------------------------------------------------------------------------------
# the launch interface the backend calls (the kernel replaced by a recorder: no GPU here)
# ---------------------------------------------------------------------------------------------

class _Recorder:
    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.calls.append((grid, args, kwargs))
        return run


def _params(**kw):
    from fp4vis.policy import KernelParams
    base = dict(s_log2=0.18, margin_raw=0.0, affine_a=1.0, affine_b=0.5, shift=2, native_exp2=False, anchor=0,
                qk_layout="block16", code_rounding="exact")
    return KernelParams(**{**base, **kw})


@pytest.mark.parametrize("masked", [False, True], ids=["all-keys", "key-lengths"])
@pytest.mark.parametrize("out_dtype", ["bf16", "fp16"])
def test_launch_arguments_follow_runtime_args(monkeypatch, masked, out_dtype):
    """``launch(ops, out, params, record, key_lengths, heads)`` passes what ``kernel.runtime_args`` does, in this
    kernel's signature order: the record's fields, flag and number (or int32 stand-ins and CALL = 0), the key counts
    with KEY_LENGTHS on (or a stand-in with it off), HEADS, the policy's numbers; grid (row tiles, G)."""
    import torch

    from fp4vis.call import RecordSlot
    from fp4vis.kernels.blackwell import gluon_ws
    rec = _Recorder()
    monkeypatch.setattr(gluon_ws, "direct_p_ws_fwd", rec)
    ops = _fake_operands(128, heads=4)
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[out_dtype]
    out = torch.empty(4, ops.seq_q, 128, dtype=dt)
    fields, flag = torch.zeros(16, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    lens = torch.tensor([300, 0], dtype=torch.int32) if masked else None
    gluon_ws.launch(ops, out, _params(), record=None, key_lengths=lens, heads=2)
    gluon_ws.launch(ops, out, _params(), record=RecordSlot(fields, flag, 7), key_lengths=lens, heads=2)
    sig = gluon_ws.signature(128, out_dtype)
    names = [n for n, t in sig.items() if t != "constexpr"]
    for (grid, args, kwargs), call in zip(rec.calls, (0, 7)):
        assert grid == (ops.rows_q // 128, 4)
        assert len(args) == len(names)
        a = dict(zip(names, args))
        assert a["OUT"] is out
        assert {"D": 128, "KEY_LENGTHS": masked}.items() <= kwargs.items()
        assert a["CALL"] == call and a["HEADS"] == 2 and a["NUM_KEYS"] == ops.num_keys
        assert (a["SQ"], a["SQP"], a["SKP"]) == (ops.seq_q, ops.rows_q, ops.keys)
        assert (a["s_log2"], a["affine_a"], a["affine_b"], a["shift"]) == (0.18, 1.0, 0.5, 2)
        for name in ("REC", "FLAG", "KEY_LENS"):
            assert a[name].dtype == torch.int32
        if call:
            assert a["REC"] is fields and a["FLAG"] is flag
        if masked:
            assert a["KEY_LENS"] is lens
        for name in ("q_desc", "qs_desc", "k_desc", "ks_desc", "v_desc", "vs_desc"):
            assert a[name].__mangle__() == sig[name]


def test_launch_refuses_what_the_kernel_does_not_compute(monkeypatch):
    import torch

    from fp4vis.kernels.blackwell import gluon_ws
    monkeypatch.setattr(gluon_ws, "direct_p_ws_fwd", _Recorder())
    ops = _fake_operands(64)
    out = torch.empty(2, ops.seq_q, 64, dtype=torch.bfloat16)
    with pytest.raises(AssertionError, match="anchors"):
        gluon_ws.launch(ops, out, _params(anchor=128))
    with pytest.raises(AssertionError, match="native exp2"):
        gluon_ws.launch(ops, out, _params(native_exp2=True))
    with pytest.raises(AssertionError, match="bf16 or fp16"):
        gluon_ws.launch(ops, out.float(), _params())


def test_jit_specialises_as_compile_for_target():
    """The JIT compiles what compile_for_target does: no value specialisation of the arguments that vary from call
    to call (SQ, the key count, HEADS, the call number: no new build per call number or key count), no alignment
    specialisation of the record's words and the key counts (compile_for_target gives only OUT's)."""
    from fp4vis.kernels.blackwell import gluon_ws
    f = gluon_ws.direct_p_ws_fwd
    assert {p.name for p in f.params if p.do_not_specialize} == {"SQ", "NUM_KEYS", "HEADS", "CALL"}
    assert {p.name for p in f.params if p.do_not_specialize_on_alignment} == {"REC", "FLAG", "KEY_LENS"}
