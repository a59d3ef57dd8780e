"""The generic layer (``fsdp_compat.runtime.every_root``): a trainer fsdp-compat has no adapter for, calling
``fully_shard`` by its own rule (``lab.every_root.own_apply_fsdp2``: verl's old rule, as lmms-engine, miles, siirl and
ROLL copy it), with fsdp-compat merely installed (the ``.pth`` hook; the job never imports fsdp-compat).

Crash first: with ``FSDP_COMPAT=off`` (or ``FSDP_COMPAT_GENERIC=off``) tiny GLM4V dies in ``grid_sampler_2d`` (the
vision position table's own group is read raw by its parent). With the layer on, at the root's first forward the
groups are checked (one WARNING for that group), the run-time guard is armed and unshards the table at its read,
and distinct image batches, and image|text ranks (the mixed-batch alignment runs the tower on a zero dummy on the
text rank), train equal to one process on all the ranks' batches with the mean loss: 0.0 in gradients and
parameters after 2 AdamW steps, fp32. A text model's groups pass the check: the guard stays disarmed (no per-op
check) and the run is exact. Activation after the trainer bound ``fully_shard`` and sharded the model (an explicit
import, the ``.pth`` off) works too: the hook point is looked up at every forward.
"""

from __future__ import annotations

from typing import Any

import pytest
from lab.support import WORLD_SIZE, assert_ranks_exact

from fsdp_compat.testing.launch import RunResult, run_ranks

# breadth on the other torches: test_guard_contract.py runs the generic layer's image|text case on each of them
pytestmark = [pytest.mark.timeout(400), pytest.mark.slow, pytest.mark.breadth]

GRID_SAMPLER_CRASH = "aten.grid_sampler_2d.default"
MIXED = "got mixed torch.Tensor and DTensor"
ON = {"FSDP_COMPAT": None, "FSDP_COMPAT_GENERIC": None, "FSDP_COMPAT_GUARD": None, "FSDP_COMPAT_AUTOLOAD": None}
UNSAFE_TABLE = "the FSDP2 group model.visual.embeddings.position_embedding can be read while sharded"
#: the process's one INFO line where the layer changes the run (fsdp_compat.log.announce_once), and its DEBUG line
#: for a root whose groups pass the check with nothing to align
ANNOUNCED = "fsdp-compat: generic layer on FSDP2 root Glm4vForConditionalGeneration ("
ARMED_AND_ALIGNED = "run-time guard armed (unsafe groups), mixed micro-batch alignment installed"
SAFE = "DEBUG fsdp-compat: generic layer: Qwen2ForCausalLM: its "
SAFE_END = " FSDP2 groups pass fsdp-compat's safety check; nothing to guard or align"


def run(model: str, variants: list[str], env: dict[str, str | None], **cfg: Any) -> RunResult:
    return run_ranks(
        "lab.every_root:own_trainer_rank",
        {"model": model, "steps": 2, "variants": variants, **cfg},
        world_size=WORLD_SIZE,
        timeout_s=240,
        env={**ON, **env},
    )


def _variants(*kinds: str) -> list[str]:
    return [kinds[r % len(kinds)] for r in range(WORLD_SIZE)]


@pytest.mark.parametrize("switch", [{"FSDP_COMPAT": "off"}, {"FSDP_COMPAT_GENERIC": "off"}], ids=["off", "generic-off"])
def test_an_unseen_trainer_crashes_on_glm4v_without_the_generic_layer(switch: dict[str, str]) -> None:
    result = run("glm4v", _variants("image"), switch)
    assert not result.ok
    errors = "\n".join(r.error for r in result.ranks)
    assert GRID_SAMPLER_CRASH in errors and MIXED in errors, errors


@pytest.mark.parametrize("kinds", [("image",), ("image", "text")], ids=["image|image", "image|text"])
def test_an_unseen_trainer_trains_glm4v_exactly_with_fsdp_compat_merely_installed(kinds: tuple[str, ...]) -> None:
    result = run("glm4v", _variants(*kinds), {})
    assert_ranks_exact(result)
    ranks = result.ranks
    # the trainer's own groups are kept, the table's included; its check warns on rank 0 and arms the guard
    assert ["model.visual.embeddings.position_embedding"] in ranks[0].extra["groups"]
    assert any(UNSAFE_TABLE in line for line in ranks[0].extra["log"]), ranks[0].extra["log"]
    for r in ranks:
        # each rank's one line from the generic layer: what it changes in this run, the alignment included
        generic = [line for line in r.extra["log"] if "generic layer" in line and UNSAFE_TABLE not in line]
        assert len(generic) == 1 and generic[0].startswith(ANNOUNCED), r.extra["log"]
        assert generic[0].endswith(ARMED_AND_ALIGNED), generic
        assert r.extra["guard_armed"] is True
        # once a step on every rank: a text rank's dummy tower call reads the table too, so the ranks agree
        assert r.extra["guard_unshards"] == 2, r.extra
        assert r.extra["mixed_batches"]["installed"] == 1
        expected_dummies = 2 if len(kinds) > 1 and kinds[r.rank % len(kinds)] == "text" else 0
        assert r.extra["mixed_batches"]["dummy_calls"] == expected_dummies, r.extra


def test_an_unseen_trainer_on_image_text_ranks_falls_out_of_step_when_only_the_guard_is_on() -> None:
    """Image|text ranks need the alignment, not only the guard: with it off the ranks' collectives mismatch."""
    result = run("glm4v", _variants("image", "text"), {"FSDP_COMPAT_MIXED_BATCHES": "off"})
    assert not result.ok


def test_a_text_model_keeps_the_trainers_groups_and_a_disarmed_guard() -> None:
    """The groups pass the check and nothing is aligned: the generic layer says so at DEBUG only (the log captured
    here from DEBUG up, each line with its level); no INFO line, and nothing about alignment."""
    result = run("qwen2", _variants("image"), {}, debug_log=True)  # a text model: the variant is ignored
    assert_ranks_exact(result)
    for r in result.ranks:
        assert r.extra["guard_armed"] is False and r.extra["guard_unshards"] == 0, r.extra
        assert r.extra["mixed_batches"]["installed"] == 0, r.extra
        log = r.extra["log"]
        safe = [line for line in log if line.startswith(SAFE) and line.endswith(SAFE_END)]
        assert len(safe) == 1, log  # the check ran and passed
        assert not [line for line in log if "generic layer" in line and not line.startswith("DEBUG ")], log
        assert not [line for line in log if "alignment" in line], log


def test_activation_after_the_trainer_bound_fully_shard_and_sharded_the_model() -> None:
    """No ``.pth`` hook: fsdp-compat is imported after ``fully_shard`` was bound and applied; still exact."""
    result = run("glm4v", _variants("image", "text"), {"FSDP_COMPAT_AUTOLOAD": "off"}, activate="late")
    assert_ranks_exact(result)
    assert all(r.extra["guard_armed"] is True for r in result.ranks)
