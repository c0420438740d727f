"""Compile-level checks of the kernel backends on any machine (no GPU, no driver).

``python -m fp4vis.kernels.compile_check --arch sm_90a [options]`` runs the check of the backend that
targets that architecture and passes the remaining options on (``--help`` after the arch lists
them). Each backend's own module does the work: ``fp4vis.kernels.hopper.compile_check`` for sm_90a,
``fp4vis.kernels.blackwell.compile_check`` for sm_100a, sm_103a and sm_120a (it exits non-zero where
the FP4 block-scaled MMA is absent).
"""

from __future__ import annotations

import argparse
import importlib
import sys

# target architecture -> module with the compile check of the backend built for it
CHECKS = {"sm_90a": "fp4vis.kernels.hopper.compile_check", "sm_100a": "fp4vis.kernels.blackwell.compile_check",
          "sm_103a": "fp4vis.kernels.blackwell.compile_check", "sm_120a": "fp4vis.kernels.blackwell.compile_check"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=False)
    ap.add_argument("--arch", default="sm_90a", choices=sorted(CHECKS),
                    help="target architecture (default sm_90a)")
    args, rest = ap.parse_known_args(sys.argv[1:] if argv is None else argv)
    return importlib.import_module(CHECKS[args.arch]).main(["--arch", args.arch, *rest])


if __name__ == "__main__":
    raise SystemExit(main())
