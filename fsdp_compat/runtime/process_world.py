"""The run-time layer lives as long as its process group: what it caches or numbers across ranks belongs to one
default process group (a "world") and is made anew in the next, and its waits end with the job's timeout.

A process may destroy its process group and make a new one (a rank rejoining, a worker re-initialised, a test
running again): a host group made in the old world is not in the new one's group map (``ValueError: Process group
... is not initialized in the world group map``), and numbers counted per process (the guard's store keys) no longer
match a rank that started fresh. Plain FSDP2 restarts and trains; so must fsdp-compat.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any, Generic, TypeVar

__all__ = ["PerWorld", "current_world", "job_timeout"]

T = TypeVar("T")


def current_world() -> Any:
    """The default process group object, or None when there is none (not initialised, or destroyed)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.distributed_c10d._get_default_group()


class PerWorld(Generic[T]):
    """A value made by ``make()`` for the current world, and made again once the world changed."""

    def __init__(self, make: Callable[[], T]) -> None:
        self._make = make
        self._world: Any = None
        self._value: T | None = None

    def get(self) -> T:
        world = current_world()
        if self._value is None or world is not self._world:
            self._world, self._value = world, self._make()
        return self._value


def job_timeout(group: Any = None) -> datetime.timedelta | None:
    """The timeout the job gave its process group (``init_process_group(timeout=...)``), or None where torch does not
    say: fsdp-compat's own waits (the mixed-batch exchange, the guard's agreement) never outlast the job's."""
    import torch

    pg = group if group is not None else current_world()
    if pg is None:
        return None
    for kind in ("cuda", "cpu", *(str(t) for t in getattr(pg, "_device_types", ()))):
        try:
            timeout = pg._get_backend(torch.device(kind)).options._timeout
        except Exception:  # no backend for that device, or another torch's internals: try the next
            continue
        if isinstance(timeout, datetime.timedelta) and timeout.total_seconds() > 0:
            return timeout
    return None
