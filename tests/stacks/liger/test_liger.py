"""liger-kernel 0.8.5's VLM forwards (``liger_kernel/transformers/model/glm4v.py``, ``qwen2_5_vl.py``) under FSDP2.

liger's fused linear + cross-entropy takes ``self.lm_head.weight`` raw from the model's own forward: safe where
``lm_head`` is in the root or an enclosing group, a crash where it has a group of its own (the legacy rule, verl's
old rule and its copies, every trainer that gives the output embedding its own ``fully_shard``).

What runs on CPU: liger's kernels are Triton-only (no CPU backend in 0.8.5: ``triton.runtime.driver`` finds
"0 active drivers"), so no step can finish here. So the tests assert (1) the plan, which reads the forward that
actually runs (liger's, bound on the instance), keeps ``lm_head`` out of a group of its own while the legacy rule
gives it one, and transformers' own forward still lets it have one; (2) the group check flags the ``lm_head`` group
under liger's forward only; (3) on 2 gloo ranks with a trainer's own rule, the read crashes with ``FSDP_COMPAT=off``
(the sharded DTensor meets liger's ``torch.mm``), and with the generic layer the check warns, the guard unshards
``lm_head`` at that read and the step goes on to liger's Triton launch, the first line CPU cannot run.
Exact parity needs a GPU.
"""

from __future__ import annotations

from importlib.metadata import version
from typing import Any

import pytest
from lab.support import DEVICE, WORLD_SIZE, rank_pythonpath, require_framework
from torch import nn

from fsdp_compat.group_check import check_groups, evidence
from fsdp_compat.plan import plan_wrap, select_wrap_targets, unsafe_reads
from fsdp_compat.testing import build_model
from fsdp_compat.testing.launch import RunResult, run_ranks

LIGER = require_framework("liger-kernel", lambda: version("liger-kernel"))
MODELS = ["glm4v", "qwen2.5-vl"]
LIGER_READ = "lm_head.weight read raw by <root>"
LIGER_SITE = "liger_fused_linear_cross_entropy"
MIXED = "got mixed torch.Tensor and DTensor"
NO_TRITON_DRIVER = "0 active drivers"
UNSAFE_LM_HEAD = "the FSDP2 group lm_head can be read while sharded"
ON = {"FSDP_COMPAT": None, "FSDP_COMPAT_GENERIC": None, "FSDP_COMPAT_GUARD": None, "FSDP_COMPAT_AUTOLOAD": None}


def _model(name: str, *, liger: bool) -> nn.Module:
    from lab.stacks.liger_ranks import apply_liger

    model = build_model(name)
    if liger:
        apply_liger(model, name)
    return model


def _group_paths(model: nn.Module, policy: str) -> list[tuple[str, ...]]:
    return [g.paths for g in plan_wrap(model, policy=policy).groups]


@pytest.mark.parametrize("name", MODELS)
def test_the_plan_keeps_lm_head_in_the_root_under_liger_forward(name: str) -> None:
    model = _model(name, liger=True)
    plan = plan_wrap(model)
    assert ("lm_head",) not in [g.paths for g in plan.groups], plan
    kept = {entry.path: entry for entry in plan.root}
    assert LIGER_READ in kept["lm_head"].reason and LIGER_SITE in kept["lm_head"].reason, kept["lm_head"]
    assert kept["lm_head"].enclosing == ""  # the root group: unsharded for the whole root forward
    assert model.lm_head not in select_wrap_targets(model)
    # the text layers keep their groups: only the module liger reads raw moves
    assert ("model.language_model.layers.0",) in [g.paths for g in plan.groups]


@pytest.mark.parametrize("name", MODELS)
def test_the_legacy_rule_gives_lm_head_its_own_group_and_liger_reads_it_sharded(name: str) -> None:
    model = _model(name, liger=True)
    legacy = plan_wrap(model, policy="legacy")
    assert ("lm_head",) in [g.paths for g in legacy.groups]
    problems = unsafe_reads(model, legacy)
    assert any(p.startswith(LIGER_READ) and "group lm_head is sharded there" in p for p in problems), problems


@pytest.mark.parametrize("name", MODELS)
def test_transformers_own_forward_lets_lm_head_keep_its_group(name: str) -> None:
    """The control: the plan moves ``lm_head`` because of liger's forward, not because of the model."""
    model = _model(name, liger=False)
    assert ("lm_head",) in _group_paths(model, "auto")
    assert model.lm_head in select_wrap_targets(model)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("liger", [True, False], ids=["liger", "transformers"])
def test_the_group_check_flags_the_lm_head_group_only_under_liger(name: str, liger: bool) -> None:
    model = _model(name, liger=liger)
    found = evidence("liger", model)
    assert found is not None
    groups = [(paths, True) for paths in _group_paths(model, "legacy")]  # a trainer's own rule, as it shards
    flagged = dict(check_groups(*found, groups))
    assert ("lm_head" in flagged) is liger, flagged
    if liger:
        assert LIGER_SITE in flagged["lm_head"], flagged


def _run(env: dict[str, str | None]) -> RunResult:
    return run_ranks(
        "lab.stacks.liger_ranks:liger_rank",
        {"model": "qwen2.5-vl", "liger": True},
        world_size=WORLD_SIZE,
        timeout_s=240,
        env={**ON, "PYTHONPATH": rank_pythonpath(), **env},
    )


def _errors(result: RunResult) -> list[Any]:
    result.raise_for_error()  # the ranks record liger's error; a rank that raised is a harness failure
    return [r.extra["error"] for r in result.ranks]


@pytest.mark.timeout(300)
@pytest.mark.skipif(DEVICE != "cpu", reason="on CPU liger's Triton launch is the expected stop; a GPU run needs parity")
def test_liger_reads_its_sharded_lm_head_group_without_fsdp_compat() -> None:
    result = _run({"FSDP_COMPAT": "off"})
    for r, error in zip(result.ranks, _errors(result), strict=True):
        assert ["lm_head"] in r.extra["groups"]
        assert error is not None and MIXED in error, error


@pytest.mark.timeout(300)
@pytest.mark.skipif(DEVICE != "cpu", reason="on CPU liger's Triton launch is the expected stop; a GPU run needs parity")
def test_the_generic_layer_unshards_lm_head_at_liger_read_up_to_the_triton_launch() -> None:
    result = _run({})
    ranks = result.ranks
    assert any(UNSAFE_LM_HEAD in line for line in ranks[0].extra["log"]), ranks[0].extra["log"]
    for r, error in zip(ranks, _errors(result), strict=True):
        assert ["lm_head"] in r.extra["groups"]  # the trainer's own groups are kept
        assert r.extra["guard_armed"] is True
        assert r.extra["guard_unshards"] == 1, r.extra  # lm_head, at liger's read
        assert error is not None and NO_TRITON_DRIVER in error and MIXED not in error, error
