"""Compile a Hopper kernel variant for sm_90a on any machine (no GPU, no driver) and inspect it.

``compile_variant(cfg)`` traces and compiles ``DirectPAttentionSm90(cfg)`` with fake tensors and a
fake stream, keeps the cubin in a temporary dump directory, disassembles it with ``nvdisasm`` (PyPI
wheel ``nvidia-cuda-nvdisasm``, a dev dependency) and returns a ``CompileReport``: registers,
spill bytes, stack frame, shared memory, instruction counts (HGMMA, QGMMA, MUFU.EX2, local memory
traffic, total) and the compile time. CI uses it to assert, per variant, that the kernel compiles,
does not spill, uses the tensor cores (HGMMA), and that the exp-free policies contain no MUFU.EX2.

CLI: ``python -m fp4vis.kernels.compile_check [--arch sm_90a] [--policy fast] [--head-dim 128] [--json] [--schedule]``
(``--schedule``: ptxas's static schedule of the ping-pong loop's Direct-P, ``direct_p_schedule``).

The Triton pre-pass compiles the same way (``compile_triton_sm90``: Triton's own compiler and ptxas,
no GPU); ``--triton-prepass`` prints the instruction count of the NVFP4 scale search's candidate loop
and the search's instructions per value per head dim, warps, E2M1 code form and search (the contenders,
or every candidate: ``prepass_search_per_value``).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

ARCH = "sm_90a"


@dataclass
class CompileReport:
    variant: dict
    compile_s: float
    registers: int | None = None
    spill_store_bytes: int | None = None
    spill_load_bytes: int | None = None
    stack_frame_bytes: int | None = None
    shared_bytes: int | None = None
    counts: dict = field(default_factory=dict)   # mnemonic (e.g. "HGMMA", "MUFU.EX2") -> count
    wgmma_serialized: bool = False                # ptxas C751x: WGMMAs forced to run one by one
    setmaxnreg: list = field(default_factory=list)  # [(DEALLOC | TRY_ALLOC | ..., registers)] in SASS order
    total_instructions: int = 0
    cubin: str | None = None
    ptxas_log: str = ""

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("ptxas_log", None)
        return d


def find_nvdisasm() -> str | None:
    """nvdisasm from PATH, else from the nvidia-cuda-nvdisasm wheel (nvidia/cu13/bin or cuda_nvdisasm)."""
    exe = shutil.which("nvdisasm")
    if exe:
        return exe
    try:
        import nvidia  # namespace package of the NVIDIA wheels
    except ImportError:
        return None
    for root in list(getattr(nvidia, "__path__", [])):
        for cand in glob.glob(os.path.join(root, "**", "bin", "nvdisasm"), recursive=True):
            if os.access(cand, os.X_OK):
                return cand
    return None


def _fake_args(cfg):
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    d = cfg.head_dim
    out_dt = cutlass.BFloat16 if cfg.out_dtype == "bf16" else cutlass.Float16

    def t(dtype, s_sym):
        # SDPA (B, H, S, D), D contiguous
        b, h = cute.sym_int32(), cute.sym_int32()
        return make_fake_tensor(dtype, (b, h, s_sym, d),
                                stride=(cute.sym_int64(divisibility=d), cute.sym_int64(divisibility=d), d, 1),
                                assumed_align=16)

    def scales(n_sym):
        # (B, H, N) float32, N contiguous
        return make_fake_tensor(cutlass.Float32, (cute.sym_int32(), cute.sym_int32(), n_sym),
                                stride=(cute.sym_int64(), cute.sym_int64(), 1), assumed_align=4)

    sq, skv = cute.sym_int32(), cute.sym_int32()
    qk_dt = cutlass.Uint8 if cfg.qk_fp8 else cutlass.BFloat16   # E4M3 bytes arrive as uint8
    q = t(qk_dt, sq)
    k = t(qk_dt, skv)
    v, v_scale = t(cutlass.BFloat16, skv), None
    if cfg.pv_fp8:   # V^T E4M3 bytes (B, H, D, S'), S' a multiple of 32; one float32 scale per channel
        sp = cute.sym_int32(divisibility=32)
        v = make_fake_tensor(cutlass.Uint8, (cute.sym_int32(), cute.sym_int32(), d, sp),
                             stride=(cute.sym_int64(divisibility=32), cute.sym_int64(divisibility=32),
                                     cute.sym_int64(divisibility=32), 1), assumed_align=16)
        v_scale = make_fake_tensor(cutlass.Float32, (cute.sym_int32(), cute.sym_int32(), d),
                                   stride=(cute.sym_int64(), cute.sym_int64(), 1), assumed_align=4)
    # O: any strides with D contiguous (the launcher's is (B, Sq, H, D) in memory: ``launch.output_like``)
    o = make_fake_tensor(out_dt, (cute.sym_int32(), cute.sym_int32(), sq, d),
                         stride=(cute.sym_int64(divisibility=d), cute.sym_int64(divisibility=d),
                                 cute.sym_int64(divisibility=d), 1), assumed_align=16)
    # a key-masked variant reads one int32 key count per batch element
    key_lens = (make_fake_tensor(cutlass.Int32, (cute.sym_int32(),), stride=(1,), assumed_align=4)
                if cfg.key_lengths else None)
    return (q, k, v, o, scales(sq), scales(cute.sym_int32()), key_lens, v_scale, cutlass.Float32(0.18),
            cutlass.Float32(0.0), cutlass.Int64(0), cutlass.Int64(0), cutlass.Int32(0), make_fake_stream())


def compile_variant(cfg, *, keep_dir: str | None = None, disassemble: bool = True) -> CompileReport:
    """Compile one ``KernelConfig`` for sm_90a and return its report (see module docstring)."""
    os.environ.setdefault("CUTE_DSL_ARCH", ARCH)
    import cutlass.cute as cute

    from .kernel import DirectPAttentionSm90

    dump = keep_dir or tempfile.mkdtemp(prefix="fp4vis_cc_")
    os.makedirs(dump, exist_ok=True)
    kernel = DirectPAttentionSm90(cfg)
    args = _fake_args(cfg)
    opts = f"--gpu-arch {ARCH} --keep-cubin --dump-dir {dump} remarks{{ptx}}"
    t0 = time.perf_counter()
    with _CaptureFds() as cap:
        compiled = cute.compile(kernel, *args, options=opts)
    dt = time.perf_counter() - t0
    rep = CompileReport(variant=dataclasses.asdict(cfg), compile_s=round(dt, 2))
    storage = getattr(kernel, "shared_storage", None)   # set while tracing: the dynamic shared memory
    if storage is not None:
        rep.shared_bytes = int(storage.size_in_bytes())
    cubins = sorted(glob.glob(os.path.join(dump, "**", "*.cubin"), recursive=True), key=os.path.getmtime)
    if not cubins:
        # 4.8.1 embeds the device binary in the host module instead of honouring --keep-cubin
        # for every pipeline: pull the ELF out of the module's `kernels_binary` global.
        path = os.path.join(dump, "kernel.sm_90a.cubin")
        with open(path, "wb") as fh:
            fh.write(extract_cubin(str(compiled.ir_module)))
        cubins = [path]
    rep.cubin = cubins[-1]
    if disassemble:
        _inspect_cubin(rep, rep.cubin)
    _parse_ptxas(rep, cap.text)
    if keep_dir is None:
        shutil.rmtree(dump, ignore_errors=True)
        rep.cubin = None
    return rep


def extract_cubin(module_text: str) -> bytes:
    """The first ELF image inside the MLIR module's ``kernels_binary`` constant (a fatbin)."""
    m = re.search(r'@kernels_binary\("((?:[^"\\]|\\.)*)"\)', module_text, re.S)
    if not m:
        raise RuntimeError("compiled module holds no kernels_binary")
    raw = m.group(1)
    out = bytearray()
    i = 0
    while i < len(raw):
        ch = raw[i]
        if ch == "\\":
            nxt = raw[i + 1]
            if nxt == "\\":
                out.append(0x5C)
                i += 2
            else:
                out.append(int(raw[i + 1:i + 3], 16))
                i += 3
        else:
            out.extend(ch.encode("latin-1"))
            i += 1
    data = bytes(out)
    start = data.find(b"\x7fELF")
    if start < 0:
        raise RuntimeError("no ELF image in kernels_binary")
    elf = data[start:]
    # ELF64 header: e_shoff at 0x28 (u64), e_shentsize at 0x3A, e_shnum at 0x3C (u16)
    shoff = int.from_bytes(elf[0x28:0x30], "little")
    shentsize = int.from_bytes(elf[0x3A:0x3C], "little")
    shnum = int.from_bytes(elf[0x3C:0x3E], "little")
    return elf[:shoff + shentsize * shnum]




# a SASS instruction line of nvdisasm: its address, an optional predicate, the opcode (group 2)
SASS_OPCODE = re.compile(r"\s*/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")


def _inspect_cubin(rep: CompileReport, cubin: str) -> None:
    nvd = find_nvdisasm()
    if nvd is None:
        raise RuntimeError("nvdisasm not found: pip install nvidia-cuda-nvdisasm (a dev dependency)")
    sass = subprocess.run([nvd, "-c", cubin], capture_output=True, text=True, check=True).stdout
    counts: Counter = Counter()
    total = 0
    for line in sass.splitlines():
        m = SASS_OPCODE.match(line)
        if not m:
            continue
        op = m.group(2)
        total += 1
        base = op.split(".")[0]
        counts[base] += 1
        if base in ("MUFU", "HGMMA", "QGMMA"):
            counts[".".join(op.split(".")[:2])] += 1
        if base == "USETMAXREG" and (m2 := re.search(r"(0x[0-9a-f]+)\s*;", line)):
            rep.setmaxnreg.append((op.split(".")[1], int(m2.group(1), 16)))
    rep.counts = dict(sorted(counts.items()))
    rep.total_instructions = total


def compile_triton_sm90(fn, signature: dict, constexprs: dict, num_warps: int,
                        max_registers: int | None = None) -> dict:
    """Compile the Triton kernel ``fn`` for sm_90 down to a cubin with Triton's bundled ptxas (no GPU
    needed), as it is built on the GPU (``enable_fp_fusion=False``; pointers 16-byte aligned, as the
    launcher's tensors are and as Triton specialises them: without that hint it lays the tiles out one
    element per thread, not the GPU build); returns its asm (``"cubin"``, ``"ptx"``, ``"ttgir"``, ...)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = dict(signature, **{name: "constexpr" for name in constexprs})
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]]
             for name, kind in signature.items() if kind.startswith("*")}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    caps = {} if max_registers is None else {"maxnreg": max_registers}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "enable_fp_fusion": False, **caps}).asm


def global_loads(ptx: str) -> collections.Counter:
    """The global-memory load instructions of a PTX listing, by kind (``ld.global.v4.b32``: a 16-byte
    vector; ``ld.global.b16``: one BF16 value)."""
    return collections.Counter(re.findall(r"\bld\.global(?:\.[a-z0-9]+)+", ptx))


def sass_text(cubin: bytes) -> str:
    """nvdisasm of a cubin given as bytes (``find_nvdisasm``, else Triton's bundled copy)."""
    nvd = find_nvdisasm()
    if nvd is None:
        import triton
        nvd = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([nvd, "-c", f.name], capture_output=True, text=True, check=True).stdout


def innermost_loops(sass: str) -> list[list[str]]:
    """The instructions of each loop of a SASS listing that contains no other loop (a backward branch
    to a label, with no backward branch between them)."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"\s*(\.L_x_\d+):", line))}
    spans = [(labels[m.group(1)], i) for i, line in enumerate(lines)
             if (m := re.search(r"BRA.*`\((\.L_x_\d+)\)", line)) and labels.get(m.group(1), i) < i]
    inner = [(a, b) for a, b in spans if not any(a <= c < d <= b and (c, d) != (a, b) for c, d in spans)]
    return [[line for line in lines[a:b + 1] if re.match(r"\s*/\*[0-9a-f]{4,}\*/", line)] for a, b in inner]


def prepass_candidate_loop(d: int = 128, codes_f16: bool = True, num_warps: int | None = None,
                           full_search: bool = False) -> int:
    """Instructions of the NVFP4 pre-pass's scale-search loop (one candidate scale; folded-K64, no
    permutation; the contenders' loop, or every candidate's with ``full_search``; not the saturating
    tiles' float64 one) in the sm_90 build for head dim ``d``."""
    from . import prepass_kernels as tk
    from . import prepass_launch as tp
    consts = dict(D=d, FOLDED=True, HAS_PERM=False, BLOCK_R=tp.nvfp4_launch(d)[0], BLOCK_D=min(d, 64),
                  CODES_F16=codes_f16, NORM=False, ROPE=False, FULL_SEARCH=full_search, ROW_ALIGN=8)
    asm = compile_triton_sm90(tk.prepass_kernel, tk.compile_signature(False), consts,
                              num_warps or tp.nvfp4_launch(d)[1], tp.nvfp4_launch(d)[2])
    # not the saturating tiles' branch (float64 sums: DADD), nor the one-instruction trap (a branch to
    # itself) that ends the listing
    loops = [body for body in innermost_loops(sass_text(asm["cubin"]))
             if len(body) > 1 and not any(re.search(r"\bDADD\b", line) for line in body)]
    if len(loops) != 1:
        raise RuntimeError(f"expected one float32 candidate loop, found {len(loops)}")
    return len(loops[0])


def prepass_search_per_value(d: int = 128, codes_f16: bool = True, num_warps: int | None = None,
                             full_search: bool = False) -> dict:
    """The scale search's instructions per value on a tile's ordinary path (no saturating group, no
    subnormal m = 0.625 scale): the candidate loop's instructions (``prepass_candidate_loop``) times the
    candidates a group evaluates (the contenders but m = 0.625, or every distinct candidate), over the
    values a thread holds (a program's BLOCK_R rows of d values over its threads). An estimate: the first
    candidate's evaluation is the same code outside the loop."""
    from fp4vis.formats import FOLDED_MSE_CONTENDERS, FOLDED_MSE_MULTIPLIERS

    from . import prepass_launch as tp
    warps = num_warps or tp.nvfp4_launch(d)[1]
    loop = prepass_candidate_loop(d, codes_f16, warps, full_search)
    n_cand = len(set(FOLDED_MSE_MULTIPLIERS)) if full_search else len(FOLDED_MSE_CONTENDERS) - 1
    per_thread = tp.nvfp4_launch(d)[0] * d // (32 * warps)
    return dict(d=d, warps=warps, codes="fp16 pairs" if codes_f16 else "float32",
                search="full" if full_search else "contenders", loop=loop, candidates=n_cand,
                values_per_thread=per_thread, per_value=round(loop * n_cand / per_thread, 1))


def direct_p_schedule(cubin: str) -> dict:
    """ptxas's static schedule of the ping-pong loop's Direct-P: the instructions from the loop's
    ``WARPGROUP.DEPBAR.LE gsb0, 0x1`` (S_j ready) to the last predicated store that pins the PV wait
    (``order_before_wait``), and the sum of their stall counts (bits 105-108 of each 128-bit
    instruction word): the cycles one warp needs to issue them when nothing else delays it; the
    same for the whole loop iteration (``loop_*``: from one turn's named-barrier wait to the next)."""
    sass = subprocess.run([find_nvdisasm(), "-c", "-hex", cubin], capture_output=True, text=True,
                          check=True).stdout
    insts = []   # (text, high 64-bit word)
    for line in sass.splitlines():
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?);\s*/\* 0x[0-9a-f]+ \*/", line)
        if m:
            insts.append([m.group(1).strip(), None])
        elif insts and insts[-1][1] is None and (m2 := re.search(r"/\* (0x[0-9a-f]+) \*/", line)):
            insts[-1][1] = int(m2.group(1), 16)
    waits = [i for i, (t, _) in enumerate(insts) if t.startswith("WARPGROUP.DEPBAR.LE gsb0, 0x1")]
    if not waits:
        return {}
    start = waits[0]
    pv_wait = next((i for i in range(start, len(insts)) if insts[i][0].startswith("WARPGROUP.DEPBAR.LE gsb0, 0x0")),
                   len(insts))
    pins = [i for i in range(start, pv_wait) if "STS" in insts[i][0] and insts[i][0].startswith("@")]
    end = pins[-1] if pins else None
    if end is None:
        return {}
    def stall(i):
        return (insts[i][1] >> 41) & 0xF

    # the whole loop iteration: from the named-barrier wait for this warpgroup's turn to the next one
    syncs = [i for i, (t, _) in enumerate(insts) if t.startswith("BAR.SYNC.DEFER_BLOCKING R")]
    lo = max((i for i in syncs if i < start), default=start)
    hi = min((i for i in syncs if i > end), default=end)
    return {"instructions": end - start, "stall_cycles": sum(stall(i) for i in range(start, end)),
            "loop_instructions": hi - lo, "loop_stall_cycles": sum(stall(i) for i in range(lo, hi))}


class _CaptureFds:
    """Capture what native code writes to fds 1 and 2 (ptxas remarks are printed there)."""

    def __enter__(self):
        sys.stdout.flush()
        sys.stderr.flush()
        self._py = io.StringIO()
        self._py_saved = (sys.stdout, sys.stderr)
        sys.stdout = sys.stderr = self._py
        self._tmp = tempfile.TemporaryFile(mode="w+b")
        self._saved = [os.dup(1), os.dup(2)]
        os.dup2(self._tmp.fileno(), 1)
        os.dup2(self._tmp.fileno(), 2)
        return self

    def __exit__(self, *exc):
        sys.stdout, sys.stderr = self._py_saved
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(self._saved[0], 1)
        os.dup2(self._saved[1], 2)
        for fd in self._saved:
            os.close(fd)
        self._tmp.seek(0)
        self.text = self._tmp.read().decode("utf-8", "replace") + self._py.getvalue()
        self._tmp.close()
        return False


def _parse_ptxas(rep: CompileReport, text: str) -> None:
    """Registers, stack frame and spill bytes from the ptxas remarks (worst over all entries)."""
    rep.ptxas_log = text
    rep.wgmma_serialized = "wgmma.mma_async instructions are" in text and "serialized" in text
    for m in re.finditer(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", text):
        f, st, ld = (int(x) for x in m.groups())
        rep.stack_frame_bytes = max(rep.stack_frame_bytes or 0, f)
        rep.spill_store_bytes = max(rep.spill_store_bytes or 0, st)
        rep.spill_load_bytes = max(rep.spill_load_bytes or 0, ld)
    for m in re.finditer(r"Used (\d+) registers", text):
        rep.registers = max(rep.registers or 0, int(m.group(1)))


def loop_opcodes(cubin: str | os.PathLike) -> list[tuple[str, int, Counter]]:
    """Per kernel of a cubin (any, e.g. FlashAttention-3's: ``benchmarks/build_fa3.py --cubin``), in the order
    nvdisasm lists them: ``sass_loop_opcodes`` of its listing."""
    with open(cubin, "rb") as f:
        return sass_loop_opcodes(sass_text(f.read()))


def sass_loop_opcodes(sass: str) -> list[tuple[str, int, Counter]]:
    """Per kernel (``.text.<name>:`` section) of a SASS listing: its name, the length of its longest innermost loop
    (the key loop's body in an attention kernel) and that loop's opcodes, counted by their first token (``FFMA``,
    ``MUFU``, ...)."""
    out = []
    for part in re.split(r"\n\s*\.text\.", sass)[1:]:
        body = max(innermost_loops(part), key=len, default=[])
        ops = Counter(m.group(2).split(".")[0] for line in body
                      if (m := SASS_OPCODE.match(line)))
        out.append((part.split(":")[0], len(body), ops))
    return out


def variants(head_dims=(128, 64)):
    """The kernel variants CI compiles: every supported policy x head dim with the default schedule
    and P path, plus the serial schedule with the scalar P path, the overlapped schedule for the
    policies with at most 64 anchors, three consumer warpgroups, the short-sequence variant (two CTAs
    per SM: ``*_short``), and (first head dim) the scalar, integer-constant and timing-only P paths with
    the default schedule, one serial warpgroup, the per-thread block constants, the range record
    (``*_record``), the key counts of a key-masked call (``*_klen``; BF16 out) and the FP8 P/V softmax on the
    serial schedule."""
    from fp4vis.policy import POLICIES, guard_policy_for_heads

    from .config import KernelConfig
    pols = {name: POLICIES[name] for name in ("fast", "wan_fast", "accurate", "guard")}
    pols["guard_h40"] = guard_policy_for_heads(40)
    pols.update((name, POLICIES[name]) for name in ("fast_bf16round", "fast_fp8qk", "fp8", "fp8pv"))
    fast = pols["fast"]
    out = []
    for d in head_dims:
        for name, p in pols.items():
            out.append((name, KernelConfig.from_policy(p, d, "bf16", schedule="pingpong", p_path="packed")))
        for name in ("fast", "wan_fast", "accurate"):  # the overlapped schedule (64-key tiles): <= 64 anchors
            out.append((f"{name}_overlap", KernelConfig.from_policy(pols[name], d, "bf16", schedule="overlap")))
        for name in ("fast", "accurate"):
            out.append((f"{name}_serial_scalar", KernelConfig.from_policy(pols[name], d, "bf16", schedule="serial",
                                                                           p_path="scalar")))
        out.append(("fast_3wg", KernelConfig.from_policy(fast, d, "bf16", num_wg=3)))
        for name in ("fast", "accurate", "guard", "fast_fp8qk", "fp8", "fp8pv"):   # two CTAs per SM (short sequences)
            out.append((f"{name}_short", KernelConfig.from_policy(pols[name], d, "bf16", ctas_per_sm=2)))
        if d == head_dims[0]:  # the timing-only P paths (wrong results) must stay buildable
            for pp in ("scalar", "packed_alu", "none", "timing_scales", "timing_codes"):
                out.append((f"fast_{pp}", KernelConfig.from_policy(fast, d, "bf16", p_path=pp)))
            out.append(("fast_serial_1wg", KernelConfig.from_policy(fast, d, "bf16", schedule="serial",
                                                                     num_wg=1)))
            for name in ("fast", "guard", "fast_fp8qk"):   # block constants per thread, the earlier form
                out.append((f"{name}_lane", KernelConfig.from_policy(pols[name], d, "bf16", block_scales="lane")))
            # the range record (range_check "raise"/"warn"): default, anchored, short FP8
            out.append(("fp8_serial", KernelConfig.from_policy(pols["fp8"], d, "bf16", schedule="serial")))
            for name, kw in (("fast", {}), ("guard", {}), ("fast_fp8qk", {"ctas_per_sm": 2}), ("fp8", {})):
                cfg = KernelConfig.from_policy(pols[name], d, "bf16", **kw)
                out.append((f"{name}{'_short' if kw else ''}_record", dataclasses.replace(cfg, range_record=True)))
                # a key count per batch element (key masks), on the same three
                out.append((f"{name}{'_short' if kw else ''}_klen", dataclasses.replace(cfg, key_lengths=True)))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="sm_90a", choices=["sm_90a"], help="the target (this check's one)")
    ap.add_argument("--policy", default=None, help="one policy (default: all CI variants)")
    ap.add_argument("--head-dim", type=int, default=None)
    ap.add_argument("--keep-dir", default=None)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--tile-n", type=int, default=None,
                    help="the FP8 P/V policies' key tile (config.PV_FP8_TILES; default the contract's, softmax_tile)")
    ap.add_argument("--poly-exp2", type=int, default=None,
                    help="the FP8 P/V policies' exponentials on the FMA pipe, of every 8 (default the policy's)")
    ap.add_argument("--schedule", action="store_true",
                    help="also report ptxas's static schedule of the loop's Direct-P (ping-pong variants)")
    ap.add_argument("--triton-prepass", action="store_true",
                    help="only the NVFP4 pre-pass's scale-search instruction counts (Triton build)")
    ap.add_argument("--loop-opcodes", metavar="CUBIN", default=None,
                    help="only: each kernel's longest innermost loop in CUBIN, its length and opcodes (loop_opcodes)")
    a = ap.parse_args(argv)
    if a.loop_opcodes:
        for i, (name, n, ops) in enumerate(loop_opcodes(a.loop_opcodes)):   # name: mangled, abridged
            print(f"kernel {i} {name[:60]}...{name[-30:]}: loop {n}: "
                  + ", ".join(f"{k} {v}" for k, v in ops.most_common()), flush=True)
        return 0
    if a.triton_prepass:
        for d in (a.head_dim,) if a.head_dim else (128, 64):
            for f16 in (True, False):
                for full in (False, True):
                    r = prepass_search_per_value(d, f16, None, full)
                    print(f"D={d} warps={r['warps']} codes={r['codes']} search={r['search']}: candidate loop "
                          f"{r['loop']} instructions for {r['values_per_thread']} values per thread, "
                          f"{r['candidates']} candidates: {r['per_value']} instructions per value", flush=True)
        return 0
    rows = []
    for name, cfg in variants((a.head_dim,) if a.head_dim else (128, 64)):
        if a.policy and name != a.policy:
            continue
        if a.tile_n is not None:
            if not cfg.pv_fp8:
                continue   # --tile-n names the FP8 P/V softmax's tile; the other kernels' tiles are their schedule's
            cfg = dataclasses.replace(cfg, tile_n=a.tile_n)
        if a.poly_exp2 is not None:
            if not cfg.pv_fp8:
                continue   # --poly-exp2 names the FP8 P/V softmax's exponentials
            cfg = dataclasses.replace(cfg, poly_exp2=a.poly_exp2)
        keep = a.keep_dir or (tempfile.mkdtemp(prefix="fp4vis_cc_") if a.schedule else None)
        try:
            rep = compile_variant(cfg, keep_dir=keep)
        except Exception as exc:   # noqa: BLE001 - a variant --tile-n makes may not fit: report it, go on
            if a.tile_n is None:
                raise
            rows.append({"policy": name, "variant": dataclasses.asdict(cfg), "error": str(exc).strip()[:300]})
            if not a.json:
                print(f"{name:10s} D={cfg.head_dim:3d} tile_n={cfg.tile_n}: does not compile: "
                      f"{str(exc).strip().splitlines()[0][:160]}", flush=True)
            continue
        d = rep.to_dict()
        d["policy"] = name
        if a.schedule and cfg.schedule == "pingpong":   # with the innermost loop's length (the key loop's body)
            loops = innermost_loops(sass_text(open(rep.cubin, "rb").read()))
            d["direct_p_schedule"] = dict(direct_p_schedule(rep.cubin), innermost_loop=max(map(len, loops), default=0))
        if keep and not a.keep_dir:
            shutil.rmtree(keep, ignore_errors=True)
        rows.append(d)
        if not a.json:
            c = rep.counts
            print(f"{name:10s} D={cfg.head_dim:3d} compile {rep.compile_s:6.1f}s regs={rep.registers} "
                  f"frame={rep.stack_frame_bytes} LDL/STL={c.get('LDL', 0)}/{c.get('STL', 0)} "
                  f"HGMMA={c.get('HGMMA', 0)} QGMMA={c.get('QGMMA', 0)} MUFU.EX2={c.get('MUFU.EX2', 0)} "
                  f"spill={rep.spill_store_bytes}/{rep.spill_load_bytes} serialized={rep.wgmma_serialized} "
                  f"total={rep.total_instructions}"
                  + (f" direct_p={d['direct_p_schedule']}" if d.get("direct_p_schedule") else ""), flush=True)
    if a.json:
        json.dump(rows, sys.stdout, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
