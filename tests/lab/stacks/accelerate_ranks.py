"""Rank-side code for the accelerate tests: shard through accelerate's own ``Accelerator.prepare`` (FSDP2) and compare
data-parallel training against one process.

Imported in fresh rank interpreters (``tests/`` on PYTHONPATH). It imports no fsdp_compat adapter, so whatever
patches ``fsdp2_prepare_model`` here is the ``.pth`` hook (or nothing, with ``FSDP_COMPAT=off``).

How a CPU machine gets accelerate's FSDP2 path. accelerate picks FSDP only on a GPU-type distributed state
(``AcceleratorState.__init__``: ``distributed_type in (MULTI_GPU, MULTI_NPU, ...)`` and an ``fsdp_plugin`` ->
``DistributedType.FSDP``); on a CPU process group ``PartialState`` says ``MULTI_CPU`` and ``prepare`` wraps the
model in DDP. The least invasive way found: build accelerate's ``PartialState`` as a CPU job normally does
(``cpu=True``: gloo backend, CPU device, our gloo group already initialised), then set the one field of its shared
state that names the kind, ``distributed_type``, to ``MULTI_GPU``, before the ``Accelerator`` is built. Nothing of
accelerate is replaced or mocked: ``AcceleratorState`` then takes its own FSDP branch, ``Accelerator.prepare`` its
own ``_prepare_fsdp2`` (optimizer parameter swap included), which calls ``fsdp2_prepare_model`` by name from
``accelerate.accelerator``; ``accelerator.backward`` and the prepared optimizer's ``step`` are accelerate's. The
device stays CPU (``PartialState.device``), the backend gloo; no ``torch.cuda`` is touched (nothing of it is
patched either).
"""

from __future__ import annotations

import copy
import logging
import os
import sys
from typing import Any

from fsdp_compat.testing.parity import Diff, init_group, reference_backward, runtime_counters
from lab.observe import LogLines, fsdp_groups

__all__ = ["LogLines", "accelerate_env", "accelerate_rank", "build_fsdp2_accelerator", "fsdp_groups", "gpu_type_state"]


def accelerate_env(cfg: dict[str, Any], rank: int) -> None:
    """What a launcher sets and accelerate's CPU path reads (``get_cpu_distributed_information``)."""
    world = cfg["world_size"]
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cfg["port"]), OMP_NUM_THREADS="1",
    )  # fmt: skip


def gpu_type_state() -> Any:
    """accelerate's ``PartialState`` built as a CPU job (gloo: the group exists already, :func:`init_group`; device
    cpu; ``MULTI_CPU``), then its shared ``distributed_type`` set to ``MULTI_GPU``: the one change, so that an
    ``Accelerator`` built afterwards (by the test, or by the HF Trainer with ``use_configured_state``) takes FSDP."""
    from accelerate import PartialState
    from accelerate.utils import DistributedType

    state = PartialState(cpu=True)
    assert state.distributed_type == DistributedType.MULTI_CPU and state.backend == "gloo", state
    state.distributed_type = DistributedType.MULTI_GPU
    return state


def build_fsdp2_accelerator(cfg: dict[str, Any]) -> Any:
    """accelerate's ``Accelerator`` with ``FullyShardedDataParallelPlugin(fsdp_version=2)`` on the CPU gloo group (see
    the module docstring for the one field set on accelerate's shared state)."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    gpu_type_state()
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",  # the Trainer's default with fsdp_version 2: _no_split_modules
        reshard_after_forward=True,
        state_dict_type="SHARDED_STATE_DICT",
        cpu_ram_efficient_loading=False,
        **cfg.get("plugin", {}),
    )
    accelerator = Accelerator(fsdp_plugin=plugin)
    assert accelerator.distributed_type == DistributedType.FSDP and accelerator.is_fsdp2, accelerator.state
    assert accelerator.device.type == "cpu", accelerator.device
    return accelerator


def accelerate_rank(cfg: dict[str, Any], rank: int, extra: dict[str, Any]) -> None:
    """Zoo model ``cfg["model"]`` prepared by accelerate's own ``Accelerator.prepare(model, optimizer)`` (FSDP2), this
    rank training on its own batch (``cfg["variants"][rank]``, seed 100 + rank) for ``cfg["steps"]`` AdamW steps
    through ``accelerator.backward`` and the prepared optimizer; every rank also trains the unsharded reference on
    all ranks' batches with the mean loss (:func:`~fsdp_compat.testing.parity.reference_backward`). ``extra``: the
    groups, whether accelerate's bindings are fsdp-compat's, fsdp-compat's log lines, the mixed-batch counters,
    the losses and the worst differences (gradients after each backward, parameters after each step)."""
    lines = LogLines()
    logging.getLogger("fsdp_compat").addHandler(lines)
    extra["log"] = lines.lines  # filled as it goes: a failing rank reports what was logged until then
    accelerate_env(cfg, rank)
    init_group(cfg, rank)  # gloo, with the run's timeout: a stuck collective fails instead of hanging

    import torch

    from fsdp_compat.testing.zoo import build_model, make_batch

    accelerator = build_fsdp2_accelerator(cfg)
    bindings = [sys.modules[name].fsdp2_prepare_model for name in cfg["bindings"]]
    extra["patched"] = [bool(getattr(f, "__fsdp_compat__", False)) for f in bindings]

    model = build_model(cfg["model"], seed=0)
    reference = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = accelerator.prepare(model, opt)
    extra["groups"] = fsdp_groups(model)

    kinds = cfg["variants"]
    batches = [make_batch(cfg["model"], seed=100 + r, variant=kinds[r]) for r in range(cfg["world_size"])]
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    grads, params = Diff(), Diff()  # NaN-failing
    extra["losses"], extra["reference_losses"] = [], []
    for _ in range(cfg["steps"]):
        loss = model(**batches[rank]).loss
        accelerator.backward(loss)
        ref_losses = reference_backward(reference, batches)
        ref_params = dict(reference.named_parameters())
        grads.add_grads(model, {name: p.grad for name, p in ref_params.items()})
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        params.add_params(model, ref_params)
        extra["losses"].append(float(loss.detach()))
        extra["reference_losses"].append(float(ref_losses[rank]))
    extra["grad_diff"], extra["param_diff"] = grads.abs, params.abs
    extra["worst_grad_param"], extra["worst_param"] = grads.where, params.where
    extra.update(runtime_counters(model))
