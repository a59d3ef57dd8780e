"""The exchange: every rank's tower-call counts for this forward, one host all-reduce of a small int64 table on a gloo
group of its own. The counts are host values, so nothing goes to a device: no device-to-host sync on an NCCL mesh,
which would stall the CPU that issues FSDP2's prefetches ahead of the GPU. Its cost per forward, by world size:
``python -m benchmarks exchange`` (docs/performance.md)."""

from __future__ import annotations

from typing import Any

import torch

from fsdp_compat.runtime.process_world import PerWorld, job_timeout

__all__ = ["column", "exchange", "host_group"]

_HOST_GROUPS: PerWorld[dict[tuple[int, ...], Any]] = PerWorld(dict)


def host_group(ranks: tuple[int, ...]) -> Any:
    """A gloo process group over ``ranks``, made once per process group (:mod:`fsdp_compat.runtime.process_world`: a
    new default group after a restart gets new ones) at the first exchange, with the job's timeout. ``new_group`` is
    itself collective: every rank of ``ranks`` makes its first exchange at the same point of the same forward (or
    tower call outside it), after the root's unshard, so no rank waits in it while another waits in an all-gather.
    Local synchronisation: ranks outside ``ranks`` (another data-parallel replica's sub-mesh) need not take part."""
    import torch.distributed as dist

    groups = _HOST_GROUPS.get()
    group = groups.get(ranks)
    if group is None:
        timeout = job_timeout()
        extra = {} if timeout is None else {"timeout": timeout}
        group = dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True, **extra)
        groups[ranks] = group
    return group


def exchange(ranks: tuple[int, ...], values: tuple[int, ...]) -> dict[int, tuple[int, ...]]:
    """Every rank's ``values`` (global rank -> values; one value per aligned tower) over ``ranks``."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or len(ranks) < 2:
        return {0: values}
    table = torch.zeros(len(ranks), len(values), dtype=torch.int64, device="cpu")
    table[ranks.index(dist.get_rank())] = torch.tensor(values, dtype=torch.int64, device="cpu")
    dist.all_reduce(table, group=host_group(ranks))
    return {rank: tuple(row) for rank, row in zip(ranks, table.tolist(), strict=True)}


def column(counts: dict[int, tuple[int, ...]], index: int = 0) -> dict[int, int]:
    """One tower's counts (column ``index``: 0 the vision tower, 1 the audio tower) of an exchange."""
    return {rank: row[index] for rank, row in counts.items()}
