"""More patch-grid families (``get_image_features(pixel_values, image_grid_thw, ...)`` and kin): the second set.

Sizes from each family's tester in transformers' ``tests/models/<type>/test_modeling_<type>.py`` where it is stored
(else the config class's defaults, shrunk: said in ``source``), with 2 text and 2 vision layers, special token ids
below 16, a vocabulary of 128, untied embeddings, fp32 and eager attention.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lab.vlms import TinyVlm, eager, grid_pixels
from lab.vlms.grid import AUDIO_NOTE, VIDEO_NOTE, OmniVlm

# ------------------------------------------------------------------------------------------------- ERNIE 4.5 VL


def _ernie4_5_vl_moe() -> nn.Module:
    """ERNIE-4.5-VL (MoE): the tester's text and vision sizes, vocab 128, untied."""
    from transformers import Ernie4_5_VLMoeConfig, Ernie4_5_VLMoeForConditionalGeneration

    text = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 1, "hidden_act": "silu", "max_position_embeddings": 512,
            "tie_word_embeddings": False, "mlp_layer_types": ["dense", "sparse"], "moe_intermediate_size": [32, 32],
            "moe_k": 2, "moe_num_experts": 8, "moe_num_shared_experts": 2, "moe_norm_min": 1e-12,
            "rope_parameters": {"type": "default", "rope_theta": 500_000.0, "mrope_section": [3, 3, 2]}}  # fmt: skip
    vision = {"depth": 2, "hidden_size": 32, "hidden_act": "silu", "intermediate_size": 32, "num_heads": 2,
              "spatial_merge_size": 1}  # fmt: skip
    config = Ernie4_5_VLMoeConfig(text_config=text, vision_config=vision, image_token_id=7, video_token_id=8,
                                  video_start_token_id=3, video_end_token_id=4, image_start_token_id=5,
                                  image_end_token_id=6, tie_word_embeddings=False)  # fmt: skip
    return Ernie4_5_VLMoeForConditionalGeneration(eager(config))


def _ernie_moe_types(batch: dict[str, torch.Tensor], variant: str) -> dict[str, torch.Tensor]:
    """The processor's ``moe_mm_token_type_ids`` (1 on image tokens): routes them to the vision experts."""
    return {"moe_mm_token_type_ids": (batch["input_ids"] == 7).long()}


# ------------------------------------------------------------------------------------------------------ Kimi K2.5


def conv_patch_pixels(config: Any, g: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    """``n`` random images as ``(patches, C, p, p)`` patch images (Kimi's Conv2d patch embedding) with their
    ``image_grid_thw``: 2k x 3k and 3k x 2k patches alternating (k x k: the merge kernel)."""
    vision = config.vision_config
    kh, kw = (int(k) for k in vision.merge_kernel_size)
    patch = int(vision.patch_size)
    grids = [[1, 2 * kh, 3 * kw] if i % 2 == 0 else [1, 3 * kh, 2 * kw] for i in range(n)]
    patches = sum(t * h * w for t, h, w in grids)
    return {"pixel_values": torch.randn(patches, 3, patch, patch, generator=g), "image_grid_thw": torch.tensor(grids)}


def _kimi_k25() -> nn.Module:
    """Kimi K2.5: the tester's kwargs over VLMModelTester's defaults (DeepseekV3 text: hidden 32, 2 heads, 8 experts
    of 12, top-2, MLA ranks 16/32; vision: patch 8, 4 heads of 8, 4 x 4 position table, merge kernel 1 x 1)."""
    from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration

    text = {"model_type": "deepseek_v3", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 37,
            "moe_intermediate_size": 12, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
            "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 2, "n_group": 1, "topk_group": 1,
            "first_k_dense_replace": 1, "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 16,
            "v_head_dim": 32, "qk_nope_head_dim": 32, "hidden_act": "silu", "max_position_embeddings": 512,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000}, "pad_token_id": 0, "bos_token_id": 1,
            "eos_token_id": 2, "tie_word_embeddings": False}  # fmt: skip
    vision = {"patch_size": 8, "pos_emb_height": 4, "pos_emb_width": 4, "pos_emb_time": 1, "num_attention_heads": 4,
              "num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 37, "hidden_act": "silu",
              "merge_kernel_size": (1, 1)}  # fmt: skip
    config = Kimi_K25Config(text_config=text, vision_config=vision, projection_hidden_size=32, image_token_id=3,
                            video_token_id=4, vision_start_token_id=5, vision_end_token_id=6,
                            tie_word_embeddings=False)  # fmt: skip
    return Kimi_K25ForConditionalGeneration(eager(config))


# ------------------------------------------------------------------------------------------------------ HunYuanVL


def wide_grid_pixels(config: Any, g: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    """``n`` random images of 2m x 3m patches each (Qwen-VL layout): for towers whose feature count is not
    h * w / m^2 (HunYuanVL adds a newline per row), so that every image takes as many placeholders as the first;
    still not the dummy's 2m x 2m square."""
    one = grid_pixels(config, g, 1)
    pixels = torch.cat([one["pixel_values"], *(grid_pixels(config, g, 1)["pixel_values"] for _ in range(n - 1))])
    return {"pixel_values": pixels, "image_grid_thw": one["image_grid_thw"].repeat(n, 1)}


def _hunyuan_vl() -> nn.Module:
    """HunYuanVL (HunyuanOCR): the tester's sizes (hidden 64, 4 heads of 16, patch 16, merge 1, image 64)."""
    from transformers import HunYuanVLConfig, HunYuanVLForConditionalGeneration

    text = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16, "hidden_act": "silu",
            "max_position_embeddings": 128, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
            "tie_word_embeddings": False, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                             "mrope_section": [2, 2, 2, 2]}}  # fmt: skip
    vision = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 4, "hidden_act": "silu", "num_channels": 3, "patch_size": 16,
              "temporal_patch_size": 1, "spatial_merge_size": 1, "out_hidden_size": 64, "text_hidden_size": 64,
              "max_image_size": 64, "min_image_size": 64, "max_vit_seq_len": 16}  # fmt: skip
    config = HunYuanVLConfig(text_config=text, vision_config=vision, image_token_id=5, tie_word_embeddings=False)
    return HunYuanVLForConditionalGeneration(eager(config))


# ---------------------------------------------------------------------------------------------------- VideoLLaMA3


def merge_size_pixels(config: Any, g: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    """``n`` random images as patch rows with ``image_grid_thw`` (2 x 3 and 3 x 2 patches alternating) and
    ``image_merge_sizes`` of 1 (VideoLLaMA3's processor merges images 1 x 1, videos 2 x 2)."""
    vision = config.vision_config
    dim = int(vision.num_channels) * int(vision.patch_size) ** 2
    grids = [[1, 2, 3] if i % 2 == 0 else [1, 3, 2] for i in range(n)]
    return {"pixel_values": torch.randn(6 * n, dim, generator=g), "image_grid_thw": torch.tensor(grids),
            "image_merge_sizes": torch.ones(n, dtype=torch.long)}  # fmt: skip


def _video_llama_3() -> nn.Module:
    """VideoLLaMA3: the tester's sizes (Qwen2 text: hidden 32, 4 heads, 2 kv; vision: hidden 32, 4 heads, patch
    14)."""
    from transformers import VideoLlama3Config, VideoLlama3ForConditionalGeneration

    text = {"model_type": "qwen2", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 37,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_act": "silu",
            "max_position_embeddings": 512, "max_window_layers": 3, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
            "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
            "tie_word_embeddings": False}  # fmt: skip
    vision = {"model_type": "video_llama_3_vision", "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_channels": 3, "patch_size": 14,
              "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-06, "attention_dropout": 0.0}  # fmt: skip
    config = VideoLlama3Config(text_config=text, vision_config=vision, use_token_compression=True, image_token_id=3,
                               video_token_id=4, tie_word_embeddings=False)  # fmt: skip
    return VideoLlama3ForConditionalGeneration(eager(config))


# -------------------------------------------------------------------------------------------------- MiniMax-M3-VL


def _minimax_m3_vl() -> nn.Module:
    """MiniMax-M3-VL: the tester's sizes (text hidden 32, 4 heads of 32, a dense then a MoE layer of 4 experts,
    the second layer sparse-attention with blocks of 8; vision hidden 32, patch 14, temporal 2, merge 1), as the
    tester's legacy keys (``moe_layer_freq``, ``sparse_attention_config``) which the 5.24 config still maps."""
    from transformers import MiniMaxM3SparseForConditionalGeneration, MiniMaxM3VLConfig

    text = {"hidden_size": 32, "intermediate_size": 64, "dense_intermediate_size": 128,
            "shared_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 32, "rotary_dim": 16, "hidden_act": "silu",
            "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "vocab_size": 128, "bos_token_id": 0,
            "eos_token_id": 1, "pad_token_id": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
            "moe_layer_freq": [0, 1], "routed_scaling_factor": 2.0, "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
            "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "partial_rotary_factor": 0.5},
            "sparse_attention_config": {"sparse_attention_freq": [0, 1], "sparse_block_size": 8,
                                        "sparse_index_dim": 16, "sparse_local_block": 1,
                                        "sparse_num_index_heads": 2, "sparse_topk_blocks": 4}}  # fmt: skip
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_channels": 3, "image_size": 14, "patch_size": 14, "temporal_patch_size": 2,
              "spatial_merge_size": 1}  # fmt: skip
    config = MiniMaxM3VLConfig(text_config=text, vision_config=vision, image_token_index=4, video_token_index=5,
                               projector_hidden_size=32, tie_word_embeddings=False)  # fmt: skip
    return MiniMaxM3SparseForConditionalGeneration(eager(config))


# ----------------------------------------------------------------------------------------------------- dots3 note


def _dots3_note() -> nn.Module:
    """dots3-note: the tester's ``get_tiny_config`` (flat text keys, hidden 32, MLA ranks 16, a full and a
    sliding-window layer, 4 experts; vision hidden 32, patch 2, merge 2, a dense then a 2-expert MoE block; a
    2-layer audio tower of 32), with DSA off (the tester's default) and special tokens moved below 16."""
    from transformers import Dots3NoteConfig, Dots3NoteForConditionalGeneration

    vision = {"embed_dim": 32, "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 32,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_channels": 3, "patch_size": 2,
              "spatial_merge_size": 2, "temporal_patch_size": 1, "pyramid_num_routed": [-1, 2], "capacity_factor": 2,
              "adapter_in_dim": 32, "adapter_out_dim": 32, "adapter_merge_size": 2}  # fmt: skip
    audio = {"whisper_config": {"d_model": 32, "encoder_attention_heads": 4, "encoder_ffn_dim": 64,
                                "encoder_layers": 2, "num_mel_bins": 8, "max_source_positions": 32,
                                "activation_function": "swiglu"},
             "feature_size": 8, "n_fft": 16, "hop_length": 4, "chunk_seconds": 1, "downsample_hidden_size": 4,
             "conv_bucket_step": None, "conv_bucket_max_elements": None, "adapter_input_size": 32,
             "adapter_output_size": 32}  # fmt: skip
    config = Dots3NoteConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=128, seq_length=128, q_lora_rank=16, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, head_dim=16,
        layer_types=["full_attention", "sliding_attention"], sliding_window_size=4, swa_num_attention_heads=4,
        swa_num_key_value_heads=4, swa_q_lora_rank=16, swa_kv_lora_rank=16, swa_head_dim=16,
        swa_qk_nope_head_dim=8, swa_qk_rope_head_dim=8, swa_v_head_dim=8, index_n_heads=2, index_head_dim=128,
        index_topk=4, use_dsa=False, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_experts_intermediate_size=16, moe_shared_expert_intermediate_size=16,
        first_k_dense_replace=1, image_token_id=10, image_start_token_id=6, image_end_token_id=7, video_token_id=11,
        audio_start_token_id=8, audio_end_token_id=9, audio_token_id=12, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, vision_config=vision, audio_config=audio, tie_word_embeddings=False,
    )  # fmt: skip
    return Dots3NoteForConditionalGeneration(eager(config))


def _dots3_clips(config: Any, g: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    """``n`` random chunks of 16 mel frames, ``(n, feature_size, 16)``, and their ``chunk_sample_lengths`` (16
    hops: two tokens each)."""
    audio = config.audio_config
    return {"input_features": torch.randn(n, int(audio.feature_size), 16, generator=g),
            "chunk_sample_lengths": torch.full((n,), 16 * int(audio.hop_length), dtype=torch.long)}  # fmt: skip


# -------------------------------------------------------------------------------------------------------- LFM3-VL


def _lfm3_vl() -> nn.Module:
    """LFM3-VL: no tester stored; the config defaults shrunk (text: hidden 64, a conv then a full-attention layer,
    4 heads of 16, 2 kv; vision: hidden 32, a conv then a full-attention layer, 4 heads, 2 kv, patch 4, temporal
    2, merge 2; projector 64)."""
    from transformers import Lfm3VlConfig, Lfm3VlForConditionalGeneration

    text = {"model_type": "lfm3", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "layer_types": ["conv", "full_attention"], "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 16, "max_position_embeddings": 256,
            "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}  # fmt: skip
    vision = {"hidden_size": 32, "intermediate_size": 64, "in_channels": 3, "patch_size": 4, "spatial_merge_size": 2,
              "temporal_patch_size": 2, "num_hidden_layers": 2, "layer_types": ["conv", "full_attention"],
              "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
    config = Lfm3VlConfig(text_config=text, vision_config=vision, image_token_id=10, video_token_id=11,
                          vision_start_token_id=12, vision_end_token_id=13, projector_hidden_size=64,
                          tie_word_embeddings=False)  # fmt: skip
    return Lfm3VlForConditionalGeneration(eager(config))


# --------------------------------------------------------------------------------------------------- Cosmos3 Edge


def _cosmos3_edge() -> nn.Module:
    """Cosmos3 Edge: the tester's sizes (hidden 32, 4 heads of 8, 2 kv, relu2, mrope [2, 1, 1]; vision hidden 32,
    patch 2, a 2 x 2 position table, merge 2; projector 64)."""
    from transformers import Cosmos3EdgeConfig, Cosmos3EdgeForConditionalGeneration

    text = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 128,
            "hidden_act": "relu2", "rms_norm_eps": 1e-5, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
            "tie_word_embeddings": False, "rope_parameters": {"rope_type": "default", "rope_theta": 100_000_000,
                                                             "mrope_section": [2, 1, 1]}}  # fmt: skip
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_channels": 3, "patch_size": 2, "num_patches": 4, "spatial_merge_size": 2}  # fmt: skip
    config = Cosmos3EdgeConfig(text_config=text, vision_config=vision, projector_hidden_size=64, image_token_id=3,
                               video_token_id=4, vision_start_token_id=5, vision_end_token_id=6,
                               tie_word_embeddings=False)  # fmt: skip
    return Cosmos3EdgeForConditionalGeneration(eager(config))


# ------------------------------------------------------------------------------------------------------- HY-V4-VL


def _hy_v4_vl() -> nn.Module:
    """HY-V4-VL: no tester stored; the config defaults shrunk (text: hidden 32, 4 heads, MLA ranks 16 with
    8 + 8 head dims, mrope [2, 1, 1], a dense then a MoE layer of 4 experts, both indexed attention (a full then a
    shared indexer, 2 heads of 16, top 4), hyper-connections x4 as default; vision: hidden 32, 4 heads, patch 4,
    merge 2, a 4 x 4 position table)."""
    from transformers import HYV4VLConfig, HYV4VLForConditionalGeneration

    text = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 8,
            "max_position_embeddings": 256, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
            "tie_word_embeddings": False, "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
            "q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8,
            "qk_head_dim": 16, "mlp_layer_types": ["dense", "sparse"],
            "layer_types": ["indexed_attention", "indexed_attention"], "indexer_types": ["full", "shared"],
            "index_topk": 4, "index_head_dim": 16, "index_n_heads": 2,
            "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default", "mrope_section": [2, 1, 1]}}  # fmt: skip
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4,
              "num_hidden_layers": 2, "num_channels": 3, "patch_size": 4, "spatial_merge_size": 2,
              "max_image_size": 16, "out_hidden_size": 32}  # fmt: skip
    config = HYV4VLConfig(text_config=text, vision_config=vision, image_token_id=10, video_token_id=11,
                          tie_word_embeddings=False)  # fmt: skip
    return HYV4VLForConditionalGeneration(eager(config))


# ------------------------------------------------------------------------------------------------------- Inkling 2


def token_patch_pixels(config: Any, g: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    """``n`` random images as Inkling2 lays them out: one ``(p m, p m, C)`` tile per language-model image token, and
    ``image_grid_thw`` counted in those tokens (2 x 3 and 3 x 2 alternating)."""
    vision = config.vision_config
    side = int(vision.patch_size) * int(vision.spatial_merge_size)
    grids = [[1, 2, 3] if i % 2 == 0 else [1, 3, 2] for i in range(n)]
    pixels = torch.rand(6 * n, side, side, int(vision.num_channels), generator=g) * 2 - 1
    return {"pixel_values": pixels, "image_grid_thw": torch.tensor(grids)}


def _inkling2_sizes() -> tuple[dict[str, Any], dict[str, Any]]:
    text = {"vocab_size": 128, "unpadded_vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "swa_num_attention_heads": 4,
            "swa_num_key_value_heads": 2, "swa_head_dim": 16, "sliding_window_size": 8, "d_rel": 4,
            "rel_extent": 16, "layer_types": ["hybrid_sliding", "hybrid"], "max_position_embeddings": 256,
            "moe_intermediate_size": 16, "n_routed_experts": 4, "num_experts_per_tok": 2,
            "n_layers_per_attn_res_block": 1, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
            "tie_word_embeddings": False}  # fmt: skip
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_channels": 3, "patch_size": 4, "spatial_merge_size": 2, "posemb_grid_size": 4,
              "projection_hidden_dim": 64, "text_hidden_size": 64}  # fmt: skip
    return text, vision


_INKLING_NOTE = (
    "FSDP2 alone is not exact here, even with no image on either rank (text|text: its text model's sums are "
    "reordered): the all-image run (no dummy) is off by {alone}; the aligned image|text run by {aligned}"
)


def _inkling2() -> nn.Module:
    """Inkling 2: no tester stored; the config defaults shrunk (text: hidden 64, a hybrid-sliding then a hybrid
    layer, 4 heads of 16, 2 kv, window 8, 4 experts of 16, top 2; vision: hidden 32, 4 heads, patch 4, merge 2, a
    4 x 4 position grid, projector 64)."""
    from transformers import Inkling2Config, Inkling2ForConditionalGeneration

    text, vision = _inkling2_sizes()
    config = Inkling2Config(text_config=text, vision_config=vision, image_token_id=10, tie_word_embeddings=False)
    return Inkling2ForConditionalGeneration(eager(config))


def _inkling2_loop() -> nn.Module:
    """Inkling 2 Loop: no tester stored; Inkling 2's shrunk sizes (same vision tower class) with the second layer
    looped twice (gate rank 4)."""
    from transformers import Inkling2LoopConfig, Inkling2LoopForConditionalGeneration

    text, vision = _inkling2_sizes()
    text.update(loop_layer_index_start=1, loop_layer_index_end=2, loop_num_passes=2, loop_gate_rank=4)
    config = Inkling2LoopConfig(text_config=text, vision_config={"model_type": "inkling2_vision", **vision},
                                image_token_id=10, tie_word_embeddings=False)  # fmt: skip
    return Inkling2LoopForConditionalGeneration(eager(config))


# ---------------------------------------------------------------------------------------------------- MuseGlimmer


def muse_pixels(config: Any, g: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    """:func:`grid_pixels` for MuseGlimmer's spelling (``merge_size``, ``patch_temporal``, 3 channels)."""
    vision = config.vision_config
    merge = int(vision.merge_size)
    dim = 3 * int(vision.patch_temporal) * int(vision.patch_size) ** 2
    grids = [[1, 2 * merge, 3 * merge] if i % 2 == 0 else [1, 3 * merge, 2 * merge] for i in range(n)]
    patches = sum(t * h * w for t, h, w in grids)
    return {"pixel_values": torch.randn(patches, dim, generator=g), "image_grid_thw": torch.tensor(grids)}


def _muse_glimmer() -> nn.Module:
    """MuseGlimmer: the tester's kwargs over VLMModelTester's defaults (hidden 32, 2 heads, intermediate 37, a full
    then a sliding layer; vision patch 2, temporal 2, merge 1, a 4 x 4 position table, window then full attention;
    projector 32)."""
    from transformers import MuseGlimmerConfig, MuseGlimmerForConditionalGeneration

    text = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 512,
            "layer_types": ["full_attention", "sliding_attention"], "pad_token_id": 0, "bos_token_id": 1,
            "eos_token_id": 2, "tie_word_embeddings": False}  # fmt: skip
    vision = {"hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 2, "num_attention_heads": 2,
              "patch_size": 2, "patch_temporal": 2, "merge_size": 1, "pos_emb_height": 4, "pos_emb_width": 4,
              "layer_types": ["window_attention", "full_attention"]}  # fmt: skip
    config = MuseGlimmerConfig(text_config=text, vision_config=vision, image_token_id=3, video_token_id=4,
                               out_hidden_size=32, projector_hidden_size=32, tie_word_embeddings=False)  # fmt: skip
    return MuseGlimmerForConditionalGeneration(eager(config))


def _dots3_videos(config: Any, g: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    """``n`` random videos as :func:`lab.vlms.grid_pixels`' patch rows, as ``pixel_values_videos`` and
    ``video_grid_thw`` (dots3 encodes them with ``get_image_features``: the vision tower's own parameters)."""
    pixels = grid_pixels(config, g, n)
    return {"pixel_values_videos": pixels["pixel_values"], "video_grid_thw": pixels["image_grid_thw"]}


def _muse_spark() -> nn.Module:
    """MuseSpark: no tester stored; the config defaults shrunk (text: hidden 32, 4 heads of 8, 2 kv, a sliding then
    a full layer, both MoE of 4 experts of 16, top 2; vision: MuseGlimmer's tester sizes (same tower code); audio:
    4 stages of 8-32 wide, one block each)."""
    from transformers import MuseSparkConfig, MuseSparkForConditionalGeneration

    text = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 512,
            "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"],
            "layer_rope_theta": [500000.0, 0], "moe_intermediate_size": 16, "moe_hidden_size": 32,
            "num_local_experts": 4, "num_experts_per_tok": 2, "mlp_layer_types": ["sparse", "sparse"],
            "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}  # fmt: skip
    vision = {"model_type": "muse_spark_vision", "hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 2,
              "num_attention_heads": 2, "patch_size": 2, "patch_temporal": 2, "merge_size": 1, "pos_emb_height": 4,
              "pos_emb_width": 4, "layer_types": ["window_attention", "full_attention"]}  # fmt: skip
    audio = {"hidden_sizes": [8, 16, 16, 32], "depths": [1, 1, 1, 1], "out_hidden_size": 32}
    config = MuseSparkConfig(text_config=text, vision_config=vision, audio_config=audio, image_token_id=3,
                             video_token_id=4, audio_token_id=5, out_hidden_size=32, projector_hidden_size=32,
                             tie_word_embeddings=False)  # fmt: skip
    return MuseSparkForConditionalGeneration(eager(config))


def _muse_spark_clips(config: Any, g: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    """``n`` random waveforms of two tokens' samples each, ``(n, 2 * samples_per_token)``, all real
    (``input_values_mask``)."""
    samples = 2 * int(config.audio_config.samples_per_token)
    return {"input_values": torch.randn(n, samples, generator=g),
            "input_values_mask": torch.ones(n, samples, dtype=torch.long)}  # fmt: skip


# ------------------------------------------------------------------------------------------ Nemotron-H Omni (RADIO)


def grid_hw_pixels(config: Any, g: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    """``n`` random images as RADIO patch rows with ``image_grid_hw``: 2 x 4 and 4 x 2 patches alternating (pixel
    shuffle by 0.5 needs even sides; 4 is the tiny tower's largest side, ``max_img_size / patch_size``)."""
    vision = config.vision_config
    dim = int(vision.num_channels) * int(vision.patch_size) ** 2
    grids = [[2, 4] if i % 2 == 0 else [4, 2] for i in range(n)]
    return {"pixel_values": torch.randn(8 * n, dim, generator=g), "image_grid_hw": torch.tensor(grids)}


def _nemotron_h_omni() -> nn.Module:
    """Nemotron-H Omni: the tester's sizes (NemotronH text hidden 32, 4 heads of 8, 2 kv, 4 experts of 40, top 2;
    RADIO vision hidden 32, 4 heads, patch 16, image 32, max 64, 2 class tokens, 1 register; projector 64,
    downsample 0.5), the text stack cut to the tester's attention and MoE blocks (2 layers); a Parakeet audio
    encoder of 2 layers of 32 (8 mel bins, subsampling 4, no dropout, so that training is deterministic)."""
    from transformers import NemotronH_Omni_Reasoning_V3, NemotronH_Omni_Reasoning_V3_Config

    text = {"model_type": "nemotron_h", "vocab_size": 128, "hidden_size": 32,
            "layers_block_type": ["full_attention", "moe"], "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 8, "intermediate_size": 40, "moe_intermediate_size": 40,
            "moe_shared_expert_intermediate_size": 40, "mlp_hidden_act": "relu2", "n_routed_experts": 4,
            "num_experts_per_tok": 2, "use_mamba_kernels": False, "pad_token_id": 0, "bos_token_id": 1,
            "eos_token_id": 2, "tie_word_embeddings": False}  # fmt: skip
    vision = {"model_type": "radio", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
              "mlp_ratio": 2.0, "patch_size": 16, "image_size": 32, "max_img_size": 64, "num_channels": 3,
              "num_cls_tokens": 2, "num_registers": 1, "video_temporal_patch_size": 2}  # fmt: skip
    audio = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64,
             "num_mel_bins": 8, "subsampling_factor": 4, "subsampling_conv_channels": 8, "conv_kernel_size": 3,
             "max_position_embeddings": 64, "dropout": 0.0, "dropout_positions": 0.0, "layerdrop": 0.0,
             "activation_dropout": 0.0, "attention_dropout": 0.0, "projection_hidden_size": 32,
             "projection_bias": False}  # fmt: skip
    config = NemotronH_Omni_Reasoning_V3_Config(text_config=text, vision_config=vision, audio_config=audio,
                                                downsample_ratio=0.5, vision_hidden_size=32,
                                                projector_hidden_size=64, image_token_id=10, video_token_id=10,
                                                audio_token_id=11, tie_word_embeddings=False)  # fmt: skip
    return NemotronH_Omni_Reasoning_V3(eager(config))


def _nemotron_videos(config: Any, g: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    """``n`` random videos of 2 tubelets of 2 x 4 patches, ``(n, 2, T * C, 2p, 4p)``: 2 features per tubelet."""
    vision = config.vision_config
    patch, channels = int(vision.patch_size), int(config.video_temporal_patch_size) * int(vision.num_channels)
    return {"pixel_values_videos": torch.randn(n, 2, channels, 2 * patch, 4 * patch, generator=g)}


def _nemotron_clips(config: Any, g: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    """``n`` random clips of two tokens' mel frames, ``(n, 2 * subsampling_factor, mels)``."""
    audio = config.audio_config
    frames = 2 * int(audio.subsampling_factor)
    return {"input_features": torch.randn(n, frames, int(audio.num_mel_bins), generator=g)}


MODELS = [
    TinyVlm(
        ("ernie4_5_vl_moe",),
        _ernie4_5_vl_moe,
        grid_pixels,
        image_token_id=7,
        extra=_ernie_moe_types,
        note="no row: the processor's moe_mm_token_type_ids send image tokens to the vision experts of every "
        "sparse text layer (Ernie4_5_VLMoeMoeBlock.vision_moe runs only when they mark a token), which a text "
        "rank skips, so its text layers' reduce-scatters differ whatever the tower does (a tower-dummy row still "
        "aborts in gloo, families524): every rank raises the mixed-batch FsdpCompatError naming the class, the "
        "ranks and the fix",
    ),
    TinyVlm(
        ("kimi_k25",),
        _kimi_k25,
        conv_patch_pixels,
        image_token_id=3,
        source="tester (its kwargs over VLMModelTester's defaults)",
    ),
    TinyVlm(("hunyuan_vl",), _hunyuan_vl, wide_grid_pixels, image_token_id=5),
    TinyVlm(("video_llama_3",), _video_llama_3, merge_size_pixels, image_token_id=3),
    TinyVlm(
        ("minimax_m3_vl",),
        _minimax_m3_vl,
        grid_pixels,
        image_token_id=4,
        source="tester (its legacy config keys, which 5.24 still maps)",
    ),
    OmniVlm(
        ("dots3_note",),
        _dots3_note,
        grid_pixels,
        image_token_id=10,
        source="tester (get_tiny_config, DSA off, special tokens below 16)",
        note=AUDIO_NOTE,
        audio_token_id=12,
        clips=_dots3_clips,
        videos=_dots3_videos,
        video_token_id=11,
    ),
    TinyVlm(("lfm3_vl",), _lfm3_vl, grid_pixels, source="no tester stored: the config defaults shrunk"),
    TinyVlm(("cosmos3_edge",), _cosmos3_edge, grid_pixels, image_token_id=3),
    TinyVlm(("hy_v4_vl",), _hy_v4_vl, wide_grid_pixels, source="no tester stored: the config defaults shrunk"),
    TinyVlm(
        ("inkling2",),
        _inkling2,
        token_patch_pixels,
        source="no tester stored: the config defaults shrunk",
        parity="measured",
        note=_INKLING_NOTE.format(
            alone="3.7e-08 in gradients (embed_tokens), 1.4e-06 in parameters after 2 AdamW steps",
            aligned="2.8e-08 and 1.6e-07: the alignment adds no error of its own",
        ),
    ),
    TinyVlm(
        ("inkling2_loop",),
        _inkling2_loop,
        token_patch_pixels,
        source="no tester stored: the config defaults shrunk (Inkling 2's sizes)",
        parity="measured",
        adamw_eps_param="model.vision_tower.merger.linear_2.weight",
        note=_INKLING_NOTE.format(
            alone="4.5e-08 in gradients, 5.9e-07 in parameters after one AdamW step",
            aligned=(
                "5.2e-08 in gradients (1.2x), but 1.5e-04 in parameters: one element of "
                "vision_tower.merger.linear_2.weight gets a gradient below AdamW's eps (1e-8) from the image rank "
                "alone, and lr * g / (|g| + eps) turns its rounding into a parameter step, so the test makes one "
                "step and holds that parameter to lr (1e-3)"
            ),
        ),
    ),
    TinyVlm(
        ("muse_glimmer",),
        _muse_glimmer,
        muse_pixels,
        image_token_id=3,
        source="tester (its kwargs over VLMModelTester's defaults)",
    ),
    OmniVlm(
        ("muse_spark",),
        _muse_spark,
        muse_pixels,
        image_token_id=3,
        source="no tester stored: the config defaults shrunk",
        note=AUDIO_NOTE,
        audio_token_id=5,
        clips=_muse_spark_clips,
    ),
    OmniVlm(
        ("nemotron_h_omni",),
        _nemotron_h_omni,
        grid_hw_pixels,
        source="tester (text cut to an attention and a MoE block; a shrunk Parakeet audio encoder)",
        note=f"{AUDIO_NOTE}; "
        + VIDEO_NOTE.format(how="the vision tower's video patch projection, aligned in a column of its own")
        + "; not images and videos on one rank: the forward fills both from the image token (video_token_id is "
        "not read), so such a batch fails its own placeholder check on one process too (ValueError: Got 4 feature "
        "vectors for 12 placeholder tokens (id 10); test_media_towers.py)",
        audio_token_id=11,
        clips=_nemotron_clips,
        videos=_nemotron_videos,
        video_token_id=10,
    ),
]
