"""Make someone else's FSDP2 grouping safe with the planner's evidence, changing as little as possible.

Frameworks that compute their own plan (transformers' ``fsdp_plan``) keep their plan; fsdp-compat only removes what
would crash. A group whose parameters are read while it is sharded is, in this order of preference:

- kept unsharded after its forward (``reshard_after_forward=False``) when every such read comes after the group's
  own forward (that covers the read until backward),
- left out, so that its parameters join the enclosing group (an ancestor's group, or the root, which is unsharded
  for the whole forward): no read of a parameter can then find it sharded;

and modules that hold one Parameter (tied or shared weights) end up in one group. Safe groups are never touched.
The evidence, the checks and the loop are the planner's own (:func:`fsdp_compat.safety.settle`); only the fix
differs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

from torch import nn

from fsdp_compat.analysis import RawRead, find_raw_reads
from fsdp_compat.safety import Key, Layout, Problem, settle, sharer_sets
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


def _layout(groups: Iterable[ForeignGroup]) -> Layout:
    return Layout.of((g.paths, _overrides(g)) for g in groups)


def _groups(layout: Layout) -> list[ForeignGroup]:
    return [ForeignGroup(key, spec.reshards) for key, spec in layout.groups.items()]


def _culprits(tree: ModuleTree, key: Key, events: Iterable[RawRead]) -> list[str]:
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
    regroup: Callable[[list[ForeignGroup]], list[ForeignGroup]] | None = None,
) -> tuple[list[ForeignGroup], list[Change]]:
    """``groups`` minus what would crash (see the module docstring), in their order, and what was changed.

    ``sharers`` adds sets of module paths whose weights the framework ties after sharding (transformers ties
    ``all_tied_weights_keys`` after ``fully_shard``), so that they count as one Parameter already. ``regroup``, when
    given, is the framework's own grouping rule: once the groups are safe it turns them into the ones the framework
    will really make (transformers bundles the kept final norm and head into one group), and those are settled
    again.
    """
    tree = ModuleTree.build(model)
    events = list(evidence) if evidence is not None else find_raw_reads(model, tree).events
    layout = _layout(g for g in groups if all(p in tree.modules for p in g.paths))
    changes: list[Change] = []
    named = 0  # changes[:named] say where their parameters went

    def name_where(layout: Layout) -> None:
        """Where each dropped group's parameters ended up, in the layout the changes so far settled into."""
        nonlocal named
        members = layout.member_key()
        for i in range(named, len(changes)):
            if changes[i].action == "dropped":
                where = " + ".join(layout.group_of(tree, changes[i].paths[0], members)) or "<root>"
                changes[i] = replace(changes[i], now_in=where)
        named = len(changes)

    def fix(layout: Layout, problem: Problem) -> None:
        changes.append(_one_repair(tree, layout, problem))

    def framework_groups(layout: Layout) -> bool:
        assert regroup is not None
        name_where(layout)
        regrouped = _layout(regroup(_groups(layout))).groups
        changed = regrouped != layout.groups
        layout.groups = regrouped
        return changed

    hook = framework_groups if regroup is not None else None
    settle(tree, layout, events, sharer_sets(tree, sharers), fix=fix, regroup=hook)
    name_where(layout)
    return _groups(layout), changes


def _one_repair(tree: ModuleTree, layout: Layout, problem: Problem) -> Change:
    """The smallest change that fixes ``problem``: keep the group unsharded after its forward when every offending
    read comes after that forward; else drop only the members the reads touch; else drop the group."""
    key = problem.key
    if problem.kind != "read":
        layout.drop(key, problem.describe())
        return Change(key, "dropped", problem.describe())
    why = "; ".join(sorted({e.describe() for e in problem.reads}))
    spec = layout.groups[key]
    if spec.reshards and all(e.kind == "raw-read" and set(key) & set(e.after_forward_of) for e in problem.reads):
        layout.groups[key] = replace(spec, overrides={**spec.overrides, "reshard_after_forward": False})
        return Change(key, "keep-full-weight", why)
    culprits = _culprits(tree, key, problem.reads)
    if len(key) > 1 and 0 < len(culprits) < len(key):
        layout.rekey(key, tuple(p for p in key if p not in culprits))
        return Change(tuple(culprits), "dropped", why)
    layout.drop(key, why)
    return Change(key, "dropped", why)
