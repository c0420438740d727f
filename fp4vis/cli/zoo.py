"""``fp4vis zoo``: what fp4vis ships (``list``), and its held-out digits as an image folder that the
evals read (``export digits DIR``)."""

from __future__ import annotations

import argparse

from .options import Formatter, positive_int

DATA = ("digits",)   # what ``export`` writes


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("zoo", formatter_class=Formatter, help="the shipped models and data: list, export",
                       description="The models fp4vis ships (fp4vis:<name> wherever a command takes --model) and "
                                   "their held-out data.")
    zsub = p.add_subparsers(dest="zoo_command", metavar="ZOO_COMMAND")
    zsub.required = True
    zsub.add_parser("list", formatter_class=Formatter, help="the shipped models, whether their weights are here",
                    description="The shipped models: name, kind, what they are, whether their weights are here.")
    e = zsub.add_parser("export", formatter_class=Formatter, help="write shipped data as files",
                        description="Write the 500 held-out digits the shipped models never saw in training as an "
                                    "ImageFolder (DIR/<digit>/<source index>.png, 28 px RGB PNG): what `fp4vis "
                                    "eval vit|mae|calibrate vit --data DIR` read (with --labels index for the "
                                    "ViT). The folder is written whole or not at all.")
    e.add_argument("what", choices=DATA, help="what to export")
    e.add_argument("dir", metavar="DIR", help="a new or empty folder")
    e.add_argument("--limit", type=positive_int, default=None,
                   help="only the first N digits (any prefix is balanced over the ten digits; default: all 500)")


def run(args: argparse.Namespace) -> int:
    from fp4vis import zoo

    if args.zoo_command == "list":
        for m in zoo.MODELS.values():
            here = "installed" if zoo.is_available(m.name) else "weights missing"
            print(f"{zoo.PREFIX}{m.name:<12} {m.kind:<18} {here:<16} {m.description}")
        return 0
    from fp4vis.files import atomic_folder
    from fp4vis.services.outputs import check_output_dir
    from fp4vis.services.usage import UsageError
    from fp4vis.zoo.digits import load_heldout, write_image_folder

    dest = check_output_dir(args.dir, "DIR")
    if dest.exists() and any(dest.iterdir()):
        raise UsageError(f"DIR: {args.dir!r} is not empty; give a new or empty folder (export writes it whole)")
    digits = load_heldout().head(args.limit)
    with atomic_folder(dest) as tmp:
        write_image_folder(digits, tmp)
    per = {int(d): int((digits.labels == d).sum()) for d in sorted(set(digits.labels.tolist()))}
    counts = sorted(set(per.values()))
    each = f"{counts[0]} per digit" if len(counts) == 1 else f"{min(counts)}-{max(counts)} per digit"
    print(f"wrote {len(digits)} held-out digits ({each}) to {args.dir}: an ImageFolder, {args.dir}/<digit>/<source "
          f"index>.png\nuse it: fp4vis eval vit --model fp4vis:digits-vit --data {args.dir} --labels index")
    return 0
