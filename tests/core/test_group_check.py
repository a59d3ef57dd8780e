"""``fsdp_compat.group_check``: a grouping somebody else applied, checked as it is (the generic layer and the
accelerate / NeMo Automodel / LLaMA-Factory adapters run it). One rank (FSDP2 on a 1-rank gloo group: the check is
static, what it reads is the grouping and the code), ``lab.trainer_groups`` shards by the test's rule."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from fsdp_compat.group_check import evidence, unsafe_groups
from fsdp_compat.testing.launch import run_ranks

pytestmark = [pytest.mark.timeout(300)]

LAYERS = [["model.layers.0"], ["model.layers.1"]]


def _checked(groups: list[list[str]], when: str = "before", model: str = "qwen2-fused-lmhead") -> dict[str, Any]:
    run = run_ranks(
        "lab.trainer_groups:checked_rank",
        {"model": model, "groups": groups, "evidence": when},
        world_size=1,
        timeout_s=200,
    )
    run.raise_for_error()
    return run.ranks[0].extra


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_group_the_root_reads_raw_is_named_with_the_read_and_warned_once(when: str) -> None:
    """The fused-head model's root forward reads ``lm_head.weight`` itself: a trainer's ``lm_head`` group would be
    sharded there. Evidence read before or after sharding (FSDP2's own hooks are not reads) says the same."""
    seen = _checked([*LAYERS, ["lm_head"]], when)
    assert seen["groups"] == [*LAYERS, ["lm_head"]]
    assert [group for group, _ in seen["check"]] == ["lm_head"], seen["check"]
    assert seen["unsafe"] == seen["check"] == seen["report"]
    warnings = [line for line in seen["lines"] if "cannot show that these FSDP2 groups" in line]
    assert len(warnings) == 1 and "lm_head (" in warnings[0] and "keep it out of the list" in warnings[0], seen["lines"]
    assert seen["none_report"] is None


def test_a_safe_grouping_passes_with_one_info_line_counting_its_groups() -> None:
    seen = _checked(LAYERS)
    assert seen["check"] == seen["unsafe"] == seen["report"] == []
    assert seen["lines"] == [
        "fsdp-compat: trainer: Qwen2FusedLmHeadForCausalLM: trainer's 2 FSDP2 groups below the root pass "
        "fsdp-compat's safety check (kept as they are); run-time guard and mixed micro-batch alignment installed"
    ]


def test_a_group_that_splits_a_tied_parameters_sharers_is_unsafe() -> None:
    """Tied embeddings (one Parameter, two modules): a group around one sharer alone splits them."""
    seen = _checked([["model.language_model.embed_tokens"]], model="glm4v-tied")
    assert [group for group, _ in seen["check"]] == ["model.language_model.embed_tokens"], seen["check"]
    warnings = [line for line in seen["lines"] if "cannot show that these FSDP2 groups" in line]
    assert len(warnings) == 1, seen["lines"]
    assert "The guard cannot mend model.language_model.embed_tokens: a Parameter whose sharers" in warnings[0]
    assert "keep all its sharers in one group" in warnings[0], warnings[0]


def test_a_read_alone_does_not_claim_the_guard_cannot_mend_it() -> None:
    seen = _checked([*LAYERS, ["lm_head"]])
    warnings = [line for line in seen["lines"] if "cannot show that these FSDP2 groups" in line]
    assert len(warnings) == 1 and "The guard cannot mend" not in warnings[0], warnings


def test_code_it_cannot_read_keeps_the_groups_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="fsdp_compat")
    assert evidence("trainer", object()) is None
    assert unsafe_groups("trainer", object(), None) is None
    (record,) = caplog.records
    assert record.getMessage().startswith("fsdp-compat: trainer: the safety check of object could not read its code")
