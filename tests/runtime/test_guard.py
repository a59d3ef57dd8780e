"""The run-time guard: reads of a sharded group's parameter inside the forward, crash first, then exact parity.

Every distributed case first runs with ``FSDP_COMPAT_GUARD=off`` and must hit the real crash (``got mixed
torch.Tensor and DTensor``), then runs the same plan with the guard on (the default of ``apply_fsdp2``) and must
match an unsharded single-process twin exactly (0.0) after every one of >= 2 AdamW steps. The read patterns:
a child that gets the embedding module as an argument and reads its weight after the embedding's forward, the
root reading a layer's weight before that layer runs, GLM4V's raw read of its vision position table under the
``legacy`` plan (verl/SkyRL's rule), and the root computing logits from ``lm_head.weight`` (fused kernels).
"""

from __future__ import annotations

import pytest
from lab.support import BREADTH, DEVICE, WORLD_SIZE

from fsdp_compat.runtime.guard import ENV_AGREE_S, ENV_GUARD, guard_enabled, guard_of, install_guard
from fsdp_compat.testing.launch import RunResult
from fsdp_compat.testing.parity import run_training

MODELS = "lab.guard_models"
OFF = {ENV_GUARD: "off"}
ON = {ENV_GUARD: None}  # unset: the default
MIXED = "got mixed torch.Tensor and DTensor"
WORLD_SIZES = [pytest.param(n, marks=BREADTH) if n == 1 else n for n in sorted({1, WORLD_SIZE})]
TIMEOUT_S = 240

# (model, wrap fn, the group the guard must unshard, the crash's op)
PATTERNS = [
    pytest.param(f"{MODELS}:passed_embedding", "legacy", "embed", "aten.mm.default", id="child-reads-passed-embedding"),
    pytest.param(
        f"{MODELS}:weight_before_forward", "layers_only", "blocks.1", "aten.nll_loss_backward", id="root-reads-layer"
    ),
    pytest.param(
        "glm4v", "legacy", "model.visual.embeddings.position_embedding", "aten.grid_sampler_2d", id="glm4v-legacy"
    ),
    pytest.param("qwen2-fused-lmhead", "legacy", "lm_head", "aten.mm.default", id="root-reads-lm-head"),
]


def _run(
    model: str,
    wrap: str,
    env: dict[str, str | None],
    *,
    world_size: int = WORLD_SIZE,
    steps: int = 2,
    probe: str = "probe",
) -> RunResult:
    return run_training(
        model,
        f"{MODELS}:{wrap}",
        world_size=world_size,
        steps=steps,
        device=DEVICE,
        timeout_s=TIMEOUT_S,
        env=env,
        probe=f"{MODELS}:{probe}",
    )


def _assert_crash(result: RunResult, op: str) -> None:
    assert not result.ok, "expected the sharded-parameter crash with the guard off, but training succeeded"
    assert MIXED in (result.exception or "") and op in (result.exception or ""), result.error


def _assert_exact(result: RunResult) -> None:
    result.raise_for_error()
    assert result.max_abs_grad_diff == 0.0, result.max_abs_grad_diff
    assert result.max_abs_param_diff == 0.0, result.max_abs_param_diff


def _probes(result: RunResult) -> list[dict]:
    return [r.extra["probe"] for r in result.ranks]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize(("model", "wrap", "group", "op"), PATTERNS)
def test_guard_turns_the_crash_into_exact_parity(model: str, wrap: str, group: str, op: str, world_size: int) -> None:
    _assert_crash(_run(model, wrap, OFF, world_size=world_size, steps=1), op)

    steps = 3
    result = _run(model, wrap, ON, world_size=world_size, steps=steps)
    _assert_exact(result)
    probes = _probes(result)
    for probe in probes:
        assert probe["guard"] and probe["mode_in_forward"] and not probe["mode_outside_forward"], probe
        assert probe["unshards"] == steps, probe  # the same run-time unshard on every step...
        assert len(probe["log"]) == 1 and probe["log"] == probe["events"], probe  # ...logged once
        line = probe["log"][0]
        assert line.startswith("fsdp-compat: run-time guard:"), line
        assert f"its FSDP2 group {group} was sharded" in line and f"leave {group} in its enclosing group" in line
        assert ".py:" in line  # file:line of the reader
    assert all(p["log"] == probes[0]["log"] for p in probes)  # every rank logs the same line


def test_one_log_line_per_group_the_same_on_every_rank() -> None:
    """Two groups read while sharded: two lines (one per group) over 3 steps, an unshard of each on every step."""
    model = f"{MODELS}:both_layers_before_forward"
    _assert_crash(_run(model, "layers_only", OFF, steps=1), "got mixed")
    result = _run(model, "layers_only", ON, steps=3)
    _assert_exact(result)
    probes = _probes(result)
    for probe in probes:
        assert probe["unshards"] == 2 * 3, probe
        assert [line.split(" was read")[0] for line in probe["log"]] == [
            "fsdp-compat: run-time guard: blocks.0.lin.weight",
            "fsdp-compat: run-time guard: blocks.1.lin.weight",
        ], probe["log"]
    assert all(p["log"] == probes[0]["log"] for p in probes)


@pytest.mark.parametrize(
    ("model", "wrap", "op"),
    [
        pytest.param(f"{MODELS}:passed_embedding", "legacy_reentrant", "aten.mm.default", id="read-inside-reentrant"),
        pytest.param(
            f"{MODELS}:passed_embedding",
            "legacy_non_reentrant",
            "aten.mm.default",
            id="read-inside-non-reentrant",
            marks=BREADTH,
        ),
        pytest.param(
            f"{MODELS}:weight_before_forward",
            "layers_only_reentrant",
            "aten.nll_loss_backward",
            id="layers-reentrant",
            marks=BREADTH,
        ),
        pytest.param(
            f"{MODELS}:weight_before_forward",
            "layers_only_non_reentrant",
            "aten.nll_loss_backward",
            id="layers-non-reentrant",
            marks=BREADTH,
        ),
        pytest.param("glm4v", "legacy_non_reentrant", "aten.grid_sampler_2d", id="glm4v-hf-gradient-checkpointing"),
    ],
)
def test_guard_survives_activation_checkpointing(model: str, wrap: str, op: str) -> None:
    """torch.utils.checkpoint (reentrant and not) and HF gradient_checkpointing_enable: the recompute in backward
    finds the group still unsharded, so it reads what forward read."""
    _assert_crash(_run(model, wrap, OFF, steps=1), op)
    result = _run(model, wrap, ON)
    _assert_exact(result)
    for p in _probes(result):
        assert p["unshards"] == 2 and len(p["log"]) == 1, p


@pytest.mark.parametrize(
    ("model", "op"),
    [("glm4v", "aten.grid_sampler_2d"), (f"{MODELS}:passed_embedding", "aten.mm.default")],
    ids=["glm4v", "child-reads-passed-embedding"],
)
def test_guard_under_bf16_mixed_precision_equals_the_recommended_plan_bit_for_bit(model: str, op: str) -> None:
    """bf16 parameters differ from the fp32 twin anyway, so the assertion is sharper: the guarded ``legacy`` run
    equals, bit for bit (losses and a sha256 of the final weights), the run of the plan the guard's log line
    recommends (the read table left in its enclosing group), under the same MixedPrecisionPolicy."""
    _assert_crash(_run(model, "legacy_bf16", OFF, steps=1), op)
    guarded = _run(model, "legacy_bf16", ON)
    guarded.raise_for_error()
    recommended = _run(model, "legacy_recommended_bf16", ON)
    recommended.raise_for_error()
    assert all(p["unshards"] == 2 for p in _probes(guarded))
    assert all(p["unshards"] == 0 for p in _probes(recommended))
    assert [r.losses for r in guarded.ranks] == [r.losses for r in recommended.ranks]
    assert [p["weights"] for p in _probes(guarded)] == [p["weights"] for p in _probes(recommended)]
    assert guarded.max_abs_grad_diff > 0  # the comparison is not vacuous: bf16 differs from the fp32 twin


def test_guard_changes_nothing_on_a_safe_plan() -> None:
    """``input-only`` (layers plus the input embedding) is safe on GLM4V: the guard is installed and idle. Same
    all-gathers, same numbers bit for bit, no log line."""
    off = _run("glm4v", "input_only", OFF)
    on = _run("glm4v", "input_only", ON)
    _assert_exact(off)
    _assert_exact(on)
    for p_off, p_on in zip(_probes(off), _probes(on), strict=True):
        assert not p_off["guard"] and p_on["guard"]
        assert p_on["unshards"] == 0 and p_on["log"] == [] and p_off["log"] == []
        assert p_on["all_gathers"] == p_off["all_gathers"] > 0
        assert p_on["weights"] == p_off["weights"]
    assert [r.losses for r in on.ranks] == [r.losses for r in off.ranks]


def test_guard_installed_before_fully_shard_finds_the_groups_at_the_first_forward() -> None:
    """verl >= 0.7.1 and SkyRL's selector path: fsdp-compat picks the targets and installs the guard; the framework
    calls fully_shard afterwards."""
    _assert_crash(_run("glm4v", "legacy_selector", OFF, steps=1), "aten.grid_sampler_2d")
    result = _run("glm4v", "legacy_selector", ON)
    _assert_exact(result)
    for p in _probes(result):
        assert p["unshards"] == 2 and len(p["log"]) == 1, p


def test_guard_reshards_after_a_no_grad_forward() -> None:
    """A forward under no_grad (a rollout's log-prob pass) has no backward: the guard reshards when it ends."""
    result = _run(f"{MODELS}:passed_embedding", "legacy", ON, probe="probe_no_grad")
    _assert_exact(result)
    for probe in _probes(result):
        assert probe["unshards"] == 1 and probe["all_sharded_after"] and probe["reshard_after_forward_restored"]
        assert probe["loss"] > 0


def test_a_reinstalled_guard_still_guards() -> None:
    """remove() gives FSDP2 back its callbacks; a new guard on the same sharded model takes over cleanly."""
    result = _run(f"{MODELS}:passed_embedding", "legacy", ON, probe="probe_reinstall")
    _assert_exact(result)
    for probe in _probes(result):
        assert probe["new_guard"] and probe["unshards"] == 1 and probe["missing_grads"] == [], probe
        assert probe["all_sharded_after"], probe


# ---------------------------------------------------------------------------------------------- no process group


def test_install_is_idempotent_and_the_switch_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    model = torch.nn.Linear(2, 2)
    monkeypatch.delenv(ENV_GUARD, raising=False)
    assert guard_enabled()
    guard = install_guard(model)
    assert guard is not None and install_guard(model) is guard and guard_of(model) is guard
    assert len(model._forward_pre_hooks) == 1
    model(torch.ones(1, 2))  # not sharded: no groups, the mode is never entered
    assert guard.unshards == 0 and not torch._C._is_torch_function_mode_enabled()
    guard.remove()
    assert guard_of(model) is None and not model._forward_pre_hooks
    for value in ("off", "0", "false", "NO"):
        monkeypatch.setenv(ENV_GUARD, value)
        assert not guard_enabled() and install_guard(torch.nn.Linear(2, 2)) is None


# ------------------------------------------------------------------------- data-parallel: each rank its own batch

DP = "lab.guard_models:dp_rank"
STOOD_ASIDE = "fsdp-compat: run-time guard disabled"


def _dp(model: str, policy: str, env: dict[str, str | None], **cfg: object) -> RunResult:
    """``guard_models.dp_rank`` on WORLD_SIZE ranks, each on its own batch, against the mean-loss twin (0.0)."""
    from fsdp_compat.testing.launch import run_ranks

    return run_ranks(DP, {"model": model, "policy": policy, **cfg}, world_size=WORLD_SIZE, timeout_s=60, env=env)


def test_a_list_passed_by_keyword_is_guarded() -> None:
    """``torch.cat(tensors=[h, self.embed.weight])``: the sharded parameter inside a keyword list is found."""
    off = _dp("kwarg_cat", "legacy", OFF, steps=1)
    assert not off.ok and MIXED in (off.exception or ""), off.error
    on = _dp("kwarg_cat", "legacy", ON)
    on.raise_for_error()
    for rank in on.ranks:
        assert rank.extra["max_abs_diff"] == 0.0 and rank.extra["unshards"] == 2, rank.extra


def test_a_no_grad_forward_between_forward_and_backward_keeps_the_held_group() -> None:
    """An evaluation forward under no_grad between a training forward and its backward: the guard reshards only
    what that forward unsharded, never the group the training forward holds for its backward (0.0 after 2 steps)."""
    result = _dp("passed_embedding", "legacy", ON, no_grad_between=True)
    result.raise_for_error()
    for rank in result.ranks:
        assert rank.extra["max_abs_diff"] == 0.0 and rank.extra["unshards"] == 2, rank.extra
        assert len(rank.extra["eval_losses"]) == 2 and not rank.extra["stood_aside"], rank.extra


@pytest.mark.parametrize(
    "hidden",
    [
        "FSDPParamGroup.post_forward_mesh_info",  # met at the first read (the guard's reshard setting)
        "FSDPParamGroup.wait_for_unshard",  # met after the all-gather started
        "FSDPParam.unsharded_param",  # met after the group is unsharded and held
        "FSDPParam._module_info",  # met while writing the log line
    ],
)
def test_an_internals_change_met_at_a_read_stands_aside(hidden: str) -> None:
    """Every call into FSDP2 internals is inside the stand-aside path: an internal the guard cannot use, met at a
    read (after discovery worked), gives one warning per rank and FSDP2's own behaviour, here the same crash as with
    the guard off, never the guard's AttributeError. ``linger_s``: rank 0 hosts the store here and keeps it up until
    the other rank failed too (as torchrun's agent does), so a rank still agreeing through the store when its peer
    crashed is not cut off (without it, a loaded machine showed 'DistNetworkError: Failed to recv' on that rank)."""
    result = _dp("passed_embedding", "legacy", ON, hide=[hidden], steps=1, linger_s=20)
    assert not result.ok
    for rank in result.ranks:
        assert MIXED in rank.extra.get("exception", ""), rank.error
        warnings = [line for line in rank.extra["log"] if line.startswith(STOOD_ASIDE)]
        assert len(warnings) == 1 and "AttributeError" in warnings[0], rank.extra["log"]


def test_a_read_on_one_rank_only_is_a_named_error_on_every_rank() -> None:
    """A data-dependent raw read (``rank0_reads``: only rank 0's batch takes the branch that reads ``blocks.1``'s
    weight): rank 0's guard must not all-gather alone (its all-gather would pair with rank 1's all-gather of
    ``blocks.0``, the same size: wrong weights, silently). It waits for every rank at the same read
    (FSDP_COMPAT_GUARD_AGREE_S, 3 s here), then raises GuardReadMismatch naming the rank and the read; rank 1,
    whose own collective then fails (here at the 10 s gloo timeout), logs the same report under its own rank.
    ``linger_s`` keeps rank 0 (which hosts the store in this test) alive as torchrun's agent keeps the store."""
    env = {**ON, ENV_AGREE_S: "3"}
    result = _dp("rank0_reads", "layers-only", env, steps=1, collective_timeout_s=10, linger_s=14)
    assert not result.ok and len(result.ranks) == 2
    zero, one = result.ranks
    exception = zero.extra.get("exception", "")
    assert exception.startswith("fsdp_compat.runtime.guard.GuardReadMismatch: "), zero.error
    assert "rank 0 read blocks.1.lin.weight at " in exception and "guard_models.py:" in exception, exception
    assert "rank(s) 1 did not make this read within 3s" in exception, exception
    assert any(line in exception for line in zero.extra["log"]), zero.extra["log"]
    reports = [line for line in one.extra.get("log", []) if "rank 1's forward failed after another rank" in line]
    assert len(reports) == 1 and "rank 0 read blocks.1.lin.weight at " in reports[0], one.error
    assert "max_abs_diff" not in zero.extra and "max_abs_diff" not in one.extra  # no result at all, never a wrong one
    assert result.seconds < 45, result.seconds


def test_the_guard_stands_aside_on_a_torch_older_than_it_supports(monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """The guard runs on every torch fsdp-compat supports (>= 2.8: the guard envs run tests/runtime on 2.8, 2.10,
    2.11, 2.13, 2.14.1 and 2.15). On an older one it is not installed, with one warning per process, and FSDP2 runs
    as without it."""
    import torch
    from torch import nn

    from fsdp_compat.runtime import guard as guard_module

    supported = ("2.8.0+cu128", "2.10.0", "2.11.0+cu130", "2.13.0+cpu", "2.14.1", "2.15.0", "2.16.0.dev20270101")
    assert all(guard_module.torch_supported(v) for v in supported)
    assert not any(guard_module.torch_supported(v) for v in ("2.7.1", "2.6.0+cu124", "1.13.1", "garbage"))
    assert guard_module.torch_supported()  # this env's torch
    monkeypatch.setattr(torch, "__version__", "2.7.1+cu126")
    monkeypatch.setattr(guard_module, "_warned_torch", [])
    with caplog.at_level("WARNING", logger="fsdp_compat"):
        assert install_guard(nn.Linear(2, 2)) is None and install_guard(nn.Linear(2, 2)) is None
    lines = [r.getMessage() for r in caplog.records if "run-time guard off" in r.getMessage()]
    assert len(lines) == 1 and "torch >= 2.8" in lines[0] and "2.7.1+cu126" in lines[0], lines
