"""Patch-grid families (``pixel_values`` rows of patches + ``image_grid_thw``): GLM and Qwen-VL lineage."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import lab.vlms as vlms
from fsdp_compat.testing.zoo import _GLM_TOKENS, _GLM_VISION, glm4v_config
from lab.vlms import TinyVlm, eager, grid_pixels


def _glm46v() -> nn.Module:
    """GLM-4.6V: GLM4V's text and vision configs under its own outer class (the zoo GLM4V's sizes)."""
    from transformers import Glm46VConfig, Glm46VForConditionalGeneration

    glm4v = glm4v_config()
    config = Glm46VConfig(text_config=glm4v.text_config.to_dict(), vision_config=dict(_GLM_VISION),
                          tie_word_embeddings=False, **_GLM_TOKENS)  # fmt: skip
    return Glm46VForConditionalGeneration(eager(config))


# The shared text-tester defaults of transformers' tests (causal_lm_tester's _TEXT_MODEL_TESTER_DEFAULTS), vocab 128.
_TESTER_TEXT = dict(vocab_size=128, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, bos_token_id=1,
                    eos_token_id=2, tie_word_embeddings=False)  # fmt: skip
# Qwen3-VL lineage testers' special tokens (image 3, video 4, vision start 5 / end 6).
_QWEN3_TOKENS = dict(image_token_id=3, video_token_id=4, vision_start_token_id=5, vision_end_token_id=6)


def _qwen3_vl_moe() -> nn.Module:
    """Qwen3-VL-MoE: Qwen3VLMoeVisionText2TextModelTester's sizes (patch 16, merge 1, 8 experts top-4,
    deepstack at both vision layers); mrope section [2, 1, 1] to fit head_dim 8 (the tester's [16, 8, 8] is
    for larger heads)."""
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    text = dict(_TESTER_TEXT, num_attention_heads=4, num_key_value_heads=2, head_dim=8, hidden_act="silu",
                moe_intermediate_size=16, num_experts=8, num_experts_per_tok=4, decoder_sparse_step=1,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                                 "mrope_interleaved": True})  # fmt: skip
    vision = dict(depth=2, hidden_size=32, intermediate_size=32, num_heads=4, out_hidden_size=32, in_channels=3,
                  patch_size=16, spatial_merge_size=1, temporal_patch_size=2, num_position_embeddings=16,
                  deepstack_visual_indexes=[0, 1], hidden_act="gelu_pytorch_tanh")  # fmt: skip
    config = Qwen3VLMoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, pad_token_id=0,
                              **_QWEN3_TOKENS)  # fmt: skip
    return Qwen3VLMoeForConditionalGeneration(eager(config))


# Qwen3.5 testers' text (hybrid: one full-attention, one gated-delta-net layer) and vision (patch 16, merge 1).
_QWEN3_5_TEXT = dict(_TESTER_TEXT, bos_token_id=0, eos_token_id=1, pad_token_id=2, hidden_act="silu", head_dim=32,
                     intermediate_size=37, num_attention_heads=4, num_key_value_heads=2,
                     layer_types=["full_attention", "linear_attention"], linear_conv_kernel_dim=2,
                     linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=4,
                     linear_num_value_heads=8,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                                      "mrope_interleaved": True})  # fmt: skip
_QWEN3_5_VISION = dict(depth=2, in_channels=3, hidden_act="gelu_pytorch_tanh", intermediate_size=32, out_hidden_size=32,
                       hidden_size=32, num_heads=4, patch_size=16, spatial_merge_size=1, temporal_patch_size=2,
                       num_position_embeddings=16)  # fmt: skip


def _qwen3_5() -> nn.Module:
    """Qwen3.5: Qwen3_5VisionText2TextModelTester's sizes, untied."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    config = Qwen3_5Config(text_config=dict(_QWEN3_5_TEXT), vision_config=dict(_QWEN3_5_VISION),
                           tie_word_embeddings=False, **_QWEN3_TOKENS)  # fmt: skip
    return Qwen3_5ForConditionalGeneration(eager(config))


def _qwen3_5_moe() -> nn.Module:
    """Qwen3.5-MoE: Qwen3_5MoeVisionText2TextModelTester's sizes (8 experts top-2, a shared expert), untied."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    text = dict(_QWEN3_5_TEXT, moe_intermediate_size=16, shared_expert_intermediate_size=36, num_experts_per_tok=2,
                num_experts=8)  # fmt: skip
    config = Qwen3_5MoeConfig(text_config=text, vision_config=dict(_QWEN3_5_VISION), tie_word_embeddings=False,
                              **_QWEN3_TOKENS)  # fmt: skip
    return Qwen3_5MoeForConditionalGeneration(eager(config))


def _glm_ocr() -> nn.Module:
    """GLM-OCR: GlmOcrVisionText2TextModelTester's sizes (patch 14, merge 1), untied."""
    from transformers import GlmOcrConfig, GlmOcrForConditionalGeneration

    text = dict(vocab_size=128, hidden_size=16, intermediate_size=22, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=8, hidden_act="silu", max_position_embeddings=512,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]},
                tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)  # fmt: skip
    vision = dict(depth=2, hidden_act="silu", hidden_size=48, num_heads=12, out_hidden_size=16, intermediate_size=22,
                  patch_size=14, spatial_merge_size=1, temporal_patch_size=2)  # fmt: skip
    config = GlmOcrConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, video_start_token_id=3,
                          video_end_token_id=4, image_start_token_id=5, image_end_token_id=6, image_token_id=7,
                          video_token_id=8)  # fmt: skip
    return GlmOcrForConditionalGeneration(eager(config))


def _glm5_next() -> nn.Module:
    """GLM-5-Next: Glm5NextVisionText2TextModelTester's sizes (one linear-attention and one MLA layer, dense then
    8-expert MoE MLP, GLM-OCR vision at patch 14, merge 1); the vision projector's intermediate size (10240 by
    default, absent from the tester's GLM-OCR vision config) shrunk to 16; untied."""
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    text = dict(vocab_size=128, hidden_size=48, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=2, head_dim=16, hidden_act="silu", max_position_embeddings=512,
                moe_intermediate_size=16, num_experts_per_tok=4, n_routed_experts=8, linear_num_heads=2,
                linear_head_dim=16, linear_conv_kernel_dim=2, v_head_dim=16, qk_rope_head_dim=0,
                qk_nope_head_dim=64, q_lora_rank=32, kv_lora_rank=16, mlp_layer_types=["dense", "sparse"],
                layer_types=["linear_attention", "full_attention"], pad_token_id=0, bos_token_id=1,
                eos_token_id=2, tie_word_embeddings=False)  # fmt: skip
    vision = dict(depth=2, hidden_act="silu", hidden_size=48, num_heads=2, out_hidden_size=48, intermediate_size=16,
                  patch_size=14, spatial_merge_size=1, temporal_patch_size=2,
                  projection_intermediate_size=16)  # fmt: skip
    config = Glm5NextConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, video_start_token_id=3,
                            video_end_token_id=4, image_start_token_id=5, image_end_token_id=6, image_token_id=7,
                            video_token_id=8)  # fmt: skip
    return Glm5NextForConditionalGeneration(eager(config))


#: The note of the families whose row aligns a video path of their own too (``how``: what that path is).
VIDEO_NOTE = (
    "videos run through {how}: ranks that differ in images, videos (and audio) train at exact parity "
    "(test_media_towers.py)"
)

#: The note of every family whose row aligns its audio encoder too.
AUDIO_NOTE = (
    "the audio tower is aligned too: ranks that differ in audio, in images or in both train at exact parity "
    "(test_audio_towers.py)"
)

# Mel frames of one random audio clip in an omni batch: both thinkers' encoders give it more than one feature (4 and 2)
_CLIP = 16
_AUDIO_FEATURES: dict[str, int] = {}

Clips = Callable[[Any, torch.Generator, int], dict[str, torch.Tensor]]


def mel_clips(config: Any, g: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    """``n`` random clips of ``_CLIP`` mel frames with their ``feature_attention_mask`` (the Qwen omni thinkers)."""
    mels = int(config.audio_config.num_mel_bins)
    return {"input_features": torch.randn(n, mels, _CLIP, generator=g),
            "feature_attention_mask": torch.ones(n, _CLIP, dtype=torch.long)}  # fmt: skip


@dataclass(frozen=True)
class OmniVlm(TinyVlm):
    """A family whose micro-batches may carry audio or videos besides images: variants ``"text"`` or any ``+``-join
    of ``"image"``, ``"video"`` (each row one video) and ``"audio"`` (each row one clip). Each row starts with its
    video's placeholders, then its clip's (the count of features one video / clip gives, counted on the built model,
    from the output field the family's :class:`~fsdp_compat.runtime.vlm_families.AudioTower` names, and
    ``get_video_features``' ``pooler_output``). ``clips(config, generator, n)``: the forward's audio keywords for
    ``n`` random clips (the Qwen omni thinkers' mel clips by default; None: no audio); ``videos``: the same for
    videos (None: no videos); ``audio_tokens``: placeholders per clip where the forward pads the features to a
    fixed count (Gemma3n's ``audio_soft_tokens_per_image``; 0: counted)."""

    audio_token_id: int = 1
    clips: Clips | None = mel_clips
    videos: Clips | None = None
    video_token_id: int = 0
    audio_tokens: int = 0

    def media(self) -> tuple[str, ...]:
        """The media this model's batches may carry besides images."""
        return tuple(m for m, b in (("video", self.videos), ("audio", self.clips)) if b is not None)

    def batch(self, g: torch.Generator, variant: str = "image") -> dict[str, torch.Tensor]:
        media = set(variant.split("+"))
        if variant != "text" and not media <= {"image", *self.media()}:
            raise ValueError(
                f"{self.name}: variant 'text' or a '+'-join of image, {', '.join(self.media())}: {variant!r}"
            )
        batch = super().batch(g, "image" if "image" in media else "text")
        rows = batch["input_ids"].shape[0]
        config = vlms._config(self)
        prefix, extra = [], {}
        if "video" in media and self.videos is not None:
            prefix.append(torch.full((rows, self.video_features()), self.video_token_id))
            extra.update(self.videos(config, g, rows))
        if "audio" in media and self.clips is not None:
            prefix.append(torch.full((rows, self.audio_features()), self.audio_token_id))
            extra.update(self.clips(config, g, rows))
        if not prefix:
            return batch
        placeholders = torch.cat(prefix, dim=1)
        input_ids = torch.cat([placeholders, batch["input_ids"]], dim=1)
        batch = {
            **batch,
            "input_ids": input_ids,
            "attention_mask": torch.ones_like(input_ids),
            "labels": torch.cat([torch.full_like(placeholders, -100), batch["labels"]], dim=1),
            **extra,
        }
        if "mm_token_type_ids" in batch:  # audio placeholders are not image tokens
            batch["mm_token_type_ids"] = torch.cat([torch.zeros_like(placeholders), batch["mm_token_type_ids"]], 1)
        return batch

    def audio_features(self) -> int:
        """Features (placeholder tokens) one clip becomes, counted on the built model: the rows of the output field
        the forward reads (its ``attention_mask``'s valid frames where the output has one: Gemma4)."""
        if self.audio_tokens:
            return self.audio_tokens
        if self.name not in _AUDIO_FEATURES:
            from fsdp_compat.runtime.vlm_families import FAMILIES

            assert self.clips is not None, self.name
            model = vlms._built(self)
            inner = vlms.inner_model(model)
            names = {cls.__name__ for cls in type(inner).__mro__}
            audio = next(f.audio for f in FAMILIES if names.intersection(f.classes) and f.audio is not None)
            clip = self.clips(model.config, torch.Generator().manual_seed(0), 1)
            with torch.no_grad():
                out = inner.get_audio_features(**clip)
            mask = getattr(out, "attention_mask", None)
            features = getattr(out, audio.features)
            count = int(mask.sum()) if mask is not None else features.numel() // features.shape[-1]
            _AUDIO_FEATURES[self.name] = count
        return _AUDIO_FEATURES[self.name]

    def video_features(self) -> int:
        """Features (placeholder tokens) one video becomes, counted on the built model (``get_video_features``'
        ``pooler_output``: one tensor, or one per video)."""
        key = f"{self.name}:video"
        if key not in _AUDIO_FEATURES:
            assert self.videos is not None, self.name
            model = vlms._built(self)
            video = self.videos(model.config, torch.Generator().manual_seed(0), 1)
            with torch.no_grad():
                pooled = vlms.inner_model(model).get_video_features(**video).pooler_output
            tensors = list(pooled) if isinstance(pooled, (list, tuple)) else [pooled]
            _AUDIO_FEATURES[key] = sum(t.numel() // t.shape[-1] for t in tensors)
        return _AUDIO_FEATURES[key]


def _qwen2_5_omni_thinker() -> nn.Module:
    """Qwen2.5-Omni thinker: Qwen2_5OmniThinkerForConditionalGenerationTester's sizes (patch 14, merge 1; the
    tester's vision embed_dim 32 / mlp_ratio 4 as hidden 32 / intermediate 128; a 2-layer audio encoder), 2 text
    layers instead of 4."""
    from transformers import Qwen2_5OmniThinkerConfig, Qwen2_5OmniThinkerForConditionalGeneration

    vision = dict(depth=2, hidden_size=32, intermediate_size=128, out_hidden_size=32, hidden_act="quick_gelu",
                  num_heads=4, patch_size=14, spatial_merge_size=1, temporal_patch_size=2)  # fmt: skip
    audio = dict(model_type="qwen_omni_thinker_audio_encoder", d_model=32, encoder_attention_heads=4,
                 encoder_ffn_dim=32, encoder_layers=2, num_mel_bins=20, max_source_positions=1500, n_window=100,
                 output_dim=32)  # fmt: skip
    text = dict(vocab_size=128, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, hidden_act="silu", max_position_embeddings=1024, tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [1, 1, 2]},
                use_sliding_window=False)  # fmt: skip
    config = Qwen2_5OmniThinkerConfig(audio_config=audio, vision_config=vision, text_config=text,
                                      audio_token_index=1, image_token_index=2, video_token_index=3,
                                      audio_start_token_id=4, audio_end_token_id=5, user_token_id=6,
                                      vision_start_token_id=7, vision_end_token_id=8,
                                      tie_word_embeddings=False)  # fmt: skip
    return Qwen2_5OmniThinkerForConditionalGeneration(eager(config))


def _qwen3_omni_moe_thinker() -> nn.Module:
    """Qwen3-Omni-MoE thinker: Qwen3OmniMoeThinkerForConditionalGenerationTester's sizes (patch 16, merge 1,
    deepstack at vision layer 1, 8 experts top-2, a 2-layer audio encoder), 2 text layers instead of 4."""
    from transformers import Qwen3OmniMoeThinkerConfig, Qwen3OmniMoeThinkerForConditionalGeneration

    vision = dict(depth=2, hidden_act="quick_gelu", hidden_size=32, out_hidden_size=32, intermediate_size=24,
                  num_heads=4, patch_size=16, spatial_merge_size=1, temporal_patch_size=2,
                  deepstack_visual_indexes=[1])  # fmt: skip
    audio = dict(d_model=32, encoder_attention_heads=4, encoder_ffn_dim=32, encoder_layers=2, num_mel_bins=20,
                 max_source_positions=1500, downsample_hidden_size=32, n_window=50, output_dim=32,
                 n_window_infer=100)  # fmt: skip
    text = dict(vocab_size=128, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, hidden_act="silu", max_position_embeddings=1024, tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [1, 1, 2],
                                 "interleaved": True},
                use_sliding_window=False, pad_token_id=0, moe_intermediate_size=32, num_experts_per_tok=2,
                num_experts=8, decoder_sparse_step=1)  # fmt: skip
    config = Qwen3OmniMoeThinkerConfig(audio_config=audio, vision_config=vision, text_config=text, audio_token_id=1,
                                       image_token_id=2, video_token_id=3, position_id_per_seconds=13,
                                       seconds_per_chunk=2, audio_start_token_id=4, audio_end_token_id=5,
                                       user_token_id=6, vision_start_token_id=7, vision_end_token_id=8,
                                       tie_word_embeddings=False)  # fmt: skip
    return Qwen3OmniMoeThinkerForConditionalGeneration(eager(config))


def grid_patch_pixels(config: Any, g: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    """:func:`lab.vlms.grid_pixels`' images with each patch as a small image, ``(patches, C, P, P)``
    (PaddleOCR-VL's layout: no temporal patch)."""
    vision = config.vision_config
    merge, patch = int(vision.spatial_merge_size), int(vision.patch_size)
    channels = int(getattr(vision, "num_channels", None) or 3)
    grids = [[1, 2 * merge, 3 * merge] if i % 2 == 0 else [1, 3 * merge, 2 * merge] for i in range(n)]
    patches = sum(t * h * w for t, h, w in grids)
    pixels = torch.randn(patches, channels, patch, patch, generator=g)
    return {"pixel_values": pixels, "image_grid_thw": torch.tensor(grids)}


def _paddleocr_vl() -> nn.Module:
    """PaddleOCR-VL: PaddleOCRVLVisionText2TextModelTester's sizes (SigLIP-style tower, hidden 144, patch 14, merge
    2; text head_dim 128), vocab 103424 -> 128, image token 10 (the tester's 100295 is beyond that vocab)."""
    from transformers import PaddleOCRVLConfig, PaddleOCRVLForConditionalGeneration

    text = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, vocab_size=128, head_dim=128, hidden_act="silu",
                hidden_size=32, intermediate_size=32, max_position_embeddings=512, num_attention_heads=4,
                num_hidden_layers=2, num_key_value_heads=2, rms_norm_eps=1e-05, tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 500000.0,
                                 "mrope_section": [16, 24, 24]})  # fmt: skip
    vision = dict(hidden_act="gelu_pytorch_tanh", hidden_size=144, intermediate_size=32, layer_norm_eps=1e-06,
                  num_attention_heads=4, num_channels=3, num_hidden_layers=2, patch_size=14,
                  spatial_merge_size=2)  # fmt: skip
    config = PaddleOCRVLConfig(text_config=text, vision_config=vision, image_token_id=10, video_token_id=11,
                               vision_start_token_id=12, vision_end_token_id=13,
                               tie_word_embeddings=False)  # fmt: skip
    return PaddleOCRVLForConditionalGeneration(eager(config))


def _cosmos3_omni() -> nn.Module:
    """Cosmos3-Omni (Qwen3-VL text and vision sub-configs): Cosmos3OmniVisionText2TextModelTester's sizes (patch 16,
    merge 1, deepstack at both vision layers), untied."""
    from transformers import Cosmos3OmniConfig, Cosmos3OmniForConditionalGeneration

    text = dict(_TESTER_TEXT, model_type="qwen3_vl_text", hidden_act="silu", num_attention_heads=4,
                num_key_value_heads=2, head_dim=16,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                 "mrope_interleaved": True})  # fmt: skip
    text.pop("tie_word_embeddings")
    vision = dict(model_type="qwen3_vl_vision", depth=2, hidden_size=32, intermediate_size=32, num_heads=4,
                  out_hidden_size=32, in_channels=3, patch_size=16, spatial_merge_size=1, temporal_patch_size=2,
                  num_position_embeddings=16, deepstack_visual_indexes=[0, 1],
                  hidden_act="gelu_pytorch_tanh")  # fmt: skip
    config = Cosmos3OmniConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, pad_token_id=0,
                               **_QWEN3_TOKENS)  # fmt: skip
    return Cosmos3OmniForConditionalGeneration(eager(config))


def _hyperclovax_vision_v2() -> nn.Module:
    """HyperCLOVA X Vision V2 (HyperCLOVAX text, Qwen2.5-VL vision tower, a linear projector):
    HCXVisionV2VisionText2TextModelTester's sizes (the shared VLM tester's text and vision widths; patch 14, merge 1,
    out 32), untied; image token 3 (the shared tester's), video 4."""
    from transformers import HyperCLOVAXVisionV2Config, HyperCLOVAXVisionV2ForConditionalGeneration

    text = dict(_TESTER_TEXT, model_type="hyperclovax", hidden_act="gelu")
    text.pop("tie_word_embeddings")
    vision = dict(model_type="qwen2_5_vl_vision", depth=2, hidden_size=32, intermediate_size=32, num_heads=4,
                  in_channels=3, patch_size=14, spatial_merge_size=1, temporal_patch_size=2, out_hidden_size=32,
                  tokens_per_second=1)  # fmt: skip
    config = HyperCLOVAXVisionV2Config(text_config=text, vision_config=vision, image_token_id=3, video_token_id=4,
                                       tie_word_embeddings=False)  # fmt: skip
    return HyperCLOVAXVisionV2ForConditionalGeneration(eager(config))


def _exaone4_5() -> nn.Module:
    """EXAONE 4.5 (EXAONE 4 text, a Qwen2.5-VL-style tower with grouped-query attention): Exaone4_5_ModelTester's
    sizes (the shared VLM tester's widths, head_dim 8, patch 16, merge 1, out 32), untied."""
    from transformers import Exaone4_5_Config, Exaone4_5_ForConditionalGeneration

    text = dict(_TESTER_TEXT, model_type="exaone4", hidden_act="silu", num_attention_heads=4, num_key_value_heads=2,
                head_dim=8)  # fmt: skip
    text.pop("tie_word_embeddings")
    vision = dict(depth=2, hidden_size=32, intermediate_size=32, hidden_act="silu", num_heads=4, num_key_value_heads=2,
                  in_channels=3, patch_size=16, spatial_merge_size=1, temporal_patch_size=2,
                  out_hidden_size=32)  # fmt: skip
    config = Exaone4_5_Config(text_config=text, vision_config=vision, image_token_id=3, video_token_id=4,
                              tie_word_embeddings=False)  # fmt: skip
    return Exaone4_5_ForConditionalGeneration(eager(config))


def _cohere_compass() -> nn.Module:
    """Cohere Compass: CohereCompassModelTester's sizes (patch 16, merge 2, deepstack at vision layer 0; text head_dim
    8 with per-layer-type rope, both layers full attention), vocab 64 -> 128, untied."""
    from transformers import CohereCompassConfig, CohereCompassForConditionalGeneration

    text = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=64, hidden_act="silu", pad_token_id=0,
                bos_token_id=1, eos_token_id=2, layer_types=["full_attention", "full_attention"],
                rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0,
                                                    "mrope_section": [1, 1, 2]}})  # fmt: skip
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, hidden_act="silu", num_heads=4, in_channels=3,
                  patch_size=16, spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=32,
                  deepstack_visual_indexes=[0])  # fmt: skip
    config = CohereCompassConfig(text_config=text, vision_config=vision, image_token_id=5, vision_start_token_id=6,
                                 vision_end_token_id=7, video_token_id=8, tie_word_embeddings=False,
                                 pad_token_id=0)  # fmt: skip
    return CohereCompassForConditionalGeneration(eager(config))


def _qwen4_exp() -> nn.Module:
    """Qwen4-Exp: Qwen4ExpVisionText2TextModelTester's sizes (a gated-delta-net and a sparse-attention layer,
    4-expert MoE, hyper-connections, a PLE n-gram embedding; patch 16, merge 1), 2 vision layers instead of 1, vocab
    99 -> 128, image token 3 (the shared VLM tester's)."""
    from transformers import Qwen4ExpConfig, Qwen4ExpForConditionalGeneration

    text = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                head_dim=24, hidden_act="silu", max_position_embeddings=512, tie_word_embeddings=False,
                layer_types=["linear_attention", "qwen_sparse_attention"], linear_conv_kernel_dim=2,
                linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=4, linear_num_value_heads=8,
                hc_count=2, hc_lowrank=8, ple_layer_ids=[1], ple_embed_dim=16, ple_conv_kernel_size=2,
                ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=31, make_ngram_vocab_size_divisible_by=8,
                split_ngram_parts=4, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=4,
                indexer_compress_ratio=2, moe_intermediate_size=8, shared_expert_intermediate_size=8,
                num_experts=4, num_experts_per_tok=2, bos_token_id=0, eos_token_id=1, pad_token_id=2,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                 "mrope_section": [1, 1, 1], "mrope_interleaved": True})  # fmt: skip
    vision = dict(depth=2, hidden_size=32, intermediate_size=32, hidden_act="gelu_pytorch_tanh", num_heads=4,
                  in_channels=3, patch_size=16, spatial_merge_size=1, temporal_patch_size=2, out_hidden_size=32,
                  num_position_embeddings=16)  # fmt: skip
    config = Qwen4ExpConfig(text_config=text, vision_config=vision, tie_word_embeddings=False,
                            **_QWEN3_TOKENS)  # fmt: skip
    return Qwen4ExpForConditionalGeneration(eager(config))


MODELS = [
    TinyVlm(("glm46v", "glmga"), _glm46v, grid_pixels, source="the zoo GLM4V's sizes (GLM4V's configs)"),
    TinyVlm(
        ("qwen3_vl_moe",),
        _qwen3_vl_moe,
        grid_pixels,
        image_token_id=3,
        source="tests/models/qwen3_vl_moe tester (mrope section shrunk to head_dim 8)",
    ),
    TinyVlm(("qwen3_5",), _qwen3_5, grid_pixels, image_token_id=3, source="tests/models/qwen3_5 tester"),
    TinyVlm(("qwen3_5_moe",), _qwen3_5_moe, grid_pixels, image_token_id=3, source="tests/models/qwen3_5_moe tester"),
    TinyVlm(("glm_ocr",), _glm_ocr, grid_pixels, image_token_id=7, source="tests/models/glm_ocr tester"),
    TinyVlm(
        ("glm5_next",),
        _glm5_next,
        grid_pixels,
        image_token_id=7,
        source="tests/models/glm5_next tester (vision projection_intermediate_size 10240 -> 16)",
    ),
    OmniVlm(
        ("qwen2_5_omni_thinker",),
        _qwen2_5_omni_thinker,
        grid_pixels,
        image_token_id=2,
        note=AUDIO_NOTE,
        source="tests/models/qwen2_5_omni thinker tester (2 text layers, not 4)",
    ),
    OmniVlm(
        ("qwen3_omni_moe_thinker",),
        _qwen3_omni_moe_thinker,
        grid_pixels,
        image_token_id=2,
        note=AUDIO_NOTE,
        source="tests/models/qwen3_omni_moe thinker tester (2 text layers, not 4)",
    ),
    TinyVlm(
        ("paddleocr_vl",),
        _paddleocr_vl,
        grid_patch_pixels,
        source="tests/models/paddleocr_vl tester (vocab 103424 -> 128, special tokens 10-13)",
    ),
    TinyVlm(("cosmos3_omni",), _cosmos3_omni, grid_pixels, image_token_id=3, source="tests/models/cosmos3_omni tester"),
    TinyVlm(
        ("hyperclovax_vision_v2",),
        _hyperclovax_vision_v2,
        grid_pixels,
        image_token_id=3,
        source="tests/models/hyperclovax_vision_v2 tester",
    ),
    TinyVlm(("exaone4_5",), _exaone4_5, grid_pixels, image_token_id=3, source="tests/models/exaone4_5 tester"),
    TinyVlm(
        ("cohere_compass",),
        _cohere_compass,
        grid_pixels,
        image_token_id=5,
        source="tests/models/cohere_compass tester (vocab 64 -> 128)",
    ),
    TinyVlm(
        ("qwen4_exp",),
        _qwen4_exp,
        grid_pixels,
        image_token_id=3,
        source="tests/models/qwen4_exp tester (2 vision layers, not 1; vocab 99 -> 128)",
    ),
]
