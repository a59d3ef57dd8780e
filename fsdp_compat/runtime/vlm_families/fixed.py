"""Fixed-resolution towers (CLIP, SigLIP and kin): builders and rows."""

from __future__ import annotations

from typing import Any

import torch

from fsdp_compat.runtime.vlm_families.audio import INKLING_AUDIO
from fsdp_compat.runtime.vlm_families.rows import VideoTower, VisionFamily, _channels, _fixed, _side, fixed_inputs

# ---------------------------------------------------------------------- fixed resolution (CLIP, SigLIP and kin)


def packed_patch_inputs(config: Any, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One zero packed patch, ``(1, T, P, P, C)`` (Inkling: ``pixel_values`` are patches of temporal x patch x patch
    pixels, which the tower folds into one token each, on its own, so one patch is the smallest input)."""
    vision = config.vision_config
    shape = (1, int(vision.temporal_patch_size), int(vision.patch_size), int(vision.patch_size), _channels(vision))
    return {"pixel_values": torch.zeros(*shape, dtype=dtype, device=device)}


def hybrid_inputs(config: Any, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One zero image for each of DeepSeek-VL-Hybrid's two fixed-resolution towers, in one call: ``pixel_values``
    at the SigLIP tower's ``image_size`` and ``high_res_pixel_values`` at the SAM tower's (each position table has
    exactly one row per patch, and the aligner concatenates both towers' features token by token)."""
    high = config.high_res_vision_config
    return {
        **fixed_inputs(config, device, dtype),
        "high_res_pixel_values": torch.zeros(1, _channels(high), _side(high), _side(high), dtype=dtype, device=device),
    }


def fixed_video_inputs(config: Any, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One zero video of one frame at the tower's fixed resolution, ``(1, 1, C, S, S)`` (Video-LLaVA's video
    tower: a CLIP tower of its own, frames folded into its batch)."""
    return {"pixel_values_videos": fixed_inputs(config, device, dtype)["pixel_values"].unsqueeze(1)}


FIXED_FAMILIES: tuple[VisionFamily, ...] = (
    _fixed("llava", "LlavaModel"),
    _fixed("gemma3", "Gemma3Model"),
    _fixed("paligemma", "PaliGemmaModel"),
    _fixed("aya-vision", "AyaVisionModel"),
    _fixed("cohere2-vision", "Cohere2VisionModel"),
    _fixed("got-ocr2", "GotOcr2Model"),
    _fixed("deepseek-vl", "DeepseekVLModel", "vision_model"),
    _fixed("janus", "JanusModel", "vision_model"),
    _fixed("ovis2", "Ovis2Model"),
    _fixed("vipllava", "VipLlavaModel"),  # its projector reads several tower layers: the dummy runs them all
    # the SigLIP tower and the text encoder sit in the encoder of an encoder-decoder (the features join its input)
    VisionFamily("t5gemma2", ("T5Gemma2Encoder",), ("pixel_values",), fixed_inputs, "vision_tower", "text_model"),
    VisionFamily(
        "inkling", ("InklingModel",), ("pixel_values",), packed_patch_inputs, "vision_tower", audio=INKLING_AUDIO
    ),
    # two CLIP towers: images through image_tower (pixel_values, formerly pixel_values_images), videos through
    # video_tower
    VisionFamily(
        "video-llava",
        ("VideoLlavaModel",),
        ("pixel_values", "pixel_values_images"),
        fixed_inputs,
        "image_tower",
        video=VideoTower(dummy=fixed_video_inputs),
    ),
    VisionFamily("deepseek-vl-hybrid", ("DeepseekVLHybridModel",), ("pixel_values",), hybrid_inputs, "vision_model"),
)
