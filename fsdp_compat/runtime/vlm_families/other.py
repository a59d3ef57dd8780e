"""Towers of other shapes (flat patches, VQ tokenizers, positioned patches, strided convolutions): builders and
rows."""

from __future__ import annotations

from typing import Any

import torch

from fsdp_compat.runtime.vlm_families.rows import VisionFamily, _channels, _index, fixed_inputs

# ------------------------------------------------------------------------------------------------- other shapes


def flat_patch_inputs(config: Any, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
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
    return {"pixel_values": pixels, "image_sizes": _index([[side, side]], torch.long, device)}


def position_patch_inputs(config: Any, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One zero merged patch at position (0, 0), ``(1, 1, (P * k) ** 2 * 3)`` and ``image_position_ids`` ``(1, 1, 2)``
    (Gemma4 unified: encoder-free, the "tower" is a patch embedder; a position of -1 marks a padding patch, which
    ``get_image_features`` strips, so the one patch sits at (0, 0))."""
    dim = int(config.vision_config.model_patch_size) ** 2 * 3
    return {
        "pixel_values": torch.zeros(1, 1, dim, dtype=dtype, device=device),
        "image_position_ids": torch.zeros(1, 1, 2, dtype=torch.long, device=device),
    }


def token_tile_inputs(config: Any, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One zero tile of one language-model token, ``(1, p m, p m, C)``, and its ``image_grid_thw`` ``[[1, 1, 1]]``
    (Inkling 2: ``pixel_values`` hold one ``(p m, p m, C)`` tile per image token and the grid counts tokens, so one
    token is the smallest image)."""
    vision = config.vision_config
    side = int(vision.patch_size) * int(vision.spatial_merge_size)
    pixels = torch.zeros(1, side, side, _channels(vision), dtype=dtype, device=device)
    return {"pixel_values": pixels, "image_grid_thw": torch.ones(1, 3, dtype=torch.long, device=device)}


def strided_inputs(config: Any, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One zero image whose side is the product of the stages' ``patch_stride``, ``(1, C, s, s)`` (Florence-2's
    DaViT: convolutional stages take any size and the projector's position table is indexed by the feature grid,
    so one feature, a 1 x 1 grid, is the smallest image)."""
    vision = config.vision_config
    side = 1
    for stride in vision.patch_stride:
        side *= int(stride)
    return {"pixel_values": torch.zeros(1, _channels(vision), side, side, dtype=dtype, device=device)}


OTHER_FAMILIES: tuple[VisionFamily, ...] = (
    # transformers <= 5.18 names Fuyu's patches image_patches, 5.24 pixel_values: each takes one of them
    VisionFamily(
        "fuyu", ("FuyuModel",), ("pixel_values", "image_patches"), flat_patch_inputs, "vision_embed_tokens",
        "language_model",
    ),
    VisionFamily("gemma4-unified", ("Gemma4UnifiedModel",), dummy=position_patch_inputs, tower="embed_vision"),
    VisionFamily("emu3", ("Emu3Model",), ("pixel_values",), vq_inputs, "vqmodel.encoder", "text_model"),
    VisionFamily("inkling2", ("Inkling2Model",), ("pixel_values",), token_tile_inputs, "vision_tower"),
    VisionFamily("inkling2-loop", ("Inkling2LoopModel",), ("pixel_values",), token_tile_inputs, "vision_tower"),
    # BART's encoder consumes the features (the forward calls language_model.encoder, never language_model itself)
    VisionFamily(
        "florence2", ("Florence2Model",), ("pixel_values",), strided_inputs, "vision_tower", "language_model.encoder"
    ),
    # the outer model holds both; its forward projects get_image_features' last_hidden_state itself
    VisionFamily(
        "llama4",
        ("Llama4ForConditionalGeneration",),
        ("pixel_values",),
        fixed_inputs,
        "vision_model",
        projector="multi_modal_projector",
    ),
)
