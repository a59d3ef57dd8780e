"""The vision-language families the mixed micro-batch alignment knows: one row per family, one dummy builder per
tower kind.

Why a table: a rank whose micro-batch has no image must still run its tower's collectives, on the smallest input the
tower accepts; what that input is depends on the tower kind, not on the training stack. Each row names the inner
model classes (the ones holding the tower and the text model), the attributes of both, the pixel arguments of the
forward (one tower call each) and the dummy builder. Rows are grouped by tower kind; a new family of a known kind is
one line. Used by :mod:`fsdp_compat.runtime.mixed_batches`; imports torch only.

One module per tower kind (``grid``, ``fixed``, ``tiled``, ``other``, ``timm``; ``audio`` for the omni families'
audio encoders), the row types and shared builders in ``rows``; this package assembles the table and holds the rows
a user registers (:func:`register_family`).
"""

from __future__ import annotations

from fsdp_compat.runtime.vlm_families.audio import (
    DOTS3_AUDIO,
    GEMMA3N_AUDIO,
    GEMMA4_AUDIO,
    INKLING_AUDIO,
    MUSE_SPARK_AUDIO,
    NEMOTRON_AUDIO,
    QWEN_OMNI_AUDIO,
    chunk_mel_inputs,
    dmel_token_inputs,
    masked_mel_inputs,
    padded_mel_inputs,
    subsampled_mel_inputs,
    waveform_inputs,
)
from fsdp_compat.runtime.vlm_families.fixed import (
    FIXED_FAMILIES,
    fixed_video_inputs,
    hybrid_inputs,
    packed_patch_inputs,
)
from fsdp_compat.runtime.vlm_families.grid import (
    GRID_FAMILIES,
    MORE_GRID_FAMILIES,
    NEMOTRON_VIDEO,
    conv_grid_inputs,
    grid_hw_inputs,
    grid_patches_inputs,
    merge_size_inputs,
    patch_grid_inputs,
    tubelet_inputs,
)
from fsdp_compat.runtime.vlm_families.other import (
    OTHER_FAMILIES,
    flat_patch_inputs,
    position_patch_inputs,
    strided_inputs,
    token_tile_inputs,
    vq_inputs,
)
from fsdp_compat.runtime.vlm_families.rows import (  # noqa: F401 (re-exported)
    AudioTower,
    CrossAttention,
    DummyInputs,
    PerImage,
    VideoTower,
    VisionFamily,
    _index,
    fixed_inputs,
    grid_dummy,
    grid_inputs,
    mel_inputs,
    sized_inputs,
    tile_inputs,
)
from fsdp_compat.runtime.vlm_families.tiled import (
    PACKED_PER_IMAGE,
    TILED_FAMILIES,
    anyres_inputs,
    aspect_tile_inputs,
    masked_tile_inputs,
    naflex_inputs,
    packed_images,
    packed_inputs,
    pooled_inputs,
    positioned_inputs,
    sam_inputs,
)
from fsdp_compat.runtime.vlm_families.timm import (  # noqa: F401 (re-exported)
    TIMM_FAMILIES,
    _timm_side,
    timm_inputs,
    timm_tile_inputs,
)

__all__ = [
    "DOTS3_AUDIO",
    "FAMILIES",
    "GEMMA3N_AUDIO",
    "GEMMA4_AUDIO",
    "INKLING_AUDIO",
    "MUSE_SPARK_AUDIO",
    "NEMOTRON_AUDIO",
    "NEMOTRON_VIDEO",
    "PACKED_PER_IMAGE",
    "QWEN_OMNI_AUDIO",
    "AudioTower",
    "CrossAttention",
    "DummyInputs",
    "PerImage",
    "VideoTower",
    "VisionFamily",
    "anyres_inputs",
    "aspect_tile_inputs",
    "chunk_mel_inputs",
    "conv_grid_inputs",
    "dmel_token_inputs",
    "family_named",
    "fixed_inputs",
    "fixed_video_inputs",
    "flat_patch_inputs",
    "grid_dummy",
    "grid_hw_inputs",
    "grid_inputs",
    "grid_patches_inputs",
    "hybrid_inputs",
    "masked_mel_inputs",
    "masked_tile_inputs",
    "mel_inputs",
    "merge_size_inputs",
    "naflex_inputs",
    "packed_images",
    "packed_inputs",
    "packed_patch_inputs",
    "padded_mel_inputs",
    "patch_grid_inputs",
    "pooled_inputs",
    "position_patch_inputs",
    "positioned_inputs",
    "register_family",
    "registered_families",
    "sam_inputs",
    "sized_inputs",
    "strided_inputs",
    "subsampled_mel_inputs",
    "tile_inputs",
    "timm_inputs",
    "timm_tile_inputs",
    "token_tile_inputs",
    "tubelet_inputs",
    "vq_inputs",
    "waveform_inputs",
]


# ------------------------------------------------------------------------------------------------------- table

#: Every row, in the order the alignment matches them (an inner model's class or one of its bases).
FAMILIES: tuple[VisionFamily, ...] = (
    *GRID_FAMILIES,
    *MORE_GRID_FAMILIES,
    *FIXED_FAMILIES,
    *TILED_FAMILIES,
    *OTHER_FAMILIES,
    *TIMM_FAMILIES,
)


def family_named(name: str) -> VisionFamily:
    """The row called ``name`` (``KeyError`` naming the rows if none)."""
    for family in FAMILIES:
        if family.name == name:
            return family
    raise KeyError(f"no family {name!r}; rows: {', '.join(f.name for f in FAMILIES)}")


# ------------------------------------------------------------------------------------------- a user's own rows

_REGISTERED: list[VisionFamily] = []


def register_family(family: VisionFamily) -> VisionFamily:
    """Add a row for a vision-language model of your own (or one fsdp-compat has no row for), so that its ranks stay
    in step when some micro-batches have no images: call it before the model's first forward (before or after
    ``fully_shard``). The row names the inner model class (``classes``: the class that has ``get_image_features``,
    the tower and the text model as attributes; your outer model may be that class), its pixel arguments
    (``inputs``), the tower and text-model attributes, and ``dummy(config, device, dtype)``: the
    ``get_image_features`` keywords of the smallest valid input (``config`` is the inner model's ``config``
    attribute, None where it has none). A registered row is trusted for a forward that is not transformers' own.
    The text model must take ``inputs_embeds`` (the dummy's zero term joins there). Returns the row; registering
    a row with the same name again replaces it."""
    if not isinstance(family, VisionFamily):
        raise TypeError(f"register_family takes a VisionFamily, not {type(family).__name__}")
    if not family.classes or not family.inputs or not callable(family.dummy):
        raise ValueError(
            f"register_family({family.name!r}): a row needs the inner model class names (classes), its pixel "
            "arguments (inputs) and a dummy builder (dummy(config, device, dtype) -> get_image_features keywords)"
        )
    _REGISTERED[:] = [f for f in _REGISTERED if f.name != family.name]
    _REGISTERED.append(family)
    return family


def registered_families() -> tuple[VisionFamily, ...]:
    """The rows :func:`register_family` added, newest last (they are looked up before :data:`FAMILIES`)."""
    return tuple(_REGISTERED)
