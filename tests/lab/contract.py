"""Rank routines of tests/runtime/test_contract.py: plain FSDP2's contract, kept by the run-time layer that
fsdp-compat puts on every FSDP2 root (a forward method registered with FSDP2 as the first call, a dropped model, a
forward on one rank, one group for the whole model, a ``no_grad`` first forward before the optimizer exists).

Imported in fresh rank interpreters. ``cfg["shard"]`` picks who shards: ``own`` (a trainer's own ``fully_shard`` rule,
:func:`lab.every_root.own_apply_fsdp2`: fsdp-compat only through the installed ``.pth``, the generic layer), ``root``
(one ``fully_shard(model)`` call, nothing below it) or ``apply`` (``fsdp_compat.apply_fsdp2``).
"""

from __future__ import annotations

import copy
import gc
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

from fsdp_compat.testing.parity import Diff, init_group, loss_scale, runtime_counters, twin_step
from lab.every_root import own_apply_fsdp2

__all__ = ["contract_rank"]


def _shard(model: nn.Module, how: str, mesh: Any, **kwargs: Any) -> None:
    if how == "own":
        own_apply_fsdp2(model, {"mesh": mesh, **kwargs})
    elif how == "root":
        fully_shard(model, mesh=mesh, **kwargs)
    elif how == "replicate":  # FSDP2's data-parallel sibling: its state is an FSDPState, every rank the whole model
        from torch.distributed._composable.replicate_with_fsdp import replicate

        replicate(model, mesh=mesh, **kwargs)
    elif how == "apply":
        from fsdp_compat import apply_fsdp2

        apply_fsdp2(model, {"mesh": mesh, **kwargs})
    elif how == "install":  # plain fully_shard calls, then the run-time layer by hand
        own_apply_fsdp2(model, {"mesh": mesh, **kwargs})
        from fsdp_compat.runtime import install_runtime

        install_runtime(model)
    else:
        raise ValueError(how)


def _mesh(cfg: dict[str, Any]) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (cfg["world_size"],))


def _train(cfg: dict[str, Any], rank: int, extra: dict[str, Any], model: nn.Module, reference: nn.Module,
           mesh: Any, *, opt: Any = None) -> None:  # fmt: skip
    """``cfg["steps"]`` AdamW steps of ``model`` on this rank's batch against ``reference`` on every rank's batch."""
    from fsdp_compat.testing.zoo import make_batch

    opt = opt or torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    kinds = cfg["variants"]
    batches = [make_batch(cfg["model"], seed=100 + r, variant=kinds[r]) for r in range(cfg["world_size"])]
    grads, params = Diff(), Diff()
    extra["losses"], extra["reference_losses"] = [], []
    for _ in range(cfg.get("steps", 2)):
        step = twin_step(model, reference, (opt, ref_opt), batches, rank, (grads, params), scale=loss_scale(mesh))
        extra["losses"].append(float(step.loss.detach()))
        extra["reference_losses"].append(float(step.ref_losses[rank]))
    extra["grad_diff"], extra["param_diff"] = grads.abs, params.abs
    extra["worst_grad_param"], extra["worst_param"] = grads.where, params.where
    extra.update(runtime_counters(model))


def generate_first(cfg: dict[str, Any], rank: int, extra: dict[str, Any]) -> None:
    """A rollout before the first update: ``register_fsdp_forward_method(model, "generate")``, ``generate`` under
    ``no_grad`` as the root's first call (on this rank's prompt), then training against one process."""
    from fsdp_compat.testing.zoo import build_model
    from lab.generation import prompt

    model = build_model(cfg["model"], seed=0)
    reference = copy.deepcopy(model)
    mesh = _mesh(cfg)
    _shard(model, cfg["shard"], mesh)
    register_fsdp_forward_method(model, "generate")
    with torch.no_grad():
        out = model.generate(
            **prompt(cfg["model"], 200 + rank, cfg["variants"][rank], torch.device("cpu")),
            max_new_tokens=2, min_new_tokens=2, do_sample=False, synced_gpus=True,
        )  # fmt: skip
    extra["generated"] = list(out.shape)
    extra["modes_after_generate"] = len(torch.overrides._get_current_function_mode_stack())
    _train(cfg, rank, extra, model, reference, mesh)


def drop(cfg: dict[str, Any], rank: int, extra: dict[str, Any]) -> None:
    """For each way of sharding in ``cfg["ways"]``: shard, train a step, drop the model and its optimizer; whether
    the model and one of its parameters are still alive after ``gc.collect()``."""
    from fsdp_compat.testing.zoo import build_model, make_batch

    mesh = _mesh(cfg)
    alive: dict[str, list[bool]] = {}
    extra["armed"] = {}
    for how in cfg["ways"]:
        model = build_model(cfg["model"], seed=0)
        _shard(model, how, mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        batch = make_batch(cfg["model"], seed=100 + rank, variant=cfg["variants"][rank])
        model(**batch).loss.backward()
        opt.step()
        from fsdp_compat.runtime.guard import guard_of

        guard = guard_of(model)
        extra["armed"][how] = None if guard is None else guard.armed
        del guard
        refs = [weakref.ref(model), weakref.ref(next(model.parameters()))]
        del model, opt, batch
        gc.collect()
        alive[how] = [r() is not None for r in refs]
    extra["alive"] = alive


def soak(cfg: dict[str, Any], rank: int, extra: dict[str, Any]) -> None:
    """``cfg["rebuilds"]`` times: build the model, shard it (``cfg["shard"]``), train ``cfg["steps"]`` AdamW steps on
    this rank's batch, drop it. After each rebuild (and ``gc.collect()``): this process's resident memory (MiB) and
    how many of the models built so far are still alive."""
    from fsdp_compat.testing.zoo import build_model, make_batch

    mesh = _mesh(cfg)
    batch = make_batch(cfg["model"], seed=100 + rank, variant=cfg["variants"][rank])
    models: list[weakref.ref[nn.Module]] = []
    extra["rss_mib"], extra["alive"] = [], []
    for _ in range(cfg["rebuilds"]):
        model = build_model(cfg["model"], seed=0)
        _shard(model, cfg["shard"], mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(cfg["steps"]):
            model(**batch).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        models.append(weakref.ref(model))
        del model, opt
        gc.collect()
        extra["rss_mib"].append(_rss_mib())
        extra["alive"].append(sum(ref() is not None for ref in models))


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    import os

    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def one_rank_forward(cfg: dict[str, Any], rank: int, extra: dict[str, Any]) -> None:
    """``reshard_after_forward=False``, a training step, ``unshard()`` on every rank, then a ``no_grad`` sample on
    rank 0 alone (plain FSDP2 issues no collective there), then a barrier."""
    from fsdp_compat.testing.zoo import build_model, make_batch

    model = build_model(cfg["model"], seed=0)
    mesh = _mesh(cfg)
    _shard(model, cfg["shard"], mesh, reshard_after_forward=False)
    batch = make_batch(cfg["model"], seed=100 + rank, variant=cfg["variants"][rank])
    model(**batch).loss.backward()
    model.unshard()
    if rank == 0:
        with torch.no_grad():
            extra["sample_loss"] = float(model(**batch).loss)
    dist.barrier()
    extra.update(runtime_counters(model))


def train_after_no_grad_first(cfg: dict[str, Any], rank: int, extra: dict[str, Any]) -> None:
    """A ``no_grad`` forward as the root's first call (an evaluation before the optimizer exists), then the
    optimizer, then training against one process."""
    from fsdp_compat.testing.zoo import build_model, make_batch

    model = build_model(cfg["model"], seed=0)
    reference = copy.deepcopy(model)
    mesh = _mesh(cfg)
    _shard(model, cfg["shard"], mesh)
    with torch.no_grad():
        model(**make_batch(cfg["model"], seed=300 + rank, variant=cfg["variants"][rank]))
    extra["plain_params_after_eval"] = sum(not hasattr(p, "device_mesh") for p in model.parameters())
    _train(cfg, rank, extra, model, reference, mesh)


def train(cfg: dict[str, Any], rank: int, extra: dict[str, Any]) -> None:
    """Training against one process, sharded as ``cfg["shard"]`` says."""
    from fsdp_compat.testing.zoo import build_model

    model = build_model(cfg["model"], seed=0)
    reference = copy.deepcopy(model)
    mesh = _mesh(cfg)
    _shard(model, cfg["shard"], mesh)
    _train(cfg, rank, extra, model, reference, mesh)


CASES = {f.__name__: f for f in (generate_first, drop, soak, one_rank_forward, train_after_no_grad_first, train)}


def contract_rank(cfg: dict[str, Any], rank: int, extra: dict[str, Any]) -> None:
    init_group(cfg, rank)
    CASES[cfg["case"]](cfg, rank, extra)


def own_vlm(cfg: dict[str, Any], rank: int, extra: dict[str, Any]) -> None:
    """The user's own VLM class (``lab.own_vlm``), sharded by a trainer's rule (every block its own group, then the
    root), its row registered with ``fsdp_compat.register_family`` where ``cfg["register"]``; trains against one
    process."""
    from fsdp_compat.testing.zoo import build_model
    from lab.own_vlm import row

    if cfg["register"]:
        import fsdp_compat

        fsdp_compat.register_family(row())
    model = build_model(cfg["model"], seed=0)
    reference = copy.deepcopy(model)
    mesh = _mesh(cfg)
    for module in [*model.encoder.blocks, *model.decoder.blocks]:
        fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    _train(cfg, rank, extra, model, reference, mesh)

CASES["own_vlm"] = own_vlm
