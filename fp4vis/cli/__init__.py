"""The ``fp4vis`` command line: generate videos, run the evals and the kernel benchmark, calibrate
guard plans, and say which attention backends work on this machine.

    fp4vis demo
    fp4vis info
    fp4vis bench --quick
    fp4vis generate --model Wan-AI/Wan2.1-T2V-1.3B-Diffusers --prompt "a red fox in the snow" --policy fast
    torchrun --nproc-per-node 2 -m fp4vis.cli generate --model ... --prompt ... --cp ulysses=2
    fp4vis eval vit --model timm/vit_base_patch16_224.augreg2_in21k_ft_in1k --data ~/imagenet/val --resolution 1008
    fp4vis eval mae --model facebook/vit-mae-base --data ~/photos
    fp4vis eval wan --speed-only 1.3B --steps 2
    fp4vis calibrate wan --model Wan-AI/Wan2.1-T2V-1.3B-Diffusers --prompt "a red fox" --out plan.json
    fp4vis zoo export digits digits/

Every command takes a Hub id or a local directory for its weights, never downloads implicitly for a
path, prints a one-line error (exit status 2) for bad options, missing paths or GPU-only options on
a machine without a GPU, and shows progress bars on long work (``--no-progress`` hides them).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from fp4vis.attention import RangeExceededError
from fp4vis.patching import GuardPlanError
from fp4vis.services.console import WarningLog, loading_bars
from fp4vis.services.environment import fp4vis_version
from fp4vis.services.usage import UsageError

from . import bench, calibrate, demo, evaluate, generate, info, selfcheck, zoo
from .options import EPILOG, Formatter, Parser, fill_help, innermost

# command name -> module with add_parser(sub) and run(args)
COMMANDS = {"demo": demo, "info": info, "bench": bench, "generate": generate, "eval": evaluate, "calibrate": calibrate,
            "selfcheck": selfcheck, "zoo": zoo}


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="fp4vis", formatter_class=Formatter, epilog=EPILOG,
        description="Direct-P FP4 attention for vision and video diffusion models: generate, evaluate, "
                    "benchmark, calibrate.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {fp4vis_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for command in COMMANDS.values():
        command.add_parser(sub)
    fill_help(parser)
    return parser


def one_line(exc: BaseException) -> str:
    """The message of a user error on one line; one raised in a DataLoader worker comes back with the
    worker's traceback in it (torch re-raises it as 'Caught UsageError in DataLoader worker ...'): its
    last line."""
    text = str(exc).strip()
    if "Original Traceback" in text:
        text = text.splitlines()[-1].split(": ", 1)[-1]
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:   # named by the command they were given to, whose --help lists its options
        innermost(parser, args).error(f"unrecognized arguments: {' '.join(unknown)}")
    with loading_bars(not getattr(args, "no_progress", False)):
        return _run(args, innermost(parser, args).prog)


def _run(args: argparse.Namespace, prog: str) -> int:
    """Run the command; a user error is one line on stderr, named by the command (``prog``: ``fp4vis eval wan``)."""
    try:
        with WarningLog():   # fp4vis' warnings printed, the libraries' counted for the reports (services)
            return COMMANDS[args.command].run(args)
    except (UsageError, GuardPlanError) as e:   # a plan that cannot be read, or does not fit the model
        print(f"{prog}: error: {one_line(e)}", file=sys.stderr)
        return 2
    except (FileNotFoundError, NotImplementedError) as e:  # missing files; a model fp4vis cannot patch
        print(f"{prog}: error: {one_line(e)}", file=sys.stderr)
        return 2
    except RangeExceededError as e:
        print(f"{prog}: error: {one_line(e)} At the command line: calibrate a guard plan (`fp4vis calibrate ...`) "
              "and pass it with --guard-plan, or use --policy accurate.", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130

