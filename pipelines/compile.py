"""torch.compile of a pipeline's transformers (``compile_transformers``), the way ``fp4vis generate`` and the
pipeline evals compile them (``fp4vis.services.runtime.COMPILE_MODES``)."""

from __future__ import annotations

from fp4vis.pipelines.model_files import pipeline_transformers
from fp4vis.services.runtime import COMPILE_MODES
from fp4vis.services.usage import UsageError

# transformer classes whose diffusers release names no repeated blocks (its regional compilation refuses them),
# and their blocks: the class names ``compile_repeated_blocks`` reads from ``_repeated_blocks``
REPEATED_BLOCKS = {"CogVideoXTransformer3DModel": ["CogVideoXBlock"]}


def compile_transformers(pipe, mode: str, backend: str = "inductor") -> None:
    """torch.compile the pipeline's transformers in place with ``fullgraph=True``, as diffusers documents:
    ``"regional"``, ``ModelMixin.compile_repeated_blocks`` (the Wan blocks share one graph, compiled once:
    diffusers' advice for diffusion transformers, a fraction of the compile time), or ``"full"``,
    ``ModelMixin.compile`` (the whole transformer, one graph). Each compiles at its first call; patched and
    unpatched layers alike (docs/patching.md, "torch.compile"). ``backend``: torch.compile's (the tests'
    "aot_eager" traces the same graphs without generating code). A transformer ``REPEATED_BLOCKS`` names gets
    its blocks there first."""
    if mode not in COMPILE_MODES:
        raise UsageError(f"compile: must be one of {', '.join(COMPILE_MODES)}, got {mode!r}")
    for transformer in pipeline_transformers(pipe):
        if mode == "regional":
            if not getattr(transformer, "_repeated_blocks", None) and type(transformer).__name__ in REPEATED_BLOCKS:
                transformer._repeated_blocks = REPEATED_BLOCKS[type(transformer).__name__]
            transformer.compile_repeated_blocks(fullgraph=True, backend=backend)
        else:
            transformer.compile(fullgraph=True, backend=backend)
