"""An adversarial corpus of raw-read patterns, run for real on one gloo rank (world size 1 reproduces the crash).

Each pattern (``fsdp_compat.testing.read_corpus``) reads an embedding's weight outside the embedding's forward in
its own way. Every pattern is trained for 2 SGD steps against an unsharded twin under three settings, all in one
spawned process (the harness's ``run_ranks``: one deadline, tracebacks reported):

- ``legacy`` with the guard off must crash: the pattern is a real hazard, not a pattern that never breaks;
- ``auto`` with the guard off must train with exact parity (0.0): the static plan alone is safe - unless the
  pattern is in ``KNOWN_GAPS`` (reads no static analysis can see), where it must crash, so the list cannot go stale;
- ``auto`` with the guard on (the default) must train with exact parity (0.0): the guard covers the gaps.
"""

from __future__ import annotations

from typing import Any

import pytest

from fsdp_compat.plan import plan_wrap
from fsdp_compat.testing.harness import run_ranks
from fsdp_compat.testing.read_corpus import PATTERNS

ROUTINE = "fsdp_compat.testing.read_corpus:corpus_rank"
SETTINGS = (("auto", True), ("auto", False), ("legacy", False))
CRASH = "got mixed torch.Tensor and DTensor"
# Reads a static analysis cannot see: a module reached through a weak reference, an eval'd string.
KNOWN_GAPS = frozenset({"WeakRegistry", "EvalString"})
# The read comes after the embedding's own call on every path: auto keeps its group, unsharded until backward.
NO_RESHARD = frozenset({"AfterOwnForward"})
# The module each pattern reads raw (the embedding ``emb`` unless named here).
READ_TARGET = {"ModuleDictKey": "tables.pos"}

pytestmark = pytest.mark.timeout(600)


def _key(name: str, policy: str, guard: bool) -> str:
    return f"{name}|{policy}|{'guard' if guard else 'noguard'}"


@pytest.fixture(scope="module")
def corpus() -> dict[str, Any]:
    cases = [(name, policy, guard) for name in sorted(PATTERNS) for policy, guard in SETTINGS]
    run = run_ranks(ROUTINE, {"cases": cases}, world_size=1, timeout_s=500)
    run.raise_for_error()
    results = run.ranks[0].extra["results"]
    handled = [n for n in PATTERNS if results[_key(n, "auto", False)]["ok"]]
    print(f"corpus: {len(PATTERNS)} patterns, {len(cases)} runs in {run.seconds:.1f}s; static plan alone safe on "
          f"{len(handled)}, known gaps {sorted(KNOWN_GAPS)}")
    return results


def test_corpus_is_large_and_the_gap_list_is_real() -> None:
    assert len(PATTERNS) >= 30
    assert set(KNOWN_GAPS) <= set(PATTERNS) and set(NO_RESHARD) <= set(PATTERNS)


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_pattern(corpus: dict[str, Any], name: str) -> None:
    legacy = corpus[_key(name, "legacy", False)]
    assert not legacy["ok"], f"{name} does not crash under legacy: it proves nothing"
    assert CRASH in legacy["exception"] or "DTensor" in legacy["exception"], legacy["traceback"]

    static = corpus[_key(name, "auto", False)]
    if name in KNOWN_GAPS:
        assert not static["ok"], f"{name} no longer crashes with the guard off: remove it from KNOWN_GAPS"
        assert CRASH in static["exception"], static["traceback"]
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


# Patterns that also hand the layer itself to unmodelled code: reflection on the root (every parameter is
# reachable there) or a tuple holding both modules passed to a helper. The layer then stays in the root, too.
REACHES_THE_LAYER = frozenset({"NamedParameters", "ModulesDict", "Vars", "ComputedGetattr", "TuplePass"})


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_layers_keep_their_groups(name: str) -> None:
    """Conservative, not careless: the layer, used only through its forward, keeps its group unless the pattern
    hands the layer itself to code the analysis does not model (then the layer's parameters may be read too)."""
    plan = plan_wrap(PATTERNS[name](), ["Block"])
    assert (("block",) in plan.group_paths()) == (name not in REACHES_THE_LAYER), plan


def test_comparator_catches_a_perturbed_run() -> None:
    """Negative control: the same comparison fails when the twin's loss is scaled by (1 + 1e-6)."""
    run = run_ranks(ROUTINE, {"cases": [("AttrChain", "auto", True)], "perturb": True}, world_size=1, timeout_s=300)
    run.raise_for_error()
    result = run.ranks[0].extra["results"][_key("AttrChain", "auto", True)]
    assert result["ok"] and result["max_abs_diff"] > 0.0, result
