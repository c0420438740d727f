"""The Wan layer's q/k transform folded into the Hopper pre-pass: GPU bit checks and timings (one H200 run).

    python3 benchmarks/wan_qk_bench.py --out $OUT/wan_qk.json [--skip checks,layer,prepass,calls]

(``layer`` and ``calls`` need diffusers and the CuTe DSL kernel; the rest only Triton.)

Sections (each a key of the JSON, written after every section):

1. ``checks``: on CUDA tensors, bit for bit, counting differing values:
   * ``rstd``: ``prepass_launch.rms_rstd`` against the rstd torch's own CUDA rms_norm returns
     (``aten._fused_rms_norm``), per Wan width (H*D = 1536, 5120), for ``RMS_THREADS`` 128 and 256 (the
     sum order of torch's block; the module's constant is the one that must match);
   * ``operands``: the fused pre-pass from the raw projections (NVFP4 ``folded64_mse`` and
     ``block16``, FP8 Q/K; float32 and BF16 rotary tables; with and without the anchor permutation)
     against today's pre-pass fed with diffusers' ``norm_q``/``norm_k`` + rotary output;
   * ``layer``: a diffusers ``WanAttention`` (random BF16 weights) patched with fp4vis: its output
     against today's path written out (diffusers' q, k, v, then ``fp4vis.attention``, then
     ``to_out``), for ``fast``, ``wan_fast``, ``fast_fp8qk``; a cross-attention layer; an I2V
     cross-attention layer (image branch: q, k made by the layer, ordinary path); a cross-attention
     layer left exact (a per-step override) against the original processor.
2. ``prepass``: per shape (B=1, D=128), CUDA events, median, inputs rotated past the L2:
   ``today_ms`` (norm_q, norm_k, the two rotary embeddings and the pre-pass, as the processor ran
   them), ``fused_ms`` (rstd launch + fused pre-pass), ``copy_floor_ms`` (a device copy of the bytes
   the fused pre-pass must move: q, k, v read once, the operands written once), per policy layout;
   for the folded layout also the pre-pass with the scale search over the contenders (the default) and
   over every candidate (``prepass_contenders_ms`` / ``prepass_full_search_ms``, ``fused_full_search_ms``;
   the checks section compares the fused contender search against the plain full search and counts the
   fused full search's differing values too); for FP8 the pre-pass (no transform) of the Q rows
   alone and of the K/V blocks alone (``prepass_q_rows_ms``, ``prepass_kv_blocks_ms``: the other part
   cut to 32 tokens), the most that quantizing Q inside the kernel could take off the pre-pass.
3. ``calls``: per shape, the whole patched-layer attention call (``fp4vis.attention`` with the
   transform, range check as a patched layer runs it) against the kernel alone on prepared operands,
   both CUDA events over back-to-back calls and from a CUDA graph (GPU time, no host overhead).
"""

from __future__ import annotations

import argparse

import torch

from fp4vis.services.environment import environment
from fp4vis.services.timing import input_copies, run_sections, time_events, time_graph

WIDTHS = ((12, 128), (40, 128))          # Wan2.1 1.3B and 14B: heads, head dim
SEQS = (4096, 32760)
POLICIES = ("fast", "fast_fp8qk")


def _rope(s: int, d: int, dtype, dev, g):
    ang = torch.rand(1, s, 1, d // 2, generator=g, device=dev).repeat_interleave(2, -1) * 50
    return ang.cos().to(dtype), ang.sin().to(dtype)


def _proj(b, s, n, dev, g, scale=1.0):
    x = torch.randn(b, s, n, generator=g, device=dev) * scale
    return (x * torch.exp2(torch.randint(-3, 3, (b, s, 1), generator=g, device=dev).float())).bfloat16()


def _bits(t):
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _ndiff(a, b) -> int:
    return int((_bits(a) != _bits(b)).sum())


def checks(layer: bool = True) -> dict:
    from fp4vis.kernels.hopper import prepass_launch as tp
    from fp4vis.kernels.launch_shared import cached_anchor_permutation
    from fp4vis.qk_transform import QKTransform, apply_rotary_emb
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    out: dict = {"rstd": [], "operands": [], "layer": []}
    default_threads = tp.RMS_THREADS
    for h, d in WIDTHS:
        n, s = h * d, 4096
        qp, kp = _proj(1, s, n, dev, g, 2.0), _proj(1, s, n, dev, g, 0.5)
        wq, wk = ((1 + 0.2 * torch.randn(n, generator=g, device=dev)).bfloat16() for _ in range(2))
        q, k = (t.view(1, s, h, d).transpose(1, 2) for t in (qp, kp))
        ref_q = torch.ops.aten._fused_rms_norm(qp, [n], wq, 1e-6)
        ref_k = torch.ops.aten._fused_rms_norm(kp, [n], wk, 1e-6)
        for threads in (128, 256):
            tp.RMS_THREADS = threads
            tp.RMS_LAUNCH_STATE.clear()
            rq, rk = tp.rms_rstd(q, k, 1e-6, 1e-6)
            normed = ((qp.float() * rq.view(1, s, 1)) * wq.float()).bfloat16()
            out["rstd"].append(dict(heads=h, width=n, threads=threads, rstd_q_differing=_ndiff(rq, ref_q[1].view(-1)),
                                    rstd_k_differing=_ndiff(rk, ref_k[1].view(-1)),
                                    normed_q_differing=_ndiff(normed, ref_q[0]),
                                    normed_q_vs_rms_norm_differing=_ndiff(normed, torch.nn.functional.rms_norm(
                                        qp, (n,), wq, 1e-6))))
        tp.RMS_THREADS = default_threads
        tp.RMS_LAUNCH_STATE.clear()
        v = _proj(1, s, n, dev, g).view(1, s, h, d).transpose(1, 2)
        for rope_dtype in (torch.float32, torch.bfloat16):
            rope = _rope(s, d, rope_dtype, dev, g)
            tr = QKTransform(wq, wk, 1e-6, 1e-6, rope)
            qn = apply_rotary_emb(torch.nn.functional.rms_norm(qp, (n,), wq, 1e-6).view(1, s, h, d), *rope)
            kn = apply_rotary_emb(torch.nn.functional.rms_norm(kp, (n,), wk, 1e-6).view(1, s, h, d), *rope)
            qn, kn, vc = qn.transpose(1, 2).contiguous(), kn.transpose(1, 2).contiguous(), v.contiguous()
            for anchor in (0, 32):
                perm = cached_anchor_permutation(s, anchor, q.device, torch.int32) if anchor else None
                for layout in ("folded64_mse", "block16", "fp8"):
                    row = dict(heads=h, rope=str(rope_dtype), anchor=anchor, layout=layout)
                    if layout == "fp8":
                        fused, plain = tp.fp8_prepass(q, k, v, perm, qk=tr), tp.fp8_prepass(qn, kn, vc, perm)
                    else:
                        fused = tp.prepass(q, k, v, layout, perm, qk=tr, full_search=False)
                        plain = tp.prepass(qn, kn, vc, layout, perm, full_search=True)
                        full = tp.prepass(q, k, v, layout, perm, qk=tr, full_search=True)
                        row["full_search_differing"] = [_ndiff(a, c) for a, c in zip(full, plain)]
                    row["differing"] = [_ndiff(a, c) for a, c in zip(fused, plain)]
                    out["operands"].append(row)
    if layer:
        out["layer"] = _layer_checks(dev)
    return out


@torch.no_grad()
def _layer_checks(dev) -> list:
    from diffusers.models.transformers.transformer_wan import WanAttention, WanAttnProcessor

    import fp4vis
    from fp4vis.patching.layer import LayerSpec, LayerState
    from fp4vis.patching.wan import FP4WanAttnProcessor
    from fp4vis.qk_transform import apply_rotary_emb
    torch.manual_seed(0)
    g = torch.Generator(device=dev).manual_seed(1)
    h, d, s, text = 12, 128, 4096, 512
    rows = []

    def layer(**kw):
        m = WanAttention(dim=h * d, heads=h, dim_head=d, eps=1e-6, **kw).to(dev, torch.bfloat16).eval()
        for p in m.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.02)
            else:
                p.normal_(1, 0.1)
        return m

    def today(attn, x, ctx, rope, policy):
        query, key, value = attn.to_q(x), attn.to_k(x if ctx is None else ctx), attn.to_v(x if ctx is None else ctx)
        query, key = attn.norm_q(query).unflatten(2, (h, -1)), attn.norm_k(key).unflatten(2, (h, -1))
        value = value.unflatten(2, (h, -1))
        if rope is not None:
            query, key = apply_rotary_emb(query, *rope), apply_rotary_emb(key, *rope)
        o = fp4vis.attention(query, key, value, policy=policy, layout="bshd", backend="hopper")
        return attn.to_out[0](o.flatten(2, 3).type_as(query))

    x = torch.randn(1, s, h * d, generator=g, device=dev).bfloat16()
    ctx = torch.randn(1, text, h * d, generator=g, device=dev).bfloat16()
    rope = _rope(s, d, torch.float32, dev, g)
    for kind in ("self", "cross"):
        attn = layer(cross_attention_dim_head=d if kind == "cross" else None)
        for policy in ("fast", "wan_fast", "fast_fp8qk"):
            spec = LayerSpec(name=kind, module=attn, index=0, group=kind, default=True, patcher="wan", num_heads=h,
                             head_dim=d)
            st = LayerState(spec, fp4vis.policy.get_policy(policy), backend="hopper", range_check="raise",
                            strict=True, handle=None)
            proc = FP4WanAttnProcessor(st, WanAttnProcessor())
            r = rope if kind == "self" else None
            got = proc(attn, x, None if kind == "self" else ctx, None, r)
            fp4vis.check_range()
            rows.append(dict(layer=kind, policy=policy, differing=_ndiff(got, today(attn, x, None if kind == "self"
                                                                                       else ctx, r, policy))))
    # I2V cross-attention (image branch: the layer computes q and k), and a cross layer left exact
    attn = layer(added_kv_proj_dim=h * d, cross_attention_dim_head=d)
    ctx_img = torch.cat([torch.randn(1, 257, h * d, generator=g, device=dev).bfloat16(), ctx], 1)
    spec = LayerSpec(name="i2v", module=attn, index=0, group="cross", default=True, patcher="wan", num_heads=h,
                     head_dim=d)
    for policy in ("fast", None):
        st = LayerState(spec, None if policy is None else fp4vis.policy.get_policy(policy), backend="hopper",
                        range_check="raise", strict=True, handle=None)
        original = WanAttnProcessor()
        got = FP4WanAttnProcessor(st, original)(attn, x, ctx_img, None, None)
        if policy is None:
            ref = original(attn, x, ctx_img, None, None)
        else:
            query = attn.norm_q(attn.to_q(x)).unflatten(2, (h, -1))
            img, txt = ctx_img[:, :257], ctx_img[:, 257:]
            k_img = attn.norm_added_k(attn.add_k_proj(img)).unflatten(2, (h, -1))
            v_img = attn.add_v_proj(img).unflatten(2, (h, -1))
            key = attn.norm_k(attn.to_k(txt)).unflatten(2, (h, -1))
            value = attn.to_v(txt).unflatten(2, (h, -1))
            o_img = fp4vis.attention(query, k_img, v_img, policy=policy, layout="bshd", backend="hopper")
            o = fp4vis.attention(query, key, value, policy=policy, layout="bshd", backend="hopper")
            ref = attn.to_out[0](o.flatten(2, 3).type_as(query) + o_img.flatten(2, 3).type_as(query))
        rows.append(dict(layer="i2v_cross", policy=policy or "exact", differing=_ndiff(got, ref)))
    return rows


def _rows(make_row, seed: int) -> list:
    """make_row(h, d, s, norm weights, generator) over the timed shapes (the 14B width at S = 32760 only)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    rows = []
    for h, d in WIDTHS:
        weights = tuple((1 + 0.2 * torch.randn(h * d, generator=g, device="cuda")).bfloat16() for _ in range(2))
        for s in SEQS:
            if not (h == 40 and s == 4096):
                rows.append(make_row(h, d, s, weights, g))
                print(rows[-1], flush=True)
    return rows


def prepass_times() -> list:
    return _rows(_prepass_row, 2)


def _prepass_row(h: int, d: int, s: int, weights, g) -> dict:
    from fp4vis.kernels.hopper import prepass_launch as tp
    from fp4vis.qk_transform import QKTransform
    n, dev = h * d, "cuda"
    norms = tuple(torch.nn.RMSNorm(n, eps=1e-6).to(dev, torch.bfloat16).requires_grad_(False) for _ in range(2))
    for norm, w in zip(norms, weights):
        norm.weight.copy_(w)
    nbytes = 3 * s * n * 2
    copies = input_copies(nbytes)
    raw = [tuple(_proj(1, s, n, dev, g) for _ in range(3)) for _ in range(copies)]
    rope = _rope(s, d, torch.float32, dev, g)
    tr = QKTransform(norms[0].weight, norms[1].weight, 1e-6, 1e-6, rope)
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    row = dict(heads=h, head_dim=d, seq=s, copy_floor_ms=time_events(lambda i: dst.copy_(src), 1),
               rstd_ms=time_events(lambda i: tp.rms_rstd(*_views(raw[i][:2], h), 1e-6, 1e-6), copies))
    for policy in POLICIES:
        row[policy] = _prepass_policy(policy, raw, h, norms, rope, tr, copies)
        row[policy]["fused_over_floor"] = row[policy]["fused_ms"] / row["copy_floor_ms"]
        row[policy]["prepass_over_floor"] = row[policy]["prepass_no_transform_ms"] / row["copy_floor_ms"]
    return row


def _views(projections, h: int) -> tuple:
    """(B, H, S, D) views of (B, S, H*D) projections."""
    return tuple(t.unflatten(2, (h, -1)).transpose(1, 2) for t in projections)


def _prepass_policy(policy: str, raw: list, h: int, norms, rope, tr, copies: int) -> dict:
    from fp4vis.call import AttentionCall, default_scale
    from fp4vis.kernels.hopper import prepass_launch as tp
    from fp4vis.kernels.hopper.prepass import kernel_operands
    from fp4vis.policy import get_policy
    from fp4vis.qk_transform import apply_rotary_emb
    from fp4vis.settings import kernel_settings
    pol, d, settings = get_policy(policy), raw[0][0].shape[-1] // h, kernel_settings()
    scale = default_scale(d)
    params = pol.kernel_params(d, scale)
    fmt = params.qk_layout

    def operands(q, k, v, qk=None):   # the backend's pre-pass of (B, H, S, D) views
        return kernel_operands(AttentionCall(q, k, v, pol, scale, qk), params, settings)

    def today(i):   # what the processor ran before: diffusers' norms and rotary, then the pre-pass
        qp, kp, vp = raw[i]
        q = apply_rotary_emb(norms[0](qp).unflatten(2, (h, -1)), *rope)
        k = apply_rotary_emb(norms[1](kp).unflatten(2, (h, -1)), *rope)
        return operands(q.transpose(1, 2), k.transpose(1, 2), *_views(raw[i][2:], h))

    r = dict(layout=fmt, today_ms=time_events(today, copies),
             fused_ms=time_events(lambda i: operands(*_views(raw[i], h), qk=tr), copies),
             prepass_no_transform_ms=time_events(lambda i: operands(*_views(raw[i], h)), copies))
    r["today_over_fused"] = r["today_ms"] / r["fused_ms"]
    if fmt == "folded64_mse":   # the scale search over every candidate (FP4VIS_PREPASS_FULL_SEARCH) side by side
        r["prepass_full_search_ms"] = time_events(
            lambda i: tp.prepass(*_views(raw[i], h), fmt, full_search=True), copies)
        r["prepass_contenders_ms"] = time_events(
            lambda i: tp.prepass(*_views(raw[i], h), fmt, full_search=False), copies)
        r["fused_full_search_ms"] = time_events(
            lambda i: tp.prepass(*_views(raw[i], h), fmt, qk=tr, full_search=True), copies)
    else:   # the Q rows' share of the FP8 pre-pass: what quantizing Q inside the kernel could save (issue 17, item 3)
        def part(i, q_rows: bool):
            q, k, v = _views(raw[i], h)
            return tp.fp8_prepass(q, k[:, :, :32], v[:, :, :32]) if q_rows else tp.fp8_prepass(q[:, :, :32], k, v)
        r["prepass_q_rows_ms"] = time_events(lambda i: part(i, True), copies)
        r["prepass_kv_blocks_ms"] = time_events(lambda i: part(i, False), copies)
    return r


def call_times() -> list:
    return _rows(_call_row, 3)


def _call_row(h: int, d: int, s: int, weights, g) -> dict:
    from fp4vis.qk_transform import QKTransform
    dev = "cuda"
    copies = input_copies(3 * s * h * d * 2)
    raw = [tuple(_proj(1, s, h * d, dev, g).unflatten(2, (h, -1)) for _ in range(3)) for _ in range(copies)]
    tr = QKTransform(weights[0], weights[1], 1e-6, 1e-6, _rope(s, d, torch.float32, dev, g))
    row = dict(heads=h, head_dim=d, seq=s)
    for policy in POLICIES:
        row[policy] = _call_policy(policy, raw, tr, copies)
    return row


def _call_policy(policy: str, raw: list, tr, copies: int) -> dict:
    import fp4vis
    from fp4vis.call import AttentionCall, default_scale
    from fp4vis.kernels.hopper import launch as hb
    from fp4vis.kernels.hopper.config import product_config
    from fp4vis.kernels.hopper.prepass import kernel_operands
    from fp4vis.policy import get_policy
    from fp4vis.settings import kernel_settings
    b, s, h, d = raw[0][0].shape
    scale, pol, settings = default_scale(d), get_policy(policy), kernel_settings()
    params = pol.kernel_params(d, scale)
    ops = [kernel_operands(AttentionCall(*(t.transpose(1, 2) for t in r), pol, scale, tr), params, settings)
           for r in raw]
    out = torch.empty(b, h, s, d, dtype=torch.bfloat16, device="cuda")
    cfg = product_config(params, d, "bf16", hb.short_sequences(s, s, settings), False)

    def kernel(i):
        hb.launch(cfg, ops[i], out, params, None, settings.hopper_tvm_ffi)

    def call(i, check="raise"):   # the patched layer's call: raw projections and the transform
        q, k, v = raw[i]
        return fp4vis.attention(q, k, v, policy=policy, layout="bshd", backend="hopper", range_check=check,
                                qk_transform=tr)

    r = dict(kernel_ms=time_events(kernel, copies), call_ms=time_events(call, copies),
             call_off_ms=time_events(lambda i: call(i, "off"), copies),
             kernel_graph_ms=time_graph(kernel), call_graph_ms=time_graph(lambda i: call(i, "off")))
    fp4vis.check_range()
    r["kernel_over_call"] = r["kernel_ms"] / r["call_ms"]
    r["kernel_over_call_graph"] = r["kernel_graph_ms"] / r["call_graph_ms"]
    return r


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--skip", default="")
    a = ap.parse_args()
    skip = set(filter(None, a.skip.split(",")))
    res = run_sections({"env": environment()},
                       (("checks", lambda: checks("layer" not in skip)), ("prepass", prepass_times),
                        ("calls", call_times)), a.out, skip)
    print({k: v for k, v in res.items() if k == "checks"}, flush=True)


if __name__ == "__main__":
    main()
