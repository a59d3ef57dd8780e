"""The distributed harness detects parity, real crashes, failing and hanging ranks, and leaves no process.

These use hand-written ``fully_shard`` wraps from ``lab.wraps``, so they check the harness independently of
fsdp-compat's planner.
"""

from __future__ import annotations

import math
import os
import time

import pytest

from fsdp_compat.errors import FsdpCompatError
from fsdp_compat.testing.core_smoke import GRID_SAMPLER_CRASH
from fsdp_compat.testing.launch import RankResult, RunResult
from fsdp_compat.testing.parity import run_training
from fsdp_compat.testing.smoke import SmokeRow, format_smoke_table

W = "lab.wraps:"


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_glm4v_parity_with_safe_wrap() -> None:
    result = run_training(
        "glm4v", W + "layers_and_input", steps=3, probe=W + "probe", env={"FSDP_COMPAT_TEST_MARK": "m1"}
    )
    result.raise_for_error()
    print(
        f"glm4v layers+input: Δgrad={result.max_abs_grad_diff} Δparam={result.max_abs_param_diff} "
        f"step {result.step_time_s:.3f}s run {result.seconds:.1f}s"
    )
    assert result.ok and result.error is None
    assert len(result.ranks) == 2
    assert result.max_abs_grad_diff == 0.0 and result.max_abs_param_diff == 0.0
    assert result.max_rel_grad_diff == 0.0 and result.max_rel_param_diff == 0.0
    for r in result.ranks:
        assert len(r.losses) == 3 and r.losses == r.extra["reference_losses"]
        assert r.losses[-1] < r.losses[0]
        assert r.step_time_s > 0
        assert r.extra["probe"]["rank"] == r.rank and r.extra["probe"]["mark"] == "m1"
        groups = r.extra["fsdp_groups"]
        assert "" in groups and "model.language_model.embed_tokens" in groups
        assert "model.visual.embeddings.position_embedding" not in groups
        assert sorted(r.extra["fsdp_group_sets"]) == sorted([g] for g in groups)
        assert _gone(r.extra["pid"])


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_glm4v_legacy_like_wrap_reproduces_grid_sampler_crash() -> None:
    # plain FSDP2 without fsdp-compat: its automatic activation, the generic layer included, is off
    result = run_training("glm4v", W + "every_embedding", steps=1, env={"FSDP_COMPAT": "off"})
    assert not result.ok
    assert result.error is not None and result.error.startswith("rank ")
    assert GRID_SAMPLER_CRASH in result.error
    assert "Traceback (most recent call last)" in result.error
    assert "modeling_glm4v.py" in result.error and "grid_sample" in result.error
    assert result.exception is not None and result.exception.startswith("RuntimeError: " + GRID_SAMPLER_CRASH)
    assert "model.visual.embeddings.position_embedding" in result.ranks[0].extra["fsdp_groups"]
    assert math.isnan(result.max_rel_grad_diff)
    with pytest.raises(AssertionError, match="grid_sampler_2d"):
        result.raise_for_error()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_failing_rank_reported_fast() -> None:
    t = time.monotonic()
    result = run_training("qwen2", W + "raise_on_rank1", steps=2, timeout_s=90)
    elapsed = time.monotonic() - t
    print(f"failing rank reported after {elapsed:.1f}s")
    assert not result.ok
    rank0, rank1 = result.ranks
    assert not rank1.ok and "deliberate failure on rank 1" in (rank1.error or "")
    assert "Traceback" in (rank1.error or "")
    assert result.error is not None and "deliberate failure on rank 1" in result.error
    assert not rank0.ok  # blocked in a collective with a dead peer: killed or its own error, never "ok"
    assert elapsed < 60  # far below the 90 s timeout: the parent does not wait for gloo
    assert all(_gone(r.extra["pid"]) for r in result.ranks)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_hanging_rank_times_out_and_leaves_no_process() -> None:
    t = time.monotonic()
    result = run_training("qwen2", W + "hang_on_rank1", steps=1, timeout_s=20)
    elapsed = time.monotonic() - t
    assert not result.ok
    assert "timed out after 20s" in (result.ranks[1].error or "")
    assert 20 <= elapsed < 40
    assert all(_gone(r.extra["pid"]) for r in result.ranks)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_tied_parameter_group_recorded_with_parity() -> None:
    result = run_training("glm4v-tied", W + "tied_pair", steps=2)
    result.raise_for_error()
    assert result.max_abs_grad_diff == 0.0 and result.max_abs_param_diff == 0.0
    sets = result.ranks[0].extra["fsdp_group_sets"]
    assert ["model.language_model.embed_tokens", "lm_head"] in sets


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_world_size_one() -> None:
    result = run_training("qwen2", W + "root_only", world_size=1, steps=2)
    result.raise_for_error()
    assert len(result.ranks) == 1
    assert result.max_rel_grad_diff <= 1e-6 and result.max_rel_param_diff <= 1e-6
    assert result.ranks[0].extra["fsdp_groups"] == [""]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_missing_wrap_fn_is_reported() -> None:
    result = run_training("qwen2", W + "_no_such_function", world_size=1, steps=1, timeout_s=60)
    assert not result.ok and "AttributeError" in (result.error or "")


def test_wrap_fn_must_be_importable() -> None:
    with pytest.raises(FsdpCompatError, match="module:function"):
        run_training("qwen2", lambda m, k: None)  # type: ignore[arg-type]


def test_run_result_properties() -> None:
    ok = RankResult(0, True, [1.0], 0.0, 0.0, 1e-9, 1e-9, 0.1, None, {})
    bad = RankResult(1, False, error="Traceback ...\nValueError: boom", extra={"exception": "ValueError: boom"})
    run = RunResult([ok, bad])
    assert not run.ok
    assert run.error == "rank 1: Traceback ...\nValueError: boom"
    assert run.exception == "ValueError: boom"
    assert run.max_abs_param_diff == 1e-9
    with pytest.raises(AssertionError, match="rank 1"):
        run.raise_for_error()
    assert RunResult([ok]).ok and not RunResult([]).ok


def test_smoke_rows_and_table() -> None:
    crash = SmokeRow(
        "core",
        "legacy",
        "crash",
        "crash",
        "RuntimeError: " + GRID_SAMPLER_CRASH,
        None,
        None,
        5.0,
        expect_text=GRID_SAMPLER_CRASH,
    )
    parity = SmokeRow("core", "auto", "ok", "ok", "parity Δgrad=0 Δparam=0", 0.0, 0.0, 6.0)
    wrong_crash = SmokeRow(
        "core",
        "legacy",
        "crash",
        "crash",
        "TypeError: other",
        None,
        None,
        1.0,
        expect_text=GRID_SAMPLER_CRASH,
    )
    drift = SmokeRow("core", "auto", "ok", "ok", "parity", 1e-3, 0.0, 6.0)
    ulp = SmokeRow("core", "auto", "ok", "ok", "parity", 0.0, 1e-7, 6.0)  # exact means 0.0, not "close"
    ulp_allowed = SmokeRow("core", "auto", "ok", "ok", "parity", 0.0, 1e-7, 6.0, tolerance=1e-6)
    nan = SmokeRow("core", "auto", "ok", "ok", "parity", float("nan"), 0.0, 6.0, tolerance=1e-6)
    unexpected_ok = SmokeRow("core", "legacy", "crash", "ok", "parity", 0.0, 0.0, 6.0)
    assert crash.passed and parity.passed and ulp_allowed.passed
    assert not wrong_crash.passed and not drift.passed and not unexpected_ok.passed
    assert not ulp.passed and not nan.passed
    table = format_smoke_table([crash, parity, drift])
    lines = table.splitlines()
    assert lines[0].split()[:6] == ["framework", "case", "expected", "outcome", "result", "seconds"]
    assert "PASS" in lines[2] and "FAIL" in lines[4] and GRID_SAMPLER_CRASH in lines[2]
    print("\n" + table)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_core_smoke() -> None:
    from fsdp_compat.testing.core_smoke import run

    rows = run()
    print("\n" + format_smoke_table(rows))
    assert [(r.case, r.outcome) for r in rows] == [
        ("legacy", "crash"),
        ("auto", "ok"),
        ("auto, rank 1 without images, alignment off", "crash"),
        ("auto, rank 1 without images", "ok"),
    ]
    assert all(r.passed for r in rows)
    assert [r.max_rel_grad_diff for r in rows if r.outcome == "ok"] == [0.0, 0.0]


@pytest.mark.parametrize("order", ["nan first", "nan last"])
def test_comparator_keeps_nan_whatever_comes_after(order: str) -> None:
    """``parity.Diff`` and the cross-rank maxima never let a later finite value replace a NaN (the comparator before
    this redesign lost it when a NaN parameter came before a finite one: 0.0 was reported)."""
    import torch

    from fsdp_compat.testing.parity import Diff

    nan, finite = (torch.tensor([math.nan]), torch.tensor([1.0])), (torch.tensor([2.0]), torch.tensor([2.0]))
    pairs = [nan, finite] if order == "nan first" else [finite, nan]
    diff = Diff()
    for i, (got, ref) in enumerate(pairs):
        diff.add(f"p{i}", got, ref)
    assert math.isnan(diff.abs) and math.isnan(diff.rel)
    values = [math.nan, 0.0] if order == "nan first" else [0.0, math.nan]
    run = RunResult([RankResult(rank=r, ok=True, max_abs_grad_diff=v) for r, v in enumerate(values)])
    assert math.isnan(run.max_abs_grad_diff)  # one rank's NaN fails the run


def test_comparator_counts_a_missing_side_and_a_wrong_shape_as_inf() -> None:
    """A gradient on one side only, or of another shape (which a broadcast would hide: ``[1.0]`` against
    ``[1.0, 1.0]`` subtracts to zeros), is never 0.0; ``absent_is_zero`` compares a missing side with zeros."""
    import torch

    from fsdp_compat.testing.parity import Diff

    one, two = torch.tensor([1.0]), torch.tensor([1.0, 1.0])
    assert float((one - two).abs().max()) == 0.0  # what the comparator must not be fooled by
    for got, ref in ((one, two), (two, one), (None, one), (one, None)):
        diff = Diff()
        diff.add("p", got, ref)
        assert diff.abs == math.inf and diff.rel == math.inf and diff.where == "p", (got, ref)
    lenient = Diff(absent_is_zero=True)
    lenient.add("q", None, torch.zeros(3))
    lenient.add("r", torch.zeros(2), None)
    assert lenient.abs == 0.0
    lenient.add("s", None, torch.tensor([0.5]))
    assert lenient.abs == 0.5 and lenient.where == "s"


@pytest.mark.parametrize("relaunches", [0, 2])
def test_a_port_taken_before_rank_0_binds_it_is_relaunched_on_another(
    monkeypatch: pytest.MonkeyPatch, relaunches: int
) -> None:
    """The port run_ranks chose is taken by another process before rank 0's store binds it (seen on a busy
    machine: ``EADDRINUSE``): the ranks start again on another port. Without relaunches the same run fails."""
    import socket

    from fsdp_compat.testing import launch

    taker = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taker.bind(("127.0.0.1", 0))
    taker.listen()
    chosen = iter([int(taker.getsockname()[1])])
    real = launch._free_port
    monkeypatch.setattr(launch, "_free_port", lambda: next(chosen, None) or real())
    monkeypatch.setattr(launch, "_PORT_RELAUNCHES", relaunches)
    try:
        run = launch.run_ranks("lab.exchange_ranks:exchange_rank", {"job_timeout_s": 30}, world_size=2, timeout_s=120)
    finally:
        taker.close()
    if relaunches:
        run.raise_for_error()
        assert run.relaunches == 1
        assert run.ranks[1].extra["world"] == {"0": [0, 1], "1": [1, 11]}
    else:
        assert not run.ok and run.relaunches == 0
        assert "address already in use" in (run.error or "").lower() or "EADDRINUSE" in (run.error or "")
