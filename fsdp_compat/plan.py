"""The wrap planner: which modules get their own ``fully_shard`` group, in which order, and why.

The invariant it guarantees (policy ``auto``): a module owns a group only if every read of its parameters that the
static analysis sees happens while that group is unsharded. The analysis (:mod:`fsdp_compat.analysis`) counts
whatever it cannot follow as a read, and the run-time guard (:mod:`fsdp_compat.runtime.guard`) covers reads no static
analysis can see. Every decision carries a reason;
the finished plan is checked against the evidence once more before it is returned, so a planning bug degrades to
"kept in the root", never to a crash. A plan is a plain value: printable, comparable, testable without a process
group. Only :mod:`fsdp_compat.apply` touches torch.distributed.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from fsdp_compat.analysis import RawRead, find_raw_reads
from fsdp_compat.errors import FsdpCompatError
from fsdp_compat.log import logger
from fsdp_compat.policies import Auto, InputOnly, LayersOnly, Legacy, Policy, resolve_policy
from fsdp_compat.safety import (
    GroupSpec,
    Key,
    Layout,
    Problem,
    bottom_up,
    is_split,
    settle,
    sharer_sets,
    split_parameters,
    violation,
)
from fsdp_compat.safety import forbidden as forbidden_roots
from fsdp_compat.tree import ModuleTree, repeated_block_classes
from fsdp_compat.units import fmt_bytes as _fmt_bytes

LayerClasses = Iterable[str | type] | str | type | None


@dataclass(frozen=True)
class Group:
    """One ``fully_shard`` call: its modules, why they are grouped, and the parameters it manages."""

    modules: tuple[nn.Module, ...]
    paths: tuple[str, ...]
    reason: str
    kind: str
    overrides: Mapping[str, Any] = field(default_factory=dict)
    num_params: int = 0
    num_bytes: int = 0

    @property
    def name(self) -> str:
        return " + ".join(p or "<root>" for p in self.paths)


@dataclass(frozen=True)
class RootEntry:
    """A candidate that did not get its own group: where its parameters live instead, and why."""

    path: str
    num_params: int
    reason: str
    enclosing: str = ""  # the group that holds it ("" = the root group)


@dataclass(frozen=True)
class WrapPlan:
    """The planner's answer. ``groups`` are in bottom-up order; the root group is applied last."""

    model_class: str
    policy: str
    layer_classes: tuple[str, ...]
    groups: tuple[Group, ...]
    root: tuple[RootEntry, ...]
    root_params: int
    root_bytes: int
    total_params: int
    total_bytes: int
    evidence: tuple[RawRead, ...] = ()
    warnings: tuple[str, ...] = ()

    def flat_targets(self) -> list[nn.Module]:
        """What a framework selector may wrap one by one: single-module groups without their own kwargs."""
        return [g.modules[0] for g in self.groups if len(g.modules) == 1 and not g.overrides]

    def group_paths(self) -> list[tuple[str, ...]]:
        return [g.paths for g in self.groups]

    def to_transformers_fsdp_plan(self, model: nn.Module | None = None, *, strict: bool = False) -> dict[str, str]:
        """This plan as transformers' ``DistributedConfig(fsdp_plan=...)``; limits in :mod:`fsdp_compat.export`."""
        from fsdp_compat.export import to_transformers_fsdp_plan

        return to_transformers_fsdp_plan(self, model, strict=strict)

    def per_rank_bytes(self, world_size: int) -> dict[str, int]:
        """Analytic per-rank parameter bytes: at rest (all sharded) and at the forward peak.

        The peak model follows what FSDP2 does and was checked against FSDP2's own unshard/reshard events on every
        zoo model and policy (``python -m benchmarks policies``): on top of the resident shard, a rank holds the
        root group (unsharded for the whole forward), groups with ``reshard_after_forward=False``, multi-module
        groups (unsharded from their first member's forward to their last's), and the transient of the largest
        single-module group twice (its parameters plus the flat all-gather buffer that lives until the next
        group's copy-out), with the root's buffer still alive while the first group gathers.
        """
        if world_size < 1:
            raise FsdpCompatError(f"world_size must be >= 1, got {world_size}")
        resident = self.total_bytes // world_size
        if world_size == 1:
            return {"resident": resident, "peak_forward": resident}
        no_reshard = sum(g.num_bytes for g in self.groups if g.overrides.get("reshard_after_forward") is False)
        rest = [g for g in self.groups if g.overrides.get("reshard_after_forward") is not False]
        spanning = sum(g.num_bytes for g in rest if len(g.modules) > 1)
        largest = max((g.num_bytes for g in rest if len(g.modules) == 1), default=0)
        unsharded = self.root_bytes + no_reshard + spanning + max(self.root_bytes, largest) + largest
        return {"resident": resident, "peak_forward": resident + unsharded}

    def __str__(self) -> str:
        return self.format()

    def format(self, *, all_rows: bool = False) -> str:
        """The plan as a table; repeated layers fold into one row (``layers.{0..39}  x40``) unless ``all_rows``."""
        lines = [
            f"WrapPlan for {self.model_class} (policy {self.policy}; layer classes: "
            f"{', '.join(self.layer_classes) or '-'})",
            f"  {'#':>5}  {'group (bottom-up)':<54} {'params':>13}  {'kind':<16} reason",
        ]
        index = 1
        for name, count, group in _rows(self.groups, fold=not all_rows):
            extra = "".join(f" [{k}={v}]" for k, v in group.overrides.items())
            number = f"{index}" if count == 1 else f"{index}-{index + count - 1}"
            times = f"  x{count}" if count > 1 else ""
            lines.append(
                f"  {number:>5}  {_clip(name + times, 54):<54} {group.num_params:>13,}  {group.kind:<16} "
                f"{group.reason}{extra}"
            )
            index += count
        lines.append(
            f"  {'':>5}  {'<root> (fully_shard(model), applied last)':<54} {self.root_params:>13,}  "
            f"{'root':<16} unsharded for the whole forward"
        )
        lines.append(f"  groups: {len(self.groups)} + root; parameters: {self.total_params:,}")
        if self.root:
            lines.append("  not their own group:")
            for entry in self.root:
                where = entry.enclosing or "<root>"
                lines.append(f"    - {entry.path} ({entry.num_params:,} params, now in {where}): {entry.reason}")
        for warning in self.warnings:
            lines.append(f"  warning: {warning}")
        return "\n".join(lines)


_INDEXED = re.compile(r"^(?P<prefix>.*\.)(?P<index>\d+)$")  # a path ending in a ModuleList index


def _rows(groups: tuple[Group, ...], *, fold: bool) -> list[tuple[str, int, Group]]:
    """(name, how many groups, the first group): consecutive single-module groups that differ only in their
    ModuleList index (same kind, reason, overrides and size) become one row ``prefix.{first..last}``."""
    rows: list[tuple[str, int, Group]] = []
    run: list[tuple[int, Group]] = []
    prefix = None

    def flush() -> None:
        if not run:
            return
        if len(run) == 1:
            rows.append((run[0][1].name, 1, run[0][1]))
        else:
            rows.append((f"{prefix}{{{run[0][0]}..{run[-1][0]}}}", len(run), run[0][1]))
        run.clear()

    for group in groups:
        match = _INDEXED.match(group.name) if fold and len(group.modules) == 1 else None
        if match is None:
            flush()
            rows.append((group.name, 1, group))
            continue
        i, first = int(match["index"]), run[0][1] if run else None
        same = first is not None and match["prefix"] == prefix and run[-1][0] + 1 == i and (
            group.kind, group.reason, group.overrides, group.num_params
        ) == (first.kind, first.reason, first.overrides, first.num_params)  # fmt: skip
        if not same:
            flush()
            prefix = match["prefix"]
        run.append((i, group))
    flush()
    return rows


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else "…" + text[-(width - 1) :]


# ---------------------------------------------------------------------------------------------------------------
# Inputs


def resolve_layer_classes(model: nn.Module, layer_classes: LayerClasses) -> tuple[str, ...]:
    """Names of the layer classes; ``None`` means ``model._no_split_modules`` (a list or, in transformers 5, a set).

    Names that match no module are normal (configs list classes a given model may not build); none matching at all
    is an error that lists the model's classes.
    """
    if layer_classes is None:
        layer_classes = getattr(model, "_no_split_modules", None) or ()
    if isinstance(layer_classes, (str, type)):
        layer_classes = [layer_classes]
    names = tuple(sorted({c if isinstance(c, str) else c.__name__ for c in layer_classes if c is not None}))
    present = sorted({type(m).__name__ for m in model.modules()})
    if not names:
        raise FsdpCompatError(
            f"{type(model).__name__} declares no layer classes (no _no_split_modules): pass layer_classes=[...] "
            f"naming its repeated block class. Its module classes are: {', '.join(present)}"
        )
    if not set(names) & set(present):
        raise FsdpCompatError(
            f"none of the layer classes {list(names)} matches a module of {type(model).__name__}; fix "
            f"layer_classes (or wrap_policy.transformer_layer_cls_to_wrap) to name its repeated block class. "
            f"Its module classes are: {', '.join(present)}"
        )
    return names


def _check_model(model: nn.Module) -> None:
    if not isinstance(model, nn.Module):
        raise FsdpCompatError(f"expected a torch.nn.Module, got {type(model).__name__}")
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without distributed
        return
    wrapped = [path or "<root>" for path, m in model.named_modules() if isinstance(m, FSDPModule)]
    if wrapped:
        raise FsdpCompatError(
            f"{type(model).__name__} is already wrapped by FSDP2 (fully_shard was applied to {wrapped[:3]}); plan "
            "and apply on the unwrapped model, once"
        )


def _tied(model: nn.Module) -> bool:
    return bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))


def _getter(model: nn.Module, name: str) -> nn.Module | None:
    try:
        module = getattr(model, name)()
    except Exception:
        return None
    return module if isinstance(module, nn.Module) else None


# ---------------------------------------------------------------------------------------------------------------
# Candidate selection


def _layer_candidates(tree: ModuleTree, names: tuple[str, ...], found: bool = False) -> dict[str, tuple[str, str]]:
    what = "repeated block class {} (the model declares no _no_split_modules)" if found else "layer class {}"
    return {
        path: ("layer", what.format(type(m).__name__))
        for path, m in tree.modules.items()
        if path and type(m).__name__ in names
    }


def _found_layer_classes(model: nn.Module, layer_classes: LayerClasses, policy: Policy) -> tuple[str, ...]:
    """Under ``auto``, for a model that declares no layer classes when none are given: its repeated block classes
    (explicit ``layer_classes`` and ``_no_split_modules`` always win; other policies keep raising)."""
    if layer_classes is not None or getattr(model, "_no_split_modules", None) or not isinstance(policy, Auto):
        return ()
    return tuple(repeated_block_classes(model))


def _select(
    tree: ModuleTree, names: tuple[str, ...], policy: Policy, warnings: list[str], found: bool = False
) -> dict[str, tuple[str, str]]:
    """Candidates (path -> (kind, reason)) under ``policy``; notes what it could not do in ``warnings``."""
    model = tree.model
    chosen = _layer_candidates(tree, names, found)
    untied = not _tied(model)
    if isinstance(policy, Legacy):
        if untied:
            for path, m in tree.modules.items():
                leaf = path.rsplit(".", 1)[-1]
                if path in chosen or not path:
                    continue
                if isinstance(m, nn.Embedding):
                    chosen[path] = ("embedding", "nn.Embedding, tie_word_embeddings false (upstream rule)")
                elif policy.output_embeddings and leaf in ("embed_tokens", "lm_head") and hasattr(m, "weight"):
                    chosen[path] = ("by-name", f"leaf named {leaf} (upstream rule)")
    elif isinstance(policy, InputOnly):
        embedding = _getter(model, "get_input_embeddings")
        if untied and embedding is not None and id(embedding) in tree.path_of:
            chosen.setdefault(tree.path_of[id(embedding)], ("embedding", "input embedding, untied"))
        elif untied and embedding is None:
            warnings.append(
                f"{type(model).__name__}.get_input_embeddings() is missing or failed: input-only shards the layers "
                "only (policy auto finds the embeddings by type)"
            )
    elif isinstance(policy, Auto):
        for path, m in tree.modules.items():
            if path and path not in chosen and isinstance(m, nn.Embedding):
                chosen[path] = ("embedding", "nn.Embedding")
        output = _getter(model, "get_output_embeddings") if policy.wrap_output_embeddings else None
        if output is not None and id(output) in tree.path_of:
            path = tree.path_of[id(output)]
            if path and path not in chosen and any(p is not None for p in output._parameters.values()):
                chosen[path] = ("output-embedding", "output embedding")
    elif not isinstance(policy, LayersOnly):
        raise FsdpCompatError(f"policy {policy!r} is not supported by this version of fsdp-compat")
    return chosen


# ---------------------------------------------------------------------------------------------------------------
# The auto policy's decisions


def _lift_target(tree: ModuleTree, events: list[RawRead]) -> str:
    """The highest module whose window covers every read in ``events``."""
    tops = [e.reader if e.kind == "opaque" else tree.lca(e.reader, e.owner) for e in events]
    return min(tops, key=tree.depth)


def _subtree_bytes(tree: ModuleTree, path: str) -> int:
    return sum(p.numel() * p.element_size() for _, p in tree.subtree_params(path))


def _decide_auto(
    tree: ModuleTree, candidates: dict[str, tuple[str, str]], events: list[RawRead], policy: Auto
) -> Layout:
    forbidden = forbidden_roots(tree, events)
    decisions = Layout()
    for path in sorted(candidates, key=lambda p: -tree.depth(p)):
        kind, reason = candidates[path]
        blockers = forbidden.get(path)
        if not blockers:
            decisions.groups.setdefault((path,), GroupSpec(kind, reason))
            continue
        evidence = blockers[0].describe()
        if policy.allow_no_reshard and all(
            e.kind == "raw-read" and path in e.after_forward_of for e in blockers
        ):
            decisions.groups[(path,)] = GroupSpec(
                "no-reshard",
                f"{reason}; read again after its own forward ({evidence}): kept unsharded until backward",
                {"reshard_after_forward": False},
            )
            continue
        target = _lift_target(tree, blockers)
        size = _subtree_bytes(tree, path)
        if target and target not in forbidden and size >= policy.lift_min_bytes:
            previous = decisions.groups.get((target,))
            note = f"lifted {path} ({_fmt_bytes(size)}): {evidence}"
            if previous is None:
                decisions.groups[(target,)] = GroupSpec("lifted", f"reader of {note}")
            else:
                decisions.groups[(target,)] = dataclasses.replace(previous, reason=f"{previous.reason}; {note}")
            decisions.kept[path] = f"{evidence}; lifted into the reader's group"
        elif target and target not in forbidden:
            decisions.kept[path] = (
                f"{evidence}; a group of its own would be sharded there. Lifting it to {target} would add an "
                f"all-gather for {_fmt_bytes(size)} (< lift_min_bytes {_fmt_bytes(policy.lift_min_bytes)}), "
                "so it stays in the enclosing group"
            )
        else:
            decisions.kept[path] = (
                f"{evidence}; a group of its own would be sharded there, and no module below the root covers "
                "every read, so it stays in the enclosing group"
            )
    if policy.split_root_min_bytes is not None:
        _split_root(tree, decisions, forbidden, policy.split_root_min_bytes)
    sets = sharer_sets(tree)
    if policy.allow_shared_groups:
        _join_sharers(tree, decisions, forbidden, sets)
    # The finished plan is checked against every piece of evidence once more, and against the sharers and the
    # bottom-up order: whatever is still unsafe is dropped, so a planning bug degrades to "kept in the root".
    settle(tree, decisions, events, sets, fix=_drop, ordered=True)
    return decisions


def _drop(decisions: Layout, problem: Problem) -> None:
    """The planner's fix: no group; the reason the plan prints for each member says what the group would break."""
    if problem.kind == "read":
        why = f"{problem.reads[0].describe()}; its group would be sharded there"
    elif problem.kind == "split":
        with_ = ", ".join(x for x in problem.sharers if x)
        why = f"shares a Parameter with {with_}; kept with them in an enclosing group"
    else:
        why = "cannot be ordered bottom-up with the other groups; kept in the enclosing group"
    decisions.drop(problem.key, why)


def _split_root(tree: ModuleTree, decisions: Layout, forbidden: dict[str, list[RawRead]], min_bytes: int) -> None:
    """Give a group to each top-most module still in the root group that weighs at least ``min_bytes``, has a forward
    of its own, holds no group below it and whose parameters no read outside its own forward touches.

    The root group is unsharded for the whole forward; such a module's group only during its own forward (the
    peak model counts it as one more single-module group). The usual checks follow: a group the evidence forbids is
    never made, and the finished plan is settled once more (:func:`~fsdp_compat.safety.settle`).
    """
    members = decisions.member_key()
    covered = {a for path in members for a in (path, *tree.ancestors(path))}  # groups at or below these
    owners_of = {pid: {path for path, _ in owners} for pid, owners in tree.param_owners.items()}

    def own_params_only(path: str) -> bool:
        return all(
            all(tree.is_ancestor_or_self(path, o) for o in owners_of[id(param)])
            for _, param in tree.subtree_params(path)
        )

    def visit(path: str) -> None:
        module = tree.modules[path]
        if path in members:
            return  # its subtree is that group's
        if path not in covered:
            size = _subtree_bytes(tree, path)
            if size < max(min_bytes, 1):
                return  # nothing below it weighs more (and a module without parameters needs no group)
            has_forward = type(module).forward is not nn.Module.forward
            if has_forward and path not in forbidden and path not in decisions.kept and own_params_only(path):
                decisions.groups[(path,)] = GroupSpec(
                    "split-from-root",
                    f"{type(module).__name__} ({_fmt_bytes(size)}) would stay in the root group, unsharded for the "
                    "whole forward; only its own forward reads its parameters",
                )
                return
        for child in module._modules.values():
            child_path = tree.path_of.get(id(child)) if child is not None else None
            if child_path is not None and tree.parent(child_path) == path:
                visit(child_path)

    for child in tree.model._modules.values():
        child_path = tree.path_of.get(id(child)) if child is not None else None
        if child_path is not None and tree.parent(child_path) == "":
            visit(child_path)


def _join_sharers(
    tree: ModuleTree, decisions: Layout, forbidden: dict[str, list[RawRead]], sets: list[tuple[str, ...]]
) -> None:
    """Invariant 2, by grouping: modules holding the same Parameter object that are split across groups get one
    group together (``fully_shard([a, b])``) when one of them has a group of its own, none is forbidden and none
    sits inside another. Sharers that cannot be joined are left to :func:`~fsdp_compat.safety.settle`, which drops
    the groups that separate them (so they share an enclosing group)."""
    for sharers in sets:
        if not is_split(tree, decisions, sharers):
            continue
        nested = any(a != b and tree.is_ancestor_or_self(a, b) and a for a in sharers for b in sharers)
        own = [(s,) for s in sharers if (s,) in decisions.groups]
        if nested or any(s in forbidden for s in sharers) or not own:
            continue
        touched = {decisions.group_of(tree, s) for s in sharers} - {("",)}
        reasons = [decisions.groups[key].reason for key in own]
        for s in sharers:
            decisions.groups.pop((s,), None)
            decisions.kept.pop(s, None)
        for key in touched:
            if len(key) > 1 and set(key) & set(sharers):
                decisions.groups.pop(key, None)
        why = f"hold one Parameter object ({reasons[0]}): one group for all"
        decisions.groups[tuple(sharers)] = GroupSpec("shared", why)


# ---------------------------------------------------------------------------------------------------------------
# Ordering and accounting


def _account(
    tree: ModuleTree, decisions: Layout
) -> tuple[dict[Key, tuple[int, int]], tuple[int, int], tuple[int, int], dict[str, str]]:
    members = decisions.member_key()
    sizes: dict[Key, list[int]] = {key: [0, 0] for key in decisions.groups}
    root = [0, 0]
    total = [0, 0]
    for pid, owners in tree.param_owners.items():
        param = tree.params[pid]
        numel, nbytes = param.numel(), param.numel() * param.element_size()
        total[0] += numel
        total[1] += nbytes
        key = decisions.group_of(tree, owners[0][0], members)
        bucket = root if key == ("",) else sizes[key]
        bucket[0] += numel
        bucket[1] += nbytes
    enclosing = {
        path: " + ".join(k for k in decisions.group_of(tree, path, members) if k) for path in decisions.kept
    }
    return (
        {k: (v[0], v[1]) for k, v in sizes.items()},
        (root[0], root[1]),
        (total[0], total[1]),
        enclosing,
    )


# ---------------------------------------------------------------------------------------------------------------
# Public API


def plan_wrap(model: nn.Module, layer_classes: LayerClasses = None, *, policy: str | Policy = "auto") -> WrapPlan:
    """Decide which modules of ``model`` get their own FSDP2 group, bottom-up, each with a reason.

    ``layer_classes`` None means ``model._no_split_modules``; when that is empty too, ``auto`` plans with the
    model's repeated block classes (the groups' reasons say so) and the other policies raise.
    """
    _check_model(model)
    chosen_policy = resolve_policy(policy)
    found = _found_layer_classes(model, layer_classes, chosen_policy)
    names = resolve_layer_classes(model, found or layer_classes)
    tree = ModuleTree.build(model)
    evidence: tuple[RawRead, ...] = ()
    warnings: list[str] = []
    candidates = _select(tree, names, chosen_policy, warnings, bool(found))
    if isinstance(chosen_policy, Auto):
        analysis = find_raw_reads(model, tree)
        evidence = tuple(e for e in analysis.events if e.kind != "call" or _skips_levels(tree, e))
        for path, why in sorted(analysis.opaque.items()):
            if not any(c != path and tree.is_ancestor_or_self(path, c) for c in candidates):
                continue  # nothing below it could have had a group: the unreadable code changes nothing
            warnings.append(
                f"cannot read the source of {path or '<root>'} ({why}); assumed it may read any parameter "
                "below it, so nothing below it gets a group of its own there"
            )
        decisions = _decide_auto(tree, candidates, analysis.events, chosen_policy)
    else:
        decisions = Layout(groups={(p,): GroupSpec(kind, reason) for p, (kind, reason) in candidates.items()})
        settle(tree, decisions, (), fix=_drop, ordered=True)  # one module per group: always ordered
    order, _ = bottom_up(tree, list(decisions.groups))  # settled: nothing is stuck
    sizes, root_size, total_size, enclosing = _account(tree, decisions)
    groups = tuple(
        Group(
            modules=tuple(tree.modules[p] for p in key),
            paths=key,
            reason=decisions.groups[key].reason,
            kind=decisions.groups[key].kind,
            overrides=dict(decisions.groups[key].overrides),
            num_params=sizes[key][0],
            num_bytes=sizes[key][1],
        )
        for key in order
    )
    in_groups = {p for key in decisions.groups for p in key}
    root_entries = tuple(
        RootEntry(
            path=path,
            num_params=sum(p.numel() for _, p in tree.subtree_params(path)),
            reason=why,
            enclosing=enclosing.get(path, ""),
        )
        for path, why in sorted(decisions.kept.items())
        if path not in in_groups
    )
    cliff = _opaque_cliff(tree, root_entries, type(model).__name__)
    if cliff:
        warnings.append(cliff)
        logger.warning("%s", cliff)
    return WrapPlan(
        model_class=type(model).__name__,
        policy=chosen_policy.name,
        layer_classes=names,
        groups=groups,
        root=root_entries,
        root_params=root_size[0],
        root_bytes=root_size[1],
        total_params=total_size[0],
        total_bytes=total_size[1],
        evidence=evidence,
        warnings=tuple(warnings),
    )


_OPAQUE_SITE = re.compile(r"\(([^;()]+); (?:handed to code|held by an object) the analysis does not")


def _opaque_cliff(tree: ModuleTree, entries: Iterable[RootEntry], model_class: str) -> str:
    """One line naming the code the analysis could not follow (a hook handing the module to an opaque call, say) and
    the bytes it keeps unsharded in the root, when such code kept candidates out of their groups; else ""."""
    by_site: dict[str, list[RootEntry]] = {}
    for entry in entries:
        found = _OPAQUE_SITE.search(entry.reason)
        if found and not entry.enclosing:
            by_site.setdefault(found.group(1), []).append(entry)
    parts = []
    for site, kept in by_site.items():
        nbytes = sum(p.numel() * p.element_size() for e in kept for _, p in tree.subtree_params(e.path))
        parts.append(f"{site} ({len(kept)} candidates, {_fmt_bytes(nbytes)}: {', '.join(e.path for e in kept[:4])}"
                     f"{', ...' if len(kept) > 4 else ''})")
    if not parts:
        return ""
    return (
        f"{model_class}: code the analysis cannot follow keeps candidates in the root group, unsharded on every rank "
        f"for the whole forward: {'; '.join(parts)}. If that code reads no parameter, make it not take the module "
        "(or its inputs) into code fsdp-compat cannot read; the plan cannot shard what it cannot show safe."
    )


def _skips_levels(tree: ModuleTree, event: RawRead) -> bool:
    """A call that jumps over a module with code of its own (containers without a forward don't count)."""
    between = tree.path_between(event.owner, tree.lca(event.reader, event.owner), include_low=False)
    return any(not isinstance(tree.modules[p], (nn.ModuleList, nn.ModuleDict)) for p in between)


def select_wrap_targets(
    model: nn.Module, layer_classes: LayerClasses = None, *, policy: str | Policy = "auto"
) -> list[nn.Module]:
    """The flat, bottom-up list a framework selector returns: modules to ``fully_shard`` one at a time.

    Groups that need several modules at once or their own kwargs are left out (their parameters then stay in an
    enclosing group, which is always safe); :func:`fsdp_compat.apply_fsdp2` applies them fully.
    """
    chosen = resolve_policy(policy)
    if isinstance(chosen, Auto):
        # Plan for what a one-module-at-a-time loop can do, so that sharers stay together in this view too.
        chosen = dataclasses.replace(chosen, allow_no_reshard=False, allow_shared_groups=False)
    return plan_wrap(model, layer_classes, policy=chosen).flat_targets()


def unsafe_reads(model: nn.Module, plan: WrapPlan, evidence: Iterable[RawRead] | None = None) -> list[str]:
    """What would crash under ``plan``: each read that finds its group sharded, as a sentence.

    Checks any plan (e.g. ``legacy``) against the static evidence, so the CLI can predict a crash without running.
    """
    tree = ModuleTree.build(model)
    events = list(evidence) if evidence is not None else find_raw_reads(model, tree).events
    decisions = Layout(groups={g.paths: GroupSpec(g.kind, g.reason, dict(g.overrides)) for g in plan.groups})
    members = decisions.member_key()
    problems = []
    for event in events:  # in evidence order: the CLI names the first one
        key = violation(tree, decisions, event, members)
        if key is not None:
            problems.append(f"{event.describe()}, but group {' + '.join(key)} is sharded there")
    split = set(split_parameters(tree, decisions, sharer_sets(tree)))
    for owners in tree.param_owners.values():  # one sentence per Parameter object, in registration order
        if tuple(sorted({path for path, _ in owners})) in split:
            names = ", ".join(f"{p}.{a}" if p else a for p, a in owners)
            problems.append(f"one Parameter ({names}) is split across groups: fully_shard raises ValueError")
    return problems
