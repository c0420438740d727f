"""Video generation: a diffusers pipeline patched with FP4 attention (``wan_video``), and its spread over
the GPUs of a torchrun launch (``context_parallel``)."""

if __name__ == "pipelines":  # imported as top-level `pipelines` from the repository root: never hide the installed one
    from fp4vis.toplevel import yield_to_installed

    yield_to_installed(__name__)
