"""Test support: a zoo of tiny real transformers models, meta-device skeletons, and a distributed FSDP2
harness (rank processes in ``launch``, the parity loop in ``parity``, smoke tables in ``smoke``).

Names resolve lazily, so importing this package costs nothing until one is used (then torch, and transformers
for models, are imported).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ZOO": "zoo",
    "ZooModel": "zoo",
    "build_model": "zoo",
    "make_batch": "zoo",
    "build_skeleton": "skeleton",
    "reference_skeleton": "skeleton",
    "REFERENCE_NAMES": "skeleton",
    "RankResult": "launch",
    "RunResult": "launch",
    "SmokeRow": "smoke",
    "format_smoke_table": "smoke",
    "WrapFn": "parity",
    "run_training": "parity",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fsdp_compat.testing' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"fsdp_compat.testing.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
