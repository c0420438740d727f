"""``fp4vis eval mae``: ViTMAE reconstruction PSNR under each FP4 policy against BF16, with identical masks
(``fp4vis.evals.mae_psnr``)."""

from __future__ import annotations

import argparse

from .eval_common import PROTOCOL_HELP, eval_announcer
from .options import (
    Formatter,
    add_runtime,
    main_process,
    non_negative_int,
    open_fraction,
    policy_list,
    positive_int,
    seed,
)

DESCRIPTION = ("Masked-patch and full-image PSNR of ViTMAE reconstructions (same seeded masks for BF16 and FP4), "
               "the mean FP4-BF16 difference with its 95 %% t-interval, and FP4-vs-BF16 reconstruction PSNR.")


def add_parser(esub: argparse._SubParsersAction) -> None:
    p = esub.add_parser("mae", formatter_class=Formatter, help="ViTMAE reconstruction PSNR with identical masks",
                        description=DESCRIPTION)
    p.add_argument("--model", default=None, help="Hub id (e.g. facebook/vit-mae-base), local folder, or "
                                                 "config:default (ViTMAEConfig defaults, random weights)")
    p.add_argument("--data", required=True, help="a folder of images (e.g. COCO val2017) or an ImageFolder root")
    p.add_argument("--protocol", choices=["paper"], default=None, help=PROTOCOL_HELP)
    p.add_argument("--resolution", type=positive_int, default=None, help="input size (default: the model's)")
    p.add_argument("--mask-ratio", type=open_fraction, default=None, help="the share of patches masked, in (0, 1); "
                                                                         "default: the model's (0.75)")
    p.add_argument("--decoder", action="store_true", help="also run the MAE decoder in FP4 (default: encoder only)")
    p.add_argument("--policies", type=policy_list, default="fast,accurate")
    p.add_argument("--batch-size", type=positive_int, default=8)
    p.add_argument("--limit", type=positive_int, default=None)
    p.add_argument("--random-weights", action="store_true")
    p.add_argument("--seed", type=seed, default=0, help="seed of the masks (and of random weights)")
    p.add_argument("--workers", type=non_negative_int, default=0)
    p.add_argument("--out-dir", default="out")
    p.add_argument("--name", default="mae_psnr")
    add_runtime(p)


def run(args: argparse.Namespace, common: dict) -> dict | None:
    """The eval, then one line per policy; None on a process other than the main one (it prints nothing)."""
    from fp4vis.evals.mae_psnr import MaeEvalConfig, run_mae_eval

    config = MaeEvalConfig(args.model, args.data, policies=args.policies, resolution=args.resolution,
                           batch_size=args.batch_size, limit=args.limit, random_weights=args.random_weights,
                           mask_ratio=args.mask_ratio, seed=args.seed, decoder=args.decoder,
                           num_workers=args.workers, name=args.name, **common)
    r = run_mae_eval(config, say=eval_announcer(args))
    if not main_process():
        return None
    print(f"bf16 (baseline): masked-patch PSNR {r['bf16']['masked_psnr']['mean']:.3f} dB, the model's own "
          "attention")
    for pol, p in r["policies"].items():
        d = p["masked_psnr_diff_vs_bf16"]
        print(f"{pol}: masked-patch PSNR {p['masked_psnr']['mean']:.3f} dB, FP4-BF16 {d['mean']:+.4f} dB, "
              f"recon PSNR vs BF16 {p['recon_psnr_vs_bf16']['mean']:.2f} dB")
    return r
