"""The one answer to "which FSDP2 groups would be read while sharded, and what follows": a grouping (the planner's
decisions, a framework's own selection, transformers' ``fsdp_plan``) is checked against the static evidence here
and nowhere else.

A group is unsafe when a read of its parameters falls outside its window (the module's own forward, or until
backward for ``reshard_after_forward=False`` and a read after that forward), when unreadable code above it may read
it, or when it holds some but not all of the modules that share one Parameter object. The planner
(:mod:`fsdp_compat.plan`), the repair of someone else's plan (:mod:`fsdp_compat.repair`) and the adapters that keep a
framework's selection minus what is unsafe (:func:`unsafe_targets`) all ask these functions.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from fsdp_compat.analysis import RawRead, find_raw_reads
from fsdp_compat.tree import ModuleTree

__all__ = ["Key", "Layout", "forbidden", "sharer_sets", "split_sharers", "unsafe_targets", "violation", "violations"]

Key = tuple[str, ...]  # the member paths of one group


@dataclass
class Layout:
    """A grouping under construction or review: group key -> (kind, reason, fully_shard overrides), and for the
    candidates that have no group of their own, why."""

    roots: dict[Key, tuple[str, str, dict[str, Any]]] = field(default_factory=dict)
    kept: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, groups: Iterable[tuple[Key, dict[str, Any]]], kind: str = "foreign") -> Layout:
        """A layout of existing groups (their paths and overrides)."""
        return cls(roots={key: (kind, "", dict(overrides)) for key, overrides in groups})

    def member_key(self) -> dict[str, Key]:
        return {path: key for key in self.roots for path in key}

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
        self.roots.pop(key, None)
        for path in key:
            self.kept.setdefault(path, reason)


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
        for key in layout.roots:
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
    no_reshard = key in layout.roots and layout.roots[key][2].get("reshard_after_forward") is False
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


def split_sharers(tree: ModuleTree, layout: Layout, sets: list[tuple[str, ...]]) -> list[tuple[Key, str, str]]:
    """(group, why, node) for each group to drop so that every set of sharers lives in one group."""
    out: list[tuple[Key, str, str]] = []
    members = layout.member_key()
    for sharers in sets:
        if len({layout.group_of(tree, s, members) for s in sharers}) <= 1:
            continue
        why = f"{', '.join(sharers)} hold one Parameter, which fully_shard cannot split across groups"
        for node in tree.below_common_ancestor(sharers):
            out.extend((key, why, node) for key in layout.roots if node in key)
    return out


def unsafe_targets(
    model: nn.Module, targets: list[Any], *, tree: ModuleTree | None = None, events: Iterable[RawRead] | None = None
) -> dict[int, str]:
    """id(target) -> why it cannot own a group, for a framework's one-module-per-group selection: groups are
    dropped, deepest first, until no evidence falls outside a window and no Parameter is split across groups
    (the framework's own rule ignores both)."""
    tree = tree if tree is not None else ModuleTree.build(model)
    paths = {id(m): p for p, m in tree.modules.items()}
    chosen = {paths[id(t)]: id(t) for t in targets if id(t) in paths}
    if not chosen:
        return {}
    evidence = list(events) if events is not None else find_raw_reads(model, tree).events
    layout = Layout.of(((path,), {}) for path in chosen)
    why: dict[int, str] = {}
    sets = sharer_sets(tree)
    for _ in range(2 * len(chosen) + 2):
        bad = violations(tree, layout, evidence)
        if bad:
            key = max(bad, key=lambda k: tree.depth(k[0]))
            why[chosen[key[0]]] = bad[key][0].describe()
        else:
            split = split_sharers(tree, layout, sets)
            if not split:
                break
            key, reason, _ = max(split, key=lambda item: tree.depth(item[0][0]))
            why[chosen[key[0]]] = reason
        layout.drop(key, why[chosen[key[0]]])
    return why
