"""Kernel backends of fp4vis, one subpackage each (``hopper``: sm_90a, CuTe DSL; ``blackwell``:
sm_100a / sm_103a / sm_120a, Triton on the block-scaled FP4 MMAs). The backend
registry (``fp4vis.backends.registry``) loads a subpackage's ``backend`` module on first use."""

if __name__ == "kernels":  # imported as top-level `kernels` from the repository root: never hide the installed one
    from fp4vis.toplevel import yield_to_installed

    yield_to_installed(__name__)
