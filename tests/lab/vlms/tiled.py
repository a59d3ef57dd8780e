"""Tiled, any-resolution and masked families (tiles of whole images, ``image_sizes``, pixel masks): InternVL, the
LLaVA-Next line, Idefics2, Pixtral kin and the others of ``TILED_FAMILIES``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lab.vlms import TinyVlm, fixed_pixels

IMAGE = 10  # the image placeholder token of every model here (special ids < 16)


def _eager(config: Any) -> Any:
    config._attn_implementation = "eager"
    for sub in ("text_config", "vision_config"):
        if getattr(config, sub, None) is not None:
            getattr(config, sub)._attn_implementation = "eager"
    return config


def _qwen2_text(**extra: Any) -> dict[str, Any]:
    """A 2-layer Qwen2 text config (vocab 128, untied, pad 0)."""
    text = dict(model_type="qwen2", vocab_size=128, hidden_size=64, intermediate_size=37, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, hidden_act="silu",
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
                bos_token_id=0, eos_token_id=0, pad_token_id=0)  # fmt: skip
    text.update(extra)
    return text


# ---------------------------------------------------------------------------------------------------- InternVL


def _internvl() -> nn.Module:
    from transformers import InternVLConfig, InternVLForConditionalGeneration

    vision = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                  image_size=32, patch_size=4, num_channels=3, hidden_act="quick_gelu",
                  use_absolute_position_embeddings=True)  # fmt: skip
    config = InternVLConfig(text_config=_qwen2_text(hidden_size=128), vision_config=vision, image_token_id=IMAGE,
                            image_seq_length=16, vision_feature_layer=-1, bos_token_id=0, eos_token_id=0,
                            pad_token_id=0, tie_word_embeddings=False)  # fmt: skip
    return InternVLForConditionalGeneration(_eager(config))


MODELS = [
    TinyVlm(("internvl",), _internvl, fixed_pixels, IMAGE,
            source="tester (text hidden 128, vision hidden 32 patch 4), image_size 32 instead of 64: 16 tokens"),
]


# ------------------------------------------------------------------------ LLaVA-Next line (anyres, image_sizes)

_CLIP = dict(model_type="clip_vision_model", image_size=16, patch_size=4, num_channels=3, hidden_size=32,
             projection_dim=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37)  # fmt: skip
_LLAMA = dict(model_type="llama", vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              intermediate_size=37, hidden_act="gelu", max_position_embeddings=580, pad_token_id=0,
              tie_word_embeddings=False)  # fmt: skip
_PINPOINTS = [[32, 32]]


def _llava_next(prefix: str, **extra: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers

        config = getattr(transformers, f"{prefix}Config")(
            text_config=dict(_LLAMA), vision_config=dict(_CLIP), image_token_index=IMAGE, projector_hidden_act="gelu",
            vision_feature_select_strategy="default", vision_feature_layer=-1, image_grid_pinpoints=_PINPOINTS,
            tie_word_embeddings=False, **extra,
        )  # fmt: skip
        return getattr(transformers, f"{prefix}ForConditionalGeneration")(_eager(config))

    return build


def anyres_pixels(config: Any, g: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    """``n`` random 30 x 30 images (the tester's size) as the base tile plus the 32 x 32 pinpoint's tiles."""
    vision = config.vision_config
    side = int(vision.image_size)
    height, width = config.image_grid_pinpoints[0]
    tiles = 1 + (height // side) * (width // side)
    return {"pixel_values": torch.randn(n, tiles, int(vision.num_channels), side, side, generator=g),
            "image_sizes": torch.tensor([[30, 30]] * n)}  # fmt: skip


_ANYRES = "tester (CLIP 16 px tiles, pinpoints [[32, 32]], Llama text hidden 32), patch 4 instead of 2"

MODELS += [
    TinyVlm(("llava_next",), _llava_next("LlavaNext"), anyres_pixels, IMAGE, source=_ANYRES),
    TinyVlm(("llava_onevision",), _llava_next("LlavaOnevision"), anyres_pixels, IMAGE, source=_ANYRES),
    TinyVlm(("llava_next_video",), _llava_next("LlavaNextVideo"), anyres_pixels, IMAGE, source=_ANYRES),
]
