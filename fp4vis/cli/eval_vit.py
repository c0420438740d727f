"""``fp4vis eval vit``: a ViT classifier's top-1, agreement, logit and per-layer attention error under each FP4
policy against its own BF16 attention (``fp4vis.evals.vit_top1``)."""

from __future__ import annotations

import argparse

from .eval_common import PROTOCOL_HELP, eval_announcer
from .options import Formatter, add_runtime, main_process, non_negative_int, policy_list, positive_int, seed


def add_parser(esub: argparse._SubParsersAction) -> None:
    p = esub.add_parser("vit", formatter_class=Formatter, help="ViT classifier: top-1, agreement, logit and "
                                                                "per-layer attention error",
                        description="A timm or transformers classifier on an ImageFolder dataset "
                                    "(ROOT/<class>/<image>). Sharded over GPUs with `accelerate launch -m "
                                    "fp4vis.cli eval vit ...`.")
    p.add_argument("--model", default=None, help="Hub id (timm/... or a transformers id), local folder, or "
                                                 "timm:<registry name> (with --random-weights: no download)")
    p.add_argument("--data", required=True, help="ImageFolder root (ROOT/<class>/<image>) or the CIFAR-10 test set "
                                                 "(ROOT/cifar-10-batches-py)")
    p.add_argument("--protocol", choices=["paper"], default=None, help=PROTOCOL_HELP)
    p.add_argument("--resolution", type=positive_int, default=None,
                   help="input size in px (e.g. 1008: ~4k tokens for a /16 ViT); position embeddings are "
                        "interpolated. Default: the model's own")
    p.add_argument("--labels", default="auto", choices=["auto", "index", "names", "order", "none"],
                   help="how class folders map to model classes: folder = class index, = label name/synset, "
                        "sorted order, or none (agreement and logit error only)")
    p.add_argument("--policies", type=policy_list, default="fast,accurate", help="comma-separated FP4 policies")
    p.add_argument("--batch-size", type=positive_int, default=8)
    p.add_argument("--limit", type=positive_int, default=None, help="use only the first N images")
    p.add_argument("--random-weights", action="store_true", help="build the architecture with seeded random "
                                                                 "weights (numerics only; labelled in the report)")
    p.add_argument("--no-per-layer", action="store_true", help="skip the per-layer attention errors")
    p.add_argument("--seed", type=seed, default=0)
    p.add_argument("--workers", type=non_negative_int, default=0, help="DataLoader workers")
    p.add_argument("--out-dir", default="out", help="directory for NAME.json and NAME.md")
    p.add_argument("--name", default="vit_top1")
    add_runtime(p)


def run(args: argparse.Namespace, common: dict) -> dict | None:
    """The eval, then one line per policy; None on a process other than the main one (it prints nothing)."""
    from fp4vis.evals.vit_top1 import VitEvalConfig, run_vit_eval

    config = VitEvalConfig(args.model, args.data, policies=args.policies, resolution=args.resolution,
                           batch_size=args.batch_size, limit=args.limit, labels=args.labels,
                           random_weights=args.random_weights, per_layer=not args.no_per_layer, seed=args.seed,
                           num_workers=args.workers, name=args.name, **common)
    r = run_vit_eval(config, say=eval_announcer(args))
    if not main_process():
        return None
    base = r["bf16"]["top1"]
    print(f"bf16 (baseline): {'top-1 ' + format(base, '.4f') if base is not None else 'no labels: top-1 n/a'}, "
          "the model's own attention")
    for pol, p in r["policies"].items():
        top1 = f"top-1 {p['top1']:.4f}, " if p["top1"] is not None else ""
        print(f"{pol}: {top1}agreement {p['agreement_with_bf16']:.4f}, logit cosine {p['logit_cosine_mean']:.5f}, "
              f"relL2 {p['logit_rel_l2_mean']:.4f}")
    return r
