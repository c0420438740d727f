"""What the command modules share: the parser and help formatter, the option types and groups, and where a
command says what it is doing."""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable

from fp4vis.backends import backend_names
from fp4vis.policy import POLICIES
from fp4vis.services.runtime import SEED_MAX, SEED_MIN

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


def _int_within(s: str, low: int | None, high: int | None, expected: str) -> int:
    """``s`` as an int in [low, high] (None: unbounded), else argparse's error saying what was ``expected``."""
    try:
        v = int(s)
    except ValueError:
        v = None
    if v is None or (low is not None and v < low) or (high is not None and v > high):
        raise argparse.ArgumentTypeError(f"{expected}, got {s!r}")
    return v


def positive_int(s: str) -> int:
    return _int_within(s, 1, None, "expected a positive integer")


def non_negative_int(s: str) -> int:
    return _int_within(s, 0, None, "expected an integer >= 0")


def seed(s: str) -> int:
    """A seed within what torch's generators accept (``fp4vis.services.runtime.SEED_MIN`` .. ``SEED_MAX``)."""
    return _int_within(s, SEED_MIN, SEED_MAX,
                       "must be an integer in [-2**63, 2**64 - 1] (what torch's generators accept)")


def finite_float(s: str) -> float:
    """A float option: a finite number (float() also reads 'nan' and 'inf')."""
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a finite number, got {s!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {s!r}")
    return v


def guidance(s: str) -> float:
    """A classifier-free guidance scale: finite and >= 0. As in diffusers' Wan pipelines, a scale above 1
    runs guidance (two transformer passes a step), one of at most 1 runs without it (0 and 1 alike)."""
    v = finite_float(s)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0 (above 1: classifier-free guidance; "
                                         f"at most 1: none), got {s!r}")
    return v


def open_fraction(s: str) -> float:
    """A fraction strictly between 0 and 1 (--mask-ratio: the share of patches masked)."""
    v = finite_float(s)
    if not 0 < v < 1:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1), got {s!r}")
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


def add_prompt(p: argparse.ArgumentParser, *, required: bool, help: str, force_help: str | None = None) -> None:
    """``--prompt``, ``--force`` (where the command refuses a prompt a model does not know: ``force_help``) and
    ``--negative-prompt``: what ``generate`` and the diffusion evals take alike."""
    p.add_argument("--prompt", required=required, default=None, help=help)
    if force_help is not None:
        p.add_argument("--force", action="store_true", help=force_help)
    p.add_argument("--negative-prompt", default=None)


def add_denoising_runs(p: argparse.ArgumentParser, *, decode_help: str, no_decode_help: str,
                       compile_help: str) -> None:
    """How the diffusion evals run each schedule: ``--decode``/``--no-decode`` (None where neither is given: the
    eval's default), ``--no-warmup``, ``--compile [regional|full]``."""
    from fp4vis.services.runtime import COMPILE_MODES

    dec = p.add_mutually_exclusive_group()
    dec.add_argument("--decode", dest="decode", action="store_true", default=None, help=decode_help)
    dec.add_argument("--no-decode", dest="decode", action="store_false", help=no_decode_help)
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed 1-step warm-up before each run")
    p.add_argument("--compile", nargs="?", const="regional", default=None, choices=COMPILE_MODES, help=compile_help)
