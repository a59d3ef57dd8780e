"""Compatibility module: the harness now lives in three modules, one job each.

- :mod:`fsdp_compat.testing.launch`: rank processes (spawn, one deadline, kill, reap, results);
- :mod:`fsdp_compat.testing.parity`: the parity training loop and its comparator;
- :mod:`fsdp_compat.testing.smoke`: smoke-table rows and their printing.

Every name importable from here before the split still is (private ones too, for the tests and benchmarks that use
them), and rank-routine specs such as ``"fsdp_compat.testing.harness:_train"`` still resolve. New code imports from
the modules above.
"""

from __future__ import annotations

from fsdp_compat.testing.launch import _FAIL_GRACE_S as _FAIL_GRACE_S
from fsdp_compat.testing.launch import RankResult, RunResult, rank_entry, run_ranks, spawn_ranks
from fsdp_compat.testing.launch import _body_main as _body_main
from fsdp_compat.testing.launch import _child_env as _child_env
from fsdp_compat.testing.launch import _collect as _collect
from fsdp_compat.testing.launch import _exit_when_orphaned as _exit_when_orphaned
from fsdp_compat.testing.launch import _free_port as _free_port
from fsdp_compat.testing.launch import _jsonable as _jsonable
from fsdp_compat.testing.launch import _jsonable_dict as _jsonable_dict
from fsdp_compat.testing.launch import _kill_group as _kill_group
from fsdp_compat.testing.launch import _nanmax as _nanmax
from fsdp_compat.testing.launch import _resolve as _resolve
from fsdp_compat.testing.launch import _tail as _tail
from fsdp_compat.testing.launch import _wrap_spec as _wrap_spec
from fsdp_compat.testing.parity import (
    PARITY_TOL,
    WrapFn,
    gradient_reduction_factor,
    rank_batches,
    reference_backward,
    run_training,
)
from fsdp_compat.testing.parity import _Diff as _Diff
from fsdp_compat.testing.parity import _fsdp_group_paths as _fsdp_group_paths
from fsdp_compat.testing.parity import _fsdp_group_sets as _fsdp_group_sets
from fsdp_compat.testing.parity import _full as _full
from fsdp_compat.testing.parity import _guard_of as _guard_of
from fsdp_compat.testing.parity import _mixed_batch_counters as _mixed_batch_counters
from fsdp_compat.testing.parity import _train as _train
from fsdp_compat.testing.smoke import SmokeRow, format_smoke_table
from fsdp_compat.testing.smoke import _fmt as _fmt

__all__ = [
    "PARITY_TOL",
    "RankResult",
    "RunResult",
    "SmokeRow",
    "WrapFn",
    "format_smoke_table",
    "gradient_reduction_factor",
    "rank_batches",
    "rank_entry",
    "reference_backward",
    "run_ranks",
    "run_training",
    "spawn_ranks",
]
