"""What the ``fp4vis eval`` commands share: the ``--protocol`` help, the line saying what an eval runs (with the
warning that the policies run on the reference where no FP4 kernel does), a figure or its absence, and the
files an eval wrote."""

from __future__ import annotations

import argparse

from .options import announcer

PROTOCOL_HELP = ("run the method's published protocol (fp4vis.evals.paper_protocols): its model (unless --model), "
                 "sizes, image counts, seeds and policies, and its published figures beside each row")


def eval_announcer(args: argparse.Namespace):
    """``say`` of an eval: the line saying what it runs (``announcer``), then, on a device without an FP4 kernel,
    the one warning that the policies run on the reference (``warn_reference_fallback``)."""
    from fp4vis.services.policies import warn_reference_fallback
    from fp4vis.services.runtime import resolve_device

    header = announcer(args)

    def say(text: str) -> None:
        if header is not None:
            header(text)
        for name in filter(None, (p.strip() for p in args.policies.split(","))):
            if warn_reference_fallback(args.backend, resolve_device(args.device), name,
                                       f"fp4vis eval {args.eval_command}"):
                break
    return say


def figure(x) -> str:
    """A measured or published figure, or a dash where there is none."""
    return "—" if x is None else f"{x:.4g}"


def print_files(result: dict) -> None:
    """The files an eval wrote (its ``files``: kind -> path), one a line."""
    for kind, path in (result.get("files") or {}).items():
        print(f"{kind}: {path}")


def run_line(name: str, run: dict, emulated: bool, timing: str, details: str = "") -> str:
    """One run of a diffusion eval: its ``timing``, speedups against BF16 and each baseline (none where the FP4
    runs were the reference emulation: its times are no speed result), ``details``, the latent cosine and, where
    decoded, PSNR/SSIM (``frames``, or ``video``)."""
    if "error" in run:
        return f"{name}: FAILED {run['error']}"
    speedups = "" if emulated else ", ".join(f"{x:.2f}x vs {ref}" for ref, x in run.get("speedup_vs", {}).items()
                                             if ref != name)
    line = f"{name}: {timing}" + (f", speedup {speedups}" if speedups else "") + details
    if "latent_cosine" in run:
        line += f", latent cosine {run['latent_cosine']:.5f}"
    frames = run.get("frames") or run.get("video")
    if frames:
        line += f", PSNR {frames['psnr_mean']:.2f} dB, SSIM {frames['ssim_mean']:.4f}"
    return line


def print_schedule_notes(result: dict) -> bool:
    """What a diffusion eval's schedule says before its runs' lines: the baselines skipped (and why), and whether
    the FP4 runs were the reference emulation (then no speedup is given). Returns the latter."""
    from fp4vis.evals.common import reference_timed

    for why in (f"{b}: {reason}" for b, reason in result["baselines_skipped"].items()):
        print(f"baseline skipped, {why}")
    emulated = reference_timed(result)
    if emulated:
        print("FP4 runs on the reference emulation: times are the emulation's, no speedup is given")
    return emulated
