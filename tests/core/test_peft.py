"""peft around GLM4V's vision position table, on 2 gloo ranks, crash first.

A user's own peft model breaks GLM4V again when the planner groups by module path: ``modules_to_save`` or a LoRA
target that includes ``position_embedding`` puts the table behind a wrapper whose inner module gets its own group
under the upstream rule (``legacy``), and the vision embeddings' raw read crashes in ``F.grid_sample``. Under
``auto`` the read is matched to the module that owns the Parameter (through the wrapper), so the static plan alone
(guard off) trains with exact parity (0.0) against an unsharded twin: each rank its own batch, the twin on every
rank's batch with the mean loss.
"""

from __future__ import annotations

import math

import pytest
from lab.peft_glm4v import PEFT_CONFIGS, build_peft_glm4v
from lab.support import WORLD_SIZE

from fsdp_compat.plan import plan_wrap
from fsdp_compat.testing.core_smoke import GRID_SAMPLER_CRASH
from fsdp_compat.testing.launch import run_ranks

ROUTINE = "lab.peft_glm4v:peft_rank"
TABLE = "base_model.model.model.visual.embeddings.position_embedding"
CONFIGS = sorted(PEFT_CONFIGS)

pytestmark = pytest.mark.timeout(600)


def _run(cases: list[tuple[str, str, bool]], **cfg: bool) -> list[dict]:
    run = run_ranks(ROUTINE, {"cases": cases, **cfg}, world_size=WORLD_SIZE, timeout_s=400)
    run.raise_for_error()
    ranks = [r.extra["results"] for r in run.ranks]
    print(f"{cases}: {run.seconds:.1f}s")
    return ranks


@pytest.mark.parametrize("config", CONFIGS)
def test_legacy_groups_the_wrapped_table_and_crashes(config: str) -> None:
    ranks = _run([(config, "legacy", False)])
    for results in ranks:
        result = results[f"{config}|legacy|noguard"]
        assert not result["ok"], result
        assert GRID_SAMPLER_CRASH in result["exception"], result["traceback"]
        assert any(g[0].startswith(TABLE + ".") for g in result.get("groups", [[TABLE + ".x"]]))


def test_auto_trains_both_peft_models_with_exact_parity() -> None:
    cases = [(config, "auto", False) for config in CONFIGS]
    for results in _run(cases):
        for config in CONFIGS:
            result = results[f"{config}|auto|noguard"]
            assert result["ok"], result.get("traceback")
            assert result["max_abs_diff"] == 0.0, result
            assert not any(p == TABLE or p.startswith(TABLE + ".") for g in result["groups"] for p in g)
            assert result["trainable"] > 0 and len(result["losses"]) == 2


def test_comparator_fails_on_nan() -> None:
    """Negative control: one of the sharded model's gradients multiplied by NaN makes the figure NaN, not 0.0."""
    for results in _run([("modules-to-save", "auto", False)], poison=True):
        result = results["modules-to-save|auto|noguard"]
        assert result["ok"], result.get("traceback")
        assert math.isnan(result["max_abs_diff"]), result


@pytest.mark.parametrize("config", CONFIGS)
def test_static_plans(config: str) -> None:
    model = build_peft_glm4v(config)
    legacy = plan_wrap(model, policy="legacy")
    assert any(key[0].startswith(TABLE + ".") for key in legacy.group_paths())
    auto = plan_wrap(model)
    assert not any(p.startswith(TABLE) for key in auto.group_paths() for p in key)
    assert any(key[0].endswith(".layers.0") for key in auto.group_paths())  # the layers keep their groups
    reads = [e for e in auto.evidence if e.kind == "raw-read" and e.reader.endswith("visual.embeddings")]
    assert any(e.owner.startswith(TABLE + ".") for e in reads), reads
