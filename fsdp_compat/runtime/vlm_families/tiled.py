"""Towers fed image sizes or tiles (Pixtral, Idefics3, the LLaVA-Next line, packed patches): builders and rows."""

from __future__ import annotations

from typing import Any

import torch

from fsdp_compat.runtime.vlm_families.audio import GEMMA4_AUDIO
from fsdp_compat.runtime.vlm_families.rows import (
    CrossAttention,
    PerImage,
    VisionFamily,
    _channels,
    _fixed,
    _index,
    _side,
    fixed_inputs,
    sized_inputs,
    tile_inputs,
)

# ------------------------------------------------------------------- image sizes and tiles (Pixtral, Idefics3)


def anyres_inputs(config: Any, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One zero image of the smallest-area ``image_grid_pinpoints`` resolution and its ``image_sizes`` (LLaVA-Next,
    LLaVA-OneVision: the forward cuts ``pixel_values`` to the tile count it derives from ``image_sizes``, the base
    tile plus the pinpoint's (h / S) x (w / S) tiles; an image of exactly the smallest pinpoint picks that pinpoint,
    so no image takes fewer tiles): ``(1, 1 + tiles, C, S, S)``."""
    vision = config.vision_config
    side = _side(vision)
    height, width = min(((int(h), int(w)) for h, w in config.image_grid_pinpoints), key=lambda hw: (hw[0] * hw[1], hw))
    tiles = 1 + (-(-height // side)) * (-(-width // side))
    pixels = torch.zeros(1, tiles, _channels(vision), side, side, dtype=dtype, device=device)
    return {"pixel_values": pixels, "image_sizes": _index([[height, width]], torch.long, device)}


def positioned_inputs(config: Any, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One zero image of k x k patches (k = ``pooling_kernel_size``) as patch rows with their (x, y)
    ``image_position_ids`` (Gemma4: the tower average-pools k x k patches into one token, so k x k patches are its
    one-token image; padding is marked by position -1, not by zero pixels): ``(1, k * k, C * p * p)``."""
    vision = config.vision_config
    k, patch = int(vision.pooling_kernel_size), int(vision.patch_size)
    pixels = torch.zeros(1, k * k, _channels(vision) * patch * patch, dtype=dtype, device=device)
    xy = torch.arange(k * k, device=device)
    positions = torch.stack((xy % k, xy // k), dim=-1).unsqueeze(0)
    return {"pixel_values": pixels, "image_position_ids": positions}


def naflex_inputs(config: Any, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One zero image of f x f patches (f = ``downsample_factor``) as patch rows, with its ``spatial_shapes`` and an
    all-valid ``pixel_attention_mask`` (LFM2-VL's SigLIP2 naflex tower: any patch grid, its positions resized to it;
    the projector unshuffles f x f patches into one token, so f x f patches are the one-token image; padding is the
    mask, not zero pixels): ``(1, f * f, C * p * p)``."""
    vision = config.vision_config
    f, patch = int(config.downsample_factor), int(vision.patch_size)
    pixels = torch.zeros(1, f * f, _channels(vision) * patch * patch, dtype=dtype, device=device)
    return {"pixel_values": pixels, "spatial_shapes": _index([[f, f]], torch.long, device),
            "pixel_attention_mask": torch.ones(1, f * f, dtype=torch.long, device=device)}  # fmt: skip


def masked_tile_inputs(config: Any, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One zero tile of one image and the ``pixel_attention_mask`` that marks it real, ``(1, 1, C, S, S)`` and
    ``(1, 1)`` (Granite Docling: tiles at the tower's ``image_size``; padding tiles are the mask's False, not zero
    pixels, and the mask is required)."""
    vision = config.vision_config
    side = _side(vision)
    pixels = torch.zeros(1, 1, _channels(vision), side, side, dtype=dtype, device=device)
    return {"pixel_values": pixels, "pixel_attention_mask": torch.ones(1, 1, dtype=torch.bool, device=device)}


def packed_inputs(config: Any, device: torch.device, dtype: torch.dtype, images: int = 1) -> dict[str, torch.Tensor]:
    """``images`` zero images of m x m patches each, NaViT-packed as ``(1, C, p, images * m * m * p)``, and their
    ``target_sizes`` (MiniCPM-V 4.6 / 4.7 / OCR: any patch grid, positions looked up per grid; the tower's window
    merger and then the merger each fold 2 x 2 patches, so m = window kernel x merge kernel ** merger_times patches
    make one token). One image is the smallest input; more where the merger's per-image MLP calls must pair with
    another rank's (:data:`PACKED_PER_IMAGE`)."""
    vision = config.vision_config
    window, merge = vision.window_kernel_size, config.merge_kernel_size
    times, patch = int(config.merger_times), int(vision.patch_size)
    height = int(window[0]) * int(merge[0]) ** times
    width = int(window[1]) * int(merge[1]) ** times
    pixels = torch.zeros(1, _channels(vision), patch, images * height * width * patch, dtype=dtype, device=device)
    sizes = _index([[height, width]] * images, torch.int32, device)
    return {"pixel_values": pixels, "target_sizes": sizes}


def packed_images(inputs: dict[str, Any]) -> tuple[int, ...]:
    """Images of a MiniCPM-V forward's two tower calls (``get_image_features``, then ``get_video_features``): the
    rows of ``target_sizes``; frames x rows of ``target_sizes_videos`` (each frame is packed as an image)."""
    images, videos = inputs.get("pixel_values"), inputs.get("pixel_values_videos")
    sizes, video_sizes = inputs.get("target_sizes"), inputs.get("target_sizes_videos")
    image_count = len(sizes) if images is not None and sizes is not None else 0
    video_count = int(videos.shape[0]) * len(video_sizes) if videos is not None and video_sizes is not None else 0
    return image_count, video_count


#: MiniCPM-V's merger: ``merger.mlp[i]`` once per image of a call (:class:`PerImage`).
PACKED_PER_IMAGE = PerImage("merger.mlp", ("target_sizes", "target_sizes_videos"), packed_images)


def _packed(name: str, cls: str) -> VisionFamily:
    """A MiniCPM-V row: NaViT-packed images, and the merger's MLPs run once per image (:data:`PACKED_PER_IMAGE`)."""
    return VisionFamily(name, (cls,), dummy=packed_inputs, tower="vision_tower", per_image=PACKED_PER_IMAGE)


def pooled_inputs(config: Any, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One zero crop (the tower's fixed patch count, ``num_position_embeddings``), ``(1, P, C * p * p)``, pooled into
    one token from its first patch (``image_token_pooling`` ``[[0]]``), and its ``image_grids`` ``[[1, 1, 0, 0]]``
    (Molmo2: the adapter pools any patch index list into a token; one crop is the smallest input the tower takes)."""
    vision = config.vision_config
    patches, patch = int(vision.num_position_embeddings), int(vision.patch_size)
    pixels = torch.zeros(1, patches, _channels(vision) * patch * patch, dtype=dtype, device=device)
    return {"pixel_values": pixels, "image_token_pooling": torch.zeros(1, 1, dtype=torch.long, device=device),
            "image_grids": _index([[1, 1, 0, 0]], torch.long, device)}  # fmt: skip


def sam_inputs(config: Any, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One zero global view at the SAM encoder's ``image_size`` and no local patches, ``(1, C, S, S)`` (DeepSeek-OCR-2,
    Unlimited-OCR: SAM's absolute positions are one per patch of that size; the local views, when given, are a second
    tower call of the same kind)."""
    sam = config.vision_config.sam_config
    side = _side(sam)
    return {"pixel_values": torch.zeros(1, _channels(sam), side, side, dtype=dtype, device=device)}


def aspect_tile_inputs(config: Any, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One zero image of one tile, padded to ``max_num_tiles`` tiles as the processor pads it, with its
    ``aspect_ratio_ids`` (the id of the 1 x 1 aspect ratio) and ``aspect_ratio_mask`` (the first tile valid):
    ``(1, 1, T, C, S, S)`` (Mllama: the aspect-ratio embeddings are laid out for ``max_num_tiles`` tiles, so every
    image has that many, the padding ones masked)."""
    vision = config.vision_config
    side, tiles = _side(vision), int(vision.max_num_tiles)
    ratios = [[int(h), int(w)] for h, w in vision.supported_aspect_ratios]
    ratio_id = ratios.index([1, 1]) + 1 if [1, 1] in ratios else 1  # ids count from 1 (0: no image)
    pixels = torch.zeros(1, 1, tiles, _channels(vision), side, side, dtype=dtype, device=device)
    mask = _index([[[1] + [0] * (tiles - 1)]], torch.long, device)
    return {"pixel_values": pixels, "aspect_ratio_ids": _index([[ratio_id]], torch.long, device),
            "aspect_ratio_mask": mask}  # fmt: skip


TILED_FAMILIES: tuple[VisionFamily, ...] = (
    VisionFamily("mistral3", ("Mistral3Model",), ("pixel_values",), sized_inputs, "vision_tower"),
    VisionFamily("idefics3", ("Idefics3Model",), ("pixel_values",), tile_inputs, "vision_model", "text_model"),
    VisionFamily("smolvlm", ("SmolVLMModel",), ("pixel_values",), tile_inputs, "vision_model", "text_model"),
    _fixed("internvl", "InternVLModel"),  # tiles of the tower's fixed image_size, one per row of pixel_values
    VisionFamily("llava_next", ("LlavaNextModel",), ("pixel_values",), anyres_inputs, "vision_tower"),
    VisionFamily("llava_onevision", ("LlavaOnevisionModel",), dummy=anyres_inputs, tower="vision_tower"),
    VisionFamily("llava_next_video", ("LlavaNextVideoModel",), dummy=anyres_inputs, tower="vision_tower"),
    VisionFamily("gemma4", ("Gemma4Model",), dummy=positioned_inputs, tower="vision_tower", audio=GEMMA4_AUDIO),
    VisionFamily("lfm2_vl", ("Lfm2VlModel",), ("pixel_values",), naflex_inputs, "vision_tower"),
    VisionFamily("lighton_ocr", ("LightOnOcrModel",), ("pixel_values",), sized_inputs, "vision_encoder"),
    VisionFamily("mistral_large4", ("MistralLarge4Model",), ("pixel_values",), sized_inputs, "vision_tower"),
    VisionFamily(
        "granite_docling", ("GraniteDoclingModel",), ("pixel_values",), masked_tile_inputs, "vision_model", "text_model"
    ),
    _fixed("qianfan_ocr", "QianfanOCRModel"),  # InternVL's tiles
    _packed("minicpmv4_6", "MiniCPMV4_6Model"),
    _packed("minicpm_ocr", "MiniCPMOcrModel"),
    _packed("minicpmv4_7", "MiniCPMV4_7Model"),
    _fixed("aria", "AriaModel"),  # the pixel_mask is optional: no mask is an all-valid image
    VisionFamily("molmo2", ("Molmo2Model",), dummy=pooled_inputs, tower="vision_tower"),
    VisionFamily(
        "deepseek_ocr2", ("DeepseekOcr2Model",), ("pixel_values", "pixel_values_local"), sam_inputs, "vision_tower"
    ),
    VisionFamily(
        "unlimited_ocr", ("UnlimitedOcrModel",), ("pixel_values", "pixel_values_local"), sam_inputs, "vision_tower"
    ),
    VisionFamily("step3p7", ("Step3p7Model",), ("pixel_values", "pixel_values_local"), fixed_inputs, "vision_model"),
    VisionFamily("idefics2", ("Idefics2Model",), ("pixel_values",), tile_inputs, "vision_model", "text_model"),
    VisionFamily("granite4_vision", ("Granite4VisionModel",), ("pixel_values",), anyres_inputs, "vision_tower"),
    # cross-attention: the projected states reach the text model's cross-attention layers, not inputs_embeds
    VisionFamily(
        "mllama",
        ("MllamaModel",),
        ("pixel_values",),
        aspect_tile_inputs,
        "vision_model",
        projector="multi_modal_projector",
        cross_attention=CrossAttention(),
    ),
)
