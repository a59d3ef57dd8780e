"""Rank-side code for the axolotl tests: axolotl's FSDP patches applied the way its model loader applies them, then
accelerate's own ``Accelerator.prepare`` (which then calls axolotl's ``fsdp2_prepare_model``) and the data-parallel
training of the accelerate tests.

Imported in fresh rank interpreters, with ``tests/`` on PYTHONPATH. It imports no
fsdp_compat adapter: what wraps axolotl's function here is the ``.pth`` hook (or nothing, with ``FSDP_COMPAT=off``).

Where it stops, and why. axolotl's ``ModelLoader`` runs ``PatchManager(cfg, model_config).
apply_pre_model_load_patches()``; with ``fsdp_config`` set, its ``_apply_fsdp_patches`` imports
``axolotl.monkeypatch.accelerate.fsdp2`` and calls ``patch_accelerate_fsdp2()`` (and axolotl's other FSDP patches:
transformers' missing-key init, accelerate's parallelism config, the full checkpoint, float8). This code runs that
method of axolotl's own ``PatchManager``, not the whole ``apply_pre_model_load_patches``: the next step,
``_apply_adapter_patches``, imports ``axolotl.loaders.model`` and through it bitsandbytes, axolotl's data pipeline
and its trainer builders (GPU-only or network-bound dependencies this CPU test does not install). axolotl's trainer
is the HF ``Trainer``, whose ``accelerator.prepare`` reaches ``Accelerator._prepare_fsdp2`` and the name
``accelerate.accelerator.fsdp2_prepare_model``; the test drives that same ``prepare`` directly (how a CPU gloo job
gets accelerate's FSDP2 path: ``tests/lab/stacks/accelerate_ranks.py``).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from lab.stacks.accelerate_ranks import LogLines, accelerate_rank

__all__ = ["apply_axolotl_fsdp_patches", "axolotl_rank"]


def apply_axolotl_fsdp_patches(model_type: str) -> None:
    """axolotl's own ``PatchManager._apply_fsdp_patches`` for an FSDP2 config (full fine-tune, no CPU-RAM-efficient
    loading, no activation checkpointing, no context parallelism): ``patch_accelerate_fsdp2()`` among them."""
    from axolotl.loaders.patch_manager import PatchManager
    from axolotl.utils.dict import DictDefault

    cfg = DictDefault(
        {
            "fsdp_version": 2,
            "fsdp_config": {
                "fsdp_version": 2,
                "reshard_after_forward": True,
                "cpu_ram_efficient_loading": False,
                "activation_checkpointing": False,
                "state_dict_type": "SHARDED_STATE_DICT",
            },
            "context_parallel_size": 1,
        }
    )
    PatchManager(cfg, DictDefault({"model_type": model_type}))._apply_fsdp_patches()


def axolotl_rank(cfg: dict[str, Any], rank: int, extra: dict[str, Any]) -> None:
    """axolotl's FSDP patches, then ``accelerate_rank`` (accelerate's ``prepare``, this rank's
    batch, the one-process reference). ``extra`` adds the whole log of this rank (``all_log``: the activation lines
    come when axolotl's modules load, before the accelerate helper attaches its handler) and whose function
    ``accelerate.accelerator`` calls (``binding``: module and name of the function under any fsdp-compat wrapper;
    ``wrapped``: whether it is fsdp-compat's)."""
    lines = LogLines()
    logging.getLogger("fsdp_compat").addHandler(lines)
    extra["all_log"] = lines.lines
    apply_axolotl_fsdp_patches(cfg["model"])
    bound = sys.modules["accelerate.accelerator"].fsdp2_prepare_model
    inner = getattr(bound, "__wrapped__", bound) if getattr(bound, "__fsdp_compat__", False) else bound
    extra["binding"] = f"{inner.__module__}.{inner.__qualname__}"
    extra["wrapped"] = bool(getattr(bound, "__fsdp_compat__", False))
    accelerate_rank(cfg, rank, extra)
