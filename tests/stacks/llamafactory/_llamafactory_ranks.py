"""Rank-side code for the LLaMA-Factory tests: shard through LLaMA-Factory's own FSDP2 plugin and compare
data-parallel training against one process.

Imported in fresh rank interpreters (this folder on PYTHONPATH). It imports no fsdp_compat adapter, so whatever
patches ``FSDP2Engine.prepare_model`` here is the ``.pth`` hook (or nothing, with ``FSDP_COMPAT=off``).

The path is the one LLaMA-Factory's v1 ``BaseTrainer._shard_model`` takes: ``DistributedInterface`` (its process
group and its 2-D ``(mp_replicate, mp_shard)`` model mesh, built from the torchrun variables set here; on a CPU-only
machine it picks gloo and a CPU mesh), then ``DistributedPlugin("fsdp2")(model, dist_config, bf16=False)``, which
builds an ``FSDP2Engine`` and calls ``shard_model`` -> ``prepare_model``.
"""

from __future__ import annotations

import copy
import os
from typing import Any

from fsdp_compat.testing.parity import Diff, twin_step

__all__ = ["engine_rank"]


def engine_rank(cfg: dict[str, Any], rank: int, extra: dict[str, Any]) -> None:
    """Shard zoo model ``cfg["model"]`` through LLaMA-Factory's ``fsdp2`` plugin, train this rank's own batch
    (seed 100 + rank) for ``cfg["steps"]`` AdamW steps; the reference, in every rank, does
    ``(ref(**batch_r).loss / W).backward()`` for every rank's batch, then one step. ``extra``: the groups, whether
    the engine's ``prepare_model`` is fsdp-compat's, and the worst absolute gradient and parameter differences."""
    import torch

    world = cfg["world_size"]
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cfg["port"]),
    )  # fmt: skip
    torch.set_num_threads(1)
    from llamafactory.v1.accelerator.interface import DistributedInterface
    from llamafactory.v1.config.arg_utils import PluginConfig
    from llamafactory.v1.plugins.trainer_plugins.distributed.hub import DistributedPlugin

    from fsdp_compat.testing.transformers_smoke import fsdp_groups
    from fsdp_compat.testing.zoo import build_model, make_batch

    interface = DistributedInterface()
    extra["mesh"] = str(interface.model_device_mesh)
    model = build_model(cfg["model"], seed=0)
    reference = copy.deepcopy(model)
    model = DistributedPlugin("fsdp2")(model, PluginConfig(name="fsdp2"), bf16=False)
    engine = __import__("llamafactory.v1.plugins.trainer_plugins.distributed.fsdp2", fromlist=["FSDP2Engine"])
    extra["patched"] = bool(getattr(engine.FSDP2Engine.prepare_model, "__fsdp_compat__", False))
    extra["groups"] = fsdp_groups(model)
    kinds = cfg.get("variants") or [None] * world  # e.g. ["image", "text"]: rank 1 without images
    batches = [make_batch(cfg["model"], seed=100 + r, **({"variant": k} if k else {})) for r, k in enumerate(kinds)]
    opts = (torch.optim.AdamW(model.parameters(), lr=1e-3), torch.optim.AdamW(reference.parameters(), lr=1e-3))
    grads, params = Diff(), Diff()  # NaN-failing
    for _ in range(cfg["steps"]):  # this rank's batch; the reference every rank's batch with the mean loss
        twin_step(model, reference, opts, batches, rank, (grads, params))
    extra["grad_diff"], extra["param_diff"] = grads.abs, params.abs
