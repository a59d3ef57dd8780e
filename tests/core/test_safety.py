"""The one way a layout is made safe (``fsdp_compat.safety.settle``): which problem is fixed first, the bound, and
one case each caller (the planner, the adapters' selection check, the repair and the transformers adapter) relies on.

The models are written here so that every expected value follows from their structure: which module reads which
table outside its owner's forward, which modules hold one Parameter. Nothing below is compared with the loop's own
earlier output.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fsdp_compat
from fsdp_compat.analysis import find_raw_reads
from fsdp_compat.errors import FsdpCompatError
from fsdp_compat.repair import ForeignGroup, repair_groups
from fsdp_compat.safety import (
    GroupSpec,
    Layout,
    Problem,
    bottom_up,
    is_split,
    next_problem,
    settle,
    sharer_sets,
    unsafe_targets,
)
from fsdp_compat.testing.zoo import build_model
from fsdp_compat.tree import ModuleTree


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(4, 4)
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x + self.emb.weight.sum())  # reads its table raw: outside the table's own forward


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.inner(x))


class ReadsDeep(nn.Module):
    """The root reads ``outer.inner.emb.weight`` raw: every group from the table up to the root is outside that
    read's window; ``side`` holds nothing that is read anywhere else."""

    def __init__(self) -> None:
        super().__init__()
        self.outer = Outer()
        self.side = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.outer(x) + self.outer.inner.emb.weight.mean()
        return self.side(x)


class Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(4, 4)
        self.lin = nn.Linear(4, 4)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lin(self.emb(idx))


class Twins(nn.Module):
    """``a.emb`` and ``c.emb`` hold one Parameter (tied below); ``d`` shares nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.a = Tower()
        self.c = Tower()
        self.d = nn.Linear(4, 4)
        self.c.emb.weight = self.a.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.d(self.a(idx) + self.c(idx))


class TwinsRead(Twins):
    """Twins whose root also reads ``a.lin.weight`` raw (a Parameter nobody shares)."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.d(self.a(idx) + self.c(idx)) + self.a.lin.weight.sum()


class Head(nn.Module):
    """A final norm and a head; the root reads ``head.weight`` after calling ``head`` (a z-loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.norm(self.body(x)))
        return logits.sum() + self.head.weight.pow(2).sum()


class FusedHead(Head):
    """The head's weight is read raw by the root before anything else runs, and ``head`` is never called (a fused
    loss kernel's shape): no group holding ``head`` is unsharded at that read."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.head.weight.t()
        return (self.norm(self.body(x)) @ weight).sum()


def _setup(model: nn.Module, keys: list[tuple[str, ...]]) -> tuple[ModuleTree, Layout, list, list]:
    tree = ModuleTree.build(model)
    events = find_raw_reads(model, tree).events
    return tree, Layout.of((key, {}) for key in keys), events, sharer_sets(tree)


# ------------------------------------------------------------------------------------------- order of the fixes


def test_groups_outside_a_read_are_dropped_innermost_first_and_nothing_else() -> None:
    tree, layout, events, sets = _setup(
        ReadsDeep(), [("outer",), ("outer.inner",), ("outer.inner.emb",), ("side",)]
    )
    fixed = settle(tree, layout, events, sets)
    assert [(p.kind, p.key) for p in fixed] == [
        ("read", ("outer.inner.emb",)),  # read by its parent and by the root: its own group is sharded at both
        ("read", ("outer.inner",)),  # now holds the table; the root's read is still outside
        ("read", ("outer",)),
    ]
    assert {e.reader for e in fixed[0].reads} == {"outer.inner", ""}
    assert {e.reader for e in fixed[1].reads} == {""}
    assert list(layout.groups) == [("side",)]
    assert layout.kept["outer.inner.emb"].startswith("outer.inner.emb.weight read raw by")


def test_reads_come_before_split_parameters_and_splits_drop_the_deepest_group_on_the_sharers_way_up() -> None:
    """TwinsRead: the root reads a.lin.weight raw, so a.lin and then a (which then holds it) go for the read, although
    c.emb (deeper than a) splits the shared table from the start; then c.emb and c go for the split (a.emb is in
    the root by then); d is never touched."""
    tree, layout, events, sets = _setup(TwinsRead(), [("a",), ("a.lin",), ("c",), ("c.emb",), ("d",)])
    assert sets == [("a.emb", "c.emb")] and is_split(tree, layout, sets[0])
    fixed = settle(tree, layout, events, sets)
    assert [(p.kind, p.key) for p in fixed] == [
        ("read", ("a.lin",)),
        ("read", ("a",)),
        ("split", ("c.emb",)),
        ("split", ("c",)),
    ]
    assert fixed[2].sharers == ("a.emb", "c.emb")
    assert list(layout.groups) == [("d",)]


def test_a_split_parameter_alone_drops_groups_deepest_first_then_in_layout_order() -> None:
    tree, layout, events, sets = _setup(Twins(), [("a",), ("a.emb",), ("c",), ("d",)])
    assert next_problem(tree, layout, events, ()) is None  # no read outside a window: only the split is a problem
    assert is_split(tree, layout, ("a.emb", "c.emb"))
    fixed = settle(tree, layout, events, sets)
    # a.emb (depth 2) first; then a and c (depth 1) in the layout's order, until both halves share the root.
    assert [(p.kind, p.key) for p in fixed] == [("split", ("a.emb",)), ("split", ("a",)), ("split", ("c",))]
    assert not is_split(tree, layout, ("a.emb", "c.emb")) and list(layout.groups) == [("d",)]
    assert fixed[0].describe() == "a.emb, c.emb hold one Parameter, which fully_shard cannot split across groups"


def test_one_group_holding_every_sharer_is_not_a_problem() -> None:
    tree, layout, events, sets = _setup(Twins(), [("a.emb", "c.emb"), ("d",)])
    assert settle(tree, layout, events, sets) == [] and list(layout.groups) == [("a.emb", "c.emb"), ("d",)]


def test_ordered_drops_one_of_two_groups_that_wait_for_each_other() -> None:
    """(a, c.emb) holds an ancestor of a.emb, so it must come after (c, a.emb), which holds an ancestor of c.emb,
    so it must come after the first: no bottom-up order. Dropping one (the first of equal depth) is enough."""
    tree = ModuleTree.build(Twins())
    layout = Layout.of([(("a", "c.emb"), {}), (("c", "a.emb"), {})])
    assert bottom_up(tree, list(layout.groups))[1] == [("a", "c.emb"), ("c", "a.emb")]
    assert settle(tree, layout, (), ()) == []  # not asked to order: not a problem
    fixed = settle(tree, layout, (), (), ordered=True)
    assert [(p.kind, p.key) for p in fixed] == [("order", ("a", "c.emb"))]
    assert list(layout.groups) == [("c", "a.emb")] and bottom_up(tree, list(layout.groups))[1] == []


# ------------------------------------------------------------------------------------------------------ the bound


def test_a_fix_that_does_not_shrink_the_layout_raises_instead_of_looping() -> None:
    tree, layout, events, sets = _setup(ReadsDeep(), [("outer.inner.emb",)])
    calls: list[Problem] = []

    def stubborn(layout: Layout, problem: Problem) -> None:
        calls.append(problem)

    with pytest.raises(FsdpCompatError, match=r"fixing group outer\.inner\.emb .* did not make the layout smaller"):
        settle(tree, layout, events, sets, fix=stubborn)
    assert len(calls) == 1


def test_keeping_a_group_unsharded_counts_as_shrinking_and_settles_a_read_after_its_forward() -> None:
    """Head reads head.weight after head's forward: with reshard_after_forward=False that read is covered."""
    tree, layout, events, sets = _setup(Head(), [("body",), ("norm",), ("head",)])
    assert layout.size() == 3 + 3  # three members, three groups that reshard

    def keep_unsharded(layout: Layout, problem: Problem) -> None:
        layout.groups[problem.key] = GroupSpec("foreign", "", {"reshard_after_forward": False})

    fixed = settle(tree, layout, events, sets, fix=keep_unsharded)
    assert [(p.kind, p.key) for p in fixed] == [("read", ("head",))]
    assert not layout.groups[("head",)].reshards and layout.size() == 5


def test_every_settle_ends_within_the_layouts_size() -> None:
    tree, layout, events, sets = _setup(TwinsRead(), [("a",), ("a.emb",), ("a.lin",), ("c",), ("c.lin",), ("d",)])
    start = layout.size()
    assert len(settle(tree, layout, events, sets)) <= start


def test_regroup_runs_when_the_layout_is_safe_at_most_once_per_size_and_may_not_change_the_size() -> None:
    tree, layout, events, sets = _setup(Head(), [("body",), ("norm",)])
    seen: list[list[tuple[str, ...]]] = []

    def regroup(layout: Layout) -> bool:  # claims a change every time: settle still ends
        seen.append(list(layout.groups))
        return True

    assert settle(tree, layout, events, sets, regroup=regroup) == [] and len(seen) == 1

    def grows(layout: Layout) -> bool:
        layout.groups[("head",)] = GroupSpec("foreign")
        return True

    with pytest.raises(FsdpCompatError, match="regrouping changed the layout's size"):
        settle(tree, layout, events, sets, regroup=grows)


# ------------------------------------------------------------------------------------- what each caller relies on


def test_planner_flat_view_keeps_tied_embedding_and_head_in_the_root() -> None:
    """glm4v-tied: the input table and lm_head hold one weight; one module per group cannot hold both, so the flat
    view (no shared groups) settles them into the root, and the plan says why for each."""
    model = build_model("glm4v-tied")
    assert model.lm_head.weight is model.model.language_model.embed_tokens.weight
    flat = fsdp_compat.select_wrap_targets(model)
    assert model.lm_head not in flat and model.model.language_model.embed_tokens not in flat
    plan = fsdp_compat.plan_wrap(model, policy=fsdp_compat.Auto(allow_no_reshard=False, allow_shared_groups=False))
    reasons = {entry.path: entry.reason for entry in plan.root}
    for path in ("lm_head", "model.language_model.embed_tokens"):
        assert reasons[path].startswith("shares a Parameter with lm_head, model.language_model.embed_tokens"), path
    # with shared groups allowed the two get one group together instead
    together = [set(key) for key in fsdp_compat.plan_wrap(model).group_paths()]
    assert {"model.language_model.embed_tokens", "lm_head"} in together


def test_adapter_selection_check_drops_only_the_table_read_outside_its_forward() -> None:
    """verl's rule on GLM4V gives the vision position table its own group; the vision embeddings read that table raw
    (interpolation before grid_sample), so it is the one target the check removes."""
    model = build_model("glm4v")
    targets = fsdp_compat.plan_wrap(model, policy="legacy").flat_targets()
    table = model.model.visual.embeddings.position_embedding
    why = unsafe_targets(model, targets)
    assert list(why) == [id(table)]
    assert why[id(table)].startswith(
        "model.visual.embeddings.position_embedding.weight read raw by model.visual.embeddings"
    )


def test_repair_drops_only_the_read_member_of_a_two_module_group() -> None:
    """FusedHead: (norm, head) in one group, head's weight read raw by the root before norm's forward (so keeping the
    group unsharded after a forward does not cover it): only head leaves the group; norm's parameters are read
    inside norm's own forward."""
    model = FusedHead()
    groups = [ForeignGroup(("body",)), ForeignGroup(("norm", "head"))]
    kept, changes = repair_groups(model, groups)
    assert kept == [ForeignGroup(("body",)), ForeignGroup(("norm",))]
    assert [(c.paths, c.action, c.now_in) for c in changes] == [(("head",), "dropped", "<root>")]


def _norm_and_head(keep: list[tuple[str, nn.Module]], model: nn.Module) -> bool:
    """transformers' is_norm_and_head_pair, in short: exactly two kept entries, a final norm and the head."""
    names = [name for name, _ in keep]
    return len(keep) == 2 and "norm" in names and "head" in names


def test_transformers_plan_fixer_judges_the_regrouped_plan_again() -> None:
    """Head: the z-loss read after head's forward turns head into keep_full_weight; transformers then bundles the
    two kept entries (norm, head) into one group, and that group is checked again (the read is still after head's
    forward, inside the no-reshard window): one change."""
    from fsdp_compat.adapters import transformers as adapter

    model = Head()
    plan = {"body": adapter.FREE, "norm": adapter.KEEP, "head": adapter.FREE}
    assert [g.paths for g in adapter.plan_groups(model, plan, _norm_and_head)] == [("body",), ("head",), ("norm",)]
    fixed, changes = adapter.fix_fsdp_plan(model, plan, _norm_and_head)
    assert fixed == {"body": adapter.FREE, "norm": adapter.KEEP, "head": adapter.KEEP}
    assert [g.paths for g in adapter.plan_groups(model, fixed, _norm_and_head)] == [("body",), ("norm", "head")]
    assert [(c.paths, c.action) for c in changes] == [(("head",), "keep-full-weight")]
    # the fused read is before any forward of head: head leaves the bundled pair, norm stays kept on its own
    fused = FusedHead()
    fixed, changes = adapter.fix_fsdp_plan(fused, {"body": adapter.FREE, "norm": adapter.KEEP, "head": adapter.KEEP},
                                           _norm_and_head)
    assert fixed == {"body": adapter.FREE, "norm": adapter.KEEP}
    assert [(c.paths, c.action, c.now_in) for c in changes] == [(("head",), "dropped", "<root>")]
