"""Fixed-resolution and single-image towers (CLIP, SigLIP, SAM, timm, ...): one image of the tower's ``image_size``."""

from __future__ import annotations

from typing import Any

from torch import nn

from lab.vlms import TinyVlm, fixed_pixels


def _eager(config: Any) -> Any:
    config._attn_implementation = "eager"
    for name in ("text_config", "vision_config"):
        sub = getattr(config, name, None)
        if sub is not None:
            sub._attn_implementation = "eager"
    return config


_TOKENS = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
_SIGLIP_64 = {"model_type": "siglip_vision_model", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
              "intermediate_size": 128, "image_size": 64, "patch_size": 8, "vision_use_head": False}  # fmt: skip
_COHERE2 = {"model_type": "cohere2", "vocab_size": 128, "hidden_size": 128, "intermediate_size": 37,
            "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_act": "silu", "max_position_embeddings": 512,
            "tie_word_embeddings": False, **_TOKENS}  # fmt: skip


def _aya_vision() -> nn.Module:
    from transformers import AyaVisionConfig, AyaVisionForConditionalGeneration

    config = AyaVisionConfig(text_config=dict(_COHERE2), vision_config=dict(_SIGLIP_64), image_token_index=2,
                             vision_feature_layer=-1, downsample_factor=2, tie_word_embeddings=False,
                             **_TOKENS)  # fmt: skip
    return AyaVisionForConditionalGeneration(_eager(config))


def _cohere2_vision() -> nn.Module:
    from transformers import Cohere2VisionConfig, Cohere2VisionForConditionalGeneration

    config = Cohere2VisionConfig(text_config=dict(_COHERE2), vision_config=dict(_SIGLIP_64), image_token_id=2,
                                 downsample_factor=2, alignment_intermediate_size=32,
                                 tie_word_embeddings=False)  # fmt: skip
    return Cohere2VisionForConditionalGeneration(_eager(config))


def _got_ocr2() -> nn.Module:
    from transformers import GotOcr2Config, GotOcr2ForConditionalGeneration

    text = {"model_type": "qwen2", "vocab_size": 128, "hidden_size": 128, "intermediate_size": 37,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_act": "silu",
            "max_position_embeddings": 512, "rope_theta": 10000, "tie_word_embeddings": False}  # fmt: skip
    vision = {"num_hidden_layers": 2, "output_channels": 64, "hidden_act": "quick_gelu", "hidden_size": 32,
              "mlp_dim": 128, "num_attention_heads": 4, "patch_size": 2, "image_size": 64,
              "initializer_range": 0.02}  # fmt: skip
    config = GotOcr2Config(text_config=text, vision_config=vision, image_token_index=1, tie_word_embeddings=False,
                           **_TOKENS)  # fmt: skip
    return GotOcr2ForConditionalGeneration(_eager(config))


MODELS = [
    TinyVlm(("aya_vision",), _aya_vision, fixed_pixels, image_token_id=2),
    TinyVlm(("cohere2_vision",), _cohere2_vision, fixed_pixels, image_token_id=2),
    TinyVlm(("got_ocr2", "pp_chart2table"), _got_ocr2, fixed_pixels, image_token_id=1,
            source="tester, vision initializer_range 0.02 (the SAM default 1e-10 gives the tower denormal gradients)"),
]
