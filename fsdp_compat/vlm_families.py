"""The vision-language families the mixed micro-batch alignment knows: one row per family, one dummy builder per
tower kind.

Why a table: a rank whose micro-batch has no image must still run its tower's collectives, on the smallest input the
tower accepts; what that input is depends on the tower kind, not on the training stack. Each row names the inner
model classes (the ones holding the tower and the text model), the attributes of both, the pixel arguments of the
forward (one tower call each) and the dummy builder. Rows are grouped by tower kind; a new family of a known kind is
one line. Used by :mod:`fsdp_compat.mixed_batches`; imports torch only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "FAMILIES",
    "DummyInputs",
    "VisionFamily",
    "family_named",
    "fixed_inputs",
    "grid_dummy",
    "grid_inputs",
    "patch_inputs",
    "position_patch_inputs",
    "sized_inputs",
    "tile_inputs",
    "vq_inputs",
]


def grid_dummy(vision_config: Any, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero patches for one image of 2m x 2m patches (m = spatial merge size) and its ``grid_thw``.

    The smallest input every ``pixel_values`` + ``*_grid_thw`` tower accepts: one merged token per m x m block,
    and at least two blocks per side for the position-embedding interpolation (GLM4V) and window partition
    (Qwen2.5-VL).
    """
    merge = int(vision_config.spatial_merge_size)
    channels = int(getattr(vision_config, "in_channels", None) or vision_config.in_chans)
    patch, temporal = int(vision_config.patch_size), int(vision_config.temporal_patch_size)
    grid = torch.tensor([[1, 2 * merge, 2 * merge]], dtype=torch.long, device=device)
    pixels = torch.zeros(4 * merge * merge, channels * temporal * patch * patch, dtype=dtype, device=device)
    return pixels, grid


DummyInputs = Callable[[Any, torch.device, torch.dtype], dict[str, torch.Tensor]]


def grid_inputs(config: Any, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``get_image_features`` arguments of a patch-grid tower (GLM4V, Qwen-VL): :func:`grid_dummy`."""
    pixels, grid = grid_dummy(config.vision_config, device, dtype)
    return {"pixel_values": pixels, "image_grid_thw": grid}


def _side(vision_config: Any) -> int:
    size = vision_config.image_size
    return int(size[0] if isinstance(size, (list, tuple)) else size)


def _channels(vision_config: Any) -> int:
    return int(getattr(vision_config, "num_channels", None) or getattr(vision_config, "in_channels", None) or 3)


def fixed_inputs(config: Any, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One zero image at the tower's fixed resolution (CLIP, SigLIP: the position table has exactly one row per
    patch of ``image_size`` x ``image_size``, so no smaller image exists): ``(1, C, S, S)``."""
    vision = config.vision_config
    side = _side(vision)
    return {"pixel_values": torch.zeros(1, _channels(vision), side, side, dtype=dtype, device=device)}


def sized_inputs(config: Any, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One zero image of 2 x 2 merged patches and its ``image_sizes`` (Pixtral: any size that is a multiple of
    patch x spatial merge; the projector merges m x m patches, so two merged tokens per side)."""
    vision = config.vision_config
    side = 2 * int(vision.patch_size) * int(getattr(config, "spatial_merge_size", 1) or 1)
    pixels = torch.zeros(1, _channels(vision), side, side, dtype=dtype, device=device)
    return {"pixel_values": pixels, "image_sizes": torch.tensor([[side, side]], dtype=torch.long, device=device)}


def tile_inputs(config: Any, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One tile of one image, ``(1, 1, C, S, S)``, of ones (Idefics3, SmolVLM: an all-zero tile is padding the
    model drops, which would leave the tower no input; the features are multiplied by 0.0 all the same)."""
    vision = config.vision_config
    side = _side(vision)
    return {"pixel_values": torch.ones(1, 1, _channels(vision), side, side, dtype=dtype, device=device)}


@dataclass(frozen=True)
class VisionFamily:
    """One row: the inner model classes of a VLM family, its vision inputs, and how to feed its tower a dummy.

    ``tower`` and ``text`` are the inner model's attributes (or dotted submodule paths) that hold the vision tower
    and the text model; ``inputs`` lists the pixel arguments, one tower call each, in the order the forward makes
    them; ``dummy`` builds the ``get_image_features`` keywords of the family's smallest valid input from the inner
    model's config (one builder per tower kind, shared by the families of that kind). The dummy's features join the
    graph at the text model's ``inputs_embeds``, where the real features join it too. ``features`` names the output
    field the forward joins there, where other fields reach the graph another way or not at all (Emu3:
    ``pooler_output``, the text embeddings of the codes; its ``last_hidden_state`` is the VQ encoder's, cut from the
    loss by the quantizer's argmin); None: every floating tensor of the output.
    """

    name: str
    classes: tuple[str, ...]
    inputs: tuple[str, ...] = ("pixel_values", "pixel_values_videos")
    dummy: DummyInputs = grid_inputs
    tower: str = "visual"
    text: str = "language_model"
    features: str | None = None


def _fixed(name: str, cls: str, tower: str = "vision_tower") -> VisionFamily:
    return VisionFamily(name, (cls,), ("pixel_values",), fixed_inputs, tower)


# Rows, by tower kind. Each section is one kind; a family joins the section of its kind.

# ------------------------------------------------------------------ patch grids (pixel_values + image_grid_thw)

GRID_FAMILIES: tuple[VisionFamily, ...] = (
    VisionFamily("glm4v", ("Glm4vModel",)),
    VisionFamily("glm4v-moe", ("Glm4vMoeModel",)),
    VisionFamily("glm46v", ("Glm46VModel",)),
    VisionFamily("qwen2-vl", ("Qwen2VLModel",)),
    VisionFamily("qwen2.5-vl", ("Qwen2_5_VLModel",)),
    VisionFamily("qwen3-vl", ("Qwen3VLModel",)),
    VisionFamily("qwen3-vl-moe", ("Qwen3VLMoeModel",)),
)

# ------------------------------------------------------------------------- more patch-grid families (second set)

MORE_GRID_FAMILIES: tuple[VisionFamily, ...] = ()

# ---------------------------------------------------------------------- fixed resolution (CLIP, SigLIP and kin)

FIXED_FAMILIES: tuple[VisionFamily, ...] = (
    _fixed("llava", "LlavaModel"),
    _fixed("gemma3", "Gemma3Model"),
    _fixed("paligemma", "PaliGemmaModel"),
)

# ------------------------------------------------------------------- image sizes and tiles (Pixtral, Idefics3)

TILED_FAMILIES: tuple[VisionFamily, ...] = (
    VisionFamily("mistral3", ("Mistral3Model",), ("pixel_values",), sized_inputs, "vision_tower"),
    VisionFamily("idefics3", ("Idefics3Model",), ("pixel_values",), tile_inputs, "vision_model", "text_model"),
    VisionFamily("smolvlm", ("SmolVLMModel",), ("pixel_values",), tile_inputs, "vision_model", "text_model"),
)

# ------------------------------------------------------------------------------------------------- other shapes


def patch_inputs(config: Any, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One zero patch of one image, ``(1, 1, P * P * C)`` (Fuyu: the "tower" is one linear layer over flattened
    patches, ``vision_embed_tokens``, so a single patch is the smallest input; a linear has no padding rule)."""
    dim = int(config.patch_size) ** 2 * int(config.num_channels)
    return {"pixel_values": torch.zeros(1, 1, dim, dtype=dtype, device=device)}


def vq_inputs(config: Any, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One zero image of 2f x 2f pixels and its ``image_sizes`` (Emu3: the VQ-VAE encoder downsamples by f = 2 **
    (levels - 1); its temporal blocks' BatchNorm needs more than one value per channel in training, so 2 x 2 latent
    pixels, four codes). The codes are discrete: the 0.0 term flows through the text embedding of those codes, and
    the tokenizer gets no gradient on any rank, as with real images. In training mode the dummy, like a real image,
    moves that BatchNorm's running statistics on its rank (buffers, not parameters)."""
    vq = config.vq_config
    side = 2 * 2 ** (len(vq.channel_multiplier) - 1)
    pixels = torch.zeros(1, int(vq.in_channels), side, side, dtype=dtype, device=device)
    return {"pixel_values": pixels, "image_sizes": torch.tensor([[side, side]], dtype=torch.long, device=device)}


def position_patch_inputs(config: Any, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One zero merged patch at position (0, 0), ``(1, 1, (P * k) ** 2 * 3)`` and ``image_position_ids`` ``(1, 1, 2)``
    (Gemma4 unified: encoder-free, the "tower" is a patch embedder; a position of -1 marks a padding patch, which
    ``get_image_features`` strips, so the one patch sits at (0, 0))."""
    dim = int(config.vision_config.model_patch_size) ** 2 * 3
    return {
        "pixel_values": torch.zeros(1, 1, dim, dtype=dtype, device=device),
        "image_position_ids": torch.zeros(1, 1, 2, dtype=torch.long, device=device),
    }


OTHER_FAMILIES: tuple[VisionFamily, ...] = (
    VisionFamily("fuyu", ("FuyuModel",), ("pixel_values",), patch_inputs, "vision_embed_tokens", "language_model"),
    VisionFamily("gemma4-unified", ("Gemma4UnifiedModel",), dummy=position_patch_inputs, tower="embed_vision"),
    VisionFamily(
        "emu3", ("Emu3Model",), ("pixel_values",), vq_inputs, "vqmodel.encoder", "text_model", "pooler_output"
    ),
)

# ------------------------------------------------------------------------------------------------------- table

#: Every row, in the order the alignment matches them (an inner model's class or one of its bases).
FAMILIES: tuple[VisionFamily, ...] = (
    *GRID_FAMILIES,
    *MORE_GRID_FAMILIES,
    *FIXED_FAMILIES,
    *TILED_FAMILIES,
    *OTHER_FAMILIES,
)


def family_named(name: str) -> VisionFamily:
    """The row called ``name`` (``KeyError`` naming the rows if none)."""
    for family in FAMILIES:
        if family.name == name:
            return family
    raise KeyError(f"no family {name!r}; rows: {', '.join(f.name for f in FAMILIES)}")
