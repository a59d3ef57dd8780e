"""Rank-side code for the NeMo Automodel tests: shard through NeMo's own ``parallelize_model`` (FSDP2) and compare
data-parallel training against one process.

Imported in fresh rank interpreters (``tests/`` on PYTHONPATH). It imports no fsdp_compat adapter, so whatever
patches ``apply_fsdp2_sharding_recursively`` here is the ``.pth`` hook (or nothing, with ``FSDP_COMPAT=off``).

NeMo's path, nothing replaced or mocked: ``MeshContext.build(FSDP2Config(...), world_size=2)`` builds NeMo's own
device mesh (its ``_mesh_device_type`` says cpu on a gloo group; axes ``dp_replicate``, ``dp_shard``, ``cp``,
``tp`` and the flattened ``dp_shard_cp``), and ``parallelize_model(model, mesh_context)`` (what
``NeMoAutoModel.from_pretrained`` calls, ``_transformers/infrastructure.py``) runs the model's sidecar, the default
``ModelParallelizer._apply``: activation checkpointing (off here), ``apply_fsdp2_sharding_recursively``, the untied
input and output embeddings, the root. The one setting that departs from NeMo's defaults: an fp32
``MixedPrecisionPolicy`` (NeMo's default is bf16 parameters), so that the comparison with one process is exact.
"""

from __future__ import annotations

import copy
import importlib
import logging
import os
import sys
from typing import Any

from fsdp_compat.testing.parity import Diff, init_group, reference_backward, runtime_counters
from lab.observe import LogLines, fsdp_groups

__all__ = ["LogLines", "first_image_only", "fsdp_groups", "nemo_parallelize", "nemo_rank"]

PARALLELIZER = "nemo_automodel.components.distributed.parallelizer"


def nemo_parallelize(model: Any, world_size: int) -> Any:
    """NeMo Automodel's own FSDP2 entry point on its own mesh (fp32 mixed precision; everything else NeMo's
    defaults)."""
    import torch
    from nemo_automodel.components.distributed.config import FSDP2Config
    from nemo_automodel.components.distributed.mesh import MeshContext
    from nemo_automodel.components.distributed.model_parallelizer import parallelize_model
    from torch.distributed.fsdp import MixedPrecisionPolicy

    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False)
    mesh_context = MeshContext.build(FSDP2Config(mp_policy=fp32), world_size=world_size)
    assert mesh_context.device_mesh.device_type == "cpu", mesh_context.device_mesh
    return parallelize_model(model, mesh_context)


def nemo_rank(cfg: dict[str, Any], rank: int, extra: dict[str, Any]) -> None:
    """Zoo model ``cfg["model"]`` sharded by NeMo's ``parallelize_model``, this rank training on its own batch
    (``cfg["variants"][rank]``, seed 100 + rank) for ``cfg["steps"]`` AdamW steps; every rank also trains the
    unsharded reference on all ranks' batches with the mean loss, and a control reference on rank 0's batch in
    every rank's place (what a run that ignored rank 1 would equal: its difference must not be 0.0). ``extra``:
    the groups, whether NeMo's function is fsdp-compat's, the log lines, the mixed-batch counters, the losses and
    the worst differences (gradients after each backward, parameters after each step)."""
    lines = LogLines()
    logging.getLogger("fsdp_compat").addHandler(lines)
    extra["log"] = lines.lines  # filled as it goes: a failing rank reports what was logged until then
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(cfg["world_size"]))
    init_group(cfg, rank)  # gloo, with the run's timeout: a stuck collective fails instead of hanging

    import torch

    from fsdp_compat.testing.zoo import build_model, make_batch

    model = build_model(cfg["model"], seed=0)
    reference, control = copy.deepcopy(model), copy.deepcopy(model)
    model = nemo_parallelize(model, cfg["world_size"])
    shard_fn = sys.modules[PARALLELIZER].apply_fsdp2_sharding_recursively
    extra["patched"] = bool(getattr(shard_fn, "__fsdp_compat__", False))
    extra["groups"] = fsdp_groups(model)

    kinds = cfg["variants"]
    batches = [make_batch(cfg["model"], seed=100 + r, variant=kinds[r]) for r in range(cfg["world_size"])]
    for r in cfg.get("one_image_ranks", ()):
        batches[r] = first_image_only(batches[r], model.config.image_token_id)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, reference, control)]
    grads, params, control_grads = Diff(), Diff(), Diff()  # NaN-failing
    extra["losses"], extra["reference_losses"] = [], []
    for _ in range(cfg["steps"]):
        loss = model(**batches[rank]).loss
        loss.backward()
        ref_losses = reference_backward(reference, batches)
        reference_backward(control, [batches[0]] * len(batches))
        ref_params = dict(reference.named_parameters())
        grads.add_grads(model, {name: p.grad for name, p in ref_params.items()})
        control_grads.add_grads(model, {name: p.grad for name, p in control.named_parameters()})
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        params.add_params(model, ref_params)
        extra["losses"].append(float(loss.detach()))
        extra["reference_losses"].append(float(ref_losses[rank]))
    extra["grad_diff"], extra["param_diff"], extra["control_grad_diff"] = grads.abs, params.abs, control_grads.abs
    extra["worst_grad_param"], extra["worst_param"] = grads.where, params.where
    extra.update(runtime_counters(model))


def first_image_only(batch: dict[str, Any], image_token: int) -> dict[str, Any]:
    """A NaViT-packed image batch (MiniCPM-V: ``pixel_values`` ``(1, C, p, L)``, one ``target_sizes`` row per image,
    one image per text row) cut to its first image: the other rows' placeholders become text (id 16), their patches
    and sizes are dropped."""
    import torch

    ids = batch["input_ids"].clone()
    ids[1:][ids[1:] == image_token] = 16
    height, width = (int(v) for v in batch["target_sizes"][0])
    patch = batch["pixel_values"].shape[2]
    return {
        **batch,
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "labels": ids.masked_fill(ids == image_token, -100),
        "pixel_values": batch["pixel_values"][..., : height * width * patch].contiguous(),
        "target_sizes": batch["target_sizes"][:1].clone(),
    }


def raw_read_model() -> Any:
    """Two tables in an ``nn.ModuleList`` (so NeMo gives each a group); the parent reads the second one's weight
    raw, outside its forward: the bug class on NeMo's own rule."""
    import torch
    from torch import nn

    class Tables(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tables = nn.ModuleList([nn.Embedding(16, 8), nn.Embedding(16, 8)])
            self.head = nn.Linear(8, 1)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.tables[0](ids) + self.tables[1].weight[ids]).square().mean()

    torch.manual_seed(0)
    return Tables()


def raw_read_rank(cfg: dict[str, Any], rank: int, extra: dict[str, Any]) -> None:
    """:func:`raw_read_model` sharded by NeMo's own ``apply_fsdp2_sharding_recursively`` (as its ``_apply`` calls
    it: the model, NeMo's mesh, an fp32 policy) and then the root, each rank training on its own ids for 2 SGD
    steps against one process on both with the mean loss."""
    lines = LogLines()
    logging.getLogger("fsdp_compat").addHandler(lines)
    extra["log"] = lines.lines
    init_group(cfg, rank)

    import torch
    from nemo_automodel.components.distributed.config import FSDP2Config
    from nemo_automodel.components.distributed.mesh import MeshContext
    from nemo_automodel.components.distributed.mesh_utils import get_fsdp_dp_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from fsdp_compat.runtime.guard import guard_of

    parallelizer = importlib.import_module(PARALLELIZER)
    model = raw_read_model()
    reference = copy.deepcopy(model)
    mesh = get_fsdp_dp_mesh(MeshContext.build(FSDP2Config(), world_size=cfg["world_size"]).device_mesh)
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    parallelizer.apply_fsdp2_sharding_recursively(model, mesh, fp32)
    fully_shard(model, mesh=mesh, mp_policy=fp32, reshard_after_forward=False)
    extra["patched"] = bool(getattr(parallelizer.apply_fsdp2_sharding_recursively, "__fsdp_compat__", False))
    extra["groups"] = fsdp_groups(model)
    ids = [torch.randint(0, 16, (4, 5), generator=torch.Generator().manual_seed(100 + r)) for r in range(2)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    grads, params = Diff(), Diff()
    for _ in range(2):
        model(ids[rank]).backward()
        reference_backward(reference, ids, loss=lambda m, b: m(b))
        ref_params = dict(reference.named_parameters())
        grads.add_grads(model, {name: p.grad for name, p in ref_params.items()})
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        params.add_params(model, ref_params)
    extra["grad_diff"], extra["param_diff"] = grads.abs, params.abs
    guard = guard_of(model)
    extra["guard_unshards"] = guard.unshards if guard is not None else None
