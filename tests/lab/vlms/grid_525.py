"""Patch-grid families new in transformers 5.25 (``llava_onevision1_5``, ``ovis2_5``): the third set of
``get_image_features(pixel_values, image_grid_thw, ...)`` families.

Their classes exist from transformers 5.25 on (the builders import them lazily, so the registry loads on 5.24, which
discovers neither family): the families test runs them in ``families525``. Sizes from each family's tester in
transformers' ``tests/models/<type>/test_modeling_<type>.py`` where it is small (else the config class's defaults,
shrunk: said in ``source``), with 2 text and 2 vision layers, special token ids below 16, a vocabulary of 128, untied
embeddings, fp32 and eager attention.
"""

from __future__ import annotations

import torch
from torch import nn

from lab.vlms import TinyVlm, eager, grid_pixels

# ---------------------------------------------------------------------------------------------- LLaVA-OneVision-1.5


def _llava_onevision1_5() -> nn.Module:
    """LLaVA-OneVision-1.5 (a RICE-ViT tower: Conv2d patches, a CLS token per image, 2D RoPE, a 2 x 2 patch merger;
    a Qwen3 text model): the tester's sizes are the 8B checkpoint's, so the config defaults shrunk (patch 14, merge
    2 kept; hidden 32, 2 heads, as the 2D RoPE needs hidden divisible by 4 heads)."""
    from transformers import LlavaOnevision15Config, LlavaOnevision15ForConditionalGeneration

    text = {"model_type": "qwen3", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 37,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
            "hidden_act": "silu", "max_position_embeddings": 512, "pad_token_id": 0, "bos_token_id": 1,
            "eos_token_id": 2, "tie_word_embeddings": False}  # fmt: skip
    vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 37, "num_heads": 2, "in_channels": 3,
              "patch_size": 14, "spatial_merge_size": 2, "out_hidden_size": 32}  # fmt: skip
    config = LlavaOnevision15Config(text_config=text, vision_config=vision, image_token_id=10, video_token_id=11,
                                    vision_start_token_id=3, vision_end_token_id=4,
                                    tie_word_embeddings=False)  # fmt: skip
    return LlavaOnevision15ForConditionalGeneration(eager(config))


# ------------------------------------------------------------------------------------------------------- Ovis2.5


def _ovis2_5() -> nn.Module:
    """Ovis2.5 (a SigLIP-style tower over packed patches with bicubic-interpolated positions and windowed RoPE
    attention; a visual tokenizer that softmaxes merged patches over a visual vocabulary, embedded by a table whose
    last rows are the image/video boundary embeddings; a Qwen3 text model): the tester's sizes (hidden 16, 4 heads,
    patch 2, image 4, window 4, visual vocabulary 12 with 4 indicators), 2 layers each, text heads 4 of 8."""
    from transformers import Ovis2_5Config, Ovis2_5ForConditionalGeneration

    text = {"model_type": "qwen3", "vocab_size": 128, "hidden_size": 16, "intermediate_size": 32,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
            "hidden_act": "silu", "max_position_embeddings": 512, "pad_token_id": 0, "bos_token_id": 1,
            "eos_token_id": 2, "tie_word_embeddings": False}  # fmt: skip
    vision = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_channels": 3, "image_size": 4, "patch_size": 2, "window_size": 4, "attention_dropout": 0.0,
              "vocab_size": 12, "num_visual_indicator_tokens": 4}  # fmt: skip
    config = Ovis2_5Config(text_config=text, vision_config=vision, image_token_id=10, video_token_id=11,
                           image_start_token_id=5, image_end_token_id=6, video_start_token_id=7,
                           video_end_token_id=8, tie_word_embeddings=False)  # fmt: skip
    return Ovis2_5ForConditionalGeneration(eager(config))


def _ovis_boundaries(batch: dict[str, torch.Tensor], variant: str) -> dict[str, torch.Tensor]:
    """The processor's image start and end tokens around each image's placeholders (Ovis2.5's forward replaces them
    with the visual table's boundary embeddings and requires one of each per image); text rows keep their text."""
    if variant != "image":
        return {}
    input_ids = batch["input_ids"].clone()
    for row in input_ids:
        placeholders = (row == 10).nonzero().flatten()
        row[int(placeholders[0]) - 1], row[int(placeholders[-1]) + 1] = 5, 6
    return {"input_ids": input_ids, "labels": input_ids.masked_fill(input_ids == 10, -100)}


MODELS = [
    TinyVlm(
        ("llava_onevision1_5",),
        _llava_onevision1_5,
        grid_pixels,
        source="the tester's sizes are the 8B checkpoint's: the config defaults shrunk",
    ),
    TinyVlm(("ovis2_5",), _ovis2_5, grid_pixels, extra=_ovis_boundaries),
]
