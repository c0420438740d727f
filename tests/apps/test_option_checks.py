"""The checks behind the CLI's options (issue 33): their bounds are the libraries' real ones, read from torch
and from the model's own configs, not guessed."""

from __future__ import annotations

import argparse

import pytest
import torch

from fp4vis.cli import options
from fp4vis.pipelines import wan_sizes as ws
from fp4vis.pipelines.denoising_steps import check_steps
from fp4vis.services.runtime import SEED_MAX, SEED_MIN, derived_seed
from fp4vis.services.usage import UsageError


def test_seed_bounds_are_what_torch_generators_accept():
    for value in (SEED_MIN, -1, 0, SEED_MAX):
        assert options.seed(str(value)) == value
        torch.Generator().manual_seed(value)
    for value in (SEED_MIN - 1, SEED_MAX + 1):
        with pytest.raises(argparse.ArgumentTypeError, match=r"must be an integer in \[-2\*\*63, 2\*\*64 - 1\]"):
            options.seed(str(value))
        with pytest.raises((ValueError, RuntimeError, OverflowError)):
            torch.Generator().manual_seed(value)
    # seeds derived from the user's (seed + prompt index) wrap as torch counts them: no overflow at the top
    assert derived_seed(SEED_MAX, 1) == 0 and derived_seed(-1, 0) == SEED_MAX
    g = torch.Generator().manual_seed(derived_seed(-5, 2))
    assert torch.equal(torch.randn(3, generator=g), torch.randn(3, generator=torch.Generator().manual_seed(-3)))


@pytest.mark.parametrize("text, ok", [("0", True), ("7.5", True), ("-0.5", False), ("nan", False), ("inf", False),
                                      ("-inf", False), ("five", False)])
def test_guidance_is_a_finite_number_at_least_0(text, ok):
    if ok:
        assert options.guidance(text) == float(text)
    else:
        with pytest.raises(argparse.ArgumentTypeError, match=f"must be a finite number.*got '{text}'"):
            options.guidance(text)


def test_step_indices_exist():
    check_steps((0, 1, -1, -2), 2)
    check_steps(None, 1)
    for bad in (2, -3):
        with pytest.raises(UsageError, match=f"--exact-steps: step {bad} does not exist in 2 denoising steps "
                                             r"\(indices 0..1, or -2..-1 from the end\)"):
            check_steps((0, bad), 2, "--exact-steps")


def test_wan_limits_are_read_from_the_model_config_before_loading(tiny_wan):
    """The geometry from the configs alone equals the loaded pipeline's, and its limits are where diffusers'
    rotary embedding really stops: the largest frames and size run through it, one step more fails."""
    from diffusers import WanTransformer3DModel

    geometry = ws.wan_geometry(str(tiny_wan))
    assert geometry == ws.WanGeometry(temporal=4, spatial=8, patch=(1, 2, 2), rope_max_seq_len=32)
    rope = WanTransformer3DModel.from_pretrained(str(tiny_wan), subfolder="transformer").rope

    def latent(frames, height, width):
        return torch.zeros(1, 1, geometry.latent_frames(frames), height // 8, width // 8)

    most = (geometry.max_frames, geometry.max_size(1), geometry.max_size(2))
    assert most == (125, 512, 512)
    geometry.check(frames=most[0], height=most[1], width=most[2])
    rope(latent(*most))
    for frames, height, width in ((most[0] + 4, 16, 16), (1, most[1] + 16, 16), (1, 16, most[2] + 16)):
        with pytest.raises(UsageError, match="at most"):
            geometry.check(frames=frames, height=height, width=width)
        with pytest.raises(RuntimeError):      # what the user got instead: a shape error from deep inside
            rope(latent(frames, height, width))
    for frames, height in ((6, 16), (5, 72)):
        with pytest.raises(UsageError, match="4k \\+ 1" if frames == 6 else "multiple of 16"):
            geometry.check(frames=frames, height=height, width=16)


def test_wan_size_multiple_is_the_vae_and_patch_and_the_pipeline_16():
    """A patch of 1 leaves the VAE's 8, but diffusers' Wan pipelines refuse any size not a multiple of 16."""
    assert ws.WanGeometry(4, 8, (1, 1, 1), 1024).size_multiple(1) == 16
    assert ws.WanGeometry(4, 8, (1, 2, 4), 1024).size_multiple(2) == 32
    assert ws.WanGeometry.of_size("1.3B").max_frames == 4093 == ws.WanGeometry.of_size("14B").max_frames
