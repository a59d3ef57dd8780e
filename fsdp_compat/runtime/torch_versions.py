"""Which torch releases the run-time guard supports: one home, readable without importing torch.

``fsdp-compat doctor`` reports whether the guard is active from the installed torch's metadata (it imports no
torch); :mod:`fsdp_compat.runtime.guard` asks the same question of the imported torch. Imports only the
standard library.
"""

from __future__ import annotations

from importlib import metadata

__all__ = ["GUARD_MIN_TORCH", "guard_supports", "installed_torch", "release"]

#: The oldest torch the run-time guard supports: the oldest fsdp-compat supports (``torch>=2.8``). Its FSDP2
#: internals pass ``tests/runtime/test_guard_contract.py`` on every torch the guard envs run (2.8, 2.10, 2.11, 2.13,
#: 2.14.1, 2.15); on an older torch the guard stands aside with one warning.
GUARD_MIN_TORCH = (2, 8)


def release(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a torch version string such as ``2.11.0+cu130`` or ``2.16.0.dev20270101``; None when
    it does not parse."""
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def guard_supports(version: str) -> bool:
    """Whether the run-time guard runs on this torch version."""
    found = release(version)
    return found is not None and found >= GUARD_MIN_TORCH


def installed_torch() -> str | None:
    """The installed torch's version from its metadata (torch is not imported), or None."""
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None
