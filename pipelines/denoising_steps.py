"""Denoising steps, for any diffusers pipeline: which step indices exist (``check_steps``), several
``callback_on_step_end`` callbacks chained into one (``chained_callbacks``) and a copy of the latents after
given steps (``LatentsAfterSteps``)."""

from __future__ import annotations

from typing import Any

from fp4vis.services.usage import UsageError


def chained_callbacks(callbacks: list[Any]):
    """One ``callback_on_step_end`` for several (diffusers' MultiPipelineCallbacks takes PipelineCallback
    objects only); each gets the callback_kwargs the one before returned."""
    if len(callbacks) == 1:
        return callbacks[0]

    def call(pipeline, step_index, timestep, callback_kwargs):
        for cb in callbacks:
            callback_kwargs = cb(pipeline, step_index, timestep, callback_kwargs)
        return callback_kwargs

    return call


class LatentsAfterSteps:
    """A ``callback_on_step_end`` keeping a copy of the latents after ``steps`` denoising steps (1 = after
    the first step), float32 on the CPU."""

    def __init__(self, steps: tuple[int, ...]):
        self.steps, self.latents = set(int(s) for s in steps), {}

    @property
    def tensor_inputs(self) -> list[str]:
        return ["latents"]

    def __call__(self, pipeline, step_index: int, timestep, callback_kwargs: dict[str, Any]) -> dict[str, Any]:
        if step_index + 1 in self.steps:
            self.latents[step_index + 1] = callback_kwargs["latents"].detach().float().cpu()
        return callback_kwargs


def check_steps(indices: tuple[int, ...] | None, steps: int, option: str = "exact_steps") -> None:
    """Denoising step indices exist: ``0 .. steps - 1``, or ``-steps .. -1`` counted from the end (-1: the
    last). A UsageError naming ``option`` otherwise (the step callback would skip it without a word)."""
    bad = [i for i in indices or () if not -steps <= i < steps]
    if bad:
        raise UsageError(f"{option}: step {bad[0]} does not exist in {steps} denoising step"
                         f"{'s' if steps > 1 else ''} (indices 0..{steps - 1}, or -{steps}..-1 from the end)")
