"""Rank routine of ``tests/runtime/test_whole_step.py``: the whole training step on ranks with and without images.

Imported in each rank process as ``lab.whole_step:whole_step_rank`` (the test puts ``tests/core`` on the ranks'
``PYTHONPATH``); it needs nothing from pytest. One run executes several cases in a row on one process group, each on
fresh models, so that the rank start-up (torch, transformers) is paid once.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fsdp_compat.testing.launch import RankResult
from fsdp_compat.testing.parity import (
    Diff,
    RankPositions,
    _fsdp_group_paths,
    accumulated_reference_backward,
    accumulation_step,
    init_group,
    loss_scale,
    rank_batches,
    reference_backward,
    runtime_counters,
    sharded_twins_step,
    twin_step,
    worse,
)
from fsdp_compat.testing.wraps import core_auto
from fsdp_compat.testing.zoo import build_model, make_batch

LR = 1e-3


def whole_step_rank(cfg: dict[str, Any], rank: int, extra: dict[str, Any]) -> RankResult:
    """Run every case of ``cfg["cases"]`` (dicts with ``kind``: accumulate, checkpoint or bf16) on ``cfg["model"]``;
    ``extra["cases"]`` gets each case's figures, the result's parity figures are the worst over the cases."""
    from torch.distributed.device_mesh import init_device_mesh

    dev = init_group(cfg, rank)
    mesh = init_device_mesh(dev.type, (cfg["world_size"],))
    scale = loss_scale(mesh)  # torch 2.8's FSDP2 over gloo sums gradients instead of averaging
    runners = {"accumulate": _accumulate, "checkpoint": _checkpoint, "bf16": _bf16}
    extra["cases"] = []
    worst = {"grads": 0.0, "params": 0.0}
    for case in cfg["cases"]:
        figures: dict[str, Any] = {"case": case}
        extra["cases"].append(figures)
        grads, params = runners[case["kind"]]({**cfg, **case}, rank, mesh, scale, figures)
        figures.update(grads=grads.abs, grads_rel=grads.rel, worst_grad=grads.where,
                       params=params.abs, params_rel=params.rel, worst_param=params.where)  # fmt: skip
        worst["grads"], worst["params"] = worse(worst["grads"], grads.abs), worse(worst["params"], params.abs)
    return RankResult(
        rank=rank, ok=True, max_abs_grad_diff=worst["grads"], max_abs_param_diff=worst["params"], extra=extra
    )


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR)


# ------------------------------------------------------------------------------------------ gradient accumulation


def _accumulate(cfg: dict[str, Any], rank: int, mesh: Any, scale: float, out: dict[str, Any]) -> tuple[Diff, Diff]:
    """``cfg["kinds"][r]``: rank r's micro-batch kinds in order (e.g. image then text); new batches every step;
    ``cfg["sync"]``: last / every (:func:`fsdp_compat.testing.parity.accumulation_step`); ``cfg["perturb"]``: a
    control that changes one gradient element of the sharded run on rank 0 before the comparison (``ulp``: one
    unit in the last place; ``nan``)."""
    name, world, seed = cfg["model"], cfg["world_size"], cfg["seed"]
    model = build_model(name, seed=seed)
    reference = copy.deepcopy(model)
    others = {"other_order": copy.deepcopy(model), "one_backward": copy.deepcopy(model)}
    out["plan"] = core_auto(model, {"mesh": mesh})
    opts = _optimizer(model), _optimizer(reference)
    positions = RankPositions(reference)
    diffs = Diff(), Diff()
    out["losses"], out["reference_losses"] = [], []
    for step in range(cfg["steps"]):
        micro = [
            [make_batch(name, seed=seed + 100 * step + 10 * r + k, variant=v) for k, v in enumerate(cfg["kinds"][r])]
            for r in range(world)
        ]
        before = _first_step_checks(model, others, micro, cfg, rank, out) if step == 0 else None
        losses, ref_losses = accumulation_step(
            model, reference, opts, micro, rank, diffs,
            sync=cfg["sync"], scale=scale, positions=positions, before_compare=before,
        )  # fmt: skip
        out["losses"].append([float(x) for x in losses])
        out["reference_losses"].append([float(x) for x in ref_losses[rank]])
    out["mixed_batches"] = runtime_counters(model)["mixed_batches"]
    return diffs


def _first_step_checks(
    model: nn.Module,
    others: dict[str, nn.Module],
    micro: list[list[Any]],
    cfg: dict[str, Any],
    rank: int,
    out: dict[str, Any],
) -> Callable[[], None]:
    """Run before the first comparison. How far two other references are from the sharded gradients: the same sums
    in the other accumulation order (``out["other_order"]``) and one process running all the micro-batches' backwards
    in a row (:func:`~fsdp_compat.testing.parity.reference_backward`, ``out["one_backward"]``): what the order
    the reference sums in is worth. Then the control's perturbation (``cfg["perturb"]``): rank 0 changes the first
    element of its shard of ``lm_head.weight``'s gradient (``ulp``: to the next float up, the smallest change
    there is; ``nan``)."""

    def check() -> None:
        other = "every" if cfg["sync"] == "last" else "last"
        accumulated_reference_backward(others["other_order"], micro, sync=other)
        reference_backward(others["one_backward"], [batch for batches in micro for batch in batches])
        for key, ref in others.items():
            diff = Diff()
            diff.add_grads(model, {name: p.grad for name, p in ref.named_parameters()})
            out[key] = diff.abs
        kind = cfg.get("perturb")
        if kind is None or rank != 0:
            return
        local = model.get_output_embeddings().weight.grad.to_local().view(-1)
        with torch.no_grad():
            local[0] = math.nan if kind == "nan" else torch.nextafter(local[0], torch.tensor(math.inf))

    return check


# ---------------------------------------------------------------------------------------- activation checkpointing


def _checkpoint(cfg: dict[str, Any], rank: int, mesh: Any, scale: float, out: dict[str, Any]) -> tuple[Diff, Diff]:
    """transformers' ``gradient_checkpointing_enable`` (``cfg["reentrant"]``: ``use_reentrant``) before sharding;
    the reference is the same weights, one process, no checkpointing (it changes no number). Counts how often the
    first text layer's and vision block's computation runs: a forward pre-hook on each submodule the block calls,
    2 per step when checkpointed (the forward and its recomputation). Not a hook on the block itself: where
    transformers puts the checkpoint (the block's ``__call__`` on 5.10.4, its ``forward`` on 5.25.0) decides
    whether the block's own hooks see the recomputation; its submodules are called by its forward either way."""
    model = build_model(cfg["model"], seed=cfg["seed"])
    reference = copy.deepcopy(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": cfg["reentrant"]})
    calls: dict[str, dict[str, int]] = {"text_layer": {}, "vision_block": {}}
    for key, block in (("text_layer", model.get_decoder().layers[0]), ("vision_block", model.model.visual.blocks[0])):
        for name, child in block.named_children():
            child.register_forward_pre_hook(
                lambda *_, seen=calls[key], name=name: seen.__setitem__(name, seen.get(name, 0) + 1)
            )
    out["plan"] = core_auto(model, {"mesh": mesh})
    batches = rank_batches(cfg, torch.device("cpu"))
    opts = _optimizer(model), _optimizer(reference)
    diffs = Diff(), Diff()
    out["losses"], out["reference_losses"] = [], []
    for _ in range(cfg["steps"]):
        step = twin_step(model, reference, opts, batches, rank, diffs, scale=scale)
        out["losses"].append(float(step.loss.detach()))
        out["reference_losses"].append(float(step.ref_losses[rank]))
    out["runs_per_step"] = {key: {name: n / cfg["steps"] for name, n in seen.items()} for key, seen in calls.items()}
    out["mixed_batches"] = runtime_counters(model)["mixed_batches"]
    return diffs


# ------------------------------------------------------------------------------------------------------------ bf16


def _per_layer(model: nn.Module, fsdp_kwargs: dict[str, Any]) -> None:
    """Plain per-layer FSDP2, written out (not fsdp-compat's planner): every ``_no_split_modules`` block a group,
    children first, then the root, which keeps the vision tower's other parts and every embedding (unsharded for
    the whole forward: nothing can be read while sharded)."""
    from torch.distributed.fsdp import fully_shard

    layers = set(model._no_split_modules or ())
    for module in [m for m in model.modules() if type(m).__name__ in layers][::-1]:
        fully_shard(module, **fsdp_kwargs)
    fully_shard(model, **fsdp_kwargs)


def _root_only(model: nn.Module, fsdp_kwargs: dict[str, Any]) -> None:
    """Another plan that cannot crash: one group, the root."""
    from torch.distributed.fsdp import fully_shard

    fully_shard(model, **fsdp_kwargs)


def _input_dtypes(model: nn.Module, paths: set[str]) -> dict[str, list[str]]:
    """The dtypes of the tensors each of these groups' modules receives, before FSDP2's mixed-precision cast (a
    forward pre-hook put ahead of FSDP2's own); filled as the model runs."""
    seen: dict[str, list[str]] = {}
    for path, module in model.named_modules():
        if path in paths:

            def record(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], path: str = path) -> None:
                tensors = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
                seen[path] = sorted({str(t.dtype) for t in tensors} | set(seen.get(path, ())))

            module.register_forward_pre_hook(record, with_kwargs=True, prepend=True)
    return seen


def _bf16(cfg: dict[str, Any], rank: int, mesh: Any, scale: float, out: dict[str, Any]) -> tuple[Diff, Diff]:
    """``auto`` against plain per-layer FSDP2 under one ``MixedPrecisionPolicy(bf16 params, fp32 reduce)``, both
    sharded, on this rank's batch; root-only FSDP2 against the same per-layer twin is the control that shows what a
    grouping that casts other inputs does (``out["root_only"]``, its first-step gradients separately). The twins
    get the same mixed micro-batch alignment as ``auto`` (any plan needs it with image|text ranks)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from fsdp_compat.runtime.mixed_batches import install_mixed_batches

    model = build_model(cfg["model"], seed=cfg["seed"])
    per_layer, root_only = copy.deepcopy(model), copy.deepcopy(model)
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fsdp_kwargs = {"mesh": mesh, "mp_policy": bf16}
    out["plan"] = core_auto(model, fsdp_kwargs)
    _per_layer(per_layer, fsdp_kwargs)
    _root_only(root_only, fsdp_kwargs)
    for twin in (per_layer, root_only):
        install_mixed_batches(twin)
    out["input_dtypes"] = _input_dtypes(model, set(_fsdp_group_paths(model)) - set(_fsdp_group_paths(per_layer)))
    models = [per_layer, model, root_only]
    opts = [_optimizer(m) for m in models]
    batch = rank_batches(cfg, torch.device("cpu"))[rank]
    diffs, control = (Diff(), Diff()), (Diff(), Diff())
    out["losses"] = []
    for step in range(cfg["steps"]):
        losses = sharded_twins_step(models, opts, batch, [diffs, control], scale=scale)
        out["losses"].append([float(x) for x in losses])
        if step == 0:
            out["root_only_first_grads"] = control[0].abs
    out["root_only"] = {"grads": control[0].abs, "params": control[1].abs, "worst_grad": control[0].where}
    out["groups"] = {"auto": _fsdp_group_paths(model), "per_layer": _fsdp_group_paths(per_layer)}
    out["mixed_batches"] = runtime_counters(model)["mixed_batches"]
    return diffs
