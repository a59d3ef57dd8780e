"""The one answer to "which FSDP2 groups would be read while sharded, and what follows": a grouping (the planner's
decisions, a framework's own selection, transformers' ``fsdp_plan``) is checked against the static evidence here
and nowhere else, and made safe by one loop, :func:`settle`.

A group is unsafe when a read of its parameters falls outside its window (the module's own forward, or until
backward for ``reshard_after_forward=False`` and a read after that forward), when unreadable code above it may read
it, or when it holds some but not all of the modules that share one Parameter object (:func:`is_split`). The planner
(:mod:`fsdp_compat.plan`), the repair of someone else's plan (:mod:`fsdp_compat.repair`, which the transformers
adapter runs) and the adapters that keep a framework's selection minus what is unsafe (:func:`unsafe_targets`) all
settle their layout with :func:`settle`; only what a fix does differs (drop the group, or keep it unsharded).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from fsdp_compat.analysis import RawRead, find_raw_reads
from fsdp_compat.errors import FsdpCompatError
from fsdp_compat.tree import ModuleTree

__all__ = [
    "GroupSpec", "Key", "Layout", "Problem", "bottom_up", "drop", "forbidden", "is_split", "next_problem", "settle",
    "sharer_sets", "split_parameters", "unsafe_targets", "violation", "violations",
]  # fmt: skip

Key = tuple[str, ...]  # the member paths of one group


@dataclass(frozen=True)
class GroupSpec:
    """One group of a layout: what made it (``kind``), why, and its own ``fully_shard`` keyword arguments."""

    kind: str
    reason: str = ""
    overrides: Mapping[str, Any] = field(default_factory=dict)

    @property
    def reshards(self) -> bool:
        """Whether the group reshards after its forward (``reshard_after_forward`` not switched off)."""
        return self.overrides.get("reshard_after_forward") is not False


@dataclass
class Layout:
    """A grouping under construction or review: each group's member paths and spec, in order, and for the
    candidates that have no group of their own, why."""

    groups: dict[Key, GroupSpec] = field(default_factory=dict)
    kept: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, groups: Iterable[tuple[Key, Mapping[str, Any]]], kind: str = "foreign") -> Layout:
        """A layout of existing groups (their paths and overrides)."""
        return cls(groups={key: GroupSpec(kind, "", dict(overrides)) for key, overrides in groups})

    def member_key(self) -> dict[str, Key]:
        return {path: key for key in self.groups for path in key}

    def group_of(self, tree: ModuleTree, path: str, members: dict[str, Key] | None = None) -> Key:
        """The group holding ``path``'s parameters: its own, the nearest ancestor's, or the root (``("",)``)."""
        members = members if members is not None else self.member_key()
        if path in members:
            return members[path]
        for ancestor in tree.ancestors(path):
            if ancestor in members:
                return members[ancestor]
        return ("",)

    def drop(self, key: Key, reason: str) -> None:
        """No group for ``key`` any more: its parameters join the enclosing group; its members keep ``reason``."""
        self.groups.pop(key, None)
        for path in key:
            self.kept.setdefault(path, reason)

    def rekey(self, key: Key, new_key: Key) -> None:
        """The group ``key`` now has the members ``new_key`` (same spec, same place in the order)."""
        self.groups = {(new_key if k == key else k): spec for k, spec in self.groups.items()}

    def size(self) -> int:
        """What every fix of :func:`settle` makes smaller: member paths, plus groups that reshard after forward."""
        return sum(len(key) + spec.reshards for key, spec in self.groups.items())


def forbidden(tree: ModuleTree, events: Iterable[RawRead]) -> dict[str, list[RawRead]]:
    """Modules that may NOT be a group root whatever else is grouped, each with the evidence that forbids it."""
    out: dict[str, list[RawRead]] = {}
    for event in events:
        if event.kind == "opaque":
            reader = tree.modules[event.reader]
            nodes = [p for p, _ in reader.named_modules(prefix=event.reader) if p != event.reader]
        else:
            top = tree.lca(event.reader, event.owner)
            nodes = tree.path_between(event.owner, top, include_low=event.kind == "raw-read")
        for node in nodes:
            out.setdefault(node, []).append(event)
    return out


def violation(tree: ModuleTree, layout: Layout, event: RawRead, members: dict[str, Key] | None = None) -> Key | None:
    """The group whose window ``event`` falls outside of, or None when the layout covers it."""
    members = members if members is not None else layout.member_key()
    if event.kind == "opaque":
        for key in layout.groups:
            if any(p != event.reader and tree.is_ancestor_or_self(event.reader, p) for p in key):
                return key
        return None
    key = layout.group_of(tree, event.owner, members)
    if key == ("",):
        return None
    if event.kind == "call" and event.owner in key:
        return None
    if any(tree.is_ancestor_or_self(member, event.reader) for member in key):
        return None
    no_reshard = key in layout.groups and not layout.groups[key].reshards
    if no_reshard and event.kind == "raw-read" and any(p in event.after_forward_of for p in key):
        return None  # read after the group's own forward, and the group stays unsharded until backward
    return key


def violations(tree: ModuleTree, layout: Layout, events: Iterable[RawRead]) -> dict[Key, list[RawRead]]:
    """Every group some evidence falls outside of, with that evidence."""
    members = layout.member_key()
    out: dict[Key, list[RawRead]] = {}
    for event in events:
        key = violation(tree, layout, event, members)
        if key is not None:
            out.setdefault(key, []).append(event)
    return out


def sharer_sets(tree: ModuleTree, extra: Iterable[Iterable[str]] = ()) -> list[tuple[str, ...]]:
    """Module paths that hold one Parameter object, plus ``extra`` sets (weights a framework ties later)."""
    sets = {
        tuple(sorted({path for path, _ in owners}))
        for owners in tree.param_owners.values()
        if len({path for path, _ in owners}) > 1
    }
    sets |= {tuple(sorted(set(s))) for s in extra if len(set(s)) > 1 and all(p in tree.modules for p in s)}
    return sorted(sets)


def is_split(
    tree: ModuleTree, layout: Layout, sharers: Iterable[str], members: dict[str, Key] | None = None
) -> bool:
    """The one split-Parameter check: whether modules holding one Parameter object sit in more than one group
    (``fully_shard`` raises ``ValueError`` on such a plan)."""
    members = members if members is not None else layout.member_key()
    return len({layout.group_of(tree, s, members) for s in sharers}) > 1


def split_parameters(tree: ModuleTree, layout: Layout, sets: Iterable[tuple[str, ...]]) -> list[tuple[str, ...]]:
    """The sets of sharers (:func:`sharer_sets`) that ``layout`` splits, in their order."""
    members = layout.member_key()
    return [sharers for sharers in sets if is_split(tree, layout, sharers, members)]


def bottom_up(tree: ModuleTree, keys: list[Key]) -> tuple[list[Key], list[Key]]:
    """Topological order, children first: a group comes after every group holding a descendant of its members.

    Returns (order, stuck): ``stuck`` lists groups that would have to come both before and after another one (only
    possible with multi-module groups).
    """
    members = {path: key for key in keys for path in key}
    waits_for: dict[Key, int] = dict.fromkeys(keys, 0)
    unlocks: dict[Key, set[Key]] = {key: set() for key in keys}
    for key in keys:
        for path in key:
            for ancestor in tree.ancestors(path):
                parent_key = members.get(ancestor)
                if parent_key is not None and parent_key != key and parent_key not in unlocks[key]:
                    unlocks[key].add(parent_key)
                    waits_for[parent_key] += 1

    def rank(key: Key) -> tuple[int, Key]:
        return (max(tree.post_order[p] for p in key), key)

    ready = sorted((k for k in keys if waits_for[k] == 0), key=rank)
    order: list[Key] = []
    while ready:
        key = ready.pop(0)
        order.append(key)
        for parent_key in unlocks[key]:
            waits_for[parent_key] -= 1
            if waits_for[parent_key] == 0:
                ready.append(parent_key)
        ready.sort(key=rank)
    placed = set(order)
    return order, [k for k in keys if k not in placed]


# ---------------------------------------------------------------------------------------------------------------
# Settling a layout: one problem at a time, deepest group first


#: The end of a ``split`` problem's description (group_check tells such a group apart by it).
SPLIT_SHARERS = "hold one Parameter, which fully_shard cannot split across groups"


@dataclass(frozen=True)
class Problem:
    """Why a layout is not safe yet, about one group: reads outside its window (``read``), a Parameter whose
    sharers it separates (``split``), or no bottom-up place among the other groups (``order``)."""

    kind: str  # "read" | "split" | "order"
    key: Key
    reads: tuple[RawRead, ...] = ()  # kind "read": every read that falls outside the group's window
    sharers: tuple[str, ...] = ()  # kind "split": the modules holding the one Parameter

    def describe(self) -> str:
        if self.kind == "read":
            return self.reads[0].describe()
        if self.kind == "split":
            return f"{', '.join(self.sharers)} {SPLIT_SHARERS}"
        return "cannot be ordered bottom-up with the other groups"


Fix = Callable[[Layout, Problem], None]


def _depth(tree: ModuleTree, key: Key) -> int:
    return max(tree.depth(p) for p in key)


def next_problem(
    tree: ModuleTree,
    layout: Layout,
    events: Iterable[RawRead],
    sets: Iterable[tuple[str, ...]] = (),
    *,
    ordered: bool = False,
) -> Problem | None:
    """The problem :func:`settle` fixes next: a read outside a group's window (the deepest such group; among equals
    the one the evidence names first), else a group on the way from some sharers of one Parameter up to their
    common ancestor while they are split (the deepest), else, when ``ordered``, a multi-module group that cannot be
    ordered bottom-up (the deepest); None when the layout is safe."""
    bad = violations(tree, layout, events)
    if bad:
        key = max(bad, key=lambda k: _depth(tree, k))
        return Problem("read", key, reads=tuple(bad[key]))
    on_path = [
        (key, sharers)
        for sharers in split_parameters(tree, layout, sets)
        for node in tree.below_common_ancestor(sharers)
        for key in layout.groups
        if node in key
    ]
    if on_path:
        key, sharers = max(on_path, key=lambda item: _depth(tree, item[0]))
        return Problem("split", key, sharers=sharers)
    if ordered:
        _, stuck = bottom_up(tree, list(layout.groups))
        spanning = [key for key in stuck if len(key) > 1]
        if stuck and not spanning:  # pragma: no cover - a tree has no cycles
            raise FsdpCompatError(f"cannot order groups {stuck} bottom-up; please report this model")
        if spanning:
            return Problem("order", max(spanning, key=lambda k: _depth(tree, k)))
    return None


def drop(layout: Layout, problem: Problem) -> None:
    """The default fix: the group goes, its parameters join the enclosing group (always safe for a read: the
    enclosing window is wider)."""
    layout.drop(problem.key, problem.describe())


def settle(
    tree: ModuleTree,
    layout: Layout,
    events: Iterable[RawRead],
    sets: Iterable[tuple[str, ...]] = (),
    *,
    fix: Fix = drop,
    ordered: bool = False,
    regroup: Callable[[Layout], bool] | None = None,
) -> list[Problem]:
    """Fix ``layout``'s problems (:func:`next_problem`) one at a time until it has none; returns them in order.

    Deepest group first, because a fix moves parameters outward (into an enclosing group), never inward: fixing an
    inner group first can only add reads to an outer one, not take any away. Each ``fix`` must make the layout
    smaller (:meth:`Layout.size`: fewer member paths, or fewer groups that reshard after forward), so settling ends
    after at most ``layout.size()`` fixes; a fix that does not shrink it raises instead of looping.

    ``regroup``, when given, is a framework's own grouping rule, called each time the layout is safe; it regroups
    the layout in place (transformers bundles a kept final norm and head into one group) and returns whether that
    changed it, and then settling goes on. It may not change the size, and it runs at most once per size.
    """
    events, sets = list(events), list(sets)
    fixed: list[Problem] = []
    regrouped_at = -1
    while True:
        problem = next_problem(tree, layout, events, sets, ordered=ordered)
        before = layout.size()
        if problem is None:
            if regroup is None or regrouped_at == before or not regroup(layout):
                return fixed
            if layout.size() != before:
                raise FsdpCompatError(f"regrouping changed the layout's size ({before} -> {layout.size()})")
            regrouped_at = before
            continue
        fix(layout, problem)
        if layout.size() >= before:
            raise FsdpCompatError(
                f"fixing group {' + '.join(problem.key)} ({problem.describe()}) did not make the layout smaller; "
                "please report this model"
            )
        fixed.append(problem)


def unsafe_targets(
    model: nn.Module, targets: list[Any], *, tree: ModuleTree | None = None, events: Iterable[RawRead] | None = None
) -> dict[int, str]:
    """id(target) -> why it cannot own a group, for a framework's one-module-per-group selection: the selection
    settled (:func:`settle`, dropping), so that no evidence falls outside a window and no Parameter is split across
    groups (the framework's own rule ignores both)."""
    tree = tree if tree is not None else ModuleTree.build(model)
    paths = {id(m): p for p, m in tree.modules.items()}
    chosen = {paths[id(t)]: id(t) for t in targets if id(t) in paths}
    if not chosen:
        return {}
    evidence = list(events) if events is not None else find_raw_reads(model, tree).events
    layout = Layout.of(((path,), {}) for path in chosen)
    return {chosen[p.key[0]]: p.describe() for p in settle(tree, layout, evidence, sharer_sets(tree))}
