"""Mixed micro-batches: every rank issues the vision tower's FSDP2 collectives, whether its micro-batch has images
or not.

Why: FSDP2 pairs collectives across ranks by order and size. A vision-language model calls its vision tower only
for a micro-batch with ``pixel_values``. A rank whose micro-batch has no image skips the all-gathers of the tower's
own groups, so its next all-gather (a text layer) meets another rank's vision-block all-gather; and even where the
tower has no group of its own, the group that holds its parameters (the root, say) reduce-scatters in backward only
the parameters that got a gradient, so its reduce-scatter is smaller on that rank. gloo aborts ("Received data size
doesn't match expected size"), NCCL hangs until its watchdog fires.

How, from the collective order: in transformers' VLM forwards an image rank all-gathers the input embedding's
group, then the tower's groups once per medium (images, then videos), then the text layers; backward reverses it.
At the start of the VLM's forward the ranks exchange how many tower calls each will make (one small all-reduce over
the tower's device mesh). Just before the text model runs, a rank that made fewer calls than the most any rank
makes calls the tower on a zero dummy (its family's smallest valid input) and adds ``0.0 * features`` to the text
model's ``inputs_embeds``: the same all-gathers in the same place forward, the same reduce-scatters backward, and a
contribution of exactly zero. When no rank has vision input, no rank runs the tower: the step equals one process
training on all the ranks' micro-batches (no zero gradients, so AdamW leaves the tower alone, as it would there).

Families are one table (:data:`FAMILIES`): the inner model classes that hold ``visual`` and ``language_model``, the
vision inputs they take, and the dummy builder. A model whose forward is not transformers' own (verl replaces the
GLM4V and Qwen-VL forwards with ones that run their own dummy) is left alone. A vision-language model outside the
table whose vision tower is sharded gets the same exchange and, where ranks differ, one
:class:`~fsdp_compat.errors.FsdpCompatError` on every rank naming the model class, the ranks and the fix, instead of
a hang.

``FSDP_COMPAT_MIXED_BATCHES``: ``sync`` (default, as above), ``always`` (no exchange: every rank runs the tower at
least once per forward, on a dummy where it has no input, as verl does; for image-only jobs, since a rank with
images and videos calls the tower twice) or ``off``.
"""

from __future__ import annotations

import inspect
import logging
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fsdp_compat import switches
from fsdp_compat.errors import FsdpCompatError

__all__ = [
    "ENV_MIXED_BATCHES",
    "FAMILIES",
    "MODES",
    "MixedBatches",
    "VisionFamily",
    "grid_dummy",
    "install_mixed_batches",
    "mixed_batches_mode",
    "mixed_batches_of",
]

ENV_MIXED_BATCHES = "FSDP_COMPAT_MIXED_BATCHES"
MODES = ("sync", "always", "off")
logger = logging.getLogger("fsdp_compat")

# Attribute names of vision towers in vision-language models outside the table (LLaVA, Gemma3, Idefics, ...).
_TOWER_NAMES = ("visual", "vision_tower", "vision_model", "vision_encoder", "image_encoder", "vision")


def mixed_batches_mode() -> str:
    """``FSDP_COMPAT_MIXED_BATCHES`` (``sync`` when unset; the on spellings mean ``sync``, the off spellings ``off``:
    :mod:`fsdp_compat.switches`); an unknown value is an error naming the choices."""
    return switches.choice(ENV_MIXED_BATCHES, MODES, "sync", on="sync", off="off", strict=True)


# ------------------------------------------------------------------------------------------------ family table


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


_IMAGES_AND_VIDEOS = (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw"))


@dataclass(frozen=True)
class VisionFamily:
    """One row: the inner model classes of a VLM family, its vision inputs, and how to feed its tower a dummy.

    ``inputs`` lists (pixel argument, grid argument) per medium in the order the forward calls the tower; the
    dummy always goes through the first (``get_image_features``), and joins the graph at ``language_model``'s
    ``inputs_embeds``, where the real features join it too.
    """

    name: str
    classes: tuple[str, ...]
    inputs: tuple[tuple[str, str], ...] = _IMAGES_AND_VIDEOS
    dummy: Callable[[Any, torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = grid_dummy


FAMILIES: tuple[VisionFamily, ...] = (
    VisionFamily("glm4v", ("Glm4vModel",)),
    VisionFamily("glm4v-moe", ("Glm4vMoeModel",)),
    VisionFamily("glm46v", ("Glm46VModel",)),
    VisionFamily("qwen2-vl", ("Qwen2VLModel",)),
    VisionFamily("qwen2.5-vl", ("Qwen2_5_VLModel",)),
    VisionFamily("qwen3-vl", ("Qwen3VLModel",)),
    VisionFamily("qwen3-vl-moe", ("Qwen3VLMoeModel",)),
)


def _family_of(module: nn.Module) -> VisionFamily | None:
    names = {cls.__name__ for cls in type(module).__mro__}
    for family in FAMILIES:
        if names.intersection(family.classes):
            return family
    return None


# ------------------------------------------------------------------------------------------------------ install

_INSTALLED: weakref.WeakKeyDictionary[nn.Module, list[MixedBatches]] = weakref.WeakKeyDictionary()


def install_mixed_batches(model: nn.Module, mode: str | None = None) -> list[MixedBatches]:
    """Keep ``model``'s ranks' collectives in step when some micro-batches lack vision input (see the module doc).

    ``mode`` defaults to ``FSDP_COMPAT_MIXED_BATCHES``. Idempotent; does nothing for text models, in mode ``off``,
    or where the model is not sharded across ranks. It may run before ``fully_shard``: whether FSDP2 shards the
    tower is decided at the first forward.
    """
    mode = mixed_batches_mode() if mode is None else mode
    if mode not in MODES:
        raise FsdpCompatError(f"mixed-batch mode {mode!r} is not one of {', '.join(MODES)}")
    if mode == "off":
        return []
    if model in _INSTALLED:
        return _INSTALLED[model]
    installed: list[MixedBatches] = []
    for path, module in model.named_modules():
        family = _family_of(module)
        if family is not None and all(hasattr(module, a) for a in ("visual", "language_model", "get_image_features")):
            installed.append(_KnownFamily(model, module, path, family, mode))
    if not installed:
        unknown = _unknown_vlm(model)
        if unknown is not None:
            installed.append(unknown)
    _INSTALLED[model] = installed
    return installed


def mixed_batches_of(model: nn.Module) -> list[MixedBatches]:
    """What :func:`install_mixed_batches` put on ``model`` (empty for text models)."""
    return list(_INSTALLED.get(model, ()))


def _marked(hook: Callable[..., Any]) -> Callable[..., Any]:
    hook.__func__.__fsdp_compat_guard__ = True  # type: ignore[attr-defined]  # no parameter read: analysis skips it
    return hook


def _forward_is_transformers(module: nn.Module) -> bool:
    forward = inspect.unwrap(type(module).forward)
    return str(getattr(forward, "__module__", "")).startswith("transformers.")


def _sharded_across_ranks(root: nn.Module, tower: nn.Module) -> bool:
    """Whether FSDP2 manages the tower's parameters (in groups of its own or in an enclosing one, the root
    included) across more than one rank. Either way a rank that skips the tower skips collectives: its blocks'
    all-gathers, and in backward the enclosing group reduce-scatters only parameters that got a gradient."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return False
    return isinstance(root, FSDPModule) or any(isinstance(m, FSDPModule) for m in tower.modules())


def _mesh_of(*modules: nn.Module) -> Any:
    """The device mesh of the first sharded (DTensor) parameter found, else None (the default process group)."""
    for module in modules:
        for p in module.parameters():
            mesh = getattr(p, "device_mesh", None)
            if mesh is not None:
                return mesh
    return None


def _exchange(mesh: Any, value: int, device: torch.device) -> list[int]:
    """Every rank's ``value``, by global rank: one all-reduce of a world-size vector per mesh dimension."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return [value]
    world, rank = dist.get_world_size(), dist.get_rank()
    if mesh is not None:  # the mesh's backend decides where the vector lives (NCCL: the current GPU)
        device = torch.device(mesh.device_type)
        if device.type != "cpu" and device.index is None:
            device = torch.device(device.type, getattr(torch, device.type).current_device())
    vector = torch.zeros(world, dtype=torch.int64, device=device)
    vector[rank] = value
    if mesh is None:
        dist.all_reduce(vector)
    else:
        for dim in range(mesh.ndim):
            dist.all_reduce(vector, group=mesh.get_group(dim))
    return [int(v) for v in vector.tolist()]


def _floating_tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _floating_tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _floating_tensors(v)


def _device_of(args: tuple[Any, ...], kwargs: dict[str, Any], fallback: nn.Module) -> torch.device:
    for value in (*kwargs.values(), *args):
        if isinstance(value, torch.Tensor):
            return value.device
    for p in fallback.parameters():
        return p.device
    return torch.device("cpu")


def _ranks(counts: list[int], pick: Callable[[int], bool]) -> str:
    return ", ".join(str(r) for r, c in enumerate(counts) if pick(c))


class MixedBatches:
    """The hooks on one model; ``dummy_calls`` counts the dummy tower calls this rank made (for tests/logs)."""

    def __init__(self, root: nn.Module, path: str, mode: str) -> None:
        self.root_class = type(root).__name__
        self._root = weakref.ref(root)
        self.path = path
        self.mode = mode
        self.dummy_calls = 0
        self.exchanges = 0
        self._active: bool | None = None  # decided at the first forward: is the tower sharded across ranks?
        self._mesh: Any = None
        self._handles: list[Any] = []

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _activate(self, tower: nn.Module) -> bool:
        if self._active is None:
            root = self._root()
            self._active = root is not None and _sharded_across_ranks(root, tower)
            self._mesh = _mesh_of(tower, root) if self._active and root is not None else None
        return self._active


class _KnownFamily(MixedBatches):
    """A table family: count the tower calls, exchange counts, top up with dummies before the text model."""

    def __init__(self, root: nn.Module, inner: nn.Module, path: str, family: VisionFamily, mode: str) -> None:
        super().__init__(root, path, mode)
        self.family = family
        self._inner = weakref.ref(inner)
        self._calls = 0
        self._target: int | None = None  # tower calls every rank makes in this forward; None = not in a forward
        self._handles = [
            inner.register_forward_pre_hook(_marked(self._pre_forward), with_kwargs=True),
            inner.register_forward_hook(_marked(self._post_forward), always_call=True),
            inner.visual.register_forward_pre_hook(_marked(self._on_tower_call)),
            inner.language_model.register_forward_pre_hook(_marked(self._before_text_model), with_kwargs=True),
        ]

    def _pre_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._target = None
        if not _forward_is_transformers(module):  # e.g. verl's GLM4V / Qwen-VL forwards run their own dummy
            return
        if not self._activate(module.visual):
            return
        bound = _bind(module, args, kwargs)
        own = sum(bound.get(pixels) is not None for pixels, _ in self.family.inputs)
        if self.mode == "always":
            self._target = max(own, 1)
        else:
            counts = _exchange(self._mesh, own, _device_of(args, kwargs, module))
            self.exchanges += 1
            self._target = max(counts)
            if own < self._target:
                logger.debug(
                    "fsdp-compat: mixed micro-batches: %s: %d tower call(s) here, %d on rank(s) %s: dummy input",
                    self.path or self.root_class, own, self._target, _ranks(counts, lambda c: c == self._target),
                )  # fmt: skip
        self._calls = 0

    def _post_forward(self, *_: Any) -> None:
        self._target = None

    def _on_tower_call(self, *_: Any) -> None:
        if self._target is not None:
            self._calls += 1

    def _before_text_model(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self._target is None or self._calls >= self._target:
            return None
        inner = self._inner()
        assert inner is not None
        missing = self._target - self._calls
        self._target = None  # the dummies' own tower calls are not counted
        name, embeds = _inputs_embeds(module, args, kwargs)
        visual = inner.visual
        zero = None
        for _ in range(missing):
            pixels, grid = self.family.dummy(inner.config.vision_config, embeds.device, visual.dtype)
            features = inner.get_image_features(pixels, grid)
            for t in _floating_tensors(features):
                term = t.sum() * 0.0
                zero = term if zero is None else zero + term
            self.dummy_calls += 1
        if zero is None:
            return None
        embeds = embeds + zero.to(embeds.dtype)
        if name in kwargs:
            return args, {**kwargs, name: embeds}
        index = list(inspect.signature(module.forward).parameters).index(name)
        return (*args[:index], embeds, *args[index + 1 :]), kwargs


def _bind(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    if not args:
        return kwargs
    try:
        return dict(inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments)
    except TypeError:
        return kwargs


def _inputs_embeds(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, torch.Tensor]:
    embeds = _bind(module, args, kwargs).get("inputs_embeds")
    if not isinstance(embeds, torch.Tensor):
        raise FsdpCompatError(
            f"fsdp-compat: mixed micro-batches: {type(module).__name__} was called without inputs_embeds, so the "
            "dummy vision features have nowhere to join; set FSDP_COMPAT_MIXED_BATCHES=off and give every "
            "micro-batch vision input, or report this model"
        )
    return "inputs_embeds", embeds


# --------------------------------------------------------------------------------------- VLMs outside the table


def _unknown_vlm(model: nn.Module) -> MixedBatches | None:
    """A model that takes ``pixel_values*`` and has a vision tower, but no row in :data:`FAMILIES`."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return None
    pixel_args = tuple(name for name in parameters if name.startswith("pixel_values"))
    if not pixel_args:
        return None
    for path, module in model.named_modules():
        if path.rpartition(".")[2] in _TOWER_NAMES:
            return _UnknownFamily(model, module, path, pixel_args)
    return None


class _UnknownFamily(MixedBatches):
    """No dummy is known: where ranks disagree on having vision input, fail on every rank with one clear error."""

    def __init__(self, model: nn.Module, tower: nn.Module, path: str, pixel_args: tuple[str, ...]) -> None:
        super().__init__(model, path, "sync")
        self.pixel_args = pixel_args
        self._tower = weakref.ref(tower)
        self._handles = [model.register_forward_pre_hook(_marked(self._pre_forward), with_kwargs=True)]

    def _pre_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        tower = self._tower()
        if tower is None or not _forward_is_transformers(module) or not self._activate(tower):
            return
        bound = _bind(module, args, kwargs)
        own = int(any(bound.get(name) is not None for name in self.pixel_args))
        counts = _exchange(self._mesh, own, _device_of(args, kwargs, module))
        self.exchanges += 1
        if len(set(counts)) > 1:
            names = ", ".join(family.name for family in FAMILIES)
            raise FsdpCompatError(
                f"fsdp-compat: mixed micro-batches: rank(s) {_ranks(counts, lambda c: c == 0)} have no "
                f"{'/'.join(self.pixel_args)} in this forward of {self.root_class} while rank(s) "
                f"{_ranks(counts, bool)} do. Its vision tower ({self.path}) is sharded by FSDP2, so the ranks' "
                "collectives would fall out of step (a gloo abort, an NCCL hang), and fsdp-compat has no dummy input "
                f"for this model (it has one for: {names}). Fix: give every micro-batch vision input, or run the "
                f"tower on a zero dummy in your forward when a micro-batch has none and add 0.0 * its output to the "
                f"input embeddings (as verl's VLM forwards do), or add a row for {self.root_class} to "
                "fsdp_compat.mixed_batches.FAMILIES."
            )
