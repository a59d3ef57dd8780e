"""The run-time layer lives as long as its process group (``fsdp_compat.runtime.process_world``): a restart in the same
process trains exactly, as plain FSDP2 does, and fsdp-compat's own waits end at the job's timeout. Rank code:
``lab.restart`` (its docstring says what failed before)."""

from __future__ import annotations

import pytest
from lab.restart import assert_both_phases_exact, free_port

from fsdp_compat.testing.launch import run_ranks

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def test_a_restarted_process_group_trains_exactly_with_the_guard_and_the_alignment_acting() -> None:
    run = run_ranks(
        "lab.restart:restart_rank",
        {"model": "glm4v", "steps": 2, "variants": ["image", "text"], "second_port": free_port()},
        world_size=2,
        timeout_s=200,
    )
    assert_both_phases_exact(run, guard_unshards=2)


def test_the_mixed_batch_exchange_fails_at_the_jobs_timeout_not_gloos_default() -> None:
    """Rank 0 runs one forward more than rank 1, which idles 30 s and exits: rank 0's exchange must give up at the
    job's 5 s timeout (before: it waited until its peer was gone, 30 s)."""
    run = run_ranks(
        "lab.restart:timeout_rank",
        {"job_timeout_s": 5, "peer_idle_s": 30},
        world_size=2,
        timeout_s=120,
    )
    run.raise_for_error()
    rank0 = run.ranks[0].extra
    assert rank0["error"], rank0
    assert rank0["waited_s"] < 20, rank0
    assert run.ranks[1].extra["idled"]
