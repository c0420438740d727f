"""``fp4vis selfcheck``: run the Blackwell kernel's self-check on this GPU now (every policy, D 64 and
128, partial tiles, cross-attention, BF16 and FP16 against the reference) and print its table, then the
first-use timing: the kernel against BF16 attention (SDPA, flash-attn-4 where installed) on this GPU, with the
ratio (on the H200 through the sm_90 verification route, labelled as not a Blackwell figure). The same check and
timing run by themselves at the backend's first use; this command runs them on demand."""

from __future__ import annotations

import argparse

from .options import Formatter


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("selfcheck", formatter_class=Formatter,
                       help="check the Blackwell kernel against the reference on this GPU",
                       description="Run the Blackwell backend's self-check on a GPU now and print the table, then "
                                   "time the kernel against BF16 attention there (SDPA; flash-attn-4 where "
                                   "installed) and print the ratio; exit status 1 when a case fails (the backend "
                                   "then refuses to run there). On an H200 the kernel runs through its sm_90 "
                                   "verification route: its figures are not Blackwell figures.")
    p.add_argument("--device", default="cuda", help="the CUDA device to check, e.g. cuda:1")
    p.add_argument("--cached", action="store_true", help="print the verdict and timing cached on disk, if any, "
                                                         "instead of running the check again")


def run(args: argparse.Namespace) -> int:
    import torch

    from fp4vis.backends import get_backend
    from fp4vis.backends.registry import load_error
    from fp4vis.services.runtime import resolve_device
    from fp4vis.services.usage import UsageError

    if not torch.cuda.is_available():   # resolve_device's advice (--device cpu) does not apply here
        raise UsageError("the self-check needs a CUDA GPU (it checks the Blackwell kernel there: sm_100, sm_103 or "
                         "sm_120), and none is visible here (torch.cuda.is_available() is False)")
    dev = resolve_device(args.device)
    if dev.type != "cuda":
        raise UsageError(f"--device: the self-check runs on a CUDA GPU, got {str(dev)!r}")
    backend = get_backend("blackwell")
    if backend is None:
        raise UsageError(f"the Blackwell backend cannot load here: {load_error('blackwell')}")
    reason = backend.unavailable_reason()
    if reason is not None:
        raise UsageError(f"the Blackwell backend does not run on {torch.cuda.get_device_name(dev)}: {reason}")
    from fp4vis.kernels.blackwell.backend import run_table

    passed, table = run_table(dev, force=not args.cached)
    print(table)
    return 0 if passed else 1
