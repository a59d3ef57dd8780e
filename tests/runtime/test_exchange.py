"""``fsdp_compat.runtime.exchange``: every rank's tower-call counts in one host all-reduce, on a gloo group made once
per world with the job's timeout, over the ranks of one sub-mesh only. Three gloo ranks (``lab.exchange_ranks``)."""

from __future__ import annotations

import pytest

from fsdp_compat.runtime.exchange import column, exchange
from fsdp_compat.testing.launch import run_ranks

pytestmark = [pytest.mark.timeout(200)]


def test_every_rank_sees_every_ranks_counts_on_its_sub_mesh_with_the_jobs_timeout() -> None:
    run = run_ranks("lab.exchange_ranks:exchange_rank", {"job_timeout_s": 37}, world_size=3, timeout_s=150)
    run.raise_for_error()
    for rank in run.ranks:
        seen = rank.extra
        assert seen["world"] == {"0": [0, 1], "1": [1, 11], "2": [2, 21]}, seen
        assert seen["world_again"] == {"0": [0, 0], "1": [1, 0], "2": [2, 0]}, seen  # no stale rows
        assert seen["reused"] is True
        assert seen["host_timeout_s"] == 37.0  # the job's, not gloo's 30-minute default
        assert seen["alone"] == {"0": [7]}  # one rank: nothing to exchange, no collective
        if rank.rank in (0, 1):
            assert seen["pair"] == {"0": [5], "1": [6]}, seen  # rank 2 took no part
        else:
            assert "pair" not in seen


def test_without_a_process_group_the_counts_are_this_processes_own() -> None:
    assert exchange((0, 1), (3, 4)) == {0: (3, 4)}


def test_column_picks_one_towers_counts() -> None:
    counts = {0: (2, 0), 1: (0, 1)}
    assert column(counts) == {0: 2, 1: 0}
    assert column(counts, 1) == {0: 0, 1: 1}
