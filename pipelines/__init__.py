"""Video generation: a diffusers Wan pipeline loaded and run with FP4 attention (``wan_video``), the sizes its
VAE and transformer take (``wan_sizes``), the ``fp4vis generate`` command (``wan_generate``), and the spread
over the GPUs of a torchrun launch (``context_parallel``)."""

if __name__ == "pipelines":  # imported as top-level `pipelines` from the repository root: never hide the installed one
    from fp4vis.toplevel import yield_to_installed

    yield_to_installed(__name__)
