"""What the command modules share: the parser and help formatter, the option types and groups, and where a
command says what it is doing."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from fp4vis.backends import backend_names
from fp4vis.policy import POLICIES

POLICY_HELP = ", ".join(sorted(POLICIES))
EPILOG = ("Weights: a Hugging Face Hub id (org/name, downloaded by the Hub client as usual) or a local "
          "directory. Policies: " + POLICY_HELP + " (bf16 = the model's own attention). Docs: README.md.")


class Parser(argparse.ArgumentParser):
    """argparse's parser with the CLI's error form: one line on stderr and exit status 2, where argparse
    prints the whole usage first (it is one ``--help`` away, which the line names). Subcommand parsers
    are of this class too (``add_subparsers`` makes its parent's class)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (options: {self.prog} --help)\n")


def innermost(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the (sub)command ``args`` were parsed for: ``fp4vis eval vit``'s for an eval of a ViT."""
    while True:
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        chosen = getattr(args, sub.dest, None) if sub is not None else None
        if chosen not in (sub.choices if sub is not None else {}):
            return parser
        parser = sub.choices[chosen]


class Formatter(argparse.RawDescriptionHelpFormatter):
    """Shows every option's default (also for options without help text), but not 'None' / False."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = (action.help or "").strip()
        d = action.default
        if (d is not None and d is not False and d is not argparse.SUPPRESS and "%(default)" not in text
                and action.option_strings and not isinstance(
                    action, (argparse._HelpAction, argparse._StoreTrueAction, argparse._StoreFalseAction))):
            text = f"{text} (default: %(default)s)".strip()
        return text


def fill_help(parser: argparse.ArgumentParser) -> None:
    """Give options without help text one, so that the formatter can show their default."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                fill_help(sub)
        elif (action.option_strings and not action.help and action.default is not None
              and not isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))):
            action.help = "(default: %(default)s)"


def main_process() -> bool:
    """False in the ranks other than 0 of a launch over several processes (accelerate launch / torchrun)."""
    return int(os.environ.get("RANK", "0")) == 0


def announcer(args: argparse.Namespace) -> Callable[[str], None] | None:
    """What a command's work calls (``say``) to state what it is doing, once its inputs are checked and its
    model loaded: a line on stderr, between the progress bars. None with --no-progress and in ranks other
    than 0."""
    if getattr(args, "no_progress", False) or not main_process():
        return None

    def say(text: str) -> None:
        from tqdm import tqdm

        tqdm.write(text, file=sys.stderr)
    return say


def positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}")
    return v


def int_list(s: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None


def policy(s: str) -> str:
    if s not in POLICIES:
        raise argparse.ArgumentTypeError(f"unknown policy {s!r}; known policies are {POLICY_HELP}")
    return s


def policy_list(s: str) -> str:
    for p in (x.strip() for x in s.split(",")):
        if p and p not in POLICIES:
            raise argparse.ArgumentTypeError(f"unknown policy {p!r}; known policies are {POLICY_HELP}")
    return s


def add_runtime(p: argparse.ArgumentParser, *, default_dtype: str = "bfloat16") -> None:
    g = p.add_argument_group("runtime")
    g.add_argument("--device", default="auto", help="auto (CUDA when visible, else CPU), cpu, cuda or cuda:N")
    g.add_argument("--dtype", default=default_dtype, choices=["bfloat16", "float16", "float32"],
                   help="model dtype (the BF16 baseline runs in this dtype too)")
    g.add_argument("--backend", default="auto", choices=backend_names(),
                   help="FP4 attention backend; auto picks the kernel for this GPU and falls back to the "
                        "reference emulation (hopper needs an sm_90 GPU)")
    g.add_argument("--guard-plan", metavar="JSON", help="guard plan written by `fp4vis calibrate`")
    g.add_argument("--no-progress", action="store_true", help="hide progress bars")
