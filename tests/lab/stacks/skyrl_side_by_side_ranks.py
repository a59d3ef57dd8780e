"""Rank-side wrap fn for the side-by-side tests: SkyRL's own ``fsdp_strategy.apply_fsdp2`` with both distributions
imported, and fsdp-compat's log records captured, so a test can see the warning a job shows.

Imported in fresh rank interpreters (``tests/`` on PYTHONPATH); it imports no fsdp_compat adapter itself.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import typing
from typing import Any

from lab.observe import LogLines

if sys.version_info < (3, 12):  # skyrl 0.2-0.4 on Python 3.11 (test-side workaround, see skyrl_ranks.py)
    import typing_extensions

    typing.TypedDict = typing_extensions.TypedDict  # type: ignore[misc]

ENV_ORDER = "FSDP_COMPAT_TEST_IMPORT_ORDER"  # comma-separated: skyrl-train, skyrl, adapter
ENV_VIA = "FSDP_COMPAT_TEST_VIA"  # the SkyRL distribution whose fsdp_strategy.apply_fsdp2 trains
ENV_LAYERS = "FSDP_COMPAT_TEST_LAYERS"  # the wrap list SkyRL's config names (comma-separated), else none

PACKAGES = {"skyrl-train": "skyrl_train.distributed", "skyrl": "skyrl.backends.skyrl_train.distributed"}




def _capture() -> LogLines:
    handler = LogLines(levels=True)
    logging.getLogger("fsdp_compat").addHandler(handler)
    return handler


def _adapter_state(module: str) -> dict[str, Any]:
    adapter = getattr(sys.modules.get(module), "ADAPTER", None)
    patched = adapter.patched() if adapter is not None else {}
    return {d: {"version": str(v), "activated_by": a, "policy": p} for d, (v, a, p) in patched.items()}


def _import_in_order() -> list[str]:
    """Import what ``FSDP_COMPAT_TEST_IMPORT_ORDER`` lists, in that order: distributions' fsdp_strategy, adapter."""
    done = []
    for item in [i for i in os.environ.get(ENV_ORDER, "skyrl-train,skyrl").split(",") if i]:
        if item == "adapter":
            importlib.import_module("fsdp_compat.adapters.skyrl")
        else:
            if item == "skyrl-train" and os.environ.get("FSDP_COMPAT") == "off":
                _repair_mpp()  # unpatched runs must reach the FSDP2 crash: 0.3.1 cannot import fsdp_strategy
            importlib.import_module(f"{PACKAGES[item]}.fsdp_strategy")
        done.append(item)
    return done


def _repair_mpp() -> None:
    """Test-side only: skyrl-train 0.3.1's fsdp_strategy imports a name its fsdp_utils lost (see FACTS)."""
    utils = importlib.import_module(f"{PACKAGES['skyrl-train']}.fsdp_utils")
    if not hasattr(utils, "MixedPrecisionPolicy"):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        utils.MixedPrecisionPolicy = MixedPrecisionPolicy


def _config(distribution: str) -> Any:
    from omegaconf import OmegaConf

    layers = [n for n in os.environ.get(ENV_LAYERS, "").split(",") if n]
    wrap_policy = {"transformer_layer_cls_to_wrap": layers} if layers else {}
    if distribution == "skyrl-train":
        base: dict[str, Any] = {"cpu_offload": False, "reshard_after_forward": True, "fsdp_size": -1}
        if wrap_policy:
            base["wrap_policy"] = wrap_policy
        return OmegaConf.create(base)
    from skyrl.train.config import FSDPConfig

    return FSDPConfig(wrap_policy=wrap_policy)


def skyrl_side_by_side(model: Any, fsdp_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Import both SkyRL distributions (and maybe the adapter) in the given order, then train through the
    ``fsdp_strategy.apply_fsdp2`` of ``FSDP_COMPAT_TEST_VIA`` with that release's own config object."""
    import torch

    records = _capture()
    order = _import_in_order()
    loaded = {d: sys.modules.get(f"{p}.fsdp_strategy") for d, p in PACKAGES.items()}
    strategies = {d: s for d, s in loaded.items() if s is not None}
    replaced = {d: bool(getattr(s.apply_fsdp2, "__fsdp_compat__", False)) for d, s in strategies.items()}
    via = os.environ.get(ENV_VIA, "skyrl")
    strategy = strategies[via]
    mp_policy = strategy.MixedPrecisionPolicy(
        param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=True
    )
    strategy.apply_fsdp2(model, {"mp_policy": mp_policy, "offload_policy": None, **fsdp_kwargs}, _config(via))
    return {
        "order": order,
        "via": via,
        "strategy_replaced": replaced,
        "patched": _adapter_state("fsdp_compat.adapters.skyrl"),
        "log": records.lines,
    }
