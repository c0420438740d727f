"""``fp4vis eval vit|mae|wan --protocol paper``: the method's published protocol run as a preset, its report beside
the published figures (``fp4vis.evals.paper_protocols``)."""

from __future__ import annotations

import argparse

from .eval_common import figure, print_files


def run(args: argparse.Namespace, common: dict) -> int:
    """``--protocol paper``: the published protocol's runs and its report beside the published figures."""
    from fp4vis.evals import paper_protocols as protocols
    from fp4vis.services.usage import UsageError

    if getattr(args, "speed_only", None):
        raise UsageError("--protocol: needs the real weights (--model), not --speed-only")
    if args.eval_command == "vit":
        r = protocols.run_vit_protocol(args.data, model=args.model, **common)
        for label, run in r["runs"].items():
            for pol, top1 in run["top1_percent"].items():
                pub = run["published_top1_percent"].get(pol)
                print(f"{label} {pol}: top-1 {figure(top1)} % (published {figure(pub)} %)")
    elif args.eval_command == "mae":
        r = protocols.run_mae_protocol(args.data, model=args.model, **common)
        print(f"bf16: masked PSNR {figure(r['bf16_masked_psnr'])} dB (published {r['published_bf16_masked_psnr']})")
        for pol, v in r["policies"].items():
            pub = v["published_diff"]
            print(f"{pol}: FP4-BF16 {figure(v['masked_psnr_diff_vs_bf16']['mean'])} dB (published "
                  f"{pub[0] if pub else '—'} ± {pub[1] if pub else '—'})")
    else:
        r = protocols.run_wan_protocol(model=args.model, **common)
        for steps, pols in r["steps"].items():
            for pol, v in pols.items():
                pub = v["published"] or ("—", "—")
                print(f"{steps} steps {pol}: latent cosine {figure(v['latent_cosine'])} (published {pub[0]}), "
                      f"relL2 {figure(v['latent_rel_l2'])} (published {pub[1]})")
    print_files(r)
    return 0
