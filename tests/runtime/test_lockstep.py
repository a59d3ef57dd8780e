"""The generic mechanism's rounds on tables alone (:mod:`fsdp_compat.runtime.lockstep`), and what it installs on
which model, in one process."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fsdp_compat.runtime.lockstep import END, Report, settle


def R(where: int, started: int = 0, running: bool = False) -> Report:  # a table's cell
    return Report(where, started, running)


def test_equal_reports_agree() -> None:
    assert settle({0: R(3), 1: R(3)}).agreed
    assert settle({0: R(END), 1: R(END), 2: R(END)}).agreed


def test_a_rank_inside_its_call_is_met_by_the_replay() -> None:
    """Rank 0 stands at its encoder's first group (index 0), rank 1 at the decoder's first (2)."""
    done = settle({0: R(0, 1, True), 1: R(2)})
    assert dict(done.owed) == {1: range(0, 1)} and done.source == 0 and done.meets
    assert done.again == {1}  # the replaying rank reports again where it stood; rank 0 goes on into its call


def test_calls_without_groups_are_replayed_then_every_rank_reports_again() -> None:
    done = settle({0: R(2, 2), 1: R(2), 2: R(2, 1)})
    assert dict(done.owed) == {1: range(0, 2), 2: range(1, 2)} and not done.meets
    assert done.again == {0, 1, 2}


def test_a_rank_running_the_same_module_owes_nothing() -> None:
    """The model's own dummy call on the text rank: both ranks stand at the encoder's first group."""
    assert settle({0: R(0, 1, True), 1: R(0)}).agreed


@pytest.mark.parametrize(
    "reports",
    [
        {0: R(1), 1: R(2)},  # different groups, no call to explain it
        {0: R(1, 1), 1: R(2)},  # a finished call, yet the ranks stand apart
        {0: R(0, 1, True), 1: R(1, 1, False)},  # callers disagree on being inside
        {0: R(0, 1, True), 1: R(2), 2: R(3)},  # the replaying ranks stand apart
    ],
)
def test_what_no_replay_explains_diverges(reports: dict[int, Report]) -> None:
    assert settle(reports).diverged


@given(st.dictionaries(st.integers(0, 7), st.tuples(st.integers(-1, 5), st.integers(0, 3), st.booleans()), min_size=1))
def test_every_round_is_one_of_agree_replay_or_diverge(rows: dict[int, tuple[int, int, bool]]) -> None:
    reports = {rank: Report(w, n, running and n > 0) for rank, (w, n, running) in rows.items()}
    done = settle(reports)
    most = max(r.started for r in reports.values())
    assert done.agreed + bool(done.owed) + done.diverged == 1
    for rank, calls in done.owed.items():
        assert reports[rank].started < most and calls == range(reports[rank].started, most)
        assert done.source is not None and reports[done.source].started == most


def test_text_models_get_nothing_and_an_unseen_vlm_gets_the_mechanism() -> None:
    from lab.own_vlm import OwnVlm

    from fsdp_compat.runtime.mixed_batches import install_mixed_batches, remove_mixed_batches
    from fsdp_compat.runtime.replay import Replayed
    from fsdp_compat.testing import build_model

    text = build_model("qwen2")
    assert install_mixed_batches(text) == []
    own = OwnVlm()
    installed = install_mixed_batches(own)
    assert [type(m) for m in installed] == [Replayed]
    remove_mixed_batches(own)
    assert not own._forward_pre_hooks and not own._forward_hooks
