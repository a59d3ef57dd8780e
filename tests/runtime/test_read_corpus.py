"""An adversarial corpus of raw-read patterns, run for real data-parallel on 2 gloo ranks, each its own batch.

Each pattern (``lab.read_corpus``) reads an embedding's weight outside the embedding's forward in
its own way. Every pattern is trained for 2 SGD steps, rank r on its own token ids, against an unsharded twin that
runs every rank's batch with loss / 2 (the mean loss) before each step, under three settings, all in one spawned
process per rank (the harness's ``run_ranks``: one deadline, tracebacks reported):

- ``legacy`` with the guard off must crash: the pattern is a real hazard, not a pattern that never breaks;
- ``auto`` with the guard off must train with exact parity (0.0, gradients and parameters, on every rank): the
  static plan alone is safe - unless the pattern is in ``KNOWN_GAPS`` (reads no static analysis can see), where it
  must crash, so the list cannot go stale;
- ``auto`` with the guard's per-op check armed (``FSDP_COMPAT_GUARD=always``; the default arms it only where the
  plan or the group check cannot rule a sharded read out, which fsdp-compat's own plan always can) must train with
  exact parity (0.0): the guard covers the gaps.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from lab.read_corpus import PATTERNS, Base, worse

from fsdp_compat.plan import plan_wrap
from fsdp_compat.testing.launch import current_wording, run_ranks

ROUTINE = "lab.read_corpus:corpus_rank"
SETTINGS = (("auto", True), ("auto", False), ("legacy", False))
CRASH = "got mixed torch.Tensor and DTensor"
# Reads a static analysis cannot see: a module reached through a weak reference, an eval'd string.
KNOWN_GAPS = frozenset({"WeakRegistry", "EvalString"})
# The read comes after the embedding's own call on every path: auto keeps its group, unsharded until backward.
NO_RESHARD = frozenset({"AfterOwnForward"})
# The module each pattern reads raw (the embedding ``emb`` unless named here).
READ_TARGET = {"ModuleDictKey": "tables.pos", "LateBindingClosure": "tail"}
# The README's figure: the exact number of patterns (a pattern added or lost must show up here and there).
PATTERN_COUNT = 69
WORLD_SIZE = 2

# breadth: 69 patterns of the mechanism test_guard.py proves case by case (the envs that rerun tests/runtime on each
# torch a framework pins deselect it; core runs it on 2.13, the guard-torch label on 2.10, 2.14.1 and 2.15)
pytestmark = [pytest.mark.timeout(600), pytest.mark.breadth]


def _key(name: str, policy: str, guard: bool) -> str:
    return f"{name}|{policy}|{'guard' if guard else 'noguard'}"


@pytest.fixture(scope="module")
def corpus() -> dict[str, Any]:
    cases = [(name, policy, guard) for name in sorted(PATTERNS) for policy, guard in SETTINGS]
    run = run_ranks(ROUTINE, {"cases": cases}, world_size=WORLD_SIZE, timeout_s=500)
    run.raise_for_error()
    results = run.ranks[0].extra["results"]
    for other in run.ranks[1:]:  # every rank saw the same outcome (and, below, the parity is asserted on rank 0's
        for key, result in other.extra["results"].items():  # figure; the other ranks' figures must agree)
            assert result["ok"] == results[key]["ok"], (key, result, results[key])
            if result["ok"]:
                results[key]["max_abs_diff"] = worse(results[key]["max_abs_diff"], result["max_abs_diff"])
    handled = [n for n in PATTERNS if results[_key(n, "auto", False)]["ok"]]
    print(f"corpus: {len(PATTERNS)} patterns, {len(cases)} runs in {run.seconds:.1f}s; static plan alone safe on "
          f"{len(handled)}, known gaps {sorted(KNOWN_GAPS)}")
    return results


def test_corpus_is_large_and_the_gap_list_is_real() -> None:
    assert len(PATTERNS) == PATTERN_COUNT
    assert set(KNOWN_GAPS) <= set(PATTERNS) and set(NO_RESHARD) <= set(PATTERNS)


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_pattern(corpus: dict[str, Any], name: str) -> None:
    legacy = corpus[_key(name, "legacy", False)]
    assert not legacy["ok"], f"{name} does not crash under legacy: it proves nothing"
    assert CRASH in current_wording(legacy["exception"]), legacy["traceback"]  # the upstream crash, not any error

    static = corpus[_key(name, "auto", False)]
    if name in KNOWN_GAPS:
        assert not static["ok"], f"{name} no longer crashes with the guard off: remove it from KNOWN_GAPS"
        assert CRASH in current_wording(static["exception"]), static["traceback"]
    else:
        assert static["ok"], f"{name}: the static plan alone crashes:\n{static['traceback']}"
        assert static["max_abs_diff"] == 0.0, static
        target = READ_TARGET.get(name, "emb")
        # The read table never owns a group that reshards after its forward; it may keep one that stays unsharded
        # until backward when its own call comes first on every path (e.g. ``self.body(ids) + self.emb.weight``).
        if [target] in static["groups"]:
            assert [target] in static["no_reshard"], static
        if name in NO_RESHARD:
            assert [target] in static["no_reshard"], static

    guarded = corpus[_key(name, "auto", True)]
    assert guarded["ok"], guarded.get("traceback")
    assert guarded["max_abs_diff"] == 0.0, guarded


@pytest.mark.parametrize("name", sorted(KNOWN_GAPS))
def test_known_gaps_get_their_own_group_statically(name: str) -> None:
    """Why the gaps crash without the guard: the plan gives the embedding a group (the read is invisible)."""
    plan = plan_wrap(PATTERNS[name](), ["Block"])
    assert (READ_TARGET.get(name, "emb"),) in plan.group_paths()


# Patterns that also hand the layer itself to unmodelled code, so the layer stays in the root too: a tuple
# holding both modules passed to a helper; an attribute name held in state; a class's own get_submodule; a
# loop variable or a named_parameters() value rebound after the test that would have narrowed it.
REACHES_THE_LAYER = frozenset(
    {"TuplePass", "GetattrFromAttribute", "OverriddenGetSubmodule", "NarrowThenRebind", "NameTestRebound"}
)
# Dynamic access Python resolves from constants: the analysis charges the read to the module or Parameter named
# (before it, each of these was an escape that kept every layer in the root group).
RESOLVED_FORMS = frozenset(
    {
        "ComputedGetattr", "GetattrLocalName", "GetattrModuleConstant", "GetattrConstantLoop", "GetattrTwoConstants",
        "ModulesDict", "ParametersSubscript", "Vars", "DunderDict", "GetSubmodule", "GetParameter", "AttrGetter",
        "ModulesIsinstance", "NamedModulesName", "NamedParameters", "NamedParametersContinue",
        "ComprehensionFilter", "NamespaceHelper", "StaticHelpers", "LateBindingClosure",
    }
)


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_layers_keep_their_groups(name: str) -> None:
    """Conservative, not careless: the layer, used only through its forward, keeps its group unless the pattern
    hands the layer itself to code the analysis does not model (then the layer's parameters may be read too)."""
    plan = plan_wrap(PATTERNS[name](), ["Block"])
    assert (("block",) in plan.group_paths()) == (name not in REACHES_THE_LAYER), plan


@pytest.mark.parametrize("name", sorted(RESOLVED_FORMS))
def test_resolved_forms_charge_the_read_table_only(name: str) -> None:
    """Each constant-resolvable form is charged to what it names: the root's evidence is a raw read of the read
    table and of nothing else (no escape through the root, no read of the layer)."""
    model = PATTERNS[name]()
    plan = plan_wrap(model, ["Block"])
    target = READ_TARGET.get(name, "emb")
    owners = {e.owner for e in plan.evidence if e.kind == "raw-read" and e.reader == ""}
    assert owners == {target} or (name == "LateBindingClosure" and owners == {"emb", "tail"}), plan.evidence
    assert not any("counts as read" in e.location for e in plan.evidence), plan.evidence


@pytest.mark.parametrize(("control", "failed"), [("perturb", lambda d: d > 0.0), ("poison", math.isnan)])
def test_comparator_catches_a_perturbed_or_nan_run(control: str, failed: Callable[[float], bool]) -> None:
    """Negative controls, on 2 ranks: the same comparison fails when the twin's loss is scaled by (1 + 1e-6), and
    when one of the sharded model's gradients is multiplied by NaN (``max(worst, nan)`` would have kept 0.0)."""
    cfg = {"cases": [("AttrChain", "auto", True)], control: True}
    run = run_ranks(ROUTINE, cfg, world_size=WORLD_SIZE, timeout_s=120)
    run.raise_for_error()
    for rank in run.ranks:
        result = rank.extra["results"][_key("AttrChain", "auto", True)]
        assert result["ok"] and failed(result["max_abs_diff"]) and result["max_abs_diff"] != 0.0, result


def test_worse_keeps_nan() -> None:
    """The comparator's running maximum (also used by the peft and verl-in-Ray comparisons) is NaN-sticky."""
    assert math.isnan(worse(0.0, math.nan)) and math.isnan(worse(math.nan, 0.0)) and math.isnan(worse(math.nan, 1.0))
    assert worse(0.0, 1.0) == 1.0 and worse(2.0, 1.0) == 2.0 and worse(0.0, 0.0) == 0.0


@pytest.mark.parametrize("name", ["TypeCast", "TypeCastWiden"])
def test_type_cast_is_a_read_for_the_analysis_and_the_audit(name: str) -> None:
    """``Tensor.type(dtype)`` reads the values: the static analysis keeps ``emb`` from a group that reshards before
    the read, and the dynamic audit records the read even when the cast's result is a new tensor (TypeCastWiden)."""
    from fsdp_compat.audit import audit_raw_reads

    model = PATTERNS[name]()
    reads = audit_raw_reads(model, torch.tensor([[1, 2, 3]]))
    assert [(r.reader, r.param) for r in reads] == [("", "emb.weight")], reads
    plan = plan_wrap(PATTERNS[name](), ["Block"])
    assert [g.overrides.get("reshard_after_forward") for g in plan.groups if g.paths == ("emb",)] in ([], [False])


def test_argument_less_type_is_metadata_for_the_audit() -> None:
    """``Tensor.type()`` (no dtype) only names the type: not a read."""
    from fsdp_compat.audit import audit_raw_reads

    class Named(Base):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            assert self.emb.weight.type() == "torch.FloatTensor"
            return self.body(ids).sum()

    assert audit_raw_reads(Named(), torch.tensor([[1, 2, 3]])) == []
