"""Alignment by mechanism: a vision-language (or audio, video) model without a family row keeps its ranks in step
when their micro-batches differ in media, by replaying on the ranks that lack a medium the module call a rank with it
made.

Why a mechanism: the family table (:mod:`.vlm_families`) knows each family's tower, its smallest valid input and
where its features join, and a model of the user's own, torchtitan's or a new transformers release's is in no table.
What every such model shares is what FSDP2 sees: a rank with images runs some module calls (the tower, on tensors
made from the media inputs) whose FSDP2 groups a text-only rank never all-gathers.

How, in a forward where the ranks' media differ (one host exchange right after FSDP2's root pre-forward says so:
which ranks have media inputs, and a digest of their shapes; equal everywhere, nothing else runs):

* a rank with media records its **media calls**: the outermost module calls whose arguments hold a media input (by
  storage: a view or the tensor itself) and no text input (``input_ids``, ``inputs_embeds``, masks, labels). A call's
  record is the module's path and its arguments with every floating tensor replaced by its shape and dtype (the
  replay feeds zeros) and every other leaf kept by value (integer grids, sizes, flags);
* every rank stops at each FSDP2 group's pre-forward, before its all-gather, and at the root's forward end, and
  reports on the same host group where it stands (:mod:`.lockstep`): a rank whose report shows a call it lacks
  replays that call's record there (the tower's all-gathers then pair with the caller's, in order), and joins
  ``(t * 0).sum()`` of the replay's floating outputs to the next group's first floating input (or, at the forward's
  end, the root's outputs), so backward reaches the same groups in the same order and adds exactly zero;
* a rank that made a media call of its own already (the model's own dummy, as VeOmni's models run) stands where the
  caller stands, and owes nothing;
* where no replay explains it (the media's modules run outside one module call: a forward that loops over its vision
  blocks itself, say), or a record cannot be rebuilt (an argument that is neither a tensor nor plain data), every rank
  raises one :class:`~fsdp_compat.errors.FsdpCompatError` naming the model class, the inputs and the ranks, before
  the all-gather that would not pair.

Cost: text-only models get nothing installed (their forwards take no media input). A media model pays one host
exchange per forward (as the table's ``sync`` does); only in a forward where the ranks' media differ does each
group's pre-forward add one host all-reduce of three integers, and ranks with media record calls with module hooks
that live for that forward only. Limits, measured or by construction: the replay's outputs all join the graph, so a
forward that uses only part of its tower's output (features from an inner layer) gives those parameters a gradient
on the replaying rank alone; such a family needs a row (:func:`~fsdp_compat.register_family`).
"""

from __future__ import annotations

import functools
import inspect
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fsdp_compat.errors import FsdpCompatError
from fsdp_compat.log import logger
from fsdp_compat.runtime import exchange as wire
from fsdp_compat.runtime import lockstep, marked
from fsdp_compat.runtime.mixed_batches import MixedBatches, _call_inputs, _input_device

__all__ = ["MEDIA_PREFIXES", "MediaCall", "Replayed", "media_inputs", "takes_media"]

#: Forward parameter names that carry a medium: vision (``pixel_values*``, ``images``, ``image_*``), video, audio
#: (``input_features``, ``input_values``, ``audio_*``, ``speech*``), Pix2Struct's ``flattened_patches``.
MEDIA_PREFIXES = (
    "pixel_", "image", "video", "audio", "input_features", "input_values", "speech", "flattened_patches", "media",
)  # fmt: skip

#: Inputs that are text: a module call that receives one of them is not a media call (the inner model that takes both).
TEXT_INPUTS = frozenset({
    "input_ids", "inputs_embeds", "attention_mask", "position_ids", "token_type_ids", "labels", "cache_position",
    "decoder_input_ids", "decoder_attention_mask", "tokens",
})  # fmt: skip

#: Methods that turn a medium into the features the forward merges with the text (transformers' convention, and many
#: models of the user's own): where a module has one, a call of it is the media call, so that what the forward runs
#: after the tower on the way to the features (a projector, a merger) is replayed too.
FEATURE_METHODS = ("get_image_features", "get_video_features", "get_audio_features")

#: Integer (and bool) tensors in a media call's arguments travel by value up to this many elements.
_MAX_VALUE_ELEMENTS = 1 << 16

#: Media calls are looked for in module calls at most this many levels below the root (``model.visual``,
#: ``model.vision_tower.vision_model``, ``encoder.blocks.0``): a media call starts near the top of a forward.
_MAX_DEPTH = 4

_SIGNATURES: dict[type, tuple[str, ...] | None] = {}


def _is_media(name: str) -> bool:
    return name.startswith(MEDIA_PREFIXES)


def _media_parameters(module: nn.Module) -> tuple[str, ...] | None:
    """The media parameters ``type(module).forward`` names (None where it cannot be read)."""
    cls = type(module)
    if cls not in _SIGNATURES:
        try:
            parameters = inspect.signature(cls.forward).parameters
            _SIGNATURES[cls] = tuple(n for n in parameters if _is_media(n))
        except (TypeError, ValueError):
            _SIGNATURES[cls] = None
    return _SIGNATURES[cls]


def takes_media(root: nn.Module) -> bool:
    """Whether a module of ``root``'s tree names a media input in its forward (a wrapper that forwards ``**kwargs``
    to a VLM counts through the VLM). A text-only model has none: nothing is installed on it."""
    return any(_media_parameters(m) for m in root.modules())


def media_inputs(inputs: dict[str, Any]) -> dict[str, Any]:
    """The media inputs among a forward's bound arguments (None left out)."""
    return {n: v for n, v in inputs.items() if v is not None and _is_media(n)}


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def _storage(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor without storage (a subclass, a fake tensor)
        return None


def _digest(media: dict[str, Any]) -> int:
    """A 62-bit digest of the media inputs' names, shapes and dtypes (and the values of small integer tensors:
    a patch grid): ranks with equal digests run the same media calls."""
    parts: list[str] = []
    for name in sorted(media):
        parts.append(name)
        for t in _tensors(media[name]):
            parts.append(f"{tuple(t.shape)}{t.dtype}")
            if not t.is_floating_point() and t.numel() <= 64:
                parts.append(str(t.tolist()))
    text = "|".join(parts).encode()
    return (zlib.crc32(text) << 30) ^ zlib.adler32(text)


# ----------------------------------------------------------------------------------------------- a call's record


class _Unreplayable(Exception):
    pass


@dataclass(frozen=True)
class _Zeros:
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class MediaCall:
    """One media call, as a rank with media made it: the module's ``path`` under the root, its number in the caller's
    forward, its arguments with each floating tensor a :class:`_Zeros` and other leaves by value, the media inputs it
    received, and why it cannot be rebuilt (empty where it can)."""

    path: str
    index: int = 0  # the caller's media calls in this forward before this one
    method: str = ""  # a features method of the module (:data:`FEATURE_METHODS`); "": the module's own call
    args: Any = ()
    kwargs: Any = field(default_factory=dict)
    media: tuple[str, ...] = ()
    unreplayable: str = ""


def _record(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex():
            return _Zeros(tuple(value.shape), value.dtype)
        if value.numel() > _MAX_VALUE_ELEMENTS:
            raise _Unreplayable(f"an integer tensor of {value.numel()} elements (at most {_MAX_VALUE_ELEMENTS} travel)")
        return value.detach().to("cpu", copy=True)
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.Size)):
        return value
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_record(v) for v in value)
    if type(value) is dict:
        return {k: _record(v) for k, v in value.items()}
    raise _Unreplayable(f"an argument of type {type(value).__module__}.{type(value).__qualname__}")


def _rebuild(value: Any, device: torch.device) -> Any:
    if isinstance(value, _Zeros):
        return torch.zeros(value.shape, dtype=value.dtype, device=device)
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(_rebuild(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _rebuild(v, device) for k, v in value.items()}
    return value


def _leaves(value: Any) -> list[torch.Tensor]:
    """A module output's floating tensors that require grad, in a fixed order (the same on every rank)."""
    return [t for t in _tensors(_outputs(value)) if t.is_floating_point() and t.requires_grad]


class _Used:
    """Which outputs of a replayed call the caller's forward used (None until its forward's end says)."""

    mask: list[bool] | None = None


class _Gate(torch.autograd.Function):
    """The sum of a replay's zero terms, ``(t * 0).sum()`` per output ``t``; backward passes a gradient only to the
    outputs the caller's forward used (:class:`_Used`), so the replay's parameters get a gradient where the caller's
    do and nowhere else (an output the forward never reads, a tower's last layers behind features from an inner
    one, leaves its parameters without one on the caller: FSDP2's reduce-scatter then covers the same ones)."""

    @staticmethod
    def forward(ctx: Any, used: _Used, *zeros: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.used, ctx.dtypes = used, [z.dtype for z in zeros]
        return torch.stack([z.detach().float() for z in zeros]).sum()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        mask = ctx.used.mask
        if mask is None or len(mask) != len(ctx.dtypes):  # no word from the caller (its forward raised): all
            mask = [True] * len(ctx.dtypes)
        return (None, *[grad.to(dtype) if used else None for used, dtype in zip(mask, ctx.dtypes, strict=True)])


def _reachable(roots: list[torch.Tensor]) -> set[Any]:
    """The autograd nodes backward from ``roots`` reaches."""
    seen: set[Any] = set()
    stack = [t.grad_fn for t in roots if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(nxt for nxt, _ in node.next_functions if nxt is not None and nxt not in seen)
    return seen


def _outputs(value: Any) -> Any:
    """A module output's tensors: a ModelOutput or dataclass by its fields."""
    if isinstance(value, (torch.Tensor, list, tuple, dict)):
        return value
    fields = getattr(value, "__dataclass_fields__", None)
    if fields:
        return [getattr(value, name, None) for name in fields]
    return ()


def _add_zero(value: Any, zero: torch.Tensor, everywhere: bool = False) -> tuple[Any, bool]:
    """``value`` with ``zero`` added to its first floating tensor that requires grad (depth first), or to every one
    of them (``everywhere``: a root's output, so that whichever the loss is computed from carries it), and whether
    one was found."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() and value.requires_grad:
            return value + zero.to(value.dtype), True
        return value, False
    fields = getattr(value, "__dataclass_fields__", None)
    if isinstance(value, (list, tuple, dict)) or fields:
        if isinstance(value, dict):
            keys: list[Any] = list(value)
            items = [value[k] for k in keys]
        elif fields:
            keys = list(fields)
            items = [getattr(value, k, None) for k in keys]
        else:
            keys, items = list(range(len(value))), list(value)
        found = False
        for i, item in enumerate(items):
            items[i], done = _add_zero(item, zero, everywhere)
            found |= done
            if done and not everywhere:
                break
        if not found:
            return value, False
        if isinstance(value, dict):
            if type(value) is dict:
                return dict(zip(keys, items, strict=True)), True
            for key, item in zip(keys, items, strict=True):
                value[key] = item  # a ModelOutput: item and attribute together
            return value, True
        if fields:
            import dataclasses

            return dataclasses.replace(value, **dict(zip(keys, items, strict=True))), True
        return (type(value)(items) if type(value) in (list, tuple) else type(value)(*items)), True
    return value, False


# --------------------------------------------------------------------------------------------------- the hooks


class Replayed(MixedBatches):
    """The generic alignment on one root (see the module doc). Counters, this rank: ``dummy_calls`` (media calls
    replayed here), ``exchanges`` (forward-start exchanges), ``rounds`` (stops reported in forwards whose media
    differ)."""

    def __init__(self, root: nn.Module) -> None:
        super().__init__(root, None, "", "sync")
        self.rounds = 0
        self._on = False  # this forward's media differ: stop at every group and at the end
        self._group_index: dict[int, int] = {}  # id(group module) -> its index (named_modules order)
        self._group_handles: list[Any] = []
        self._record_handles: list[Any] = []
        self._wrapped: list[tuple[nn.Module, str]] = []  # (module, features method) wrapped for this forward
        self._media_ptrs: set[int] = set()
        self._text_ptrs: set[int] = set()
        self._media_names: tuple[str, ...] = ()  # the media inputs some rank has in this forward (for errors)
        self._started: list[MediaCall] = []  # this rank's media calls since its last report
        self._running: nn.Module | None = None  # the media call in progress
        self._replaying = 0
        self._meets = False  # the next group pre-forward is a replay's first: the source reported there already
        self._pending: torch.Tensor | None = None  # replays' zero terms, for the next group's input or the output
        self._calls = 0  # this rank's media calls in this forward
        self._call_outputs: dict[int, list[Any]] = {}  # call number -> its outputs' autograd nodes (the caller)
        self._gates: list[tuple[int, int, _Used]] = []  # (source rank, its call number, the gate's mask) per replay
        self._replays_made = False  # a round of this forward had a rank replay (every rank knows)
        self._device = torch.device("cpu")
        self._columns = 2
        self._handles.append(
            root.register_forward_hook(marked(self._at_end), prepend=True)  # before FSDP2's root post-forward
        )

    def remove(self) -> None:
        super().remove()
        self._stop_recording()
        for handle in self._group_handles:
            handle.remove()
        self._group_handles = []

    # ------------------------------------------------------------------------------------------- forward start

    def _begin(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._reset()
        if not self._activate() or self._no_collectives():
            return
        inputs = _call_inputs(module, args, kwargs)
        media = media_inputs(inputs)
        if self._decode_step(inputs) and not media:
            self.decode_steps += 1
            return
        rows = self._exchange(int(bool(media)), _digest(media) if media else 0)
        if len(set(rows.values())) == 1:
            return  # the same media everywhere (or none): the same calls on every rank
        self._on = True
        self._device = _input_device(inputs, module)
        self._media_names = tuple(sorted(set(_media_parameters(module) or ()) | set(media)))
        self._hook_groups(module)
        if media:
            self._media_ptrs = {p for t in _tensors(media) if (p := _storage(t)) is not None}
            text = [v for n, v in inputs.items() if n in TEXT_INPUTS]
            self._text_ptrs = {p for t in _tensors(text) if (p := _storage(t)) is not None} - self._media_ptrs
            self._start_recording(module)
        logger.debug("fsdp-compat: mixed micro-batches: %s: media differ by rank: %s", self.root_class, rows)

    def _reset(self) -> None:
        self._on, self._started, self._running, self._meets, self._pending = False, [], None, False, None
        self._replaying, self._calls, self._call_outputs, self._gates = 0, 0, {}, []
        self._replays_made = False
        self._stop_recording()

    def _end(self) -> None:
        self._reset()

    def _hook_groups(self, root: nn.Module) -> None:
        """A pre-forward on every FSDP2 group below the root, before FSDP2's own (prepended), once."""
        if self._group_handles:
            return
        from torch.distributed.fsdp import FSDPModule

        index = 0
        for path, module in root.named_modules():
            if path and isinstance(module, FSDPModule):
                self._group_index[id(module)] = index
                index += 1
                hook = module.register_forward_pre_hook(marked(self._at_group), prepend=True, with_kwargs=True)
                self._group_handles.append(hook)

    # ----------------------------------------------------------------------------------------------- recording

    def _start_recording(self, root: nn.Module) -> None:
        """Module hooks (and instance wrappers of :data:`FEATURE_METHODS`) on the modules near the top, for this
        forward only."""
        for path, module in root.named_modules():
            if path.count(".") >= _MAX_DEPTH:
                continue
            if path:  # the root's own call takes the text too
                # first of its pre-hooks: a module that is an FSDP2 group itself (torchtitan's encoder) records its
                # call before the stop at its all-gather reports
                pre = module.register_forward_pre_hook(marked(self._on_call), with_kwargs=True, prepend=True)
                post = module.register_forward_hook(marked(self._on_return), always_call=True)
                self._record_handles += [pre, post]
            for name in FEATURE_METHODS:
                if callable(getattr(type(module), name, None)) and name not in module.__dict__:
                    module.__dict__[name] = functools.partial(self._on_method, module, name)
                    self._wrapped.append((module, name))
        self._paths = {id(m): p for p, m in root.named_modules()}

    def _stop_recording(self) -> None:
        for handle in self._record_handles:
            handle.remove()
        self._record_handles = []
        for module, name in self._wrapped:
            module.__dict__.pop(name, None)
        self._wrapped: list[tuple[nn.Module, str]] = []
        self._paths: dict[int, str] = {}

    def _is_media_call(self, args: Any, kwargs: Any) -> bool:
        if self._running is not None or self._replaying or not self._on:
            return False
        ptrs = {_storage(t) for t in _tensors((args, kwargs))}
        return bool(ptrs & self._media_ptrs) and not ptrs & self._text_ptrs

    def _begin_call(self, module: nn.Module, method: str, args: Any, kwargs: Any) -> None:
        self._running = module
        path = self._paths.get(id(module), "")
        try:
            call = MediaCall(path, self._calls, method, _record(args), _record(kwargs), self._media_names)
        except _Unreplayable as why:
            call = MediaCall(path, self._calls, method, media=self._media_names, unreplayable=str(why))
        self._calls += 1
        self._started.append(call)

    def _end_call(self, output: Any) -> None:
        self._running = None
        self._call_outputs[self._calls - 1] = [t.grad_fn for t in _leaves(output)]

    def _on_call(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._is_media_call(args, kwargs):
            self._begin_call(module, "", args, kwargs)

    def _on_return(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._running is module:
            self._end_call(output)

    def _on_method(self, module: nn.Module, name: str, *args: Any, **kwargs: Any) -> Any:
        """A features method (the instance's wrapper): a media call where its arguments hold media."""
        method = getattr(type(module), name)
        if not self._is_media_call(args, kwargs):
            return method(module, *args, **kwargs)
        self._begin_call(module, name, args, kwargs)
        try:
            output = method(module, *args, **kwargs)
        except BaseException:
            self._running = None
            raise
        self._end_call(output)
        return output

    # ------------------------------------------------------------------------------------------------- stops

    def _at_group(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not self._on:
            return None
        if self._meets:  # a replay's first group: the source reported here already
            self._meets = False
            return None
        self._stop(self._group_index.get(id(module), lockstep.END))
        if self._replaying or self._pending is None:
            return None
        joined = _add_zero((args, kwargs), self._pending)
        if not joined[1]:
            return None  # no floating input here (an embedding's ids): the next group, or the output
        self._pending = None
        new_args, new_kwargs = joined[0]
        return tuple(new_args), dict(new_kwargs)

    def _at_end(self, module: nn.Module, args: Any, output: Any) -> Any:
        if not self._on or self._depth != 1:
            return None
        self._stop(lockstep.END)
        if self._replays_made and torch.is_grad_enabled():
            self._share_used(output)
        pending, self._pending = self._pending, None
        self._on = False
        self._stop_recording()
        if pending is None:
            return None
        joined, done = _add_zero(output, pending, everywhere=True)
        if not done:
            raise FsdpCompatError(
                f"fsdp-compat: mixed micro-batches: {self.root_class}'s output has no floating tensor that requires "
                "grad, so the replayed media call's zero has nowhere to join and its parameters' gradients would "
                "differ by rank. Return the loss or logits from the forward, or register a family for the model "
                "(fsdp_compat.register_family)."
            )
        return joined

    def _stop(self, where: int) -> None:
        """Report at a stop, replay what this rank owes, until the ranks agree here."""
        while True:
            report = lockstep.Report(where, len(self._started), self._running is not None and bool(self._started))
            self.rounds += 1
            rows = wire.exchange(self._ranks, report.row())
            reports = {rank: lockstep.Report.of(row) for rank, row in rows.items()}
            calls, self._started = self._started, []
            done = lockstep.settle(reports)
            if done.diverged:
                self._raise_diverged(reports)
            if done.agreed:
                return
            self._replays_made = True
            source_calls = self._source_calls(done.source, calls, sorted(done.owed))
            me = self._rank()
            owed = done.owed.get(me)
            if owed is not None:
                assert done.source is not None
                self._replay(done.source, [source_calls[i] for i in owed], done.meets)
            if me not in done.again:
                return

    def _rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank()

    def _source_calls(self, source: int | None, mine: list[MediaCall], owing: list[int]) -> list[MediaCall]:
        """The source rank's calls of this round, on every rank (one broadcast over the host group)."""
        import torch.distributed as dist

        box: list[Any] = [mine if source == self._rank() else None]
        dist.broadcast_object_list(box, src=source, group=wire.host_group(self._ranks))
        calls = box[0]
        unreplayable = [c for c in calls if c.unreplayable]
        if unreplayable:
            self._raise_unreplayable(source, unreplayable[0], owing)
        return calls

    def _share_used(self, output: Any) -> None:
        """At the forward's end: every rank's calls' used outputs (reached backward from the root's output), one
        gather over the host group; each replay's gate learns its caller's."""
        import torch.distributed as dist

        reached = _reachable(_leaves(output)) if self._call_outputs else set()
        mine = {n: [fn is not None and fn in reached for fn in fns] for n, fns in self._call_outputs.items()}
        everyone: list[Any] = [None] * len(self._ranks)
        dist.all_gather_object(everyone, mine, group=wire.host_group(self._ranks))
        by_rank = dict(zip(self._ranks, everyone, strict=True))
        for source, number, used in self._gates:
            used.mask = by_rank[source].get(number)

    def _replay(self, source: int, calls: list[MediaCall], meets: bool) -> None:
        root = self._root()
        assert root is not None
        for i, call in enumerate(calls):
            module = root.get_submodule(call.path) if call.path else root
            self._meets = meets and i == len(calls) - 1
            self._replaying += 1
            target = getattr(type(module), call.method).__get__(module) if call.method else module
            try:
                out = target(*_rebuild(call.args, self._device), **_rebuild(call.kwargs, self._device))
            finally:
                self._replaying -= 1
                self._meets = False
            self.dummy_calls += 1
            leaves = _leaves(out) if torch.is_grad_enabled() else []
            if leaves:
                used = _Used()
                self._gates.append((source, call.index, used))
                zero = _Gate.apply(used, *[(t * 0).sum() for t in leaves])  # not t.sum() * 0: inf * 0 is NaN
                self._pending = zero if self._pending is None else self._pending + zero

    # ------------------------------------------------------------------------------------------------ errors

    def _fix(self) -> str:
        return (
            f"Fix: register a row for {self.root_class} (fsdp_compat.register_family(VisionFamily(...)), "
            "docs/api.md: its tower, its smallest valid input, where its features join), or give every rank's "
            "micro-batch the same media."
        )

    def _raise_diverged(self, reports: dict[int, lockstep.Report]) -> None:
        names = {index: path for path, index in self._named_groups()}
        where = "; ".join(
            f"rank {rank}: {'the forward end' if r.where == lockstep.END else names.get(r.where, r.where)}"
            + (f" ({r.started} media call(s) started)" if r.started else "")
            for rank, r in sorted(reports.items())
        )
        raise FsdpCompatError(
            f"fsdp-compat: mixed micro-batches: the ranks' micro-batches differ in their media inputs "
            f"({', '.join(self._media_names) or 'media'}) in this forward of {self.root_class}, and its ranks are "
            f"about to run different FSDP2 groups ({where}); no module call on the media alone explains the "
            "difference (the model runs its media's modules outside one call, or one rank's call differs), so the "
            "all-gathers would not pair (a gloo abort, an NCCL hang). " + self._fix()
        )

    def _raise_unreplayable(self, source: int | None, call: MediaCall, owing: list[int]) -> None:
        target = f"{call.path}.{call.method}" if call.path and call.method else call.path or call.method
        raise FsdpCompatError(
            f"fsdp-compat: mixed micro-batches: the ranks' micro-batches differ in their media inputs "
            f"({', '.join(call.media or self._media_names)}) in this forward of {self.root_class}; rank {source}'s "
            f"media call {target or self.root_class} cannot be replayed on rank(s) {', '.join(map(str, owing))}, "
            "which lack it: it takes "
            f"{call.unreplayable}, so their FSDP2 collectives would not pair (a gloo abort, an NCCL hang). "
            + self._fix()
        )

    def _named_groups(self) -> Iterator[tuple[str, int]]:
        root = self._root()
        if root is None:
            return
        for path, module in root.named_modules():
            index = self._group_index.get(id(module))
            if index is not None and path:
                yield path, index
