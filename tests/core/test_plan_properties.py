"""Property tests: on random module trees with random raw reads and shared Parameters, every ``auto`` plan keeps
its invariants (bottom-up, no module twice, sharers together) and covers every read the dynamic audit observes.

Each example generates real Python source for its module classes (so the static analysis reads real code), imports
it, builds the tree and runs one real forward under the audit. The raw reads come in many syntactic forms
(``FORMS``: aliases, tuple unpacking, getattr, F.embedding, helpers taking the module or ``self``, properties,
``named_parameters()`` loops, comprehensions, lambdas, branches, ``no_grad`` + ``.data``, helper methods); the
evidence a plan is checked against is the dynamic audit's, not the planner's own.
"""

from __future__ import annotations

import importlib.util
import itertools
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fsdp_compat
from fsdp_compat.plan import unsafe_reads
from fsdp_compat.policies import Auto
from fsdp_compat.tree import ModuleTree

_counter = itertools.count()


@dataclass
class Node:
    kind: str  # "block" | "emb" | "linear"
    children: list[Node] = field(default_factory=list)
    raw_reads: list[tuple[int, bool]] = field(default_factory=list)  # (descendant emb index, after its call)


@st.composite
def trees(draw: st.DrawFn, depth: int = 0) -> Node:
    if depth >= 3 or (depth > 0 and draw(st.booleans())):
        return Node(draw(st.sampled_from(["emb", "linear"])))
    children = draw(st.lists(trees(depth + 1), min_size=1, max_size=3))
    return Node("block", children)


def _descendant_embs(node: Node, prefix: str = "") -> list[str]:
    found = []
    for i, child in enumerate(node.children):
        path = f"{prefix}c{i}"
        if child.kind == "emb":
            found.append(path)
        found.extend(_descendant_embs(child, path + "."))
    return found


# Syntactic forms of one read of ``self.<path>.weight`` (``{p}``; ``{i}`` makes names unique). Each form is
# (forward lines, class-level lines, module-level lines); the audit, not the analysis, says what is read.
FORMS: list[tuple[list[str], list[str], list[str]]] = [
    (["x = x + self.{p}.weight.sum()"], [], []),
    (["t_{i} = self.{p}", "x = x + t_{i}.weight.sum()"], [], []),
    (["t_{i}, u_{i} = self.{p}, None", "x = x + t_{i}.weight.mean()"], [], []),
    (["x = x + getattr({parent}, '{leaf}').weight.sum()"], [], []),
    (["x = x + torch.nn.functional.embedding(idx, self.{p}.weight).mean(0)"], [], []),
    (["x = x + _h_{i}(self)"], [], ["def _h_{i}(m):", "    return m.{p}.weight.sum()"]),
    (["x = x + self._p_{i}.sum()"], ["    @property", "    def _p_{i}(self):", "        return self.{p}.weight"], []),
    (["for n_{i}, w_{i} in self.named_parameters():", "    if n_{i} == '{p}.weight':",
      "        x = x + w_{i}.sum()"], [], []),
    (["x = x + sum(w.sum() for w in [self.{p}.weight])"], [], []),
    (["x = x + (lambda: self.{p}.weight.sum())()"], [], []),
    (["if idx.numel() > 0:", "    x = x + self.{p}.weight.sum()", "else:", "    x = x - 1"], [], []),
    (["with torch.no_grad():", "    s_{i} = self.{p}.weight.data.abs().max()", "x = x * (1 + 0 * s_{i})"], [], []),
    (["x = x + _k_{i}(self.{p})"], [], ["def _k_{i}(table):", "    return table.weight.mean()"]),
    (["x = self._add_{i}(x)"], ["    def _add_{i}(self, x):", "        return x + self.{p}.weight.sum()"], []),
]


def _read_lines(path: str, form: int, classes_extra: list[str], module_extra: list[str]) -> list[str]:
    i = next(_counter)
    parent, _, leaf = path.rpartition(".")
    fields = {"p": path, "i": i, "parent": f"self.{parent}" if parent else "self", "leaf": leaf}
    lines, cls, mod = FORMS[form]
    classes_extra.extend(line.format(**fields) for line in cls)
    module_extra.extend(line.format(**fields) for line in mod)
    return ["        " + line.format(**fields) for line in lines]


def _render(node: Node, name: str, classes: list[str], reads: st.DataObject, module_extra: list[str]) -> None:
    lines = [f"class {name}(nn.Module):", "    def __init__(self):", "        super().__init__()"]
    for i, child in enumerate(node.children):
        if child.kind == "emb":
            lines.append(f"        self.c{i} = nn.Embedding(3, 4)")
        elif child.kind == "linear":
            lines.append(f"        self.c{i} = nn.Linear(4, 4)")
        else:
            child_name = f"{name}_{i}"
            _render(child, child_name, classes, reads, module_extra)
            lines.append(f"        self.c{i} = {child_name}()")
    class_extra: list[str] = []
    body: list[str] = []
    embs = _descendant_embs(node)
    chosen = reads.draw(st.lists(st.sampled_from(embs), max_size=2, unique=True)) if embs else []
    before = [p for p in chosen if not reads.draw(st.booleans(), label="after")]
    after = [p for p in chosen if p not in before]
    for path in before:
        body += _read_lines(path, reads.draw(st.sampled_from(range(len(FORMS))), label="form"), class_extra,
                            module_extra)
    for i, child in enumerate(node.children):
        if child.kind == "emb":
            body.append(f"        x = x + self.c{i}(idx).mean(0)")
        elif child.kind == "linear":
            body.append(f"        x = self.c{i}(x)")
        else:
            body.append(f"        x = self.c{i}(x, idx)")
    for path in after:
        body += _read_lines(path, reads.draw(st.sampled_from(range(len(FORMS))), label="form"), class_extra,
                            module_extra)
    lines += [*class_extra, "    def forward(self, x, idx):", *body, "        return x"]
    classes.append("\n".join(lines))


def _build(node: Node, reads: st.DataObject, tmp: Path) -> torch.nn.Module:
    name = f"gen_tree_{next(_counter)}"
    classes: list[str] = []
    module_extra: list[str] = []
    _render(node, "Root", classes, reads, module_extra)
    source = "import torch\nfrom torch import nn\n\n" + "\n".join(module_extra) + "\n\n" + "\n\n".join(classes)
    source += "\n"
    path = tmp / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    return module.Root()


def _tie_some(model: torch.nn.Module, data: st.DataObject) -> None:
    embs = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    if len(embs) >= 2 and data.draw(st.booleans(), label="tie"):
        a, b = data.draw(st.permutations(embs))[:2]
        b.weight = a.weight


def _check(model: torch.nn.Module, plan: fsdp_compat.WrapPlan) -> None:
    tree = ModuleTree.build(model)
    keys = [g.paths for g in plan.groups]
    flat = [p for key in keys for p in key]
    assert len(flat) == len(set(flat)), f"a module is wrapped twice: {keys}"
    assert "" not in flat, "the root is applied last, never as a group"
    for i, early in enumerate(keys):
        for late in keys[i + 1 :]:
            for a in early:
                for b in late:
                    assert not (a != b and tree.is_ancestor_or_self(a, b)), f"{a} wrapped before its child {b}"
    members = {p: key for key in keys for p in key}

    def group_of(path: str) -> tuple[str, ...]:
        for candidate in [path, *tree.ancestors(path)]:
            if candidate in members:
                return members[candidate]
        return ("",)

    for owners in tree.param_owners.values():
        assert len({group_of(p) for p, _ in owners}) == 1, f"shared Parameter split: {owners} in {keys}"
    x, idx = torch.randn(2, 4), torch.tensor([0, 2])
    for read in fsdp_compat.audit_raw_reads(model, x, idx):
        key = group_of(read.owner)
        if key == ("",):
            continue
        covered = any(tree.is_ancestor_or_self(m, read.reader) for m in key)
        no_reshard = next(g for g in plan.groups if g.paths == key).overrides.get("reshard_after_forward") is False
        assert covered or no_reshard, f"{read} but its group {key} is sharded there:\n{plan}"
    assert unsafe_reads(model, plan) == [], plan


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(root=trees(), data=st.data(), lift=st.sampled_from([0, 1 << 40]))
def test_auto_plans_keep_their_invariants(tmp_path_factory: pytest.TempPathFactory, root: Node, data, lift) -> None:
    if root.kind != "block":
        root = Node("block", [root])
    model = _build(root, data, tmp_path_factory.mktemp("trees"))
    _tie_some(model, data)
    block_classes = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.startswith("Root_")})
    layer_classes = []
    if block_classes:
        layer_classes = data.draw(st.lists(st.sampled_from(block_classes), max_size=3, unique=True))
    layer_classes = layer_classes or [type(next(m for m in model.modules() if m is not model)).__name__]
    plan = fsdp_compat.plan_wrap(model, layer_classes, policy=Auto(lift_min_bytes=lift))
    _check(model, plan)
    flat = fsdp_compat.select_wrap_targets(model, layer_classes, policy=Auto(lift_min_bytes=lift))
    flat_plan = fsdp_compat.plan_wrap(
        model, layer_classes, policy=Auto(lift_min_bytes=lift, allow_no_reshard=False, allow_shared_groups=False)
    )
    assert [g.modules[0] for g in flat_plan.groups] == flat
    _check(model, flat_plan)


def test_generated_source_is_what_the_analysis_reads(tmp_path: Path) -> None:
    """A sanity check of the generator itself: a raw read it writes is found, and legacy is predicted to crash."""
    root = Node("block", [Node("block", [Node("emb"), Node("linear")])])

    class Always:
        def draw(self, strategy, label=None):  # a fixed DataObject: read the embedding, before its call
            return ["c0"] if label is None else 0 if label == "form" else False

    model = _build(root, Always(), tmp_path)  # type: ignore[arg-type]
    text = textwrap.dedent(str(fsdp_compat.plan_wrap(model, ["Root_0"], policy="auto")))
    assert "read raw by c0" in text
    legacy = fsdp_compat.plan_wrap(model, ["Root_0"], policy="legacy")
    assert unsafe_reads(model, legacy), legacy


@pytest.mark.parametrize("form", range(len(FORMS)))
def test_every_read_form_is_observed_and_covered(tmp_path: Path, form: int) -> None:
    """Each form on its own: the audit observes the read, the auto plan covers it, legacy would shard it."""
    root = Node("block", [Node("block", [Node("emb"), Node("linear")])])

    class Fixed:  # the block Root_0 reads its embedding c0 (its first list draw), nothing else is read
        lists = 0

        def draw(self, strategy, label=None):
            if label is None:
                self.lists += 1
                return ["c0"] if self.lists == 1 else []
            return form if label == "form" else False

    model = _build(root, Fixed(), tmp_path)  # type: ignore[arg-type]
    reads = fsdp_compat.audit_raw_reads(model, torch.randn(2, 4), torch.tensor([0, 2]))
    assert any(r.owner == "c0.c0" for r in reads), (form, reads)
    plan = fsdp_compat.plan_wrap(model, ["Root_0"])
    _check(model, plan)
    assert ("c0.c0",) not in plan.group_paths()
    assert ("c0.c0",) in fsdp_compat.plan_wrap(model, ["Root_0"], policy="legacy").group_paths()
