"""Test support: a zoo of tiny real transformers models, meta-device skeletons, and a distributed FSDP2
harness.

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
    "RankResult": "harness",
    "RunResult": "harness",
    "SmokeRow": "harness",
    "WrapFn": "harness",
    "format_smoke_table": "harness",
    "run_training": "harness",
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
