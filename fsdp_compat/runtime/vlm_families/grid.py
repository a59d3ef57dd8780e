"""Patch-grid towers (``pixel_values`` + a grid: GLM4V, Qwen-VL and their kin): builders and rows."""

from __future__ import annotations

from typing import Any

import torch

from fsdp_compat.runtime.vlm_families.audio import DOTS3_AUDIO, MUSE_SPARK_AUDIO, NEMOTRON_AUDIO, QWEN_OMNI_AUDIO
from fsdp_compat.runtime.vlm_families.rows import VideoTower, VisionFamily, _channels, _index

# ------------------------------------------------------------------ patch grids (pixel_values + image_grid_thw)


def grid_patches_inputs(config: Any, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Zero patches as small images, ``(4 m^2, C, P, P)``, for one image of 2m x 2m patches and its
    ``image_grid_thw`` (PaddleOCR-VL: its SigLIP-style tower embeds each patch with a convolution and has no
    temporal patch, so :func:`grid_dummy`'s flattened rows do not fit; its projector merges m x m patches, and the
    learned position table is interpolated to the grid, as in GLM4V: the same 2m x 2m smallest image)."""
    vision = config.vision_config
    merge, patch = int(vision.spatial_merge_size), int(vision.patch_size)
    grid = _index([[1, 2 * merge, 2 * merge]], torch.long, device)
    pixels = torch.zeros(4 * merge * merge, _channels(vision), patch, patch, dtype=dtype, device=device)
    return {"pixel_values": pixels, "image_grid_thw": grid}


GRID_FAMILIES: tuple[VisionFamily, ...] = (
    VisionFamily("glm4v", ("Glm4vModel",)),
    VisionFamily("glm4v-moe", ("Glm4vMoeModel",)),
    VisionFamily("glm46v", ("Glm46VModel",)),
    VisionFamily("qwen2-vl", ("Qwen2VLModel",)),
    VisionFamily("qwen2.5-vl", ("Qwen2_5_VLModel",)),
    VisionFamily("qwen3-vl", ("Qwen3VLModel",)),
    VisionFamily("qwen3-vl-moe", ("Qwen3VLMoeModel",)),
    VisionFamily("qwen3.5", ("Qwen3_5Model",)),
    VisionFamily("qwen3.5-moe", ("Qwen3_5MoeModel",)),
    VisionFamily("glm-ocr", ("GlmOcrModel",)),
    VisionFamily("glm5-next", ("Glm5NextModel",)),
    VisionFamily("qwen2.5-omni-thinker", ("Qwen2_5OmniThinkerModel",), audio=QWEN_OMNI_AUDIO),
    VisionFamily("qwen3-omni-moe-thinker", ("Qwen3OmniMoeThinkerModel",), audio=QWEN_OMNI_AUDIO),
    VisionFamily("paddleocr-vl", ("PaddleOCRVLModel",), ("pixel_values",), grid_patches_inputs),
    VisionFamily("cosmos3-omni", ("Cosmos3OmniModel",)),
    VisionFamily("hyperclovax-vision-v2", ("HyperCLOVAXVisionV2Model",), tower="vision_model"),
    VisionFamily("exaone4.5", ("Exaone4_5_Model",)),
    VisionFamily("cohere-compass", ("CohereCompassModel",)),
    VisionFamily("qwen4-exp", ("Qwen4ExpModel",)),
)

# ------------------------------------------------------------------------- more patch-grid families (second set)


def conv_grid_inputs(config: Any, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One zero image of one merged token, as ``(k_h * k_w, 3, p, p)`` patch images and its ``image_grid_thw``
    ``[[1, k_h, k_w]]`` (Kimi K2.5: a Conv2d patch embedding over patch images, a learned position table resampled
    to any grid, and a temporal merge into ``k_h x k_w`` kernels (``merge_kernel_size``), so one kernel of patches
    is the smallest image that gives a feature)."""
    vision = config.vision_config
    kh, kw = (int(k) for k in vision.merge_kernel_size)
    patch = int(vision.patch_size)
    pixels = torch.zeros(kh * kw, 3, patch, patch, dtype=dtype, device=device)
    return {"pixel_values": pixels, "image_grid_thw": _index([[1, kh, kw]], torch.long, device)}


def patch_grid_inputs(config: Any, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """:func:`grid_inputs` for towers whose config spells the channels ``num_channels`` and may have no
    ``temporal_patch_size`` (one frame per patch row; MuseGlimmer: ``patch_temporal``, ``merge_size``): zero
    patches of one image of 2m x 2m patches and its ``image_grid_thw``. 2m per side, not m: HunYuanVL's patch
    merger requires a merged grid of more than one row and column."""
    vision = config.vision_config
    merge = int(getattr(vision, "spatial_merge_size", None) or getattr(vision, "merge_size", None) or 1)
    temporal = int(getattr(vision, "temporal_patch_size", None) or getattr(vision, "patch_temporal", None) or 1)
    dim = _channels(vision) * temporal * int(vision.patch_size) ** 2
    grid = _index([[1, 2 * merge, 2 * merge]], torch.long, device)
    return {"pixel_values": torch.zeros(4 * merge * merge, dim, dtype=dtype, device=device), "image_grid_thw": grid}


def merge_size_inputs(config: Any, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One zero patch: ``image_grid_thw`` ``[[1, 1, 1]]`` and ``image_merge_sizes`` ``[1]`` (VideoLLaMA3: the merge
    size is an input, per image, not a config value; a 1 x 1 grid merged 1 x 1 is one feature, the smallest image,
    the one its own tester runs)."""
    vision = config.vision_config
    dim = _channels(vision) * int(vision.patch_size) ** 2
    one = torch.ones(1, 3, dtype=torch.long, device=device)
    return {"pixel_values": torch.zeros(1, dim, dtype=dtype, device=device), "image_grid_thw": one,
            "image_merge_sizes": torch.ones(1, dtype=torch.long, device=device)}  # fmt: skip


def grid_hw_inputs(config: Any, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Zero patches of one image of 2 x 2 patches and its ``image_grid_hw`` ``[[2, 2]]`` (Nemotron-H Omni's RADIO
    tower: patch rows with a per-image ``(h, w)``; the pixel shuffle by ``downsample_ratio`` 0.5 needs even sides,
    so 2 x 2 patches, one feature, is the smallest image)."""
    vision = config.vision_config
    side = round(1 / float(config.downsample_ratio))
    dim = _channels(vision) * int(vision.patch_size) ** 2
    pixels = torch.zeros(side * side, dim, dtype=dtype, device=device)
    return {"pixel_values": pixels, "image_grid_hw": _index([[side, side]], torch.long, device)}


def tubelet_inputs(config: Any, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One zero video of one tubelet of 2 x 2 patches, ``(1, 1, T * C, 2p, 2p)`` (Nemotron-H Omni's videos:
    ``video_temporal_patch_size`` frames stacked on the channels, embedded by the RADIO tower's
    ``video_patch_projection``; the pixel shuffle by 0.5 needs even sides, so one feature per tubelet)."""
    vision = config.vision_config
    side = round(1 / float(config.downsample_ratio)) * int(vision.patch_size)
    channels = int(config.video_temporal_patch_size) * _channels(vision)
    return {"pixel_values_videos": torch.zeros(1, 1, channels, side, side, dtype=dtype, device=device)}


#: Nemotron-H Omni's videos: through the vision tower, but its video patch projection only videos reach.
NEMOTRON_VIDEO = VideoTower(dummy=tubelet_inputs, tower="vision_model")

MORE_GRID_FAMILIES: tuple[VisionFamily, ...] = (
    VisionFamily("kimi-k2.5", ("Kimi_K25Model",), dummy=conv_grid_inputs, tower="vision_tower"),
    VisionFamily("hunyuan-vl", ("HunYuanVLModel",), ("pixel_values",), patch_grid_inputs, "vision_tower"),
    VisionFamily("video-llama-3", ("VideoLlama3Model",), dummy=merge_size_inputs, tower="vision_model"),
    VisionFamily("minimax-m3-vl", ("MiniMaxM3VLModel",), dummy=patch_grid_inputs, tower="vision_tower"),
    VisionFamily("dots3-note", ("Dots3NoteModel",), dummy=patch_grid_inputs, tower="vision_tower", audio=DOTS3_AUDIO),
    VisionFamily("lfm3-vl", ("Lfm3VlModel",), tower="vision_tower"),
    VisionFamily("cosmos3-edge", ("Cosmos3EdgeModel",), dummy=patch_grid_inputs),
    VisionFamily("hy-v4-vl", ("HYV4VLModel",), dummy=patch_grid_inputs, tower="vision_tower"),
    VisionFamily("muse-glimmer", ("MuseGlimmerModel",), dummy=patch_grid_inputs, tower="vision_tower"),
    VisionFamily(
        "muse-spark", ("MuseSparkModel",), dummy=patch_grid_inputs, tower="vision_tower", audio=MUSE_SPARK_AUDIO
    ),
    # transformers 5.25: a RICE-ViT tower (one frame per patch row, no temporal patch) and Ovis2.5's packed SigLIP
    VisionFamily("llava-onevision1.5", ("LlavaOnevision15Model",), dummy=patch_grid_inputs),
    # its forward encodes images and videos before it embeds the text: the dummies run first too
    VisionFamily("ovis2.5", ("Ovis2_5Model",), dummy=patch_grid_inputs, tower="vision_tower", tower_first=True),
    VisionFamily(
        "nemotron-h-omni",
        ("NemotronH_Omni_Reasoning_V3",),
        ("pixel_values",),
        grid_hw_inputs,
        "vision_model",
        audio=NEMOTRON_AUDIO,
        video=NEMOTRON_VIDEO,
    ),
)
