"""``fp4vis eval vit|mae|wan|pipeline``: what FP4 attention costs in quality (and gains in speed) against the
model's own BF16 attention. One module per eval (``EVALS``: its name -> the module with ``add_parser(esub)`` and
``run(args, common)``); ``--protocol paper`` runs ``eval_protocol``. A new eval: a module ``eval_<name>.py`` here
beside its ``fp4vis.evals`` module, added to ``EVALS`` (docs/cli_and_evals.md, "Adding an eval")."""

from __future__ import annotations

import argparse

from . import eval_mae, eval_pipeline, eval_protocol, eval_vit, eval_wan
from .eval_common import print_files
from .options import Formatter

EVALS = {"vit": eval_vit, "mae": eval_mae, "wan": eval_wan, "pipeline": eval_pipeline}


def add_parser(sub: argparse._SubParsersAction) -> None:
    pe = sub.add_parser("eval", formatter_class=Formatter, help="quality/speed evals: vit, mae, wan, pipeline",
                        description="Measure what FP4 attention costs in quality (and gains in speed) against "
                                    "the model's own BF16 attention. Each eval writes NAME.json and NAME.md.")
    esub = pe.add_subparsers(dest="eval_command", metavar="EVAL")
    esub.required = True
    for module in EVALS.values():
        module.add_parser(esub)


def run(args: argparse.Namespace) -> int:
    from fp4vis.services.outputs import check_output_dir
    from fp4vis.services.usage import UsageError

    args.out_dir = check_output_dir(args.out_dir, "--out-dir")
    common = dict(device=args.device, dtype=args.dtype, backend=args.backend, guard_plan=args.guard_plan,
                  out_dir=args.out_dir, progress=not args.no_progress)
    if getattr(args, "protocol", None) is not None:
        return eval_protocol.run(args, common)
    if args.eval_command in ("vit", "mae") and args.model is None:
        raise UsageError("--model: required (or --protocol paper, which names its model)")
    if args.eval_command in ("wan", "pipeline") and args.model is None and args.speed_only is None:
        raise UsageError("--model or --speed-only: one is required"
                         + (" (or --protocol paper)" if args.eval_command == "wan" else ""))
    r = EVALS[args.eval_command].run(args, common)
    if r is not None:   # None: a process other than the main one of a sharded run
        print_files(r)
    return 0
