"""Generation with FP4 attention, each module named for what it holds. For any diffusers pipeline:
``model_files`` (what a model source's files say), ``media_files`` (MP4 and PNG writing), ``compile``
(torch.compile of the transformers), ``denoising_steps`` (step indices and step callbacks) and
``diffusers_generate`` (``fp4vis generate`` on any pipeline but Wan's). For Wan2.1: ``wan_sizes`` (the sizes its
VAE and transformer take), ``wan_video`` (loading and ``generate``), ``wan_generate`` (``fp4vis generate`` on
Wan); and ``context_parallel`` (the spread over the GPUs of a torchrun launch)."""

if __name__ == "pipelines":  # imported as top-level `pipelines` from the repository root: never hide the installed one
    from fp4vis.toplevel import yield_to_installed

    yield_to_installed(__name__)
