"""Rank-side code of the process-group lifetime tests: a restart in the same process, and the job's timeout.

**Restart.** Both ranks train tiny GLM4V sharded by a trainer's own rule (``lab.every_root``: the guard acts, the
mixed-batch alignment exchanges over its host group), image|text ranks. Then every rank destroys the process group;
rank 0 (the survivor) makes a new one in the same process, while rank 1 is replaced by a fresh interpreter (a
spawned child, as a restarted worker is) that joins it. Both train a fresh model again. What fsdp-compat caches or
numbers across ranks must belong to the first group and go with it (before: the survivor raised ``ValueError:
Process group ... is not initialized in the world group map`` at its cached host group while the new rank waited in
``new_group``; with that fixed, the guard's per-process store keys made a false ``GuardReadMismatch``).

**Timeout.** The job sets a short process-group timeout; rank 0 runs one forward too many (a log-prob pass), so its
mixed-batch exchange waits for a peer that never comes. It must fail at the job's timeout, as plain FSDP2 would, not
at gloo's 30-minute default (before: blocked until the peer exited).
"""

from __future__ import annotations

import multiprocessing
import time
from datetime import timedelta
from typing import Any

__all__ = ["assert_both_phases_exact", "free_port", "restart_rank", "timeout_rank"]


def free_port() -> int:
    """A loopback port free now (the new process group's, after the restart)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def assert_both_phases_exact(run: Any, guard_unshards: int | None = None) -> None:
    """Both process groups of a :func:`restart_rank` run trained exactly (0.0), the text rank with its dummies, and
    (where given) the guard acting ``guard_unshards`` times in each."""
    run.raise_for_error()
    for rank in run.ranks:
        second = rank.extra["second"]
        assert second["ok"], second.get("error")
        for phase in (rank.extra["first"], second):
            assert phase["grad_diff"] == 0.0 and phase["param_diff"] == 0.0, phase
            if guard_unshards is not None:
                assert phase["guard_unshards"] == guard_unshards, phase  # the guard acted in both groups
            assert phase["mixed_batches"]["dummy_calls"] == 2 * rank.rank, phase  # the text rank's dummies


def _phase(cfg: dict[str, Any], rank: int, port: int, extra: dict[str, Any]) -> None:
    import torch.distributed as dist

    from fsdp_compat.testing.parity import init_group
    from lab.every_root import train_own_rule

    init_group({**cfg, "port": port}, rank)
    try:
        train_own_rule(cfg, rank, extra)
    finally:
        dist.destroy_process_group()


def _fresh_rank(cfg: dict[str, Any], rank: int, port: int, queue: Any) -> None:
    """A fresh interpreter joining the new group as ``rank`` (spawned: nothing of the first group in it)."""
    extra: dict[str, Any] = {}
    try:
        _phase(cfg, rank, port, extra)
        queue.put({"ok": True, **extra})
    except BaseException as exc:  # the parent reports it
        queue.put({"ok": False, "error": f"{type(exc).__name__}: {exc}", **extra})


def restart_rank(cfg: dict[str, Any], rank: int, extra: dict[str, Any]) -> None:
    """Train, destroy the group, train again in a new one: rank 0 in the same process, rank 1 in a fresh one."""
    first: dict[str, Any] = {}
    _phase(cfg, rank, cfg["port"], first)
    extra["first"] = first
    if rank == 0:
        second: dict[str, Any] = {}
        _phase(cfg, rank, cfg["second_port"], second)
        extra["second"] = {"ok": True, **second}
        return
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_fresh_rank, args=(cfg, rank, cfg["second_port"], queue))
    child.start()
    extra["second"] = queue.get(timeout=cfg["timeout_s"])
    child.join(30)


def timeout_rank(cfg: dict[str, Any], rank: int, extra: dict[str, Any]) -> None:
    """Rank 0 runs one no-grad forward more than rank 1; rank 1 then idles past the job's timeout and exits."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_compat.testing.zoo import build_model, make_batch
    from lab.every_root import own_apply_fsdp2

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{cfg['port']}", rank=rank, world_size=cfg["world_size"],
        timeout=timedelta(seconds=cfg["job_timeout_s"]),
    )  # fmt: skip
    model = build_model("glm4v", seed=0)
    own_apply_fsdp2(model, {"mesh": init_device_mesh("cpu", (cfg["world_size"],))})
    batch = make_batch("glm4v", seed=100 + rank, variant="image" if rank == 0 else "text")
    with torch.no_grad():
        model(**batch)  # every rank: the exchange, then the vision tower (a dummy on the text rank)
    if rank == 1:
        time.sleep(cfg["peer_idle_s"])
        extra["idled"] = True
        return
    start = time.monotonic()
    try:
        with torch.no_grad():
            model(**batch)  # one log-prob pass too many: its exchange has no peer
        extra["error"] = ""
    except Exception as exc:
        extra["error"] = f"{type(exc).__name__}: {exc}"
    extra["waited_s"] = time.monotonic() - start
