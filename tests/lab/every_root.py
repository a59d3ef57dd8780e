"""Rank-side code of the generic layer's tests: a trainer fsdp-compat has no adapter for shards the model with
``fully_shard`` by its own rule, and trains it data-parallel against one process.

Imported in fresh rank interpreters. The trainer below is written as such trainers are (verl's old rule, copied by
lmms-engine, miles, siirl, ROLL): ``fully_shard`` bound by name when this module is imported, every
``_no_split_modules``-class module and every untied ``nn.Embedding`` its own group, then the root. Nothing of
fsdp-compat is imported here: whatever protects the job is the installed ``.pth`` hook (or, with
``cfg["activate"] == "late"``, an explicit ``import fsdp_compat.adapters.fsdp2`` after the model was sharded).
"""

from __future__ import annotations

import copy
import importlib
import logging
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard  # bound by name at import, as every such trainer does

from fsdp_compat.testing.parity import Diff, init_group, loss_scale, runtime_counters, twin_step
from lab.observe import LogLines, fsdp_groups

__all__ = ["own_apply_fsdp2", "own_trainer_rank", "train_own_rule"]


def own_apply_fsdp2(model: nn.Module, fsdp_kwargs: dict[str, Any]) -> None:
    """A trainer's own sharding: layer classes from ``_no_split_modules``, every embedding when untied, the root."""
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    tied = getattr(model.config, "tie_word_embeddings", False)
    targets = [
        m
        for m in model.modules()
        if type(m).__name__ in layer_classes or (isinstance(m, nn.Embedding) and not tied)
    ]
    for module in reversed(targets):  # children first, as FSDP2 requires
        fully_shard(module, **fsdp_kwargs)
    fully_shard(model, **fsdp_kwargs)


def own_trainer_rank(cfg: dict[str, Any], rank: int, extra: dict[str, Any]) -> None:
    """Zoo model ``cfg["model"]`` sharded by :func:`own_apply_fsdp2`, this rank on its own batch
    (``cfg["variants"][rank]``, seed 100 + rank) for ``cfg["steps"]`` AdamW steps, against the unsharded reference
    on every rank's batch with the mean loss. ``extra``: the groups, fsdp-compat's log lines, whether the guard is
    armed, the run-time counters, losses and the worst differences. ``cfg["debug_log"]``: the DEBUG lines too, each
    line starting with its level (else the lines a job shows, INFO and above, without it)."""
    debug = bool(cfg.get("debug_log"))
    lines = LogLines(levels=debug)
    logging.getLogger("fsdp_compat").addHandler(lines)
    if debug:
        logging.getLogger("fsdp_compat").setLevel(logging.DEBUG)
    extra["log"] = lines.lines
    init_group(cfg, rank)
    train_own_rule(cfg, rank, extra)


def train_own_rule(cfg: dict[str, Any], rank: int, extra: dict[str, Any]) -> None:
    """:func:`own_trainer_rank`'s training, in the process group that exists now."""
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_compat.testing.zoo import build_model, make_batch

    model = build_model(cfg["model"], seed=0)
    reference = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (cfg["world_size"],))
    scale = loss_scale(mesh)  # torch 2.8 over gloo sums gradients: the harness scales, the product does not
    if cfg.get("rule") == "replicate":  # FSDP2's data-parallel sibling: a _ReplicateState is an FSDPState
        from torch.distributed._composable.replicate_with_fsdp import replicate

        replicate(model, mesh=mesh)
    else:
        own_apply_fsdp2(model, {"mesh": mesh})
    if cfg.get("activate") == "late":
        importlib.import_module("fsdp_compat.adapters.fsdp2")
    extra["groups"] = fsdp_groups(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    kinds = cfg["variants"]
    batches = [make_batch(cfg["model"], seed=100 + r, variant=kinds[r]) for r in range(cfg["world_size"])]
    grads, params = Diff(), Diff()  # NaN-failing
    extra["losses"], extra["reference_losses"] = [], []
    for _ in range(cfg["steps"]):
        step = twin_step(model, reference, (opt, ref_opt), batches, rank, (grads, params), scale=scale)
        extra["losses"].append(float(step.loss.detach()))
        extra["reference_losses"].append(float(step.ref_losses[rank]))
    extra["grad_diff"], extra["param_diff"] = grads.abs, params.abs
    extra["worst_grad_param"], extra["worst_param"] = grads.where, params.where
    extra.update(runtime_counters(model))
    from fsdp_compat.runtime.guard import guard_of

    guard = guard_of(model)
    extra["guard_armed"] = None if guard is None else guard.armed
