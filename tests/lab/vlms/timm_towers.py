"""Families whose vision tower is a timm model (transformers' ``TimmWrapperModel``): PerceptionLM, FastVLM, Gemma3n.

Why a module of their own: timm imports torchvision, and no torchvision wheel imports beside the default envs' CPU
torch 2.13, so these run in ``families524-timm`` (torch 2.14.1 + torchvision 0.29.1); elsewhere their run cases are
skipped by ``requires``. The builders import transformers' classes lazily, so the registry loads without timm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lab.vlms import TinyVlm, eager
from lab.vlms.grid import AUDIO_NOTE, OmniVlm

_TEXT = {"vocab_size": 128, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
         "intermediate_size": 37, "hidden_act": "gelu", "max_position_embeddings": 512, "pad_token_id": 1,
         "tie_word_embeddings": False}  # fmt: skip
#: The PE ViT of PerceptionLM's tester (and of Gemma3n's: "timm doesn't let us create a tiny MobileNet").
_PE = {"architecture": "vit_pe_core_large_patch14_336", "do_pooling": False,
       "model_args": {"embed_dim": 32, "depth": 2, "num_heads": 4, "img_size": (28, 28), "ref_feat_shape": (2, 2),
                      "global_pool": "", "use_post_transformer_norm": False, "init_values": 0.1}}  # fmt: skip


@dataclass(frozen=True)
class TimmVlm(TinyVlm):
    """A :class:`TinyVlm` with a timm tower; ``requires``: the modules its run needs (skipped where missing),
    ``env``: the tox env that runs it."""

    requires: tuple[str, ...] = ("timm",)
    env: str = "families524-timm"


@dataclass(frozen=True)
class TimmOmniVlm(TimmVlm, OmniVlm):
    """A timm-tower family whose batches may carry audio too (Gemma3n)."""


def _side(config: Any) -> int:
    from fsdp_compat.runtime.vlm_families import _timm_side

    return _timm_side(config.vision_config)


def _images(config: Any, g: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    """``n`` random images at the tower's side, ``(n, 3, S, S)``."""
    side = _side(config)
    return {"pixel_values": torch.randn(n, 3, side, side, generator=g)}


def _tiles(config: Any, g: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    """``n`` random images of one tile each, ``(n, 1, 3, S, S)`` (PerceptionLM's layout)."""
    return {"pixel_values": _images(config, g, n)["pixel_values"].unsqueeze(1)}


def _perception_lm() -> nn.Module:
    from transformers import PerceptionLMConfig, PerceptionLMForConditionalGeneration

    config = PerceptionLMConfig(text_config={"model_type": "llama", **_TEXT}, vision_config=dict(_PE),
                                image_token_id=10, video_token_id=11, tie_word_embeddings=False)  # fmt: skip
    return PerceptionLMForConditionalGeneration(eager(config))


def _fast_vlm() -> nn.Module:
    from transformers import FastVlmConfig, FastVlmForConditionalGeneration

    vision = {"architecture": "fastvit_mci3", "do_pooling": True, "global_pool": "avg", "hidden_size": 32,
              "image_size": 16, "model_args": {"inference_mode": True, "layers": (2, 2), "embed_dims": (8, 16),
              "mlp_ratios": (4, 4), "se_downsamples": (False, False), "downsamples": (False, True),
              "pos_embs": (None, None), "token_mixers": ("repmixer", "repmixer"), "lkc_use_act": True,
              "stem_use_scale_branch": False}}  # fmt: skip
    text = {"model_type": "qwen2", **_TEXT, "num_key_value_heads": 4}
    config = FastVlmConfig(text_config=text, vision_config=vision, image_token_id=10, tie_word_embeddings=False)
    return FastVlmForConditionalGeneration(eager(config))


def _gemma3n() -> nn.Module:
    from transformers import Gemma3nConfig, Gemma3nForConditionalGeneration

    text = {**_TEXT, "vocab_size_per_layer_input": 128, "hidden_size": 16, "hidden_size_per_layer_input": 16,
            "num_kv_shared_layers": 0, "layer_types": ["full_attention", "sliding_attention"], "num_attention_heads": 2,
            "num_key_value_heads": 2, "altup_num_inputs": 2, "intermediate_size": 21, "pad_token_id": 0,
            "hidden_activation": "gelu_pytorch_tanh", "activation_sparsity_pattern": None}  # fmt: skip
    text.pop("hidden_act")
    pe = {"embed_dim": 64, "img_size": (20, 20), "depth": 2, "global_pool": "", "use_post_transformer_norm": False,
          "init_values": 0.1, "ref_feat_shape": (1, 1)}  # fmt: skip
    vision = {"architecture": "vit_pe_core_large_patch14_336", "hidden_size": 32, "model_args": pe}
    audio = {"input_feat_size": 32, "hidden_size": 32, "conf_num_attention_heads": 4, "conf_num_hidden_layers": 2,
             "sscp_conv_channel_size": (16, 8), "conf_conv_kernel_size": 3, "conf_attention_chunk_size": 4,
             "conf_attention_context_left": 5, "vocab_offset": 0}  # fmt: skip
    config = Gemma3nConfig(text_config=text, vision_config=vision, audio_config=audio, image_token_id=3, boi_token_id=4,
                           eoi_token_id=5, boa_token_id=6, eoa_token_id=7, audio_token_id=8,
                           vision_soft_tokens_per_image=4, audio_soft_tokens_per_image=4,
                           tie_word_embeddings=False)  # fmt: skip
    return Gemma3nForConditionalGeneration(eager(config))


def _gemma3n_clips(config: Any, g: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    """``n`` random clips of 8 mel frames with the processor's all-valid ``input_features_mask`` (True: a real
    frame; the forward inverts it for the tower)."""
    mels = int(config.audio_config.input_feat_size)
    return {"input_features": torch.randn(n, 8, mels, generator=g),
            "input_features_mask": torch.ones(n, 8, dtype=torch.bool)}  # fmt: skip


MODELS: list[TinyVlm] = [
    TimmVlm(
        ("perception_lm",),
        _perception_lm,
        _tiles,
        source="tester's PE ViT (vit_pe_core_large_patch14_336 through model_args), 32 wide, 2 deep, "
        "28 x 28: 2 x 2 patches of 14",
    ),
    TimmVlm(("fast_vlm",), _fast_vlm, _images, source="tester (FastViT fastvit_mci3 of 2 stages, 16 x 16)"),
    TimmOmniVlm(
        ("gemma3n",),
        _gemma3n,
        _images,
        image_token_id=3,
        source="tester (its PE ViT stand-in for MobileNetV5, which timm builds at full size only; 2 text "
        "layers, no KV sharing; audio vocab_offset 0: the forward pads the audio tokens with the text vocab's last "
        "id, which the audio embedder reads at that id minus its offset, out of range with the default 262272 and a "
        "128-token vocab: IndexError)",
        note=AUDIO_NOTE,
        audio_token_id=8,
        clips=_gemma3n_clips,
        audio_tokens=4,
    ),
]
