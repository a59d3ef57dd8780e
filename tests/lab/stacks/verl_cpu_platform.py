"""A CPU platform for verl (>= 0.9.0), registered through verl's public ``verl.plugin.platform`` registry.

Test-side only (never in the package): verl's engine asks its platform for the device, the device module and the
collective backend. ``PlatformRegistry.register`` is verl's documented extension point for new hardware; this one
answers ``cpu`` / ``torch.cpu`` / ``gloo`` and makes device management a no-op. Select it with
``VERL_PLATFORM=cpu`` before verl first calls ``get_platform()``. Nothing else in verl is changed.
"""

from __future__ import annotations

from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry

__all__ = ["PlatformCPU"]


class _HostDeviceModule(ModuleType):
    """``torch.cpu`` plus the memory and RNG queries verl makes of ``torch.cuda`` (host memory is not tracked)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    def empty_cache(self) -> None:
        return None

    def memory_allocated(self, *args: Any, **kwargs: Any) -> int:
        return 0

    memory_reserved = max_memory_allocated = max_memory_reserved = memory_allocated

    def mem_get_info(self, *args: Any, **kwargs: Any) -> tuple[int, int]:
        import psutil

        memory = psutil.virtual_memory()
        return memory.available, memory.total

    def get_rng_state(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        torch.set_rng_state(state)


_DEVICE_MODULE = _HostDeviceModule("verl_cpu_device")


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    """verl's platform interface on the host CPU: gloo collectives, no device to select, sync or empty."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> ModuleType:
        return _DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    def current_device(self) -> Any:
        return "cpu"  # verl moves batches with ``.to(get_device_id())``: "cpu" keeps them on the host

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: Any) -> None:
        return None

    def synchronize(self, device_index: Any = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        return {}

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    @contextmanager
    def nvtx_range(self, msg: str) -> Any:
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def cudart(self) -> Any:
        return None
