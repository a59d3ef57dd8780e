"""The public kit: what a user of fsdp-compat needs to try it on a model and to prove the fix on real ranks.

- :mod:`~fsdp_compat.testing.zoo`: tiny real transformers models (GLM4V first) and valid batches for them
  (``build_model``, ``make_batch``; ``builder`` for the unseeded constructor, e.g. on the meta device).
- :mod:`~fsdp_compat.testing.skeleton`: models on the meta device, no weights: a zoo name, a ``config.json`` or a
  model folder (``build_skeleton``), or a full-size reference (``reference_skeleton``); what ``fsdp-compat plan``
  reads.
- :mod:`~fsdp_compat.testing.launch`: W fresh rank processes under one deadline, every process reaped, each failing
  rank's traceback reported (``run_ranks``).
- :mod:`~fsdp_compat.testing.parity`: the data-parallel training loop, a sharded model against one process training
  on every rank's micro-batch (``run_training``), and its pieces (``twin_step``, ``Diff``).
- :mod:`~fsdp_compat.testing.smoke`, :mod:`~fsdp_compat.testing.core_smoke`,
  :mod:`~fsdp_compat.testing.verl_smoke`, :mod:`~fsdp_compat.testing.skyrl_smoke`: ``fsdp-compat smoke``'s
  tables (core; verl's and SkyRL's own ``apply_fsdp2``, when installed).
- :mod:`~fsdp_compat.testing.wraps`: one wrap function per policy for ``run_training``
  (``"fsdp_compat.testing.wraps:core_auto"``).

Names resolve lazily, so importing this package costs nothing until one is used (then torch, and transformers
for models, are imported). fsdp-compat's own test lab (read corpus, guard models, checkpoint runs) lives with the
repository's tests, not here.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ZOO": "zoo",
    "ZooModel": "zoo",
    "build_model": "zoo",
    "builder": "zoo",
    "make_batch": "zoo",
    "build_skeleton": "skeleton",
    "reference_skeleton": "skeleton",
    "REFERENCE_NAMES": "skeleton",
    "RankResult": "launch",
    "RunResult": "launch",
    "run_ranks": "launch",
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
