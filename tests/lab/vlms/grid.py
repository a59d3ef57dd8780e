"""Patch-grid families (``pixel_values`` rows of patches + ``image_grid_thw``): GLM and Qwen-VL lineage."""

from __future__ import annotations

from typing import Any

from torch import nn

from fsdp_compat.testing.zoo import _GLM_TOKENS, _GLM_VISION, glm4v_config
from lab.vlms import TinyVlm, grid_pixels


def _eager(config: Any) -> Any:
    config._attn_implementation = "eager"
    return config


def _glm46v() -> nn.Module:
    """GLM-4.6V: GLM4V's text and vision configs under its own outer class (the zoo GLM4V's sizes)."""
    from transformers import Glm46VConfig, Glm46VForConditionalGeneration

    glm4v = glm4v_config()
    config = Glm46VConfig(text_config=glm4v.text_config.to_dict(), vision_config=dict(_GLM_VISION),
                          tie_word_embeddings=False, **_GLM_TOKENS)  # fmt: skip
    return Glm46VForConditionalGeneration(_eager(config))


MODELS = [
    TinyVlm(("glm46v", "glmga"), _glm46v, grid_pixels, source="the zoo GLM4V's sizes (GLM4V's configs)"),
]
