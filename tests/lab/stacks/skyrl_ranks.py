"""Rank-side code for the SkyRL tests: harness wrap fns and the Ray actor, with this machine's workarounds.

Imported in fresh rank interpreters and Ray workers (``tests/`` and ``tests/lab/stubs`` on PYTHONPATH). It
imports no fsdp_compat adapter, so whatever patches SkyRL here is the ``.pth`` hook (or an explicit wrap fn).

Test-only workarounds, never in the product:
- Python 3.11: skyrl 0.2-0.4 declare pydantic models over ``typing.TypedDict``, which pydantic rejects before
  3.12 (SkyRL requires 3.12); ``typing_extensions.TypedDict`` is the same thing there.
- ``FSDP_COMPAT_TEST_REPAIR_MPP=1``: skyrl-train 0.3.1's ``fsdp_strategy`` imports ``MixedPrecisionPolicy``
  from ``fsdp_utils``, which no longer has it; add it after ``fsdp_utils`` loads and before ``fsdp_strategy``
  does, so that runs without the adapter (``FSDP_COMPAT=off``) reach the real FSDP2 crash.
"""

from __future__ import annotations

import os
import sys
import typing
from typing import Any

if sys.version_info < (3, 12):
    import typing_extensions

    typing.TypedDict = typing_extensions.TypedDict  # type: ignore[misc]

from fsdp_compat.testing.skyrl_smoke import (
    _PACKAGES,
    installed_skyrl,
    probe,
    wrap_explicit,
    wrap_strategy,
)

__all__ = ["RayRank", "probe", "wrap_explicit", "wrap_explicit_late", "wrap_strategy"]


def _repair_mpp() -> None:
    found = installed_skyrl()
    if found is None or found[0] != "skyrl-train":
        return
    import importlib

    utils = importlib.import_module(f"{_PACKAGES['skyrl-train']}.fsdp_utils")
    if not hasattr(utils, "MixedPrecisionPolicy"):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        utils.MixedPrecisionPolicy = MixedPrecisionPolicy


if os.environ.get("FSDP_COMPAT_TEST_REPAIR_MPP") == "1":
    _repair_mpp()


def wrap_explicit_late(model: Any, fsdp_kwargs: dict[str, Any]) -> dict[str, Any]:
    """SkyRL's fsdp_strategy imported first, the adapter after it: the by-name binding must be rebound."""
    import importlib

    from fsdp_compat.testing.skyrl_smoke import strategy_module

    strategy = strategy_module()
    before = getattr(strategy.apply_fsdp2, "__fsdp_compat__", False)
    importlib.import_module("fsdp_compat.adapters.skyrl")
    info = wrap_strategy(model, fsdp_kwargs)
    info["strategy_patched_before_adapter_import"] = bool(before)
    return info


class RayRank:
    """A Ray actor (decorated in the test): one gloo rank that trains through SkyRL's ``apply_fsdp2``.

    Imports SkyRL first and records whether its ``apply_fsdp2`` was replaced before any fsdp_compat adapter
    was imported here; then runs the harness's rank routine (zoo GLM4V, AdamW, parity against a local copy).
    """

    def run(self, rank: int, world_size: int, port: int, steps: int, timeout_s: float) -> dict[str, Any]:
        import traceback
        from dataclasses import asdict

        adapter_before = "fsdp_compat.adapters.skyrl" in sys.modules
        from fsdp_compat.testing.skyrl_smoke import strategy_module

        strategy = strategy_module()
        patched = bool(getattr(strategy.apply_fsdp2, "__fsdp_compat__", False))
        seen = {
            "pid": os.getpid(),
            "adapter_imported_before_skyrl": adapter_before,
            "strategy_apply_fsdp2_patched_on_import": patched,
        }
        from fsdp_compat.testing import parity

        cfg = {
            "model": "glm4v",
            "wrap": "lab.stacks.skyrl_ranks:wrap_strategy",
            "probe": "lab.stacks.skyrl_ranks:probe",
            "world_size": world_size,
            "steps": steps,
            "device": "cpu",
            "timeout_s": timeout_s,
            "seed": 0,
            "wrap_kwargs": {},
            "port": port,
        }
        extra: dict[str, Any] = {}
        try:
            result = asdict(parity._train(cfg, rank, extra))
        except BaseException:
            result = {"rank": rank, "ok": False, "error": traceback.format_exc(), "extra": extra}
        result["extra"] = {**result.get("extra", {}), **seen}
        return result
