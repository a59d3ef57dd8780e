"""Rank-side code for the AReaL tests: harness wrap fns that shard through AReaL's own FSDP2 code.

Imported in fresh rank interpreters (``tests/`` on PYTHONPATH). It imports no fsdp_compat adapter, so whatever
patches AReaL here is the ``.pth`` hook.
"""

from __future__ import annotations

from typing import Any

__all__ = ["wrap_parallelize_model"]


def wrap_parallelize_model(model: Any, fsdp_kwargs: dict[str, Any]) -> bool:
    """Shard ``model`` with ``areal.engine.fsdp_utils.parallel.parallelize_model``, the call AReaL's FSDPEngine
    makes: AReaL's own mesh (``ParallelHelper.build_mesh``: dp x sp x tp, flattened ``dp_sp``), an fp32
    ``TrainEngineConfig`` and no wrap-policy override; it calls ``apply_fsdp2`` (bound by name in ``parallel``).
    Returns whether the ``apply_fsdp2`` it called is fsdp-compat's."""
    import torch.distributed as dist
    from areal.api import FSDPParallelStrategy
    from areal.api.cli_args import TrainEngineConfig
    from areal.engine.fsdp_utils import parallel

    strategy = FSDPParallelStrategy(data_parallel_size=dist.get_world_size())
    helper = parallel.ParallelHelper.from_parallel_strategy(strategy)
    mesh = helper.build_mesh()
    config = TrainEngineConfig(experiment_name="fsdp-compat", trial_name="test", dtype="float32")
    config.grad_reduce_dtype = "float32"
    parallel.parallelize_model(model, config, model.config, mesh, helper, cpu_offload=None, wrap_policy=None)
    return bool(getattr(parallel.apply_fsdp2, "__fsdp_compat__", False))
