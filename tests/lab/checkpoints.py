"""Checkpoints across wrap policies: DCP save under one policy, load and resume under another, on real gloo ranks.

Users switch to fsdp-compat in the middle of long runs, on checkpoints written by the unpatched framework. The
wrap policy only decides which modules are FSDP2 groups; parameter and optimizer-state names, shapes and values
must not depend on it. :func:`run_phases` proves that on W fresh ranks: each *phase* builds a zoo model, shards it
under a policy, optionally loads a torch.distributed.checkpoint (DCP) written by an earlier phase or run, trains,
and saves DCP checkpoints plus the full state dict that verl and SkyRL gather for saving and for weight sync
(``get_model_state_dict(..., StateDictOptions(full_state_dict=True, cpu_offload=True))``) for the parent to compare.

The ranks run under :func:`fsdp_compat.testing.launch.run_ranks` (one deadline, every process killed and reaped,
each failing rank's traceback in the result) and train with :func:`fsdp_compat.testing.parity.twin_step`. Also here:
wrap fns for :func:`~fsdp_compat.testing.parity.run_training` that pass mixed precision and CPU offload through
:func:`fsdp_compat.apply.apply_fsdp2`.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fsdp_compat.testing.launch import RunResult, run_ranks

__all__ = ["Phase", "auto_bf16_cpu_offload", "dtype_probe", "load_full", "run_phases"]


@dataclass
class Phase:
    """One model's life in a rank: build, shard under ``policy``, maybe load, train to ``steps``, maybe save.

    ``load`` names a checkpoint tag written earlier (``<phase tag>_s<step>``); training resumes at that step.
    ``save_at`` lists the (1-based) steps after which a DCP checkpoint and the full state dicts are written.
    Each rank trains on its own micro-batch (:func:`~fsdp_compat.testing.parity.rank_batches`: seed ``rank``);
    ``reference`` also trains an unsharded deep copy on all the ranks' micro-batches with the mean loss
    (:func:`~fsdp_compat.testing.parity.twin_step`), for exact parity of the loss trajectory and of the
    parameters after every step (2 ranks: difference 0.0).
    ``rewrap`` tries ``apply_fsdp2`` a second time at the end (it must refuse and change nothing).
    """

    tag: str
    policy: str
    model: str = ""  # zoo model name; "" = the run's model
    seed: int = 0
    steps: int = 0
    load: str | None = None
    save_at: list[int] = field(default_factory=list)
    reference: bool = False
    rewrap: bool = False


def run_phases(
    model: str,
    phases: list[Phase],
    workdir: str | os.PathLike[str],
    *,
    world_size: int = 2,
    timeout_s: float = 180.0,
    device: str = "cpu",
) -> RunResult:
    """Run ``phases`` in order on ``world_size`` fresh ranks; checkpoints go to ``workdir`` (shared by runs).

    Each rank's ``extra["phases"]`` maps a phase tag to what it measured (losses by step, state-dict keys, the
    re-wrap error). Full state dicts are written by rank 0 as ``<workdir>/<tag>_s<step>_full.pt`` (at a save)
    and ``<workdir>/<tag>_loaded_full.pt`` (right after a load); read them with :func:`load_full`.
    """
    _validate(model, phases, Path(workdir))
    cfg = {
        "model": model,
        "phases": [asdict(p) for p in phases],
        "workdir": str(Path(workdir).resolve()),
        "device": device,
    }
    return run_ranks(f"{__name__}:_run", cfg, world_size=world_size, timeout_s=timeout_s)


def _validate(model: str, phases: list[Phase], workdir: Path) -> None:
    """Reject unknown policies, models and loads here, before paying for W interpreters."""
    from fsdp_compat.errors import FsdpCompatError
    from fsdp_compat.policies import resolve_policy
    from fsdp_compat.testing.zoo import _check_name

    saved: set[str] = set()
    for phase in phases:
        resolve_policy(phase.policy)
        _check_name(phase.model or model)
        if phase.load and phase.load not in saved and not (workdir / f"{phase.load}.json").is_file():
            raise FsdpCompatError(
                f"phase {phase.tag!r} loads {phase.load!r}, which no earlier phase saves and {workdir} does not "
                "hold; save it first (save_at) or fix the name (<tag>_s<step>)"
            )
        saved.update(f"{phase.tag}_s{step}" for step in phase.save_at)


def load_full(workdir: str | os.PathLike[str], name: str) -> dict[str, Any]:
    """A full state dict file written by rank 0: ``{"model": {fqn: tensor}, "optim": {...}}``."""
    import torch

    return torch.load(Path(workdir) / f"{name}_full.pt", map_location="cpu", weights_only=True)


# ------------------------------------------------------------------------------------------------------------
# Rank side


def _run(cfg: dict[str, Any], rank: int, extra: dict[str, Any]) -> None:
    """Rank routine of :func:`run_phases`: every phase in order, in this one process group."""
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_compat.testing.parity import init_group

    start = time.perf_counter()
    dev = init_group(cfg, rank)
    mesh = init_device_mesh(dev.type, (cfg["world_size"],))
    extra["phases"] = {}
    for spec in cfg["phases"]:
        phase = Phase(**spec)
        out: dict[str, Any] = {}
        extra["phases"][phase.tag] = out
        t0 = time.perf_counter()
        _phase(phase.model or cfg["model"], phase, Path(cfg["workdir"]), mesh, dev, out)
        out["seconds"] = time.perf_counter() - t0
    extra["setup_s"] = time.perf_counter() - start


def _full_state(model: Any, opt: Any) -> dict[str, Any]:
    """The gathered state verl/SkyRL save and sync to rollout engines (collective; complete on rank 0 only)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {
        "model": get_model_state_dict(model, options=options),
        "optim": get_optimizer_state_dict(model, opt, options=options),
    }


def _save_full(model: Any, opt: Any, path: Path) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    state = _full_state(model, opt)
    if dist.get_rank() == 0:
        torch.save(state, path)
    return state


def _phase(name: str, phase: Phase, workdir: Path, mesh: Any, dev: Any, out: dict[str, Any]) -> None:
    import copy

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from fsdp_compat.apply import apply_fsdp2
    from fsdp_compat.errors import FsdpCompatError
    from fsdp_compat.testing.parity import Diff, _fsdp_group_paths, loss_scale, rank_batches, twin_step
    from fsdp_compat.testing.zoo import build_model

    model = build_model(name, seed=phase.seed, device=dev)
    out["plain_keys"] = list(model.state_dict())
    reference = copy.deepcopy(model) if phase.reference else None
    fsdp_kwargs = {"mesh": mesh, "reshard_after_forward": True}
    plan = apply_fsdp2(model, fsdp_kwargs, policy=phase.policy)
    out["groups"] = [list(g.paths) for g in plan.groups]
    out["fsdp_groups"] = _fsdp_group_paths(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3) if reference is not None else None
    sharded = get_model_state_dict(model)
    out["sharded_keys"] = {k: [list(v.shape), type(v).__name__] for k, v in sharded.items()}
    # Not get_optimizer_state_dict here: on a fresh optimizer it runs a zero-lr step() to create the state, which
    # advances AdamW's step count and changes the trajectory. Only loads and saves call it.

    start = 0
    if phase.load:
        meta = json.loads((workdir / f"{phase.load}.json").read_text())
        before = _full_state(model, opt)["model"]
        if dist.get_rank() == 0:
            saved = torch.load(workdir / f"{phase.load}_full.pt", map_location="cpu", weights_only=True)["model"]
            out["differs_before_load"] = sorted(k for k in saved if not torch.equal(saved[k], before[k]))
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        dcp.load(state, checkpoint_id=str(workdir / phase.load))
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, opt, optim_state_dict=state["optim"])
        _save_full(model, opt, workdir / f"{phase.tag}_loaded_full.pt")
        start = int(meta["step"])
        out["loaded_step"] = start

    rank, world = dist.get_rank(), dist.get_world_size()
    batches = rank_batches({"model": name, "seed": 0, "world_size": world}, dev)  # each rank its own micro-batch
    scale = loss_scale(mesh)  # torch 2.8's FSDP2 over gloo sums gradients instead of averaging
    losses: dict[int, float] = {}
    ref_losses: dict[int, float] = {}
    grads, params = Diff(), Diff()
    for step in range(start + 1, phase.steps + 1):
        if reference is not None and ref_opt is not None:
            done = twin_step(model, reference, (opt, ref_opt), batches, rank, (grads, params), scale=scale)
            loss = done.loss
            ref_losses[step] = float(done.ref_losses[rank])
        else:
            loss = model(**batches[rank]).loss
            (loss * scale if scale != 1.0 else loss).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses[step] = float(loss.detach())
        if step in phase.save_at:
            tag = f"{phase.tag}_s{step}"
            state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
            dcp.save(state, checkpoint_id=str(workdir / tag))
            _save_full(model, opt, workdir / f"{tag}_full.pt")
            if dist.get_rank() == 0:
                (workdir / f"{tag}.json").write_text(json.dumps({"step": step, "policy": phase.policy}))
            dist.barrier()
    out["losses"] = {str(k): v for k, v in losses.items()}
    out["reference_losses"] = {str(k): v for k, v in ref_losses.items()}
    if reference is not None:
        out["max_abs_param_diff"], out["worst_param"] = params.abs, params.where
        out["max_abs_grad_diff"] = grads.abs
    if opt.state:
        out["optim_keys"] = sorted(get_optimizer_state_dict(model, opt)["state"])

    if phase.rewrap:
        before_groups = _fsdp_group_paths(model)
        try:
            apply_fsdp2(model, fsdp_kwargs, policy="auto")
            out["rewrap_error"] = None
        except FsdpCompatError as exc:
            out["rewrap_error"] = f"{type(exc).__name__}: {exc}"
        out["rewrap_groups_unchanged"] = before_groups == _fsdp_group_paths(model)
        # A user who already called fully_shard on one layer: refused too, and nothing more gets wrapped.
        from torch.distributed.fsdp import fully_shard

        fresh = build_model(name, seed=phase.seed, device=dev)
        layers = set(getattr(fresh, "_no_split_modules", None) or ())
        first = next(path for path, m in fresh.named_modules() if type(m).__name__ in layers)
        fully_shard(fresh.get_submodule(first), **fsdp_kwargs)
        try:
            apply_fsdp2(fresh, fsdp_kwargs, policy="auto")
            out["partial_error"] = None
        except FsdpCompatError as exc:
            out["partial_error"] = f"{type(exc).__name__}: {exc}"
        out["partial_layer"] = first
        out["partial_groups_after"] = _fsdp_group_paths(fresh)
    dist.barrier()


# ------------------------------------------------------------------------------------------------------------
# Wrap fns and a probe for run_training: kwargs that cannot travel as JSON (policy objects) are built in the rank.

_SEEN: dict[str, str] = {}


def _record_dtypes(model: Any) -> None:
    """Note the parameter dtype a layer computes with (FSDP2 casts at unshard time under mixed precision)."""
    layers = set(getattr(model, "_no_split_modules", None) or ())
    layer = next(m for m in model.modules() if type(m).__name__ in layers)

    def hook(module: Any, args: Any) -> None:
        param = next(module.parameters())
        _SEEN.setdefault("param_dtype_in_forward", str(param.dtype))

    layer.register_forward_pre_hook(hook)


def auto_bf16_cpu_offload(model: Any, fsdp_kwargs: dict[str, Any]) -> str:
    """``apply_fsdp2`` (auto) with bf16 mixed precision and ``CPUOffloadPolicy`` (pinning only with CUDA)."""
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    from fsdp_compat.apply import apply_fsdp2

    kwargs = {
        **fsdp_kwargs,
        "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16),
        "offload_policy": CPUOffloadPolicy(pin_memory=torch.cuda.is_available()),
    }
    _record_dtypes(model)  # before wrapping: FSDP2 renames the classes; its unshard hook is prepended
    plan = apply_fsdp2(model, kwargs, policy="auto")
    _SEEN["sharded_param_device"] = str(next(model.parameters()).to_local().device)
    return str(plan)


def dtype_probe() -> dict[str, str]:
    """What the wrap fns above observed in this rank."""
    return dict(_SEEN)
