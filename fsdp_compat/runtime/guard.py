"""Run-time guard: a parameter read while its FSDP2 group is sharded unshards that group instead of crashing.

The static plan keeps a module out of its own group when the analysis sees a read of its parameters outside the
group's window. A read the analysis missed would otherwise hand a sharded ``DTensor`` to an op that mixes it with
plain tensors (``got mixed torch.Tensor and DTensor``). While the guarded model's forward runs, a
``TorchFunctionMode`` looks at every op's tensor arguments (lists too, positional or by keyword); when one is the
sharded parameter of an FSDP2 group, the guard unshards that group on the spot (an all-gather), hands the op the
unsharded parameter, and keeps the group unsharded until the end of backward: ``reshard_after_forward`` is off for
the step and the group's post-backward (reduce-scatter, reshard) runs in FSDP2's root post-backward callback, after
every gradient contribution, including the raw read's, has arrived. A ``no_grad`` forward (no backward follows)
reshards what it unsharded when it ends, but never a group that an earlier training forward holds for its backward.
Afterwards the group's own setting comes back, so every step behaves the same. Each group is logged once
(logger ``fsdp_compat``): the parameter, where it was read, and the plan change that avoids the run-time unshard.

The all-gather is a collective: every rank of the group must make the same read. Before it, the ranks agree through
the process group's store (one set and one wait per run-time unshard, nothing when the guard is idle): a read made
on some ranks only (a data-dependent branch) raises :class:`GuardReadMismatch` on the reading ranks, naming the rank
and the read, after ``FSDP_COMPAT_GUARD_AGREE_S`` seconds (60) instead of a mismatched collective; a rank whose own
forward then fails logs that report under its own rank.

``FSDP_COMPAT_GUARD=off`` disables it. The guard relies on FSDP2 internals (``FSDPParamGroup``, ``FSDPState``;
``tests/runtime/test_guard_contract.py`` checks each one on every torch in CI). Every call into them, wherever it is met
(discovery, a read, the end of a no-grad forward, the end of backward), is inside the stand-aside path: where they
differ the guard warns once and stands aside for good, leaving FSDP2's own behaviour; it never raises into the
user's forward or backward. A group it already holds for the current step is still handed back to FSDP2 at the end
of that backward.
"""

from __future__ import annotations

import datetime
import functools
import itertools
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from fsdp_compat import switches
from fsdp_compat.errors import FsdpCompatError
from fsdp_compat.log import logger
from fsdp_compat.runtime.process_world import PerWorld, job_timeout
from fsdp_compat.runtime.torch_versions import GUARD_MIN_TORCH, guard_supports
from fsdp_compat.runtime.window import param_groups
from fsdp_compat.tree import ModuleTree
from fsdp_compat.units import fmt_bytes as _fmt_bytes

__all__ = [
    "ENV_AGREE_S", "ENV_GUARD", "MIN_TORCH", "Guard", "GuardEvent", "GuardReadMismatch", "guard_enabled", "guard_of",
    "install_guard", "torch_supported",
]

ENV_GUARD = switches.GUARD
# How long a rank about to unshard at a read waits for every rank of the group to reach the same read (seconds).
ENV_AGREE_S = switches.GUARD_AGREE_S
_AGREE_S_DEFAULT = 60.0

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_DISTRIBUTED_DIR = os.path.join(_TORCH_DIR, "distributed") + os.sep
_SEQ = (list, tuple)
# Reading these from a sharded parameter is fine (DTensor answers with the global metadata) and FSDP2 itself does
# it in forward; only ops that compute with the values need the unsharded parameter.
_METADATA_PROPERTIES = ("dtype", "shape", "device", "ndim", "requires_grad", "is_leaf", "grad", "grad_fn", "layout",
                        "is_cuda", "is_meta", "is_sparse", "is_quantized", "names", "itemsize", "nbytes")  # fmt: skip
_METADATA_METHODS = ("size", "dim", "numel", "nelement", "ndimension", "element_size", "is_floating_point",
                     "is_complex", "get_device", "__len__", "is_contiguous", "stride", "storage_offset",
                     "requires_grad_")  # fmt: skip
_METADATA = frozenset(
    [getattr(torch.Tensor, name).__get__ for name in _METADATA_PROPERTIES if hasattr(torch.Tensor, name)]
    + [getattr(torch.Tensor, name) for name in _METADATA_METHODS if hasattr(torch.Tensor, name)]
)

# What an FSDP2 internal that moved or changed looks like to the guard (a collective's RuntimeError is not one).
# FSDP2's own assertions (AssertionError) and value checks are not on this list: they are the user's errors.
_INTERNALS_CHANGED = (AttributeError, TypeError, KeyError, IndexError)

_STOOD_ASIDE: set[str] = set()  # the internals errors already reported in this process

#: Where a model keeps its guard (``module.__dict__``): the module owns it, so it dies with the module.
GUARD_ATTR = "_fsdp_compat_guard"
# Guards in the order their groups are found: the same on every rank, counted per process group (a rank that joins a
# new group after a restart starts at 0, and so must the survivors).
_ORDINALS: PerWorld[Iterator[int]] = PerWorld(itertools.count)


class GuardReadMismatch(FsdpCompatError):
    """A raw read of a sharded parameter happened on some ranks of its FSDP2 group and not on others (a
    data-dependent read). Unsharding it on the reading ranks only would pair their all-gather with another
    collective on the other ranks (gloo: ``Received data size doesn't match``; NCCL: a hang, or wrong data when
    the sizes happen to match), so the guard raises this instead, before any collective."""


def guard_enabled() -> bool:
    """False when ``FSDP_COMPAT_GUARD`` is off (:mod:`fsdp_compat.switches`); on by default; an unknown value raises."""
    return switches.guard_mode() != "off"


def guard_always_armed() -> bool:
    """``FSDP_COMPAT_GUARD=always``: the per-op check on every guarded root, whatever the check of its groups says."""
    return switches.guard_mode() == "always"


#: The oldest torch the guard supports (its one home: :mod:`fsdp_compat.runtime.torch_versions`).
MIN_TORCH = GUARD_MIN_TORCH
_warned_torch: list[bool] = []


def torch_supported(version: str | None = None) -> bool:
    """Whether the guard runs on this torch (``version`` defaults to the imported one)."""
    return guard_supports(version or torch.__version__)


def install_guard(model: nn.Module, *, armed: bool | None = None) -> Guard | None:
    """Guard ``model`` (the root that is, or will be, ``fully_shard``-ed); returns None when the guard is off, or on a
    torch older than :data:`MIN_TORCH` (one warning per process).

    Idempotent: a second call returns the same guard (armed if either call armed it). It may run before
    ``fully_shard`` (a framework selector that shards afterwards): the FSDP2 groups are found at the first forward.
    ``armed``: whether the per-op check runs (a ``TorchFunctionMode`` for the whole pass). ``None`` (the default)
    decides at the first pass, from fsdp-compat's check of the groups (:mod:`.arming`): armed only where the check
    cannot rule a sharded read out, so a safe grouping costs no per-op check. The guard lives on ``model`` (its
    ``__dict__``) and dies with it; :meth:`Guard.remove` takes it off.
    """
    if not guard_enabled():
        return None
    if not torch_supported():
        if not _warned_torch:
            _warned_torch.append(True)
            logger.warning(
                "fsdp-compat: run-time guard off: it supports torch >= %d.%d, not torch %s; FSDP2 runs as without "
                "the guard, fsdp-compat's static plan still applies",
                *MIN_TORCH,
                torch.__version__,
            )
        return None
    existing = guard_of(model)
    if existing is not None:
        if armed or guard_always_armed():
            existing.armed = True
        return existing
    guard = Guard(model, armed=True if guard_always_armed() else armed)
    model.__dict__[GUARD_ATTR] = guard
    return guard


def guard_of(model: nn.Module) -> Guard | None:
    """The guard installed on ``model``, if any."""
    guard = model.__dict__.get(GUARD_ATTR)
    return guard if guard is not None and guard.installed else None


@dataclass(frozen=True)
class GuardEvent:
    """A group the guard had to unshard at run time (recorded and logged at its first unshard)."""

    group: str  # the group's module paths
    parameter: str  # the parameter handed to an op while its group was sharded
    where: str  # file:line of the reading code
    reader: str  # the innermost module whose forward was running there ("" = the root)
    advice: str  # the plan change that avoids the run-time unshard
    unsharded_bytes: int  # the group's unsharded parameter bytes, held from the read to the end of backward
    message: str


class _GuardMode(TorchFunctionMode):
    """Per op: is any tensor argument a sharded FSDP2 parameter? One C-level set test per argument list. Not inside a
    ``torch.compile``d region: Dynamo traces the mode, and the check would break its graph (a raw read of a sharded
    parameter in compiled code fails there as without the guard)."""

    def __init__(self, guard: Guard) -> None:
        super().__init__()
        self.guard = guard
        self.keys: Any = {}.keys()  # ids of the sharded parameters (a view of Guard._sharded)

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if torch.compiler.is_compiling():  # Dynamo traces the modes on the stack: ids of traced tensors cannot be
            return func(*args, **kwargs) if kwargs else func(*args)  # compared (a graph break); no check in there
        keys = self.keys
        if keys.isdisjoint(map(id, args)) and (not kwargs or keys.isdisjoint(map(id, kwargs.values()))):
            # tensor-list arguments, positional or by keyword: torch.cat([...]), torch.cat(tensors=[...])
            for arg in (*args, *kwargs.values()) if kwargs else args:
                if arg.__class__ in _SEQ and not keys.isdisjoint(map(id, arg)):
                    break
            else:
                return func(*args, **kwargs) if kwargs else func(*args)
        return self.guard._on_sharded_read(func, args, kwargs or {})


class Guard:
    """The run-time guard of one model; see the module docstring. ``events`` lists the groups it unsharded."""

    def __init__(self, model: nn.Module, *, armed: bool | None = None) -> None:
        from fsdp_compat.runtime.window import subscribe

        self.model = model
        #: False: no per-op check (a forward costs nothing); None: decided at the first pass (:mod:`.arming`).
        #: Setting it takes effect at the next pass.
        self.armed = armed
        #: The groups fsdp-compat's check found readable while sharded (module paths joined by " + "), where the
        #: guard was armed by that check: under ``torch.compile`` of the whole root they are unsharded up front.
        self.unsafe_groups: list[str] = []
        self.events: list[GuardEvent] = []
        self.unshards = 0  # run-time unshards so far (every step counts)
        self._mode = _GuardMode(self)
        self._sharded: dict[int, tuple[Any, Any]] = {}  # id(sharded parameter) -> (FSDPParamGroup, FSDPParam)
        self._groups: list[Any] | None = None
        self._roots: list[tuple[Any, Any, Any]] = []  # (FSDP2 root state, our final-callback wrapper, the one before)
        self._paths: dict[int, str] = {}
        self._pending: dict[Any, Any] = {}  # group -> its own post_forward_mesh_info, until the end of backward
        self._held_by_grad: set[Any] = set()  # groups pending when a no-grad forward began: its end leaves them
        self._logged: set[int] = set()
        self._entered = False
        self._open = False
        self._grad = True
        self._in_final_callback = False
        self._broken = False
        self._ordinal = -1  # set when the groups are found
        self._forwards = 0  # guarded forwards so far (the same count on every rank)
        self._reads = 0  # run-time unshards in the current forward
        self._agreed: list[str] = []  # store keys of the last agreement this rank completed last (deleted later)
        self._reported = False  # this rank raised GuardReadMismatch itself
        self._unsubscribe: Callable[[], None] | None = subscribe(model, self)

    @property
    def installed(self) -> bool:
        return self._unsubscribe is not None

    def remove(self) -> None:
        """Take the guard off its window and give FSDP2 back its own callbacks and settings (call it between steps)."""
        unsubscribe, self._unsubscribe = self._unsubscribe, None
        if unsubscribe is not None:
            unsubscribe()
        self._safely(self._restore)
        for state, wrapper, previous in self._roots:
            if vars(state).get("_root_post_backward_final_callback") is wrapper:
                if isinstance(previous, functools.partial):
                    state._root_post_backward_final_callback = previous
                else:
                    del state._root_post_backward_final_callback  # FSDP2's own method again
        self._roots = []
        if self.model.__dict__.get(GUARD_ATTR) is self:
            del self.model.__dict__[GUARD_ATTR]

    # ---------------------------------------------------------------------------------------- forward window

    def on_open(self) -> None:
        """The root's FSDP2 pass starts (:mod:`.window`): arm the per-op check for the pass where it is armed."""
        self._open = True
        if self.armed is None:
            from fsdp_compat.runtime.arming import decide

            verdict = decide(self.model)
            self.armed, self.unsafe_groups = verdict.armed, verdict.unsafe_names
        if self._broken or not self.armed:
            return
        if not self._safely(self._prepare):
            return
        self._grad = torch.is_grad_enabled()
        self._held_by_grad = set(self._pending) if not self._grad else set()
        self._forwards += 1
        self._reads = 0
        if _under_compile(self.model):
            self._safely(self._hold_unsafe_groups)
            return  # Dynamo would trace a mode on the stack: no per-op check inside a compiled root
        self._mode.__enter__()
        self._entered = True

    def on_close(self, raised: bool) -> None:
        """The root's FSDP2 pass ended (or raised)."""
        if not self._open:
            return
        self._open = False
        if self._entered:
            self._entered = False
            self._mode.__exit__(None, None, None)
        if raised:  # say so if another rank stopped at a read this rank did not make
            self._safely(self._report_peer_mismatch)
        if not self._grad and self._pending.keys() - self._held_by_grad:
            # No backward follows a no-grad forward: reshard what it unsharded, but not the groups a training
            # forward before it still holds for its own backward (an evaluation pass between forward and backward).
            self._safely(self._release, self._pending.keys() - self._held_by_grad)

    def _hold_unsafe_groups(self) -> None:
        """Under ``torch.compile`` of the whole root: unshard the groups the check found readable while sharded, on
        every rank at the same point (the pass's start), and hold them to the end of backward as a read would; a
        guard armed without such a list (its analysis could not run) raises, naming the fix."""
        if not self.unsafe_groups:
            raise FsdpCompatError(
                f"fsdp-compat: run-time guard: {type(self.model).__name__} runs under torch.compile as a whole, and "
                "fsdp-compat could not rule out a read of a sharded FSDP2 group in it (its analysis could not run, "
                "or the policy skips it), so the guard's per-op check would have to run inside the compiled region, "
                "where Dynamo cannot trace it. Fix: compile the blocks rather than the root (module.compile() per "
                "block), shard with fsdp_compat.apply_fsdp2 (policy auto), or set FSDP_COMPAT_GUARD=off if you know "
                "every read happens inside its group's own forward."
            )
        wanted = set(self.unsafe_groups)
        for group in self._groups or ():
            if self._group_name(group) in wanted and not group.is_unsharded:
                self._hold(group)
                group.unshard()
                group.wait_for_unshard()
                self.unshards += 1

    def _group_name(self, group: Any) -> str:
        return " + ".join(self._paths.get(id(m), "?") or "<root>" for m in group.modules)

    def _hold(self, group: Any) -> None:
        """Keep ``group`` unsharded until the end of this step's backward (FSDP2's root final callback)."""
        if group in self._pending:
            return
        self._pending[group] = group.post_forward_mesh_info
        group.post_forward_mesh_info = None  # = set_reshard_after_forward(False) for this group, this step
        group.post_backward = functools.partial(self._deferred_post_backward, group, type(group).post_backward)

    def _prepare(self) -> bool:
        """Find the FSDP2 groups (once they exist) and index their sharded parameters for this forward."""
        if not self._groups:
            self._discover()
            if not self._groups:
                return False
        self._sharded = {id(fp.sharded_param): (group, fp) for group in self._groups for fp in group.fsdp_params}
        self._mode.keys = self._sharded.keys()
        return True

    def _discover(self) -> None:
        from torch.distributed.fsdp import FSDPModule

        groups: dict[int, Any] = {}
        roots: dict[int, Any] = {}
        for module in self.model.modules():
            if not isinstance(module, FSDPModule):
                continue
            state = module._get_fsdp_state()
            for group in param_groups(state):
                groups.setdefault(id(group), group)
            for other in state._state_ctx.all_states:  # the FSDP2 root may also be a wrapper around this model
                if other._is_root:
                    roots[id(other)] = other
        if groups and not roots:
            raise AttributeError("no FSDP2 root state after the root's lazy init")
        # FSDP2 queues the final callback of whichever state's pre-backward hook autograd reaches first: the root's
        # on torch >= 2.13, often a child's on older torches (their root registers no hook on a ModelOutput). Every
        # state of the root's tree gets the wrapper, so the one FSDP2 queues is always the guard's.
        states = {id(s): s for root in roots.values() for s in root._state_ctx.all_states}
        for state in states.values():
            current = state._root_post_backward_final_callback  # FSDP2's, or another guard's wrapper: chained
            if not (isinstance(current, functools.partial) and current.func == self._final_callback):
                wrapper = functools.partial(self._final_callback, current)
                state._root_post_backward_final_callback = wrapper
                self._roots.append((state, wrapper, current))
        self._groups = list(groups.values())
        self._ordinal = next(_ORDINALS.get())
        self._paths = {id(m): path for path, m in self.model.named_modules(remove_duplicate=False)}

    def _safely(self, call: Callable[..., Any], *args: Any) -> Any:
        """``call(*args)`` with the stand-aside path around it: an FSDP2 internals error disables the guard (one
        warning) and returns False instead of reaching the user's forward or backward."""
        try:
            return call(*args)
        except _INTERNALS_CHANGED as exc:  # FSDP2 internals of another torch release
            if isinstance(exc, FsdpCompatError):
                raise  # the guard's own named errors are meant for the user
            self._stand_aside(exc)
            return False

    def stand_aside(self, exc: BaseException) -> None:
        """The forward window cannot read FSDP2's internals on this torch (:mod:`.window`): stand aside for good."""
        self._stand_aside(exc)

    def _stand_aside(self, exc: BaseException) -> None:
        if self._broken:
            return
        self._broken = True
        self._mode.keys = {}.keys()  # the rest of this forward: every op runs as without the guard
        key = f"{type(exc).__name__}: {exc}"
        if key in _STOOD_ASIDE:  # a fact of this torch, not of this model: once per process
            return
        _STOOD_ASIDE.add(key)
        logger.warning(
            "fsdp-compat: run-time guard disabled: this torch's FSDP2 internals differ from what it supports (%s: "
            "%s); FSDP2 runs as without fsdp-compat's guard",
            type(exc).__name__,
            exc,
        )

    # ------------------------------------------------------------------------------------ a read while sharded

    def _on_sharded_read(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self._broken or _called_from_torch_distributed():
            return func(*args, **kwargs)
        swap = self._safely(self._serve, func, args, kwargs)
        if not swap:  # nothing to swap, or the guard stood aside: the op gets what FSDP2 gave it
            return func(*args, **kwargs)
        args = tuple(_swapped(a, swap) for a in args)
        kwargs = {k: _swapped(v, swap) for k, v in kwargs.items()}
        return func(*args, **kwargs)

    def _serve(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[int, Any]:
        """Unshard the groups of the sharded parameters among the op's arguments; return id -> unsharded param."""
        hits = [self._sharded[i] for i in _argument_ids(args, kwargs) if i in self._sharded]
        if func in _METADATA:  # no unshard for metadata; once unsharded, a stale reference answers as the current
            hits = [(group, fp) for group, fp in hits if group.is_unsharded]  # parameter (bf16 under mixed precision)
        for group, fp in hits:
            if not group.is_unsharded:
                self._unshard(group, fp)
        return {id(fp.sharded_param): fp.unsharded_param for _, fp in hits}

    def _unshard(self, group: Any, fp: Any) -> None:
        self._reads += 1
        self._agree(group, fp)
        self._hold(group)
        group.unshard()
        group.wait_for_unshard()
        if self._grad and hasattr(group, "_set_unsharded_grad_dtypes"):
            # torch >= 2.15 lets gradients accumulate in the parameter dtype only inside a group's backward window
            # (pre-backward to post-backward) and up-casts the ones that arrive outside it. The raw read's gradient
            # arrives before this group's pre-backward: open the window now, so it accumulates exactly as it
            # would in a group whose window covers the read (the plan the log line recommends).
            group._set_unsharded_grad_dtypes(defer_upcast=True)
        self.unshards += 1
        if id(group) not in self._logged:
            self._logged.add(id(group))
            self._log(group, fp)

    def _deferred_post_backward(self, group: Any, original: Callable[..., Any], *unused: Any) -> None:
        """Autograd reaches a group's post-backward when its own forward's inputs get their gradients, which can
        be before the raw read's backward: only FSDP2's root final callback runs it for a guarded group."""
        if self._in_final_callback or group not in self._pending:  # not (or no longer) deferred: FSDP2's own
            original(group, *unused)

    def _final_callback(self, original: Callable[[], None]) -> None:
        self._in_final_callback = True
        try:
            original()  # FSDP2's own: its errors are the user's
        finally:
            self._in_final_callback = False
            self._safely(self._restore)

    def _restore(self, groups: Iterable[Any] | None = None) -> None:
        """Give ``groups`` (default: every pending group) back their own reshard setting and post-backward."""
        for group in list(self._pending if groups is None else groups):
            vars(group).pop("post_backward", None)
            group.post_forward_mesh_info = self._pending.pop(group)

    def _release(self, groups: Iterable[Any]) -> None:
        """Reshard ``groups`` now (the end of a no-grad forward) and give them back their own settings."""
        groups = list(groups)
        for group in groups:
            if group.is_unsharded:
                group.reshard()
        self._restore(groups)

    # ------------------------------------------------------------------------------------------------ logging

    def _describe(self, group: Any, fp: Any) -> tuple[str, str, str, str, str]:
        """(group name, parameter, file:line of the read, reading module, the plan change that avoids it)."""
        holder = self._paths.get(id(fp._module_info.module), "?")
        parameter = f"{holder}.{fp._module_info.param_name}" if holder else fp._module_info.param_name
        members = [self._paths.get(id(m), "?") for m in group.modules]
        name = " + ".join(m or "<root>" for m in members)
        owner = next((m for m in members if ModuleTree.is_ancestor_or_self(m, holder)), members[0])  # holds it
        where, reader = self._reading_site()
        advice = _advice(owner, reader, forward_ran=bool(getattr(group, "_post_forward_indices", None)))
        return name, parameter, where, reader, advice

    # ------------------------------------------------------------------------------- the same read on every rank

    def _agree(self, group: Any, fp: Any) -> None:
        """Before a run-time all-gather: every rank of the group must be at the same read (the same group as its
        n-th run-time unshard of this forward), checked through the process group's store with a deadline, so
        that a read made on some ranks only never becomes a mismatched collective. Raises GuardReadMismatch.

        O(ranks) store operations in all: each rank sets its group's name and adds one to a counter; the last to
        arrive reads the names and publishes them; the others wait for that one key. The keys of a rank's previous
        agreement are deleted once this one completed (every rank added here only after it had passed that one)."""
        import torch.distributed as dist

        pg = group.mesh_info.shard_process_group
        if not dist.is_initialized() or dist.get_world_size(pg) <= 1:
            return
        store = dist.distributed_c10d._get_default_store()
        ranks = dist.get_process_group_ranks(pg)
        me = dist.get_rank()
        name, parameter, where, reader, _ = self._describe(group, fp)
        key = f"{self._store_prefix(ranks)}/{self._forwards}/{self._reads}/"
        store.set(key + str(me), name)
        mine = [key + str(me)]
        if store.add(key + "arrived", 1) == len(ranks):
            names = [v.decode() for v in store.multi_get([key + str(r) for r in ranks])]
            store.set(key + "all", "\n".join(names))
            mine += [key + "arrived", key + "all"]
        seconds = _agree_seconds()
        try:
            store.wait([key + "all"], datetime.timedelta(seconds=seconds))
            seen = dict(zip(ranks, store.get(key + "all").decode().split("\n"), strict=True))
        except RuntimeError:  # DistStoreError: a rank did not reach this read in time
            present = [r for r in ranks if r == me or store.check([key + str(r)])]
            seen = {r: store.get(key + str(r)).decode() for r in present}
        absent = [r for r in ranks if r not in seen]
        other = {r: g for r, g in seen.items() if g != name}
        if not absent and not other:
            for old in self._agreed:
                store.delete_key(old)
            self._agreed = mine
            return
        what = []
        if absent:
            what.append(f"rank(s) {', '.join(map(str, absent))} did not make this read within {seconds:g}s")
        if other:
            what.append("; ".join(f"rank {r} read group {g} at this point instead" for r, g in other.items()))
        message = (
            f"fsdp-compat: run-time guard: rank {me} read {parameter} at {where} in {reader or '<root>'}.forward "
            f"while its FSDP2 group {name} was sharded, but {'; '.join(what)} (a data-dependent raw read, made on "
            f"some ranks only). The guard did not all-gather: an all-gather on some ranks only would mismatch FSDP2's "
            f"collectives (gloo: 'Received data size doesn't match', NCCL: a hang or wrong data). To avoid it: "
            f"read the parameter on every rank (e.g. compute the branch on every rank and mask it), or "
            f"{_advice(name.split(' + ')[0], reader, forward_ran=False)}."
        )
        logger.error(message)
        self._reported = True
        # the first report wins; other ranks read it
        store.compare_set(f"{self._store_prefix(ranks)}/mismatch", "", message)
        raise GuardReadMismatch(message)

    def _store_prefix(self, ranks: list[int]) -> str:
        return f"fsdp_compat/guard/{self._ordinal}/{'-'.join(map(str, ranks))}"

    def _report_peer_mismatch(self) -> None:
        """After this rank's forward failed: if a rank of a group reported a read this rank did not make, log it
        here too (naming this rank), so the cause reaches every rank's log, not only the reading rank's."""
        import torch.distributed as dist

        if not self._groups or not dist.is_initialized() or self._reported:
            return
        store = dist.distributed_c10d._get_default_store()
        for ranks in {tuple(dist.get_process_group_ranks(g.mesh_info.shard_process_group)) for g in self._groups}:
            key = f"{self._store_prefix(list(ranks))}/mismatch"
            if len(ranks) > 1 and store.check([key]):
                report = store.get(key).decode()
                if report:
                    logger.error(
                        "fsdp-compat: run-time guard: rank %d's forward failed after another rank reported a read "
                        "this rank did not make: %s", dist.get_rank(), report,
                    )

    def _log(self, group: Any, fp: Any) -> None:
        name, parameter, where, reader, advice = self._describe(group, fp)
        nbytes = sum(p.unsharded_param.numel() * p.unsharded_param.element_size() for p in group.fsdp_params)
        message = (
            f"fsdp-compat: run-time guard: {parameter} was read while its FSDP2 group {name} was sharded, at "
            f"{where} in {reader or '<root>'}.forward; unsharded the group there and kept it unsharded until "
            f"the end of backward ({_fmt_bytes(nbytes)} the plan did not budget, on every step). To avoid it: "
            f"{advice}."
        )
        self.events.append(GuardEvent(name, parameter, where, reader, advice, nbytes, message))
        logger.warning(message)

    def _reading_site(self) -> tuple[str, str]:
        """file:line of the first frame outside torch and this module, and the innermost module running there."""
        frame = sys._getframe(1)
        where = ""
        while frame is not None:
            filename = frame.f_code.co_filename
            if not where and filename != __file__ and not filename.startswith(_TORCH_DIR):
                where = f"{filename}:{frame.f_lineno}"
            if where:
                owner = frame.f_locals.get("self")
                if isinstance(owner, nn.Module) and id(owner) in self._paths:
                    return where, self._paths[id(owner)]
            frame = frame.f_back
        return where or "?", ""




def _agree_seconds() -> float:
    """How long a rank waits for the others at a run-time unshard: ``FSDP_COMPAT_GUARD_AGREE_S`` (60), never longer
    than the job's own process-group timeout (a job that set 20 s fails at 20 s, as plain FSDP2 would)."""
    seconds = switches.seconds(ENV_AGREE_S, _AGREE_S_DEFAULT)
    timeout = job_timeout()
    return seconds if timeout is None else min(seconds, timeout.total_seconds())


def _argument_ids(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterable[int]:
    for value in (*args, *kwargs.values()):
        if value.__class__ in _SEQ:
            yield from map(id, value)
        else:
            yield id(value)


def _swapped(value: Any, swap: dict[int, Any]) -> Any:
    if value.__class__ in _SEQ:
        return value.__class__(swap.get(id(v), v) for v in value)
    return swap.get(id(value), value)


def _called_from_torch_distributed() -> bool:
    """FSDP2 and DTensor code may touch a sharded parameter in forward; that is theirs, not a raw read."""
    frame = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith(_DISTRIBUTED_DIR):
            return True
        if filename != __file__ and not filename.startswith(_TORCH_DIR):
            return False
        frame = frame.f_back
    return False


def _advice(owner: str, reader: str, *, forward_ran: bool) -> str:
    """The plan change that covers the read: no group of its own, or a group at the reader that covers it."""
    parts = [f"leave {owner} in its enclosing group"]
    common = _common_ancestor(owner, reader)
    if common and common != owner:
        if common == reader:
            parts.append(f"wrap the reader {reader} instead")
        else:
            parts.append(f"wrap {common} (holding both {owner} and the reader {reader}) instead")
    if forward_ran:
        parts.append(f"keep {owner}'s group unsharded after its forward (reshard_after_forward=False)")
    return ", or ".join(parts)


def _common_ancestor(a: str, b: str) -> str:
    pairs = itertools.takewhile(lambda pair: pair[0] == pair[1], zip(a.split("."), b.split("."), strict=False))
    return ".".join(x for x, _ in pairs)


def _under_compile(root: nn.Module) -> bool:
    """Whether the root's pass runs as a whole under ``torch.compile``: compiled in place (``module.compile()``), or
    called through a ``torch.compile(module)`` wrapper (Dynamo's ``OptimizedModule`` around it on the stack)."""
    if getattr(root, "_compiled_call_impl", None) is not None:
        return True
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # never imported: nothing was compiled
    optimized = getattr(eval_frame, "OptimizedModule", None)
    if optimized is None:
        return False
    frame: Any = sys._getframe(1)
    while frame is not None:
        if "self" in frame.f_code.co_varnames:
            owner = frame.f_locals.get("self")
            if isinstance(owner, optimized) and getattr(owner, "_orig_mod", None) is root:
                return True
        frame = frame.f_back
    return False
