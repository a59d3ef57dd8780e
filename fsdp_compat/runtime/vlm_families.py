"""The vision-language families the mixed micro-batch alignment knows: one row per family, one dummy builder per
tower kind.

Why a table: a rank whose micro-batch has no image must still run its tower's collectives, on the smallest input the
tower accepts; what that input is depends on the tower kind, not on the training stack. Each row names the inner
model classes (the ones holding the tower and the text model), the attributes of both, the pixel arguments of the
forward (one tower call each) and the dummy builder. Rows are grouped by tower kind; a new family of a known kind is
one line. Used by :mod:`fsdp_compat.runtime.mixed_batches`; imports torch only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

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
    "DummyInputs",
    "PerImage",
    "VideoTower",
    "VisionFamily",
    "anyres_inputs",
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


def _index(rows: list[Any], dtype: torch.dtype, device: Any) -> torch.Tensor:
    """A dummy's small integer tensor (a grid, image sizes), made once per value and device: a dummy built on every
    text-only micro-batch copies no host list to the GPU (a copy and a stream sync each time) after the first."""
    return _cached_index(_frozen(rows), dtype, torch.device(device))


def _frozen(value: Any) -> Any:
    return tuple(_frozen(v) for v in value) if isinstance(value, (list, tuple)) else int(value)


@functools.lru_cache(maxsize=256)
def _cached_index(rows: tuple[Any, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=dtype, device=device)


def grid_dummy(vision_config: Any, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero patches for one image of 2m x 2m patches (m = spatial merge size) and its ``grid_thw``.

    The smallest input every ``pixel_values`` + ``*_grid_thw`` tower accepts: one merged token per m x m block,
    and at least two blocks per side for the position-embedding interpolation (GLM4V) and window partition
    (Qwen2.5-VL).
    """
    merge = int(vision_config.spatial_merge_size)
    channels = int(getattr(vision_config, "in_channels", None) or vision_config.in_chans)
    patch, temporal = int(vision_config.patch_size), int(vision_config.temporal_patch_size)
    grid = _index([[1, 2 * merge, 2 * merge]], torch.long, device)
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
    return {"pixel_values": pixels, "image_sizes": _index([[side, side]], torch.long, device)}


def tile_inputs(config: Any, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One tile of one image, ``(1, 1, C, S, S)``, of ones (Idefics3, SmolVLM: an all-zero tile is padding the
    model drops, which would leave the tower no input; the features are multiplied by 0.0 all the same)."""
    vision = config.vision_config
    side = _side(vision)
    return {"pixel_values": torch.ones(1, 1, _channels(vision), side, side, dtype=dtype, device=device)}


def mel_inputs(config: Any, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One clip of 4 zero mel frames and its ``feature_attention_mask`` (the Qwen omni thinkers' Whisper-style
    encoders: two stride-2 steps leave it one feature in both)."""
    mels = int(config.audio_config.num_mel_bins)
    return {
        "input_features": torch.zeros(1, mels, 4, dtype=dtype, device=device),
        "feature_attention_mask": torch.ones(1, 4, dtype=torch.long, device=device),
    }


@dataclass(frozen=True)
class AudioTower:
    """A family's audio encoder, aligned like its vision tower: a rank whose micro-batch has no audio runs
    ``get_audio_features`` on ``dummy`` where the family's forward runs its audio. ``after_vision`` False: before
    the vision tower (the Qwen omni thinkers encode audio, then images, then videos), so before this forward's
    first vision tower call, or before the text model where there is none; True: after every vision tower call
    (dots3, Muse Spark, Nemotron-H Omni, Gemma4, Inkling encode images and videos first), so just before the text
    model, after the vision dummies, and a rank with audio that owes vision dummies runs them just before its
    audio tower call. ``inputs``: the forward's audio keywords that must all be given for it to run the tower (one
    call for all clips); ``features``: the output field the forward reads; ``method``: the inner model's method
    the forward calls (the dummy's too); ``padding``: an embedder the forward calls beside the features, with one
    token id (Gemma3n pads the audio soft tokens with ``embed_audio``'s embedding of its last token): the dummy
    calls it too, on its last token, else its embedding has a gradient on the audio ranks only.
    """

    tower: str = "audio_tower"
    inputs: tuple[str, ...] = ("input_features",)
    dummy: DummyInputs = mel_inputs
    features: str = "last_hidden_state"
    after_vision: bool = False
    method: str = "get_audio_features"
    padding: str = ""


@dataclass(frozen=True)
class VideoTower:
    """A family's video path where it is not its image path (so not in the row's ``inputs``): a second tower
    (Video-LLaVA's ``video_tower``), or the vision tower through parameters only videos reach (Nemotron-H Omni's
    ``video_patch_projection``). Aligned as an :class:`AudioTower` in a column of its own: a rank without videos
    runs ``get_video_features`` on ``dummy`` after the image tower calls (and before the audio, where the forward
    runs its audio after its videos). Where ``tower`` is the vision tower itself, the call is told from an image
    call by ``method``, wrapped on the instance.
    """

    dummy: DummyInputs
    tower: str = "video_tower"
    inputs: tuple[str, ...] = ("pixel_values_videos",)
    features: str = "pooler_output"
    after_vision: bool = True
    method: str = "get_video_features"


#: The Qwen omni thinkers' audio encoder (Qwen2.5-Omni, Qwen3-Omni-MoE).
QWEN_OMNI_AUDIO = AudioTower()


def chunk_mel_inputs(config: Any, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One chunk of 8 zero mel frames and its ``chunk_sample_lengths`` (dots3: three stride-2 convolutions leave
    the 8 frames one, and the chunk's samples, 8 hops, round up to one token; the adapter keeps real tokens only)."""
    audio = config.audio_config
    frames = 8
    return {
        "input_features": torch.zeros(1, int(audio.feature_size), frames, dtype=dtype, device=device),
        "chunk_sample_lengths": _index([frames * int(audio.hop_length)], torch.long, device),
    }


def waveform_inputs(config: Any, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One zero waveform of one token's samples (Muse Spark: a convolutional pyramid over raw audio, whose length
    must be a multiple of ``samples_per_token``, the product of its patch sizes): ``(1, samples_per_token)``."""
    samples = 1
    for size in config.audio_config.patch_sizes:
        samples *= int(size)
    return {"input_values": torch.zeros(1, samples, dtype=dtype, device=device)}


def subsampled_mel_inputs(config: Any, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One clip of twice ``subsampling_factor`` zero mel frames, ``(1, frames, mels)`` (Nemotron-H Omni's Parakeet
    encoder: its stride-2 convolutions subsample by that factor, so that many frames make one token, and its
    conformer convolutions' BatchNorm needs more than one value per channel in training: two tokens. Like a real
    clip, the dummy moves that BatchNorm's running statistics on its rank, buffers, not parameters)."""
    audio = config.audio_config
    frames = 2 * int(audio.subsampling_factor)
    return {"input_features": torch.zeros(1, frames, int(audio.num_mel_bins), dtype=dtype, device=device)}


def masked_mel_inputs(config: Any, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One clip of 4 zero mel frames with its all-valid ``input_features_mask``, ``(1, 4, F)`` (Gemma4's USM
    conformer: two stride-2 convolutions leave one frame; its projection reads F / 4 x the second conv's channels,
    so F is the first conv's channel count, ``subsampling_conv_channels[0]``, 128 mel bins in the released model;
    the forward runs the tower only with the mask)."""
    mels = int(config.audio_config.subsampling_conv_channels[0])
    return {
        "input_features": torch.zeros(1, 4, mels, dtype=dtype, device=device),
        "input_features_mask": torch.ones(1, 4, dtype=torch.bool, device=device),
    }


def dmel_token_inputs(config: Any, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One frame of zero dMel bin tokens, ``(1, 1, n_mel_bins)`` long (Inkling: the audio "tower" embeds each
    frame's quantised mel bins and sums them, one token per frame)."""
    bins = int(config.audio_config.n_mel_bins)
    return {"audio_input_ids": torch.zeros(1, 1, bins, dtype=torch.long, device=device)}


def padded_mel_inputs(config: Any, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One clip of 4 zero mel frames and its mask in the tower's own convention, True where a frame is padding,
    so all False (Gemma3n's USM encoder: two stride-2 convolutions leave one frame; its forward passes the
    processor's mask inverted)."""
    mels = int(config.audio_config.input_feat_size)
    return {
        "input_features": torch.zeros(1, 4, mels, dtype=dtype, device=device),
        "input_features_mask": torch.zeros(1, 4, dtype=torch.bool, device=device),
    }


#: dots3: mel chunks, encoded after images and videos; the forward reads the adapter's ``pooler_output``.
DOTS3_AUDIO = AudioTower(dummy=chunk_mel_inputs, features="pooler_output", after_vision=True)
#: Muse Spark: raw waveforms, after images and videos.
MUSE_SPARK_AUDIO = AudioTower(inputs=("input_values",), dummy=waveform_inputs, features="pooler_output",
                              after_vision=True)  # fmt: skip
#: Nemotron-H Omni: Parakeet mel clips, after images and videos (projected by ``embed_audio`` inside
#: ``get_audio_features``).
NEMOTRON_AUDIO = AudioTower(dummy=subsampled_mel_inputs, features="pooler_output", after_vision=True)
#: Gemma4: USM mel clips, after images and videos; the forward runs the tower only with the mask too.
GEMMA4_AUDIO = AudioTower(inputs=("input_features", "input_features_mask"), dummy=masked_mel_inputs,
                          features="pooler_output", after_vision=True)  # fmt: skip
#: Gemma3n: USM mel clips after images; the forward pads the soft tokens with ``embed_audio``'s hard embedding.
GEMMA3N_AUDIO = AudioTower(inputs=("input_features", "input_features_mask"), dummy=padded_mel_inputs,
                           features="pooler_output", after_vision=True, padding="embed_audio")  # fmt: skip
#: Inkling: dMel bin tokens, after images.
INKLING_AUDIO = AudioTower(inputs=("audio_input_ids",), dummy=dmel_token_inputs, after_vision=True)


@dataclass(frozen=True)
class PerImage:
    """Modules that a family's forward runs once per image of a tower call, outside the tower (MiniCPM-V's merger
    loops over the call's ``target_sizes`` rows and runs ``merger.mlp[i]`` on each image: a stack that gives those
    MLPs FSDP2 groups of their own, as NeMo Automodel gives every ``nn.ModuleList`` child one, all-gathers and
    reduce-scatters them once per image, and FSDP2's backward reshards and gathers such a group again between two
    calls). ``module``: the inner model's path of those modules; ``inputs``: the forward keywords the counts are read
    from (beside the row's ``inputs``); ``count``: the images of each tower call from the forward's inputs, one per
    entry of the row's ``inputs`` (0 where that call is not made). The ranks exchange these counts with the tower
    calls, and a dummy call packs as many images as the call of another rank that it pairs with."""

    module: str
    inputs: tuple[str, ...]
    count: Callable[[dict[str, Any]], tuple[int, ...]]


@dataclass(frozen=True)
class VisionFamily:
    """One row: the inner model classes of a VLM family, its vision inputs, and how to feed its tower a dummy.

    ``tower`` and ``text`` are the inner model's attributes (or dotted submodule paths) that hold the vision tower
    and the text model; ``inputs`` lists the pixel arguments, one tower call each, in the order the forward makes
    them; ``dummy`` builds the ``get_image_features`` keywords of the family's smallest valid input from the inner
    model's config (one builder per tower kind, shared by the families of that kind). The dummy's features join the
    graph at the text model's ``inputs_embeds``, where the real features join it too (the output's ``pooler_output``
    and ``deepstack_features`` where it has them: Emu3's ``pooler_output`` is the text embeddings of its codes, its
    ``last_hidden_state`` the VQ encoder's, cut from the loss by the quantizer's argmin). ``audio``: the family's
    audio encoder where it has one that fsdp-compat aligns too (:class:`AudioTower`). ``projector``: the inner
    model's attribute of a projector that the forward applies to the output's ``projected`` field outside
    ``get_image_features`` (Llama4's ``multi_modal_projector``): the dummy's features pass through it too, else its
    parameters get a gradient on the image ranks only and the group holding them reduce-scatters less elsewhere.
    ``video``: the family's video path where it differs from its image path (:class:`VideoTower`); ``inputs``
    then lists the image arguments only. ``per_image``: modules the forward runs once per image of a tower call
    (:class:`PerImage`: MiniCPM-V's merger MLPs); the dummy then packs as many images as the call it stands for.
    """

    name: str
    classes: tuple[str, ...]
    inputs: tuple[str, ...] = ("pixel_values", "pixel_values_videos")
    dummy: DummyInputs = grid_inputs
    tower: str = "visual"
    text: str = "language_model"
    audio: AudioTower | None = None
    projector: str = ""
    projected: str = "last_hidden_state"
    video: VideoTower | None = None
    per_image: PerImage | None = None


def _fixed(name: str, cls: str, tower: str = "vision_tower") -> VisionFamily:
    return VisionFamily(name, (cls,), ("pixel_values",), fixed_inputs, tower)


# Rows, by tower kind. Each section is one kind; a family joins the section of its kind.

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
)

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
