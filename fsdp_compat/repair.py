"""Make someone else's FSDP2 grouping safe with the planner's evidence, changing as little as possible.

Frameworks that compute their own plan (transformers' ``fsdp_plan``) keep their plan; fsdp-compat only removes what
would crash. A group whose parameters are read while it is sharded is, in this order of preference:

- kept unsharded after its forward (``reshard_after_forward=False``) when every such read comes after the group's
  own forward (that covers the read until backward),
- left out, so that its parameters join the enclosing group (an ancestor's group, or the root, which is unsharded
  for the whole forward): no read of a parameter can then find it sharded;

and modules that hold one Parameter (tied or shared weights) end up in one group. Safe groups are never touched.
The evidence and the violation test are the planner's own (:mod:`fsdp_compat.safety`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from torch import nn

from fsdp_compat.analysis import RawRead, find_raw_reads
from fsdp_compat.safety import Key, Layout, sharer_sets, split_sharers, violations
from fsdp_compat.tree import ModuleTree

__all__ = ["Change", "ForeignGroup", "repair_groups"]


@dataclass(frozen=True)
class ForeignGroup:
    """One ``fully_shard`` call of a framework's plan: its module paths and whether it reshards after forward."""

    paths: tuple[str, ...]
    reshard_after_forward: bool = True


@dataclass(frozen=True)
class Change:
    """What :func:`repair_groups` did to one group, and the evidence that made it necessary."""

    paths: tuple[str, ...]
    action: str  # "keep-full-weight" | "dropped"
    why: str
    now_in: str = ""  # for "dropped": the group that holds its parameters now ("<root>" for the root)

    def describe(self) -> str:
        name = " + ".join(self.paths)
        if self.action == "keep-full-weight":
            return f"{name}: kept unsharded after its forward (keep_full_weight), because {self.why}"
        return f"{name}: no group of its own; its parameters now live in {self.now_in}, because {self.why}"


def _overrides(group: ForeignGroup) -> dict[str, bool]:
    return {} if group.reshard_after_forward else {"reshard_after_forward": False}


def _culprits(tree: ModuleTree, key: Key, events: list[RawRead]) -> list[str]:
    """The members of a multi-module group whose own parameters the offending reads touch."""
    hit = []
    for member in key:
        for event in events:
            target = event.reader if event.kind == "opaque" else event.owner
            if tree.is_ancestor_or_self(member, target) or (
                event.kind == "opaque" and tree.is_ancestor_or_self(event.reader, member)
            ):
                hit.append(member)
                break
    return hit


def repair_groups(
    model: nn.Module,
    groups: Sequence[ForeignGroup],
    *,
    sharers: Iterable[Iterable[str]] = (),
    evidence: Iterable[RawRead] | None = None,
) -> tuple[list[ForeignGroup], list[Change]]:
    """``groups`` minus what would crash (see the module docstring), in their order, and what was changed.

    ``sharers`` adds sets of module paths whose weights the framework ties after sharding (transformers ties
    ``all_tied_weights_keys`` after ``fully_shard``), so that they count as one Parameter already.
    """
    tree = ModuleTree.build(model)
    events = list(evidence) if evidence is not None else find_raw_reads(model, tree).events
    shared = sharer_sets(tree, sharers)
    current = [g for g in groups if all(p in tree.modules for p in g.paths)]
    changes: list[Change] = []
    for _ in range(2 * len(current) + 2):
        layout = Layout.of((g.paths, _overrides(g)) for g in current)
        step = _one_repair(tree, current, violations(tree, layout, events), layout, shared)
        if step is None:
            break
        current, change = step
        changes.append(change)
    # Name where each dropped group's parameters ended up, against the final plan.
    final = Layout.of((g.paths, _overrides(g)) for g in current)
    members = final.member_key()
    changes = [
        replace(c, now_in=" + ".join(final.group_of(tree, c.paths[0], members)) or "<root>")
        if c.action == "dropped"
        else c
        for c in changes
    ]
    return current, changes


def _one_repair(
    tree: ModuleTree,
    current: list[ForeignGroup],
    bad: dict[Key, list[RawRead]],
    layout: Layout,
    shared: list[tuple[str, ...]],
) -> tuple[list[ForeignGroup], Change] | None:
    """The next single change (deepest offending group first), or None when the plan is safe."""
    by_key = {g.paths: g for g in current}
    if bad:
        key = max(bad, key=lambda k: max(tree.depth(p) for p in k))
        events = bad[key]
        group = by_key[key]
        why = "; ".join(sorted({e.describe() for e in events}))
        if group.reshard_after_forward and all(
            e.kind == "raw-read" and set(key) & set(e.after_forward_of) for e in events
        ):
            new = replace(group, reshard_after_forward=False)
            return [new if g is group else g for g in current], Change(key, "keep-full-weight", why)
        culprits = _culprits(tree, key, events)
        if len(key) > 1 and 0 < len(culprits) < len(key):
            rest = replace(group, paths=tuple(p for p in key if p not in culprits))
            return [rest if g is group else g for g in current], Change(tuple(culprits), "dropped", why)
        return [g for g in current if g is not group], Change(key, "dropped", why)
    split = split_sharers(tree, layout, shared)
    if split:
        key, why, _node = max(split, key=lambda item: max(tree.depth(p) for p in item[0]))
        return [g for g in current if g.paths != key], Change(key, "dropped", why)
    return None
