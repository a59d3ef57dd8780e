"""Fixed-resolution and single-image towers (CLIP, SigLIP, SAM, timm, ...): one image of the tower's ``image_size``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lab.vlms import TinyVlm, eager, fixed_pixels
from lab.vlms.grid import AUDIO_NOTE, VIDEO_NOTE, OmniVlm

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
    return AyaVisionForConditionalGeneration(eager(config))


def _cohere2_vision() -> nn.Module:
    from transformers import Cohere2VisionConfig, Cohere2VisionForConditionalGeneration

    config = Cohere2VisionConfig(text_config=dict(_COHERE2), vision_config=dict(_SIGLIP_64), image_token_id=2,
                                 downsample_factor=2, alignment_intermediate_size=32,
                                 tie_word_embeddings=False)  # fmt: skip
    return Cohere2VisionForConditionalGeneration(eager(config))


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
    return GotOcr2ForConditionalGeneration(eager(config))


# tests/vlm_tester.py's VLMModelTester defaults (DeepSeek-VL's tester): hidden 32, 2 heads, image 8 x 8, patch 4.
_VLM_TESTER_TEXT = {"model_type": "llama", "vocab_size": 128, "hidden_size": 32, "num_hidden_layers": 2,
                    "num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 37, "hidden_act": "gelu",
                    "max_position_embeddings": 512, "tie_word_embeddings": False, "pad_token_id": 0,
                    "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip
_VLM_TESTER_SIGLIP = {"model_type": "siglip_vision_model", "hidden_size": 32, "num_hidden_layers": 2,
                      "num_attention_heads": 2, "intermediate_size": 37, "image_size": 8, "patch_size": 4,
                      "vision_use_head": False}  # fmt: skip


def _deepseek_vl() -> nn.Module:
    from transformers import DeepseekVLConfig, DeepseekVLForConditionalGeneration

    config = DeepseekVLConfig(text_config=dict(_VLM_TESTER_TEXT), vision_config=dict(_VLM_TESTER_SIGLIP),
                              image_token_id=5, tie_word_embeddings=False)  # fmt: skip
    return DeepseekVLForConditionalGeneration(eager(config))


def _janus() -> nn.Module:
    from transformers import JanusConfig, JanusForConditionalGeneration

    text = {"model_type": "llama", "vocab_size": 128, "hidden_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 4, "intermediate_size": 37, "hidden_act": "gelu", "max_position_embeddings": 512,
            "pad_token_id": 1, "tie_word_embeddings": False}  # fmt: skip
    vision = {"image_size": 20, "patch_size": 5, "num_image_tokens": 4, "num_channels": 3, "hidden_size": 32,
              "projection_dim": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "mlp_ratio": 2}  # fmt: skip
    vq = {"embed_dim": 12, "num_embeddings": 12, "latent_channels": 12, "in_channels": 3, "base_channels": 32,
          "channel_multiplier": [1, 1], "projection_dim": 10, "image_token_embed_dim": 32}  # fmt: skip
    config = JanusConfig(text_config=text, vision_config=vision, vq_config=vq, image_token_id=5,
                         tie_word_embeddings=False)  # fmt: skip
    return JanusForConditionalGeneration(eager(config))


def _deepseek_vl_hybrid() -> nn.Module:
    from transformers import DeepseekVLHybridConfig, DeepseekVLHybridForConditionalGeneration

    text = {"num_hidden_layers": 2, "vocab_size": 128, "hidden_size": 16, "intermediate_size": 37,
            "max_position_embeddings": 512, "num_attention_heads": 4, "pad_token_id": 1,
            "tie_word_embeddings": False}  # fmt: skip
    vision = {"num_hidden_layers": 2, "hidden_size": 16, "intermediate_size": 37, "image_size": 32, "patch_size": 8,
              "hidden_act": "gelu", "vision_use_head": False, "num_attention_heads": 4, "num_channels": 3}  # fmt: skip
    high_res = {"num_hidden_layers": 2, "global_attn_indexes": [0], "hidden_size": 16, "intermediate_size": 37,
                "mlp_dim": 24, "output_channels": 4, "image_size": 128, "patch_size": 32, "num_attention_heads": 4,
                "num_channels": 3, "initializer_range": 0.02}  # fmt: skip
    config = DeepseekVLHybridConfig(text_config=text, vision_config=vision, high_res_vision_config=high_res,
                                    image_token_id=5, tie_word_embeddings=False)  # fmt: skip
    return DeepseekVLHybridForConditionalGeneration(eager(config))


def _ovis2() -> nn.Module:
    from transformers import Ovis2Config, Ovis2ForConditionalGeneration

    text = {"model_type": "qwen2", "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 54, "hidden_act": "gelu",
            "max_position_embeddings": 580, "pad_token_id": 0, "tie_word_embeddings": False}  # fmt: skip
    vision = {"image_size": 32, "patch_size": 8, "num_channels": 3, "hidden_size": 64, "vocab_size": 99,
              "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 54, "hidden_act": "silu",
              "qkv_bias": False, "hidden_stride": 2, "tokenize_function": "softmax"}  # fmt: skip
    config = Ovis2Config(text_config=text, vision_config=vision, image_token_id=5, visual_indicator_token_ids=[],
                         vocab_size=128, hidden_size=64, tie_word_embeddings=False)  # fmt: skip
    return Ovis2ForConditionalGeneration(eager(config))


def _video_llava() -> nn.Module:
    from transformers import VideoLlavaConfig, VideoLlavaForConditionalGeneration

    text = {"model_type": "llama", "vocab_size": 128, "hidden_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 4, "intermediate_size": 37, "max_position_embeddings": 512, "pad_token_id": 0,
            "tie_word_embeddings": False}  # fmt: skip
    vision = {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 2,
              "num_attention_heads": 4, "image_size": 16, "patch_size": 4, "projection_dim": 32}  # fmt: skip
    config = VideoLlavaConfig(text_config=text, vision_config=vision, image_token_index=5, video_token_index=6,
                              vision_feature_layer=-1, tie_word_embeddings=False)  # fmt: skip
    return VideoLlavaForConditionalGeneration(eager(config))


def _video_llava_pixels(config: Any, g: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    """``n`` random images at the image tower's ``image_size``, as ``pixel_values_images``."""
    return {"pixel_values_images": fixed_pixels(config, g, n)["pixel_values"]}


def _video_llava_videos(config: Any, g: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    """``n`` random videos of 2 frames at the video tower's ``image_size``: ``(n, 2, C, S, S)``."""
    frames = [fixed_pixels(config, g, 2)["pixel_values"] for _ in range(n)]
    return {"pixel_values_videos": torch.stack(frames)}


def _florence2() -> nn.Module:
    from transformers import Florence2Config, Florence2ForConditionalGeneration

    text = {"model_type": "bart", "vocab_size": 128, "max_position_embeddings": 64, "encoder_layers": 2,
            "encoder_ffn_dim": 16, "encoder_attention_heads": 1, "decoder_layers": 2, "decoder_ffn_dim": 16,
            "decoder_attention_heads": 1, "d_model": 16, "activation_function": "gelu", "dropout": 0.0,
            "attention_dropout": 0.0, "activation_dropout": 0.0, "eos_token_id": 2, "bos_token_id": 0,
            "pad_token_id": 1}  # fmt: skip
    vision = {"drop_path_rate": 0.0, "patch_size": [7, 3], "depths": [1, 1], "patch_stride": [4, 2],
              "patch_padding": [3, 1], "patch_prenorm": [False, True], "embed_dim": [16, 16], "num_heads": [1, 1],
              "num_groups": [1, 1], "window_size": 12, "activation_function": "gelu", "projection_dim": 16}  # fmt: skip
    config = Florence2Config(text_config=text, vision_config=vision, image_token_id=5, initializer_range=0.02)
    return Florence2ForConditionalGeneration(eager(config))


def _florence2_pixels(config: Any, g: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    """``n`` random 16 x 16 images (DaViT takes any size; its strides make 2 x 2 features of 16 x 16)."""
    return {"pixel_values": torch.randn(n, 3, 16, 16, generator=g)}


def _inkling() -> nn.Module:
    from transformers import InklingConfig, InklingForConditionalGeneration

    text = {"vocab_size": 128, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 2, "head_dim": 16, "swa_num_attention_heads": 2, "swa_num_key_value_heads": 2,
            "swa_head_dim": 16, "layer_types": ["hybrid_sliding", "hybrid"], "mlp_layer_types": ["dense", "sparse"],
            "intermediate_size": 37, "moe_intermediate_size": 16, "n_routed_experts": 16, "num_experts_per_tok": 2,
            "n_shared_experts": 1, "sliding_window_size": 16, "rel_extent": 64, "max_position_embeddings": 512,
            "pad_token_id": 0, "tie_word_embeddings": False}  # fmt: skip
    vision = {"patch_size": 5, "num_hidden_layers": 2, "num_channels": 3}
    config = InklingConfig(text_config=text, vision_config=vision,
                           audio_config={"hidden_size": 32, "n_mel_bins": 4, "mel_vocab_size": 8}, image_token_id=5,
                           audio_token_id=8, image_bos_token_id=6, audio_bos_token_id=7,
                           tie_word_embeddings=False)  # fmt: skip
    return InklingForConditionalGeneration(eager(config))


def _inkling_clips(config: Any, g: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    """``n`` random clips of two frames of dMel bin tokens, ``(n, 2, n_mel_bins)`` long: two tokens each."""
    audio = config.audio_config
    return {"audio_input_ids": torch.randint(0, int(audio.mel_vocab_size), (n, 2, int(audio.n_mel_bins)), generator=g)}


def _inkling_pixels(config: Any, g: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    """``n`` random packed patches ``(n, T, P, P, C)``: one patch, one placeholder token, per image."""
    vision = config.vision_config
    shape = (n, vision.temporal_patch_size, vision.patch_size, vision.patch_size, vision.num_channels)
    return {"pixel_values": torch.randn(*shape, generator=g)}


def _hybrid_pixels(config: Any, g: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    """``n`` random images at both towers' resolutions (``pixel_values``, ``high_res_pixel_values``)."""
    low, high = config.vision_config.image_size, config.high_res_vision_config.image_size
    return {"pixel_values": torch.randn(n, 3, low, low, generator=g),
            "high_res_pixel_values": torch.randn(n, 3, high, high, generator=g)}  # fmt: skip


MODELS = [
    TinyVlm(("aya_vision",), _aya_vision, fixed_pixels, image_token_id=2),
    TinyVlm(("cohere2_vision",), _cohere2_vision, fixed_pixels, image_token_id=2),
    TinyVlm(
        ("got_ocr2", "pp_chart2table"),
        _got_ocr2,
        fixed_pixels,
        image_token_id=1,
        source="tester, vision initializer_range 0.02 (the SAM default 1e-10 gives the tower denormal gradients)",
    ),
    TinyVlm(
        ("deepseek_vl",),
        _deepseek_vl,
        fixed_pixels,
        image_token_id=5,
        source="tester (tests/vlm_tester.py's VLMModelTester defaults)",
    ),
    TinyVlm(("janus",), _janus, fixed_pixels, image_token_id=5),
    TinyVlm(
        ("deepseek_vl_hybrid",),
        _deepseek_vl_hybrid,
        _hybrid_pixels,
        image_token_id=5,
        source="tester, 2 SigLIP layers (tester: 1), SAM initializer_range 0.02 (default 1e-10)",
        parity="reordered",
        note="within 1e-6 relative, not 0.0: the aligned image/text run is 1.5e-11 off (the SAM tower's "
        "patch-embed conv weight gradient), as is its all-image run, which needs no dummy (2.9e-11): FSDP2 "
        "reorders a sum",
    ),
    TinyVlm(("ovis2",), _ovis2, fixed_pixels, image_token_id=5),
    OmniVlm(
        ("video_llava",),
        _video_llava,
        _video_llava_pixels,
        image_token_id=5,
        source="config defaults shrunk (CLIP 2 x 32, image 16, patch 4; Llama 2 x 32)",
        note=VIDEO_NOTE.format(how="a second tower (video_tower), aligned in a column of its own"),
        clips=None,
        videos=_video_llava_videos,
        video_token_id=6,
    ),
    OmniVlm(
        ("inkling_mm_model",),
        _inkling,
        _inkling_pixels,
        image_token_id=5,
        source="tester (InklingVision2TextModelTester; text as InklingTextModelTester: hybrid_sliding + hybrid "
        "layers, dense + sparse MLPs), 2 of 16 experts per token; needs scipy (transformers' Inkling tower)",
        note=AUDIO_NOTE,
        audio_token_id=8,
        clips=_inkling_clips,
    ),
    TinyVlm(
        ("florence2",),
        _florence2,
        _florence2_pixels,
        image_token_id=5,
        source="tester, 2 encoder + 2 decoder layers and 2 DaViT stages (tester: 1 each), dropout 0; BART ties "
        "its embeddings (no untied variant)",
        parity="measured",
        note="the row's text model is language_model.encoder (BART's encoder consumes the features: the forward "
        "calls it, never language_model itself); FSDP2 alone is not exact here: the all-image run (no dummy) is "
        "1.5e-08 off in gradients (the tied shared embedding), 9.3e-08 in parameters after 2 AdamW steps; the "
        "aligned image|text run 7.5e-09 and 1.2e-07 (1.3x: other batches, other roundings)",
    ),
]
