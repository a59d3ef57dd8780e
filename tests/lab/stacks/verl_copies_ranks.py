"""Rank-side code for the verl-copy tests: wrap fns that shard through each trainer's own ``apply_fsdp2``.

Imported in fresh rank interpreters (``tests/`` on PYTHONPATH). It imports no fsdp_compat adapter, so whatever
patches the trainer here is the ``.pth`` hook. Each fn imports ``apply_fsdp2`` by name from the trainer's module
(as its trainer does) and passes what that trainer passes; fp32 everywhere (the parity is exact).
"""

from __future__ import annotations

from typing import Any

__all__ = ["wrap_lmms_engine", "wrap_siirl", "wrap_trinity_rft"]


def _fp32(fsdp_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The harness's mesh and resharding plus an fp32 ``MixedPrecisionPolicy``: the keys the trainers build."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    fp32 = torch.float32
    return {**fsdp_kwargs, "mp_policy": MixedPrecisionPolicy(param_dtype=fp32, reduce_dtype=fp32, output_dtype=fp32)}


def wrap_lmms_engine(model: Any, fsdp_kwargs: dict[str, Any]) -> bool:
    """``FSDP2SFTTrainer.prepare_model``'s call: ``apply_fsdp2(model, fsdp_kwargs, transformer_cls_names_to_wrap)``
    with the wrap list of an unset ``fsdp_config.transformer_layer_cls_to_wrap`` (None: ``_no_split_modules``).
    Returns whether the function called is fsdp-compat's."""
    from lmms_engine.utils.fsdp2_utils import apply_fsdp2

    apply_fsdp2(model, _fp32(fsdp_kwargs), None)
    return bool(getattr(apply_fsdp2, "__fsdp_compat__", False))


def wrap_siirl(model: Any, fsdp_kwargs: dict[str, Any]) -> bool:
    """``siirl.engine.fsdp_workers``' call ``apply_fsdp2(actor_module, fsdp_kwargs, fsdp_config)`` with siirl's own
    default ``FSDPArguments`` as the dict its ``config.get("wrap_policy", {})`` reads (the dataclass itself has no
    ``get``); its ``wrap_policy`` names no layer classes, so ``_no_split_modules`` applies."""
    from siirl.params.model_args import FSDPArguments
    from siirl.utils.model_utils.fsdp_utils import apply_fsdp2

    apply_fsdp2(model, _fp32(fsdp_kwargs), FSDPArguments().to_dict())
    return bool(getattr(apply_fsdp2, "__fsdp_compat__", False))


def wrap_trinity_rft(model: Any, fsdp_kwargs: dict[str, Any]) -> bool:
    """``trinity.trainer.verl_legacy.fsdp_workers``' call ``apply_fsdp2(actor_module, fsdp_kwargs, fsdp_config)`` with
    verl 0.7.1's default ``FSDPEngineConfig`` (what ``omega_conf_to_dataclass`` makes of the actor's fsdp_config:
    no wrap list, so ``_no_split_modules``); the copy takes ``fully_shard`` from ``verl.utils.fsdp_utils``."""
    from trinity.trainer.verl_legacy.utils import apply_fsdp2
    from verl.workers.config import FSDPEngineConfig

    apply_fsdp2(model, _fp32(fsdp_kwargs), FSDPEngineConfig())
    return bool(getattr(apply_fsdp2, "__fsdp_compat__", False))
