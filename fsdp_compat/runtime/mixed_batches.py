"""Mixed micro-batches: every rank issues the vision tower's FSDP2 collectives, whether its micro-batch has images
or not; and the tower works when it is called outside the model's forward (``generate``).

Why: FSDP2 pairs collectives across ranks by order and size. A vision-language model calls its vision tower only
for a micro-batch with ``pixel_values``. A rank whose micro-batch has no image skips the all-gathers of the tower's
own groups, so its next all-gather (a text layer) meets another rank's vision-block all-gather; and even where the
tower has no group of its own, the group that holds its parameters (the root, say) reduce-scatters in backward only
the parameters that got a gradient, so its reduce-scatter is smaller on that rank. gloo aborts ("Received data size
doesn't match expected size"), NCCL hangs until its watchdog fires.

How, from the collective order: in transformers' VLM forwards an image rank all-gathers the root group (FSDP2's root
pre-forward), then the input embedding's group, then the tower's groups once per medium (images, then videos), then
the text layers; backward reverses it. Right after the root's pre-forward the ranks exchange how many tower calls
each will make (one all-reduce of a small integer vector, on a CPU process group: no device sync). Just before the
text model runs, a rank that made fewer calls than the most any rank makes calls the tower on a zero dummy (its
family's smallest valid input) and adds ``0.0 * features`` to the text model's ``inputs_embeds``: the same
all-gathers in the same place forward, the same reduce-scatters backward, and a contribution of exactly zero. When no
rank has vision input, no rank runs the tower: the step equals one process training on all the ranks' micro-batches
(no zero gradients, so AdamW leaves the tower alone, as it would there).

Tower calls outside the model's forward (transformers >= 5.2x's ``generate`` encodes images with
``get_image_features`` before the first forward; a user may call it, or the tower, directly): FSDP2 unshards a group
only in its own forward, so the tower's parameters that live in an enclosing group (the root) are still sharded
there (``got mixed torch.Tensor and DTensor``), under every plan. Such a call first runs the FSDP2 root's lazy
initialisation (else the first vision block to run would make itself a root) and unshards the enclosing groups,
outermost first, with FSDP2's own ``unshard()``. Nothing is resharded afterwards: the model's next forward reshards
each group as its ``reshard_after_forward`` says (the root: FSDP2 keeps it unsharded until the end of the next
backward); a group is never held longer than that forward would hold it anyway. The call also counts: it announces
itself in the exchange (right after the root's unshard, where the ranks at a forward start exchange), and a rank at
a forward start that sees such an announcement runs the same unshards and a dummy tower call, then exchanges again,
until no rank is outside.

Generation: inside ``model.generate`` (wrapped on the model) every forward after the first that decodes from a cache
is a decode step on every rank (transformers drops vision inputs there), so no rank can call the tower and no
exchange is made; ``synced_gpus`` defaults to True on a model sharded across ranks (transformers' own rule for
FSDP-managed modules), so ranks that stop at different lengths keep running forwards together.

Families are one table (:data:`FAMILIES`, :mod:`fsdp_compat.runtime.vlm_families`): the inner model classes that hold a
vision tower and a text model, the vision inputs they take, and the dummy builder of their tower kind (a patch grid,
a fixed resolution, Pixtral's ``image_sizes``, Idefics3's tiles, ...). A row may name an audio encoder too (the omni
families) and a video path of its own (Video-LLaVA's second tower, Nemotron-H Omni's video projection): each is a
count of its own in the same exchange, and its dummies run where the forward runs that medium (the Qwen thinkers'
audio before the vision tower, other audio and videos after it). A row may also name a projector the forward applies
to the tower's output outside ``get_image_features`` (Llama4): the dummy's features pass through it. And a row may
name modules its forward runs once per image of a tower call (MiniCPM-V's merger MLPs, which NeMo Automodel gives
FSDP2 groups of their own): the exchange carries each rank's images per call, and a dummy packs as many images as the
call it pairs with (where real calls differ in images and those modules are groups, every rank raises instead of
hanging; mode ``always`` and a dummy for a call outside the forward pack one image). A model whose
forward is not transformers' own (verl replaces the GLM4V and Qwen-VL forwards with ones that run their own dummy) is
left alone. A vision-language model outside the table whose vision tower is sharded gets the same exchange and,
where ranks differ, one :class:`~fsdp_compat.errors.FsdpCompatError` on every rank naming the model class, the ranks
and the fix, instead of a hang.

``FSDP_COMPAT_MIXED_BATCHES``: ``sync`` (default, as above), ``always`` (no exchange: every rank runs the tower at
least once per forward, on a dummy where it has no input, as verl does; for image-only jobs, since a rank with
images and videos calls the tower twice) or ``off`` (no alignment; tower calls outside the forward are still
unsharded, and ``generate`` still defaults to ``synced_gpus``).
"""

from __future__ import annotations

import functools
import inspect
import types
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from fsdp_compat import switches
from fsdp_compat.errors import FsdpCompatError
from fsdp_compat.log import logger
from fsdp_compat.runtime import alignment, marked
from fsdp_compat.runtime import exchange as wire
from fsdp_compat.runtime.exchange import column as _column
from fsdp_compat.runtime.first_pass import note_unshard
from fsdp_compat.runtime.vlm_families import (
    FAMILIES,
    VisionFamily,
    fixed_inputs,
    grid_dummy,
    grid_inputs,
    registered_families,
    sized_inputs,
    tile_inputs,
)
from fsdp_compat.runtime.vlm_families.refused import refusal

__all__ = [
    "ENV_MIXED_BATCHES",
    "FAMILIES",
    "MODES",
    "MixedBatches",
    "VisionFamily",
    "fixed_inputs",
    "grid_dummy",
    "grid_inputs",
    "install_mixed_batches",
    "mixed_batches_mode",
    "mixed_batches_of",
    "remove_mixed_batches",
    "sized_inputs",
    "tile_inputs",
]

ENV_MIXED_BATCHES = switches.MIXED_BATCHES
MODES = switches.MIXED_BATCHES_MODES

# Attribute names of vision towers in vision-language models outside the table (LLaVA, Gemma3, Idefics, Video-LLaVA's
# image_tower, ...), of image tokenizers (Chameleon, Emu3: a VQ-VAE whose blocks are FSDP2 groups of their own, run
# only for images) and of patch embedders of encoder-free models (UDOP: a text-only micro-batch leaves its parameters
# without a gradient, so the group holding them reduce-scatters less). The first module, in named_modules order,
# whose name is one of these.
_TOWER_NAMES = (
    "visual", "vision_tower", "vision_model", "vision_encoder", "image_encoder", "image_tower", "vision", "vqmodel",
    "patch_embed",
)  # fmt: skip


def mixed_batches_mode() -> str:
    """``FSDP_COMPAT_MIXED_BATCHES`` (``sync`` when unset; the on spellings mean ``sync``, the off spellings ``off``:
    :mod:`fsdp_compat.switches`); an unknown value is an error naming the choices."""
    return switches.mixed_batches_mode(strict=True)


def _family_of(module: nn.Module) -> VisionFamily | None:
    """The row of ``module``'s class: a registered one first (:func:`.vlm_families.register_family`), then the table."""
    names = {cls.__name__ for cls in type(module).__mro__}
    for family in (*reversed(registered_families()), *FAMILIES):
        if names.intersection(family.classes):
            return family
    return None


# ------------------------------------------------------------------------------------------------------ install

#: Where a model keeps its hooks (``module.__dict__``): the module owns them, so they die with it.
MIXED_ATTR = "_fsdp_compat_mixed_batches"


def install_mixed_batches(model: nn.Module, mode: str | None = None) -> list[MixedBatches]:
    """Keep ``model``'s ranks' collectives in step when some micro-batches lack vision input (see the module doc).

    ``mode`` defaults to ``FSDP_COMPAT_MIXED_BATCHES``. Idempotent for one mode (another mode replaces the hooks);
    does nothing for text models, or where the model is not sharded across ranks. It may run before ``fully_shard``:
    whether FSDP2 shards the tower is decided again at every forward until it does. In mode ``off`` it returns ``[]``
    and installs only what keeps a tower call outside the forward working (and ``generate``'s ``synced_gpus``).
    """
    mode = mixed_batches_mode() if mode is None else mode
    if mode not in MODES:
        raise FsdpCompatError(f"mixed-batch mode {mode!r} is not one of {', '.join(MODES)}")
    existing = model.__dict__.get(MIXED_ATTR)
    if existing is not None and all(m.mode == mode for m in existing):
        return mixed_batches_of(model)
    remove_mixed_batches(model)
    installed: list[MixedBatches] = []
    towerless = False  # a family of the table built without its tower (a text-only configuration): nothing to align
    for path, module in model.named_modules():
        family = _family_of(module)
        if family is not None and not _has_module(module, family.tower):
            towerless = True
        if (
            family is not None
            and (family.cross_attention is not None or callable(getattr(module, "get_image_features", None)))
            and all(_has_module(module, a) for a in (family.tower, family.text))
        ):
            if mode == "off":
                tower = module.get_submodule(family.tower)
                installed.append(MixedBatches(model, tower, f"{path}.{family.tower}" if path else family.tower, mode))
            else:
                installed.append(_KnownFamily(model, module, path, family, mode))
    if not installed and not towerless:
        unknown = _unknown_vlm(model, mode)
        if unknown is not None:
            installed.append(unknown)
    if installed:
        model.__dict__[MIXED_ATTR] = installed
    return mixed_batches_of(model)


def remove_mixed_batches(model: nn.Module) -> None:
    """Take every hook :func:`install_mixed_batches` put on ``model`` off again (idempotent)."""
    for hooks in model.__dict__.pop(MIXED_ATTR, None) or ():
        hooks.remove()


def _has_module(module: nn.Module, name: str) -> bool:
    """``module`` holds a submodule at the attribute or dotted path ``name`` (a row's tower may be a submodule of an
    attribute: Emu3's ``vqmodel.encoder``). An attribute that is None is no tower: a text-only configuration of a
    family with a row (transformers 5.24's Gemma4 built without a vision config sets ``vision_tower = None``)."""
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True


def mixed_batches_of(model: nn.Module) -> list[MixedBatches]:
    """What :func:`install_mixed_batches` put on ``model`` (empty for text models and in mode ``off``)."""
    return [m for m in model.__dict__.get(MIXED_ATTR, ()) if m.mode != "off"]


def _forward_is_transformers(module: nn.Module) -> bool:
    forward = inspect.unwrap(type(module).forward)
    return str(getattr(forward, "__module__", "")).startswith("transformers.")


def _fsdp_managed(root: nn.Module, tower: nn.Module) -> bool:
    """Whether FSDP2 manages the tower's parameters, in groups of its own or in an enclosing one (the root)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(root, FSDPModule) or any(isinstance(m, FSDPModule) for m in tower.modules())


def _multi_rank() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _mesh_of(*modules: nn.Module) -> Any:
    """The device mesh of the first sharded (DTensor) parameter found, else None (the default process group)."""
    for module in modules:
        for p in module.parameters():
            mesh = getattr(p, "device_mesh", None)
            if mesh is not None:
                return mesh
    return None


def _mesh_ranks(mesh: Any) -> tuple[int, ...]:
    """The global ranks that shard the tower: every rank of its mesh (``DeviceMesh.mesh`` lives on the CPU), or the
    whole world without one."""
    import torch.distributed as dist

    if mesh is None:
        return tuple(range(dist.get_world_size()))
    return tuple(sorted(int(r) for r in mesh.mesh.flatten().tolist()))


_OUTSIDE = -1  # exchanged by a rank that is calling the tower outside the model's forward


def _floating_tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _floating_tensors(v)
        if "pooler_output" not in value:  # set as a plain attribute on an output without that field (Mistral3 5.10)
            yield from _floating_tensors(getattr(value, "pooler_output", None))
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _floating_tensors(v)


# What a transformers 5 forward reads from ``get_image_features``: the projected features, and the per-layer
# features of the deepstack models (Qwen3-VL, Granite 4 Vision, Granite Docling).
_USED_FEATURES = ("pooler_output", "deepstack_features")


def _used_features(value: Any) -> Any:
    """The part of a ``get_image_features`` output that the forward consumes: its :data:`_USED_FEATURES` where it has
    any, else all of it. The tower's own ``last_hidden_state`` / ``hidden_states`` may run through layers and norms
    the features skip (LLaVA's ``vision_feature_layer=-2`` leaves the last layer out, Aria never reads the post-norm):
    a zero through them would give those parameters a gradient on the dummy rank only, and FSDP2's reduce-scatters
    would differ in size."""
    if isinstance(value, (torch.Tensor, list, tuple)):
        return value
    used = [getattr(value, name, None) for name in _USED_FEATURES]
    if isinstance(value, dict):
        used = [u if u is not None else value.get(name) for u, name in zip(used, _USED_FEATURES, strict=True)]
    used = [u for u in used if u is not None]
    return used or value


def _zero_of(value: Any) -> torch.Tensor | None:
    """The sum of ``0 * t`` over every floating tensor ``t`` of the features in ``value`` (:func:`_used_features`;
    None if there is none): joins the graph where the real features do, adds nothing."""
    zero = None
    for t in _floating_tensors(_used_features(value)):
        term = (t * 0).sum()  # not t.sum() * 0.0: a sum that overflows (fp16) is inf, and inf * 0.0 is NaN
        zero = term if zero is None else zero + term
    return zero


def _ranks(counts: dict[int, int], pick: Callable[[int], bool]) -> str:
    return ", ".join(str(r) for r, c in counts.items() if pick(c))


def _call_inputs(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The forward's arguments by name, ``**kwargs`` flattened in."""
    if not args:
        return kwargs
    try:
        signature = inspect.signature(module.forward)
        bound = dict(signature.bind_partial(*args, **kwargs).arguments)
    except (TypeError, ValueError):
        return kwargs
    var_keyword = [n for n, p in signature.parameters.items() if p.kind is inspect.Parameter.VAR_KEYWORD]
    flat = {k: v for k, v in bound.items() if k not in var_keyword}
    for name in var_keyword:
        flat.update(bound.get(name) or {})
    return flat


def _shows(module: nn.Module, names: Iterable[str]) -> bool:
    """Whether ``module.forward`` takes every one of ``names`` (by name, or through ``**kwargs``)."""
    try:
        parameters = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return True
    return all(name in parameters for name in names)


def _input_device(inputs: dict[str, Any], fallback: nn.Module) -> torch.device:
    """Where the forward computes: its first tensor input's device (CPU offload keeps sharded parameters on the CPU)."""
    for value in inputs.values():
        if isinstance(value, torch.Tensor):
            return value.device
    for p in fallback.parameters():
        return p.device
    return torch.device("cpu")


def _bind(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    return _call_inputs(module, args, kwargs)


_CACHE_ARGS = ("past_key_values", "cache")  # transformers < 5.2x / >= 5.2x


# ------------------------------------------------------------------------------------------------------ the hooks


class MixedBatches:
    """The hooks on one model. Counters (this rank, for tests and logs): ``dummy_calls`` (dummy tower calls),
    ``audio_dummy_calls`` (dummy audio-tower calls), ``exchanges`` (all-reduces of counts), ``outside_calls`` (tower
    calls outside the model's forward, unsharded here), ``decode_steps`` (forwards of ``generate`` that decoded from
    a cache without an exchange).

    This base class alone (mode ``off``) makes tower calls outside the model's forward work and wraps ``generate``;
    the subclasses add the alignment."""

    def __init__(self, root: nn.Module, tower: nn.Module | None, path: str, mode: str) -> None:
        """``tower`` None: no tower is known before the forward runs (:mod:`.replay`); the root stands for it where
        the hooks ask whether FSDP2 manages it, and no tower call outside the forward is watched."""
        self.root_class = _class_name(root)
        self._root = weakref.ref(root)
        self._tower = weakref.ref(root if tower is None else tower)
        self.path = path
        self.mode = mode
        self.dummy_calls = 0
        self.audio_dummy_calls = 0
        self.exchanges = 0
        self.outside_calls = 0
        self.decode_steps = 0
        self._active: bool | None = None  # True once the tower is sharded across ranks; decided again until then
        self._ranks: tuple[int, ...] = ()
        self._depth = 0  # forwards of the root in flight
        self._generating: list[int] = []  # per generate() call in flight: the root forwards it has run
        self._enclosing = _enclosing_paths(root, tower) if tower is not None else ()
        self._handles: list[Any] = [
            root.register_forward_pre_hook(marked(self._root_pre_forward), with_kwargs=True),
            root.register_forward_hook(marked(self._root_post_forward), always_call=True),
        ]
        if tower is not None:
            self._handles.append(tower.register_forward_pre_hook(marked(self._on_tower_call), prepend=True))
        self._generate = _wrap_generate(root)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        root = self._root()
        if root is not None and self._generate is not None and root.__dict__.get("generate") == self._generate:
            del root.__dict__["generate"]

    # -------------------------------------------------------------------------------------------- activation

    def _activate(self) -> bool:
        """Whether the tower is sharded across ranks. A model that is not FSDP-managed yet (a forward before
        ``fully_shard``) is asked again at the next forward; only a sharded one caches the answer."""
        if self._active is not None:
            return self._active
        root, tower = self._root(), self._tower()
        if root is None or tower is None or not _fsdp_managed(root, tower):
            return False
        self._active = _multi_rank()
        if self._active:
            self._ranks = _mesh_ranks(_mesh_of(tower, root))
        return self._active

    def _no_collectives(self) -> bool:
        """Whether this pass issues no FSDP2 collective at all, on any rank: no grad (no backward, so no
        reduce-scatter) and every group of the root's tree unsharded already (``reshard_after_forward=False`` after
        an ``unshard()``, a sample on one rank). Then nothing can fall out of step, and plain FSDP2 issues nothing:
        neither does the alignment (no exchange, no dummy)."""
        if torch.is_grad_enabled():
            return False
        from torch.distributed.fsdp import FSDPModule

        from fsdp_compat.runtime.window import tree_groups

        root = self._root()
        if not isinstance(root, FSDPModule):
            return False
        try:
            state = root._get_fsdp_state()
            groups = tree_groups(state) if state._is_root else []
            return bool(groups) and all(group.is_unsharded for group in groups)
        except (AttributeError, TypeError):  # another torch's FSDP2 internals: exchange as always (safe)
            return False

    _columns = 1  # values each rank exchanges: one per aligned tower

    def _exchange(self, *values: int) -> dict[int, tuple[int, ...]]:
        """Every rank's values, one per aligned tower: ``values`` cut or padded with zeros to that length (a model
        without an aligned audio tower exchanges only the vision column; a tower call outside the forward announces
        only the vision column). Every exchange of one model has the same length, wherever it is made."""
        self.exchanges += 1
        return wire.exchange(self._ranks, (values + (0,) * self._columns)[: self._columns])

    # ------------------------------------------------------------------------------------------- forward window

    def _root_pre_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._depth += 1
        if self._depth == 1:
            self._begin(module, args, kwargs)

    def _root_post_forward(self, *_: Any) -> None:
        if self._depth == 0:
            return
        self._depth -= 1
        if self._depth == 0:
            self._end()
            if self._generating:
                self._generating[-1] += 1

    def _begin(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A forward of the root starts (FSDP2's root pre-forward has run): the alignment's exchange point."""

    def _end(self) -> None:
        """The root's forward ended (or raised)."""

    def _decode_step(self, inputs: dict[str, Any]) -> bool:
        """A forward of ``generate`` after its first that decodes from a cache: on every rank alike, since the
        ranks run generate's forwards together (``synced_gpus``) and transformers forwards vision inputs only to
        the first forward of a cache (``prepare_inputs_for_generation``). No rank can call the tower here."""
        return (
            bool(self._generating)
            and self._generating[-1] > 0
            and any(inputs.get(name) is not None for name in _CACHE_ARGS)
        )

    # ---------------------------------------------------------------------------------- a tower call outside

    def _on_tower_call(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if self._depth:
            self._count_tower_call()
            return
        root = self._root()
        if root is None or not _fsdp_managed(root, module):
            return
        self.outside_calls += 1
        self._unshard_root(root)
        if self._activate() and not self._no_collectives():
            self._announce_outside_call()
        self._unshard_enclosing(root)

    def _count_tower_call(self) -> None:
        """A tower call inside the root's forward."""

    def _announce_outside_call(self) -> None:
        """Tell the ranks at a forward start that this rank calls the tower outside a forward (the alignment)."""

    def _unshard_root(self, root: nn.Module) -> None:
        """What FSDP2's root pre-forward would have done for the tower: the root's lazy init (so that the first of
        the tower's own groups to run does not become a root), then the root group's unshard."""
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(root, FSDPModule):
            return
        state = root._get_fsdp_state()
        lazy_init = getattr(state, "_lazy_init", None)  # FSDP2 internals: torch 2.4 ... 2.15
        if callable(lazy_init):
            lazy_init()
        note_unshard(root, root)
        root.unshard()

    def _unshard_enclosing(self, root: nn.Module) -> None:
        """Unshard the FSDP2 groups between the root and the tower (outermost first) that hold its parameters; a
        group already unsharded is a no-op (no collective). They stay unsharded until the model's next forward
        reshards them."""
        from torch.distributed.fsdp import FSDPModule

        for path in self._enclosing:
            module = root.get_submodule(path)
            if isinstance(module, FSDPModule):
                note_unshard(root, module)
                module.unshard()


def _class_name(module: nn.Module) -> str:
    """The user's name of ``module``'s class: ``fully_shard`` swaps in a subclass ``FSDP<name>`` of ``FSDPModule``
    and the class (errors name the class the user wrote)."""
    cls = type(module)
    bases = [b for b in cls.__bases__ if b.__name__ != "FSDPModule"]
    if cls.__name__.startswith("FSDP") and len(bases) == 1 and cls.__name__ == f"FSDP{bases[0].__name__}":
        return bases[0].__name__
    return cls.__name__


def _enclosing_paths(root: nn.Module, tower: nn.Module) -> tuple[str, ...]:
    """Module paths strictly between ``root`` and ``tower``, outermost first."""
    for path, module in root.named_modules():
        if module is tower:
            parts = path.split(".")[:-1] if path else []
            return tuple(".".join(parts[: i + 1]) for i in range(len(parts)))
    return ()


def _wrap_generate(root: nn.Module) -> Any:
    """Put :func:`generate` on ``root`` as a bound method (a deep copy of the model gets its own); None for a model
    without generate, or whose generate is an instance attribute already (someone else's wrapper: left alone, and
    then every forward exchanges, which is safe)."""
    if not callable(getattr(type(root), "generate", None)) or "generate" in root.__dict__:
        return None
    method = types.MethodType(generate, root)
    root.__dict__["generate"] = method
    return method


def generate(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``type(model).generate``, told which forwards belong to one generate call, with ``synced_gpus`` defaulting
    to True where the model is sharded across ranks: transformers' own default for FSDP-managed modules, made
    independent of how a transformers release detects them (ranks that stop at different lengths keep running
    forwards together, else the ones still decoding wait in an all-gather no other rank makes)."""
    hooks = self.__dict__.get(MIXED_ATTR, [])
    if kwargs.get("synced_gpus") is None and _multi_rank():
        tower = next((t for t in (h._tower() for h in hooks) if t is not None), None)
        if tower is not None and _fsdp_managed(self, tower):
            kwargs["synced_gpus"] = True
    for h in hooks:
        h._generating.append(0)
    try:
        return type(self).generate(self, *args, **kwargs)
    finally:
        for h in hooks:
            h._generating.pop()


class _Medium:
    """One aligned tower of a family: the vision tower (``kind`` "vision", no ``spec``: the row itself says how to
    call it), or one besides it (an :class:`~.vlm_families.AudioTower` or a :class:`~.vlm_families.VideoTower`): its
    row, and this forward's calls and target (None: not counting)."""

    def __init__(self, spec: Any, kind: str) -> None:
        self.spec = spec
        self.kind = kind  # "vision", "audio" (counted in audio_dummy_calls) or "video" (in dummy_calls)
        self.calls = 0
        self.target: int | None = None


#: Inner models whose forward calls a medium through the vision tower itself (Nemotron-H Omni's videos): the
#: method that makes that call, wrapped on the instance, finds its hooks here (a deep copy finds none).
_SHARED_ATTR = "_fsdp_compat_shared_media"  # in the inner model's ``__dict__``: method name -> its hooks


def _shared_method(name: str) -> Callable[..., Any]:
    def call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        original = getattr(type(self), name)
        hooks = self.__dict__.get(_SHARED_ATTR, {}).get(name)
        if hooks is None:
            return original(self, *args, **kwargs)
        return hooks._shared_call(name, original, self, args, kwargs)

    return call


class _KnownFamily(MixedBatches):
    """A table family: count the tower calls, exchange counts, top up with dummies before the text model. A row
    with an :class:`~.vlm_families.AudioTower` or a :class:`~.vlm_families.VideoTower` gets the same for that tower,
    in the same exchange (a column each): its dummies run where the forward runs that medium (the Qwen thinkers'
    audio before the first vision tower call; the others' audio, and videos, after it), and a rank that owes the
    dummies of a medium the forward runs earlier runs them just before its own call of a later one."""

    def __init__(self, root: nn.Module, inner: nn.Module, path: str, family: VisionFamily, mode: str) -> None:
        tower = inner.get_submodule(family.tower)
        super().__init__(root, tower, f"{path}.{family.tower}" if path else family.tower, mode)
        self.path = path
        self.family = family
        self._inner = weakref.ref(inner)
        self._vision = _Medium(None, "vision")  # its calls and target: tower calls every rank makes in this forward
        self._exchanged = False  # the root's pre-forward exchanged this forward's counts (the inner forward's own)
        self._zero: torch.Tensor | None = None  # dummies' zero term, joining the text model's inputs_embeds
        self._device = torch.device("cpu")  # where this forward computes (its first tensor input)
        self._shared_depth = 0  # > 0 inside a medium's call through the vision tower: not a vision call
        # a cross-attention row (Mllama): a vision dummy ran in this forward, so the cross-attention layers run too
        self._cross_owed = False
        self._cross_caches: weakref.WeakSet[Any] = weakref.WeakSet()  # caches holding a dummy's zero states
        self._handles += [
            inner.register_forward_pre_hook(marked(self._pre_forward), with_kwargs=True),
            inner.register_forward_hook(marked(self._post_forward), always_call=True),
            inner.get_submodule(family.text).register_forward_pre_hook(
                marked(self._before_text_model), with_kwargs=True
            ),
        ]
        self._media: list[_Medium] = [
            _Medium(spec, kind)
            for spec, kind in ((family.audio, "audio"), (family.video, "video"))
            if spec is not None and _has_module(inner, spec.tower)
        ]
        # modules run once per image of a call (MiniCPM-V's merger MLPs): one more column per entry of the row's
        # inputs, that call's images, so that a dummy packs as many images as the call it pairs with
        per_image = family.per_image
        self._per_image = per_image if per_image is not None and _has_module(inner, per_image.module) else None
        self._images: tuple[int, ...] = ()  # images of each tower call of the longest call sequence; () = one each
        self._columns = 1 + len(self._media) + (len(family.inputs) if self._per_image is not None else 0)
        # the forward's order: media before the vision tower, the vision tower, then videos, then audio
        after = sorted((m for m in self._media if m.spec.after_vision), key=lambda m: m.kind != "video")
        self._order: list[_Medium] = [m for m in self._media if not m.spec.after_vision] + [self._vision, *after]
        self._shared: list[str] = []
        for medium in self._media:
            medium_tower = inner.get_submodule(medium.spec.tower)
            if medium_tower is tower:  # called through the vision tower: wrap the method that calls it
                self._shared.append(medium.spec.method)
                inner.__dict__.setdefault(_SHARED_ATTR, {})[medium.spec.method] = self
                inner.__dict__[medium.spec.method] = types.MethodType(_shared_method(medium.spec.method), inner)
                continue
            # first: a forward that runs this medium after another owes that one's dummies before this tower's
            # own FSDP2 pre-forward (its all-gathers) where the tower is a group itself
            hook = functools.partial(self._on_medium_call, medium)
            self._handles.append(medium_tower.register_forward_pre_hook(marked(hook), prepend=True))

    @property
    def _calls(self) -> int:
        return self._vision.calls

    @_calls.setter
    def _calls(self, value: int) -> None:
        self._vision.calls = value

    @property
    def _target(self) -> int | None:
        return self._vision.target

    @_target.setter
    def _target(self, value: int | None) -> None:
        self._vision.target = value

    def remove(self) -> None:
        super().remove()
        inner = self._inner()
        for name in self._shared:
            if inner is not None and name in inner.__dict__:
                del inner.__dict__[name]
            if inner is not None:
                inner.__dict__.get(_SHARED_ATTR, {}).pop(name, None)
        self._shared = []

    def _own_calls(self, inputs: dict[str, Any]) -> int:
        return sum(inputs.get(pixels) is not None for pixels in self.family.inputs)

    def _own_media(self, inputs: dict[str, Any]) -> tuple[int, ...]:
        """Each medium's calls in this rank's forward: one where it has every input the forward requires for that
        medium (all clips, all videos in one call)."""
        return tuple(int(all(inputs.get(n) is not None for n in m.spec.inputs)) for m in self._media)

    def _own_images(self, inputs: dict[str, Any]) -> tuple[int, ...]:
        """Images of each of the row's tower calls in this rank's forward (0 where it is not made), where the row
        names modules run once per image (:class:`~.vlm_families.PerImage`); else nothing."""
        if self._per_image is None:
            return ()
        return tuple(int(n) for n in self._per_image.count(inputs))

    def _inputs_shown(self) -> tuple[str, ...]:
        per_image = self._per_image.inputs if self._per_image is not None else ()
        return self.family.inputs + tuple(n for m in self._media for n in m.spec.inputs) + per_image

    def _aligned(self) -> bool:
        inner = self._inner()
        return (
            inner is not None
            and (_forward_is_transformers(inner) or self.family in registered_families())
            and self._activate()
            and not self._no_collectives()
        )

    def _set_media(self, targets: Iterable[int | None]) -> None:
        for medium, target in zip(self._media, targets, strict=True):
            medium.target = target

    def _reset_calls(self) -> None:
        self._calls = 0
        for medium in self._media:
            medium.calls = 0

    def _begin(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._target, self._exchanged, self._zero = None, False, None
        self._reset_calls()
        self._set_media([None] * len(self._media))
        if not self._aligned():
            return
        inputs = _call_inputs(module, args, kwargs)
        self._device = _input_device(inputs, module)
        visible = _shows(module, self._inputs_shown())
        own, own_media = self._own_calls(inputs), self._own_media(inputs)
        own_images = self._own_images(inputs)
        if self._decode_step(inputs):
            if own or any(own_media):
                raise FsdpCompatError(
                    f"fsdp-compat: mixed micro-batches: {self.root_class}.generate passed vision or audio input to a "
                    "forward that decodes from a cache; the other ranks make no exchange there, so the tower's "
                    "collectives would fall out of step. Pass such inputs only to the first forward of a cache "
                    "(transformers' prepare_inputs_for_generation does), or set FSDP_COMPAT_MIXED_BATCHES=always"
                )
            self.decode_steps += 1
            self._target, self._exchanged = 0, True
            self._set_media([0] * len(self._media))
            return
        if self.mode == "always":
            if visible:
                self._always(own, own_media)
                self._exchanged = True
            return
        while True:  # until no rank is calling the tower outside a forward
            counts = self._exchange(own, *own_media, *own_images)
            if min(_column(counts).values()) != _OUTSIDE:
                break
            self._outside_dummy(module, self._device)
        if visible:  # the root's forward shows the vision inputs: these are the inner forward's counts too
            self._set_target(own, own_media, counts)
            self._exchanged = True

    def _always(self, own: int, own_media: tuple[int, ...]) -> None:
        """Mode ``always``: at least one call of every aligned tower, no exchange."""
        self._target = max(own, 1)
        self._set_media([max(n, 1) for n in own_media])
        self._images = ()  # no exchange: a dummy packs one image

    def _set_target(self, own: int, own_media: tuple[int, ...], counts: dict[int, tuple[int, ...]]) -> None:
        image_columns = len(self.family.inputs) if self._per_image is not None else 0
        planned = alignment.targets(counts, len(self._media), image_columns)
        self._target = planned.vision
        if alignment.owed(own, planned.vision):
            most = _ranks(_column(counts), lambda c: c == planned.vision)
            logger.debug(
                "fsdp-compat: mixed micro-batches: %s: %d tower call(s) here, %d on rank(s) %s: dummy input",
                self.path or self.root_class, own, planned.vision, most,
            )  # fmt: skip
        for medium, mine, target in zip(self._media, own_media, planned.media, strict=True):
            medium.target = target
            if alignment.owed(mine, target):
                logger.debug("fsdp-compat: mixed micro-batches: %s: no %s here: dummy", self.root_class, medium.kind)
        if image_columns and not planned.consistent and self._per_image_sharded():
            self._raise_images_differ(counts)
        self._images = planned.images

    def _raise_images_differ(self, counts: dict[int, tuple[int, ...]]) -> None:
        """The per-image modules hold FSDP2 groups of their own and the ranks' real calls differ in images (or a
        shorter sequence is not the start of the longest): no dummy can pair them, so the same error on every rank,
        instead of a hang."""
        first, last = 1 + len(self._media), 1 + len(self._media) + len(self.family.inputs)
        calls = {rank: tuple(n for n in row[first:last] if n > 0) for rank, row in counts.items()}
        module = self._per_image.module if self._per_image is not None else ""
        where = f"{self.path}.{module}" if self.path else module
        groups = ", ".join(f"{where}.{path}" if path else where for path in self._per_image_groups())
        raise FsdpCompatError(
            f"fsdp-compat: mixed micro-batches: {self.root_class} runs {where} once per image of each vision tower "
            f"call, and that module holds FSDP2 groups of its own ({groups}), but "
            "the ranks' tower calls differ in images (images per call, by rank: "
            + "; ".join(f"rank {r}: {list(seq)}" for r, seq in calls.items())
            + "), so those groups' all-gathers and reduce-scatters would not pair across ranks (a gloo abort, an "
            "NCCL hang). Fix: give every rank's micro-batch the same number of images per call, or keep "
            f"{where}'s modules out of FSDP2 groups of their own (in their parent's group)."
        )

    def _per_image_groups(self) -> list[str]:
        """The paths, under the per-image module ("" for itself), of the FSDP2 groups it holds."""
        from torch.distributed.fsdp import FSDPModule

        inner = self._inner()
        if inner is None or self._per_image is None:
            return []
        module = inner.get_submodule(self._per_image.module)
        return [path for path, m in module.named_modules() if isinstance(m, FSDPModule)]

    def _per_image_sharded(self) -> bool:
        return bool(self._per_image_groups())

    def _end(self) -> None:
        self._target, self._exchanged, self._zero = None, False, None
        self._cross_owed = False
        self._images = ()
        self._set_media([None] * len(self._media))

    def _pre_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._reset_calls()
        if self._exchanged:  # decided at the root's pre-forward
            self._exchanged = False
            self._tower_first(module, args, kwargs)
            return
        self._target = None
        self._set_media([None] * len(self._media))
        if not self._aligned():
            return
        inputs = _bind(module, args, kwargs)
        self._device = _input_device(inputs, module)
        own, own_media = self._own_calls(inputs), self._own_media(inputs)
        if self.mode == "always":
            self._always(own, own_media)
        else:
            self._set_target(own, own_media, self._exchange(own, *own_media, *self._own_images(inputs)))
        self._tower_first(module, args, kwargs)

    def _tower_first(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A row whose forward calls the tower before it embeds the text (``VisionFamily.tower_first``, Ovis2.5):
        the dummies this rank owes run here, at the start of the inner forward, so that their tower calls come
        before the input embedding's all-gather as the real calls do on the other ranks (the tower's groups gather
        the same whichever call runs first); their zero terms still join the text model's ``inputs_embeds``. A
        forward given ``inputs_embeds`` embeds nothing: its dummies run before the text model, as for every row."""
        if not self.family.tower_first or self._target is None:
            return
        inputs = _bind(module, args, kwargs)
        own = self._own_calls(inputs)
        if inputs.get("inputs_embeds") is not None or own >= self._target:
            return
        inner = self._inner()
        assert inner is not None
        missing, self._target = self._target - own, None  # the dummies' own tower calls are not counted
        for _ in range(missing):
            self._join(self._dummy_zero(inner, self._dummy(inner, self._device)))
            self.dummy_calls += 1
        self._target = own  # the forward's own calls complete it

    def _post_forward(self, *_: Any) -> None:
        self._target = None
        self._set_media([None] * len(self._media))

    def _count_tower_call(self) -> None:
        if self._shared_depth:  # a medium's call through the vision tower (counted as that medium's)
            return
        if self._target is not None:
            self._top_up_before(self._vision, self._device)  # the media the forward runs before its vision tower
            self._calls += 1

    def _on_medium_call(self, medium: _Medium, module: nn.Module, args: tuple[Any, ...]) -> None:
        if self._depth and medium.target is not None:
            self._top_up_before(medium, self._device)  # the dummies of the media the forward runs before this one
            medium.calls += 1

    def _shared_call(self, name: str, original: Any, inner: nn.Module, args: Any, kwargs: dict[str, Any]) -> Any:
        """A medium's method that calls the vision tower (the instance's wrapper): counted as that medium's call,
        after the dummies the forward's order puts before it; the vision tower's own hook does not count it."""
        medium = next(m for m in self._media if m.spec.method == name)
        self._on_medium_call(medium, inner, ())
        self._shared_depth += 1
        try:
            return original(inner, *args, **kwargs)
        finally:
            self._shared_depth -= 1

    def _top_up_before(self, entry: _Medium, device: torch.device) -> None:
        for earlier in self._order[: self._order.index(entry)]:
            self._top_up(earlier, device)

    def _top_up(self, entry: _Medium, device: torch.device) -> None:
        if entry is self._vision:
            self._vision_top_up(device)
        else:
            self._medium_top_up(entry)

    def _medium_top_up(self, medium: _Medium) -> None:
        """The dummies this rank still owes for ``medium``, where the forward runs it (:meth:`_top_up_before`, or
        before the text model). Their zero terms join the text model's ``inputs_embeds`` with the rest."""
        if medium.target is None or medium.calls >= medium.target:
            return
        inner = self._inner()
        assert inner is not None
        missing, medium.target = medium.target - medium.calls, None  # dummies are not counted
        spec = medium.spec
        dtype = _dtype_of(inner.get_submodule(spec.tower))
        method = getattr(type(inner), spec.method)
        for _ in range(missing):
            self._shared_depth += 1  # a call through the vision tower is not a vision call
            try:
                out = method(inner, **spec.dummy(inner.config, self._device, dtype))
            finally:
                self._shared_depth -= 1
            self._join(_zero_of(_field(out, spec.features)))
            padding = getattr(spec, "padding", "")
            if padding:  # an embedder the forward calls beside the features (Gemma3n's audio padding token)
                embedder = inner.get_submodule(padding)
                last = int(getattr(embedder, "vocab_offset", 0)) + int(embedder.vocab_size) - 1
                self._join(_zero_of(embedder(input_ids=torch.full((1, 1), last, device=self._device))))
            if medium.kind == "audio":
                self.audio_dummy_calls += 1
            else:
                self.dummy_calls += 1

    def _join(self, zero: torch.Tensor | None) -> None:
        """Keep a dummy's zero term for the text model's ``inputs_embeds`` (under grad: backward must reach the
        tower's parameters; without grad there is nothing to reach)."""
        if zero is not None and torch.is_grad_enabled():
            self._zero = zero if self._zero is None else self._zero + zero

    def _announce_outside_call(self) -> None:
        if self.mode != "sync":
            return
        if self._generating and self._generating[-1] > 0:
            raise FsdpCompatError(
                f"fsdp-compat: mixed micro-batches: the vision tower of {self.root_class} was called between two "
                "decode steps of generate; the other ranks make no exchange there. Encode vision input before "
                "generate starts, or set FSDP_COMPAT_MIXED_BATCHES=always"
            )
        self._exchange(_OUTSIDE)

    def _outside_dummy(self, root: nn.Module, device: torch.device) -> None:
        """Another rank calls the tower outside a forward: the same unshards and a tower call on a zero dummy. The
        root group is unsharded already (this runs after FSDP2's root pre-forward). Under grad the output's zero
        joins this forward's text model, so backward runs the tower's reduce-scatters here too."""
        inner = self._inner()
        assert inner is not None
        self._unshard_enclosing(root)
        dummy = self._dummy(inner, device)
        target, self._target = self._target, None  # not counted as this forward's own calls
        try:
            zero = self._dummy_zero(inner, dummy)
        finally:
            self._target = target
        self.dummy_calls += 1
        self._join(zero)

    def _dummy_zero(self, inner: nn.Module, dummy: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """One dummy tower call's zero term: ``get_image_features`` on ``dummy``, then, where the row names a
        projector the forward applies outside it (Llama4), that projector on the output's ``projected`` field."""
        if self.family.cross_attention is not None:  # no get_image_features: the forward calls the tower itself
            out = inner.get_submodule(self.family.tower)(**dummy)
        else:
            out = inner.get_image_features(**dummy)
        if self.family.projector:
            features = _field(out, self.family.projected)
            if isinstance(features, (tuple, list)):  # a tuple output (config.return_dict False): its first field
                features = features[0]
            out = inner.get_submodule(self.family.projector)(features)
        return _zero_of(out)

    def _dummy(self, inner: nn.Module, device: torch.device, call: int | None = None) -> dict[str, torch.Tensor]:
        """The family's dummy keywords, in the dtype of the tower's first floating parameter (fp32 if none). Where
        the row names per-image modules (:class:`~.vlm_families.PerImage`), the dummy standing for this forward's
        tower call number ``call`` (from 0) packs as many images as that call of the longest call sequence (one
        where no rank makes it, or outside a forward)."""
        dtype = _dtype_of(inner.get_submodule(self.family.tower))
        if self._per_image is None:
            return self.family.dummy(getattr(inner, "config", None), device, dtype)
        images = self._images[call] if call is not None and call < len(self._images) else 1
        return self.family.dummy(getattr(inner, "config", None), device, dtype, images=images)  # type: ignore[call-arg]

    def _vision_top_up(self, device: torch.device) -> None:
        """The vision dummies this rank still owes (before the text model, or, where the forward runs its audio
        after its vision towers, before its audio call); their zero terms join the text model's ``inputs_embeds``."""
        if self._target is None or self._calls >= self._target:
            return
        inner = self._inner()
        assert inner is not None
        missing, self._target = self._target - self._calls, None  # the dummies' own tower calls are not counted
        self._cross_owed = self.family.cross_attention is not None
        for call in range(self._calls, self._calls + missing):
            self._join(self._dummy_zero(inner, self._dummy(inner, device, call)))
            self.dummy_calls += 1

    def _before_text_model(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.family.cross_attention is not None:
            return self._before_cross_attention(module, args, kwargs)
        # every dummy still owed, in the forward's order (a medium before the vision tower runs first, as it would)
        for entry in self._order:
            if entry is not self._vision:
                self._medium_top_up(entry)
            elif self._target is not None and self._calls < self._target:
                self._vision_top_up(_inputs_embeds(module, args, kwargs)[1].device)
        zero, self._zero = self._zero, None
        if zero is None:
            return None
        name, embeds = _inputs_embeds(module, args, kwargs)
        embeds = embeds + zero.to(embeds.dtype)
        if name in kwargs:
            return args, {**kwargs, name: embeds}
        index = list(inspect.signature(module.forward).parameters).index(name)
        return (*args[:index], embeds, *args[index + 1 :]), kwargs

    def _before_cross_attention(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The join point of a cross-attention row (:class:`~.vlm_families.CrossAttention`, Mllama): the vision
        states are keywords of the text model's call, and the text model skips its cross-attention layers (FSDP2
        groups of their own) without them. Where this forward ran a vision dummy, or has a dummy's zero term to
        join, and has no states of its own, the text model gets zero states of one vision token per row (plus that
        zero term), a zero additive mask and an all-zero row mask: those layers run, and return their input exactly
        (zero keys and values attend to 0, the MLP output is multiplied by 0), every parameter of theirs with a
        gradient of exactly 0. A rank with states of its own gets the zero term added to them. A forward that
        decodes from a cache holding such zero states (``generate``) runs those layers again on every rank: it gets
        the all-zero row mask again."""
        cross = self.family.cross_attention
        assert cross is not None
        inputs = _bind(module, args, kwargs)
        text = inputs.get("inputs_embeds")
        text = inputs.get("input_ids") if text is None else text
        device = text.device if isinstance(text, torch.Tensor) else self._device
        for entry in self._order:  # every dummy still owed, in the forward's order
            self._top_up(entry, device)
        owed, self._cross_owed = self._cross_owed, False
        zero, self._zero = self._zero, None
        states = inputs.get(cross.states)
        cache = next((inputs[name] for name in _CACHE_ARGS if inputs.get(name) is not None), None)
        if isinstance(states, torch.Tensor):
            if zero is None:
                return None
            return self._with_inputs(module, args, kwargs, {cross.states: states + zero.to(states.dtype)})
        if not isinstance(text, torch.Tensor):
            return None
        batch, length = int(text.shape[0]), int(text.shape[1])
        inner = self._inner()
        dtype = getattr(inner, "dtype", None) or _dtype_of(module)  # the dtype the forward's own masks take
        rows = torch.zeros(batch, 1, length, 1, dtype=dtype, device=device)
        if owed or zero is not None:
            hidden = int(module.config.hidden_size)
            states = torch.zeros(batch, 1, hidden, dtype=zero.dtype if zero is not None else dtype, device=device)
            if zero is not None:
                states = states + zero
            if cache is not None and hasattr(type(cache), "__weakref__"):
                self._cross_caches.add(cache)  # its decode steps run the cross-attention layers: the row mask again
            zeros = {cross.states: states, cross.mask: rows, cross.rows: rows}
            return self._with_inputs(module, args, kwargs, zeros)
        if cache is not None and cache in self._cross_caches:
            return self._with_inputs(module, args, kwargs, {cross.rows: rows})
        return None

    @staticmethod
    def _with_inputs(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], new: dict[str, Any]) -> Any:
        """A forward pre-hook's ``(args, kwargs)`` with the inputs ``new`` set, by name, positional where ``args``
        holds them."""
        try:
            names = list(inspect.signature(module.forward).parameters)
        except (TypeError, ValueError):
            names = []
        positional, named = list(args), dict(kwargs)
        for name, value in new.items():
            index = names.index(name) if name in names else len(positional)
            if index < len(positional):
                positional[index] = value
            else:
                named[name] = value
        return tuple(positional), named


def _dtype_of(tower: nn.Module) -> torch.dtype:
    """The dtype of the tower's first floating parameter (fp32 if none): the dtype of its dummy input."""
    return next((p.dtype for p in tower.parameters() if p.is_floating_point()), torch.float32)


def _field(output: Any, name: str) -> Any:
    """``output.name`` (or ``output[name]``), else the whole output."""
    value = getattr(output, name, None)
    if value is None and isinstance(output, dict):
        value = output.get(name)
    return output if value is None else value


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


# Vision inputs not named pixel_values*: Pix2Struct-style patches (Kosmos-2.5).
_OTHER_VISION_ARGS = ("flattened_patches",)


def _unknown_vlm(model: nn.Module, mode: str) -> MixedBatches | None:
    """A model that takes media but has no row in :data:`FAMILIES`: the generic mechanism (:mod:`.replay`), or, for
    a family refused by name (:mod:`.vlm_families.refused`: measured, neither path aligns it), the named error on
    every rank. In mode ``off``, only a tower found by name is watched for calls outside the forward."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        parameters = {}  # type: ignore[assignment]
    pixel_args = tuple(name for name in parameters if name.startswith("pixel_values") or name in _OTHER_VISION_ARGS)
    tower = next(
        ((path, module) for path, module in model.named_modules() if path.rpartition(".")[2] in _TOWER_NAMES), None
    )
    if mode == "off":
        return MixedBatches(model, tower[1], tower[0], mode) if tower is not None and pixel_args else None
    refused = refusal({cls.__name__ for m in model.modules() for cls in type(m).__mro__})  # FSDP2's subclasses too
    if refused is not None and pixel_args:
        path, module = tower if tower is not None else ("", None)
        return _UnknownFamily(model, module, path, pixel_args, refused)
    from fsdp_compat.runtime.replay import Replayed, takes_media

    return Replayed(model) if takes_media(model) else None


class _UnknownFamily(MixedBatches):
    """No dummy is known: where ranks disagree on having vision input, fail on every rank with one clear error."""

    def __init__(
        self,
        model: nn.Module,
        tower: nn.Module | None,
        path: str,
        pixel_args: tuple[str, ...],
        refused: tuple[str, str],
    ) -> None:
        super().__init__(model, tower, path, "sync")
        self.pixel_args = pixel_args
        self.refused = refused  # (inner class, why neither a row nor the generic mechanism aligns it)

    def _begin(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not _forward_is_transformers(module) or not self._activate() or self._no_collectives():
            return
        inputs = _call_inputs(module, args, kwargs)
        own = int(any(inputs.get(name) is not None for name in self.pixel_args))
        if self._decode_step(inputs) and not own:
            self.decode_steps += 1
            return
        counts = _column(self._exchange(own))
        if len(set(counts.values())) > 1:
            self._raise(counts)

    def _announce_outside_call(self) -> None:
        counts = _column(self._exchange(_OUTSIDE))
        if len(set(counts.values())) > 1:
            self._raise({r: int(c != 0) for r, c in counts.items()})

    def _raise(self, counts: dict[int, int]) -> None:
        raise FsdpCompatError(
            f"fsdp-compat: mixed micro-batches: rank(s) {_ranks(counts, lambda c: c == 0)} have no "
            f"{'/'.join(self.pixel_args)} in this forward of {self.root_class} while rank(s) "
            f"{_ranks(counts, bool)} do. Its vision tower ({self.path or 'the model'}) is sharded by FSDP2, so the "
            "ranks' collectives would fall out of step (a gloo abort, an NCCL hang), and fsdp-compat cannot align "
            f"{self.refused[0]}: {self.refused[1]} (docs/families.md). Fix: give every micro-batch vision "
            "input, or run the tower on a zero dummy in your forward when a micro-batch has none and add 0.0 * its "
            "output to the input embeddings (as verl's VLM forwards do), or register a row for "
            f"{self.root_class} (fsdp_compat.register_family, docs/api.md)."
        )
