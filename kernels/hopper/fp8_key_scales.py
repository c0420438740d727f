"""The FP8 K scales' contract between the Hopper pre-pass and kernel: one power-of-two scale per 32 keys, padded
to whole kernel tiles (docs/hopper_kernel.md, "Operands")."""

from __future__ import annotations

from fp4vis.key_positions import KEY_BLOCK

FP8_KEY_GROUP = KEY_BLOCK   # keys per FP8 K scale: the P block
FP8_KEY_TILE = 128          # keys per kernel tile: k_scale covers whole tiles, so the kernel loads it unmasked


def fp8_key_scale_blocks(skv: int) -> int:
    """Entries of k_scale per head: the 32-key blocks of ceil(Skv / 128) whole kernel tiles."""
    return FP8_KEY_TILE // FP8_KEY_GROUP * -(-skv // FP8_KEY_TILE)
