"""The eval suites (ViT top-1, MAE reconstruction PSNR, video fidelity and speed, the demo) and the kernel
benchmark, with what they share: datasets, baselines, reports and plots."""

if __name__ == "evals":  # imported as top-level `evals` from the repository root: never hide the installed one
    from fp4vis.toplevel import yield_to_installed

    yield_to_installed(__name__)
