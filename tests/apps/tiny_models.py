"""Tiny models and data for the tests, built
locally and saved in the real formats, so that every command can be run end to end without downloads or a GPU.
Imported as ``apps.tiny_models`` (``tests/`` is on the tests' path: tests/conftest.py's fixtures use it too).

Each ``make_*`` writes a folder that the real loading code reads back: a diffusers Wan pipeline
(with a tiny UMT5 text encoder and a word-level tokenizer), a timm ViT (``save_for_hf``), a
transformers ViT classifier and a ViTMAE (``save_pretrained``), and an ImageFolder of small images.
Nothing here is meant to be accurate; the weights are seeded random numbers.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

TINY_WORDS = ("a", "the", "cat", "dog", "fox", "red", "blue", "in", "snow", "on", "beach", "running", "video")


def make_tiny_wan(path: str | os.PathLike, *, seed: int = 0, text_encoder: bool = True, head_dim: int = 16) -> Path:
    """A 2-layer Wan2.1-style T2V pipeline (2 heads of ``head_dim``) saved with save_pretrained."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel

    torch.manual_seed(seed)
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=head_dim, in_channels=16, out_channels=16,
        text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32)
    vae = AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True])
    scheduler = FlowMatchEulerDiscreteScheduler(shift=7.0)
    tok = enc = None
    if text_encoder:
        tok, enc = tiny_text_encoder(seed)
    pipe = WanPipeline(tokenizer=tok, text_encoder=enc, vae=vae, scheduler=scheduler, transformer=transformer)
    path = Path(path)
    pipe.save_pretrained(str(path))
    return path


def tiny_text_encoder(seed: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    for w in TINY_WORDS:
        vocab.setdefault(w, len(vocab))
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                  model_max_length=512)
    torch.manual_seed(seed + 1)
    cfg = UMT5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=32, num_layers=1, num_heads=4,
                     relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    return tok, UMT5EncoderModel(cfg).eval()


def make_tiny_timm_vit(path: str | os.PathLike, *, num_classes: int = 5, img_size: int = 32, seed: int = 0) -> Path:
    """A 2-block timm ViT (patch 8, width 64, 2 heads of 32) saved with timm's save_for_hf."""
    import timm
    from timm.models._hub import save_for_hf

    torch.manual_seed(seed)
    args = dict(img_size=img_size, patch_size=8, embed_dim=64, depth=2, num_heads=2, num_classes=num_classes)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, **args)
    path = Path(path)
    save_for_hf(model, str(path), model_args=args, safe_serialization=True)
    return path


def make_tiny_hf_vit(path: str | os.PathLike, *, num_classes: int = 5, img_size: int = 32, seed: int = 0) -> Path:
    """A 2-layer transformers ViTForImageClassification (patch 8, 2 heads of 32) with id2label."""
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(seed)
    cfg = ViTConfig(image_size=img_size, patch_size=8, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                    intermediate_size=64, num_labels=num_classes,
                    id2label={i: f"class{i}" for i in range(num_classes)},
                    label2id={f"class{i}": i for i in range(num_classes)})
    model = ViTForImageClassification(cfg)
    path = Path(path)
    model.save_pretrained(str(path))
    return path


def make_tiny_mae(path: str | os.PathLike, *, img_size: int = 32, seed: int = 0, norm_pix_loss: bool = False) -> Path:
    """A tiny ViTMAEForPreTraining (patch 8, encoder 2 layers x 2 heads of 32, decoder 1 layer)."""
    from transformers import ViTMAEConfig, ViTMAEForPreTraining

    torch.manual_seed(seed)
    cfg = ViTMAEConfig(image_size=img_size, patch_size=8, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                       intermediate_size=64, decoder_hidden_size=32, decoder_num_hidden_layers=1,
                       decoder_num_attention_heads=2, decoder_intermediate_size=32, norm_pix_loss=norm_pix_loss)
    model = ViTMAEForPreTraining(cfg)
    path = Path(path)
    model.save_pretrained(str(path))
    return path


def make_image_folder(path: str | os.PathLike, *, classes: tuple[str, ...] = ("0", "1"), per_class: int = 2,
                      size: int = 40, seed: int = 0) -> Path:
    """An ImageFolder of smooth random RGB images (PNG), ``per_class`` per class folder."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    root = Path(path)
    for c in classes:
        (root / c).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            low = rng.random((4, 4, 3))
            img = np.kron(low, np.ones((size // 4 + 1, size // 4 + 1, 1)))[:size, :size]
            img = np.clip(img + 0.05 * rng.standard_normal(img.shape), 0, 1)
            Image.fromarray((img * 255).astype(np.uint8)).save(root / c / f"img{i}.png")
    return root


def make_tiny_wan_i2v(path: str | os.PathLike, *, seed: int = 0, head_dim: int = 16) -> Path:
    """A 2-layer Wan2.1-style I2V pipeline (tiny CLIP image encoder, image branch in the transformer)."""
    from diffusers import (
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        WanImageToVideoPipeline,
        WanTransformer3DModel,
    )
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(seed)
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=head_dim, in_channels=36, out_channels=16,
        text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32, image_dim=32, added_kv_proj_dim=2 * head_dim)
    vae = AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True])
    image_encoder = CLIPVisionModel(CLIPVisionConfig(hidden_size=32, image_size=32, patch_size=8, num_hidden_layers=2,
                                                     num_attention_heads=2, intermediate_size=32, projection_dim=32))
    image_processor = CLIPImageProcessor(crop_size=32, size=32)
    tok, enc = tiny_text_encoder(seed)
    pipe = WanImageToVideoPipeline(tokenizer=tok, text_encoder=enc, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(
        shift=7.0), image_processor=image_processor, image_encoder=image_encoder, transformer=transformer)
    path = Path(path)
    pipe.save_pretrained(str(path))
    return path


def make_tiny_flux(path: str | os.PathLike, *, seed: int = 0) -> Path:
    """A FluxPipeline of one double and one single block (2 heads of 16), a one-level VAE, a CLIP and a T5 text
    encoder of one layer each, with the word-level tokenizer of ``tiny_text_encoder``, saved with save_pretrained."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                         attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                         pooled_projection_dim=32, axes_dims_rope=[4, 4, 8])
    vae = AutoencoderKL(sample_size=32, in_channels=3, out_channels=3, block_out_channels=(4,), layers_per_block=1,
                        latent_channels=1, norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False,
                        shift_factor=0.0609, scaling_factor=1.5035)
    clip_tokenizer, _ = tiny_text_encoder(seed)
    clip_tokenizer.model_max_length = 16   # the CLIP encoder's positions
    clip = CLIPTextModel(CLIPTextConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, max_position_embeddings=16, projection_dim=32,
                                        pad_token_id=0, bos_token_id=1, eos_token_id=1))
    t5_tokenizer, _ = tiny_text_encoder(seed)
    t5 = T5EncoderModel(T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=32, num_layers=1, num_heads=4,
                                 relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1,
                                 decoder_start_token_id=0))
    pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=clip,
                        tokenizer=clip_tokenizer, text_encoder_2=t5, tokenizer_2=t5_tokenizer, transformer=transformer)
    path = Path(path)
    pipe.save_pretrained(str(path))
    return path
