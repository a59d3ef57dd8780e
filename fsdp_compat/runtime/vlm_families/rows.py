"""The row types of the family table (:class:`VisionFamily` and the towers besides the vision tower) and the
dummy builders that several tower kinds share (a patch grid, a fixed resolution, sizes, tiles, mel frames)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


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
class CrossAttention:
    """Where a cross-attention family's vision states reach the text model (Mllama): as keywords of the text model's
    call, ``states`` (the projected states), ``mask`` (the additive cross-attention mask) and ``rows`` (the 0/1 mask of
    text rows that see an image, which multiplies the cross-attention layers' MLP output), not as ``inputs_embeds``
    features. The text model skips its cross-attention layers (FSDP2 groups of their own) where ``states`` is None.

    So a rank that owes a dummy also runs those layers: just before the text model, the dummy's tower call (the tower
    module itself, then the row's projector: such a family has no ``get_image_features``) joins as ``states`` of one
    zero vision token per row (``0 * features``), with a zero additive ``mask`` and an all-zero ``rows``. Its keys and
    values are then 0, so the attention output is 0, and the MLP output is multiplied by 0: each layer returns its
    input exactly, and every parameter of those layers (and of the tower) gets a gradient of exactly 0, as in the
    layers the text rank would have skipped. Where the text model is handed a cache (``generate``), the zero states
    are cached as real ones would be, so the decode steps run those layers on every rank (the image ranks from their
    cached states): there the row mask of a cache holding dummy states is all-zero again."""

    states: str = "cross_attention_states"
    mask: str = "cross_attention_mask"
    rows: str = "full_text_row_masked_out_mask"


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
    ``cross_attention``: the vision states reach the text model as cross-attention keywords, not as ``inputs_embeds``
    features (:class:`CrossAttention`: Mllama); the dummy calls the tower module, then ``projector``.
    ``tower_first``: the forward calls the tower before it embeds the text (Ovis2.5), so a rank's dummies run at the
    start of the inner model's forward, before the input embedding's all-gather (else, where the embedding is a
    group of its own, the text rank gathers it while the image rank gathers the tower).
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
    cross_attention: CrossAttention | None = None
    tower_first: bool = False


def _fixed(name: str, cls: str, tower: str = "vision_tower") -> VisionFamily:
    return VisionFamily(name, (cls,), ("pixel_values",), fixed_inputs, tower)


# Rows, by tower kind. Each section is one kind; a family joins the section of its kind.
