"""The mixed-batch exchange alone (:mod:`fsdp_compat.runtime.exchange`) on a few gloo ranks, for its unit tests."""

from __future__ import annotations

from typing import Any

__all__ = ["exchange_rank"]


def exchange_rank(cfg: dict[str, Any], rank: int, extra: dict[str, Any]) -> None:
    """Exchanges over the whole world and over a sub-mesh of ranks 0 and 1 (rank 2 takes no part in the latter):
    what each returns, whether a repeat reuses the host group, and the host group's timeout (the job's)."""
    from datetime import timedelta

    import torch.distributed as dist

    from fsdp_compat.runtime import exchange as wire
    from fsdp_compat.runtime.process_world import job_timeout

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{cfg['port']}",
        rank=rank,
        world_size=cfg["world_size"],
        timeout=timedelta(seconds=cfg["job_timeout_s"]),
    )
    world = tuple(range(cfg["world_size"]))
    extra["world"] = {str(k): list(v) for k, v in wire.exchange(world, (rank, 10 * rank + 1)).items()}
    first = wire.host_group(world)
    extra["world_again"] = {str(k): list(v) for k, v in wire.exchange(world, (rank, 0)).items()}
    extra["reused"] = wire.host_group(world) is first
    extra["host_timeout_s"] = job_timeout(first).total_seconds()
    if rank in (0, 1):
        extra["pair"] = {str(k): list(v) for k, v in wire.exchange((0, 1), (rank + 5,)).items()}
    extra["alone"] = {str(k): list(v) for k, v in wire.exchange((rank,), (7,)).items()}
    dist.barrier()
    dist.destroy_process_group()
