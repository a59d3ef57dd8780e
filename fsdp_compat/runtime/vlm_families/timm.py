"""timm towers (``TimmWrapper``): builders and rows."""

from __future__ import annotations

from typing import Any

import torch

from fsdp_compat.runtime.vlm_families.audio import GEMMA3N_AUDIO
from fsdp_compat.runtime.vlm_families.rows import VisionFamily, _channels

# ------------------------------------------------------------------------------------- timm towers (TimmWrapper)


def _timm_side(vision: Any) -> int:
    """The side of a timm tower's image: ``model_args["img_size"]``, else the config's ``image_size``, else timm's
    own default input size for the architecture (a ViT's position table fixes it; a convolutional tower takes it)."""
    size = (getattr(vision, "model_args", None) or {}).get("img_size") or getattr(vision, "image_size", None)
    if size is None:
        import timm

        size = timm.models.get_pretrained_cfg(vision.architecture).input_size[-1]
    return int(size[0] if isinstance(size, (list, tuple)) else size)


def timm_inputs(config: Any, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One zero image at a timm tower's side, ``(1, C, S, S)`` (FastVLM's FastViT, Gemma3n's MobileNetV5: the
    config holds no ``image_size`` of transformers' kind, so :func:`_timm_side` reads timm's)."""
    side = _timm_side(config.vision_config)
    return {"pixel_values": torch.zeros(1, _channels(config.vision_config), side, side, dtype=dtype, device=device)}


def timm_tile_inputs(config: Any, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One tile of one zero image, ``(1, 1, C, S, S)`` (PerceptionLM: ``get_image_features`` flattens images and
    tiles into the timm ViT's batch)."""
    return {"pixel_values": timm_inputs(config, device, dtype)["pixel_values"].unsqueeze(0)}


TIMM_FAMILIES: tuple[VisionFamily, ...] = (
    VisionFamily("perception_lm", ("PerceptionLMModel",), dummy=timm_tile_inputs, tower="vision_tower"),
    VisionFamily("fast_vlm", ("FastVlmModel",), ("pixel_values",), timm_inputs, "vision_tower"),
    VisionFamily("gemma3n", ("Gemma3nModel",), ("pixel_values",), timm_inputs, "vision_tower", audio=GEMMA3N_AUDIO),
)
