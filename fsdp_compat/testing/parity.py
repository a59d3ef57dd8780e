"""The parity loop: W ranks train a zoo model under a wrap fn and compare with one process, exactly.

Data-parallel: every rank its own micro-batch; the single-process reference trains on all of them with the mean
loss (:func:`reference_backward`), so with 2 ranks gradients and post-AdamW parameters are equal (0.0). The
comparator (:class:`_Diff`) fails on NaN. Processes are :mod:`fsdp_compat.testing.launch`'s.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from typing import Any

from fsdp_compat.testing.launch import RankResult, RunResult, _jsonable, _resolve, _wrap_spec, run_ranks

__all__ = [
    "PARITY_TOL",
    "WrapFn",
    "gradient_reduction_factor",
    "rank_batches",
    "reference_backward",
    "run_training",
]

WrapFn = str  # "package.module:function", imported in each rank; called as fn(model, fsdp_kwargs) -> Any

PARITY_TOL = 1e-6  # max |Δ| / max(1, |reference|) accepted as exact fp32 parity


def run_training(
    model: str,
    wrap: WrapFn,
    *,
    world_size: int = 2,
    steps: int = 3,
    device: str = "cpu",
    timeout_s: float = 180.0,
    env: dict[str, str | None] | None = None,
    seed: int = 0,
    wrap_kwargs: dict[str, Any] | None = None,
    probe: WrapFn | None = None,
    python: str | None = None,
    variants: list[str] | None = None,
    same_batch: bool = False,
) -> RunResult:
    """Train zoo model ``model`` for ``steps`` AdamW steps on ``world_size`` ranks under ``wrap``: data-parallel.

    Every rank builds the model with ``seed`` and its own micro-batch (seed ``seed + rank``; ``variants[rank]``
    picks a vision-language model's kind of batch, e.g. ``["image", "text"]``), deep-copies the model as the
    single-process reference, and calls the wrap fn as ``fn(model, fsdp_kwargs)``. The reference trains on all the
    ranks' micro-batches with the mean of their losses (one backward per micro-batch of ``loss / world_size``,
    so that with 2 ranks its gradient sums are the ones FSDP2's reduce-scatter makes: exact, 0.0). Gradients are
    compared after each backward and parameters after each AdamW step. ``same_batch`` gives every rank rank 0's
    micro-batch. ``env`` is set in each rank before Python starts (a None value unsets that variable); ``python``
    runs the ranks under another interpreter (e.g. a framework's venv).
    """
    if world_size < 1:
        from fsdp_compat.errors import FsdpCompatError

        raise FsdpCompatError(f"world_size must be >= 1, got {world_size}")
    cfg = {
        "model": model,
        "wrap": _wrap_spec(wrap),
        "probe": _wrap_spec(probe),
        "steps": steps,
        "device": device,
        "seed": seed,
        "wrap_kwargs": wrap_kwargs or {},
        "variants": list(variants) if variants else None,
        "same_batch": same_batch,
    }
    if variants is not None and len(variants) != world_size:
        from fsdp_compat.errors import FsdpCompatError

        raise FsdpCompatError(f"variants names one batch kind per rank: {len(variants)} for {world_size} ranks")
    return run_ranks(
        "fsdp_compat.testing.parity:_train", cfg, world_size=world_size, timeout_s=timeout_s, env=env, python=python
    )


def _full(t: Any) -> Any:
    """A DTensor's full value (a collective: every rank calls it in the same order), else the tensor."""
    if t is None:
        return None
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


class _Diff:
    """Running max of absolute and relative differences, and where the worst one was."""

    def __init__(self) -> None:
        self.abs = 0.0
        self.rel = 0.0
        self.where = ""

    def add(self, name: str, got: Any, ref: Any) -> None:
        import torch

        if got is None and ref is None:
            return
        got = torch.zeros_like(ref) if got is None else got.detach().float()
        ref = torch.zeros_like(got) if ref is None else ref.detach().float()
        diff = (got - ref).abs()
        if diff.numel() == 0:
            return
        a = float(diff.max())
        r = float((diff / ref.abs().clamp_min(1.0)).max())
        if not (a <= self.abs):  # also catches nan
            self.abs = a
        if not (r <= self.rel):
            self.rel, self.where = r, name


def _train(cfg: dict[str, Any], rank: int, extra: dict[str, Any]) -> RankResult:
    """Set up the process group, wrap, train and compare; ``extra`` collects facts even when this fails."""
    import copy
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_compat.testing.zoo import build_model

    world_size, steps, device = cfg["world_size"], cfg["steps"], cfg["device"]
    cuda = device.startswith("cuda")
    extra.update(world_size=world_size, backend="nccl" if cuda else "gloo")
    t0 = time.perf_counter()
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
        dev = torch.device("cuda", torch.cuda.current_device())
    else:
        dev = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))  # ranks share the CPU cores
    dist.init_process_group(
        backend=extra["backend"],
        init_method=f"tcp://127.0.0.1:{cfg['port']}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=cfg["timeout_s"]),
    )
    model = build_model(cfg["model"], seed=cfg["seed"], device=dev)
    reference = copy.deepcopy(model)
    mesh = init_device_mesh(dev.type, (world_size,))
    fsdp_kwargs = {"mesh": mesh, "reshard_after_forward": True, **cfg["wrap_kwargs"]}
    extra["wrap"] = _jsonable(_resolve(cfg["wrap"])(model, fsdp_kwargs))
    extra["fsdp_groups"] = _fsdp_group_paths(model)
    extra["fsdp_group_sets"] = _fsdp_group_sets(model)
    extra["setup_s"] = time.perf_counter() - t0

    batches = rank_batches(cfg, dev)
    batch = batches[rank]
    scale = 1.0 / gradient_reduction_factor(mesh)  # torch 2.8's FSDP2 over gloo sums gradients instead of averaging
    extra["gradient_reduction_factor"] = 1.0 / scale
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    ref_params = dict(reference.named_parameters())
    grads, params = _Diff(), _Diff()
    losses: list[float] = []
    ref_losses: list[float] = []
    times: list[float] = []
    for _ in range(steps):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        loss = model(**batch).loss
        (loss * scale if scale != 1.0 else loss).backward()
        t_fb = time.perf_counter() - t
        ref_loss = reference_backward(reference, batches)[rank]
        named = list(model.named_parameters())
        with torch.no_grad():
            for name, p in named:
                grads.add(name, _full(p.grad), ref_params[name].grad)
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        times.append(t_fb + time.perf_counter() - t)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for name, p in named:
                params.add(name, _full(p), ref_params[name])
        losses.append(float(loss.detach()))
        ref_losses.append(float(ref_loss.detach()))
    extra["reference_losses"] = ref_losses
    extra["mixed_batches"] = _mixed_batch_counters(model)
    guard = _guard_of(model)
    extra["guard_unshards"] = guard.unshards if guard is not None else None
    extra["worst_grad_param"] = grads.where
    extra["worst_param"] = params.where
    if cfg.get("probe"):
        extra["probe"] = _jsonable(_resolve(cfg["probe"])())
    return RankResult(
        rank=rank,
        ok=True,
        losses=losses,
        max_abs_grad_diff=grads.abs,
        max_rel_grad_diff=grads.rel,
        max_abs_param_diff=params.abs,
        max_rel_param_diff=params.rel,
        step_time_s=statistics.median(times) if times else math.nan,
        extra=extra,
    )


def _mixed_batch_counters(model: Any) -> dict[str, int]:
    """This rank's dummy vision-tower calls and count exchanges (:mod:`fsdp_compat.mixed_batches`)."""
    from fsdp_compat.mixed_batches import mixed_batches_of

    installed = mixed_batches_of(model)
    return {
        "installed": len(installed),
        "dummy_calls": sum(m.dummy_calls for m in installed),
        "exchanges": sum(m.exchanges for m in installed),
    }


def _guard_of(model: Any) -> Any:
    from fsdp_compat.guard import guard_of

    return guard_of(model)


def rank_batches(cfg: dict[str, Any], device: Any) -> list[dict[str, Any]]:
    """Every rank's micro-batch (each rank builds all of them, for the reference): seed ``seed + rank`` and
    ``variants[rank]``, or rank 0's batch everywhere when ``same_batch``."""
    from fsdp_compat.testing.zoo import is_vlm, make_batch

    world, seed, name = cfg["world_size"], cfg["seed"], cfg["model"]
    variants = cfg.get("variants") or ["image"] * world
    out = []
    for r in range(world):
        kw = {"variant": variants[r]} if is_vlm(name) else {}
        out.append(make_batch(name, seed=seed if cfg.get("same_batch") else seed + r, device=device, **kw))
    return out


def reference_backward(reference: Any, batches: list[dict[str, Any]]) -> list[Any]:
    """One process training on all the ranks' micro-batches with the mean loss: ``(loss_r / W).backward()`` per
    micro-batch, accumulating into ``.grad``. Returns the per-micro-batch losses (unscaled)."""
    losses = []
    for b in batches:
        loss = reference(**b).loss
        (loss / len(batches)).backward()
        losses.append(loss.detach())
    return losses


def gradient_reduction_factor(mesh: Any) -> float:
    """What FSDP2 does to gradients across ranks on this torch and backend: 1.0 = averages (torch >= 2.9, NCCL),
    the world size = sums (torch 2.8 over gloo). Measured on a one-weight probe, so a test can scale its loss and
    still compare with the one-process mean; the product never does this."""
    import torch
    from torch.distributed.fsdp import fully_shard

    probe = torch.nn.Linear(1, 1, bias=False, device=mesh.device_type)
    with torch.no_grad():
        probe.weight.fill_(1.0)
    fully_shard(probe, mesh=mesh)
    probe(torch.ones(1, 1, device=mesh.device_type)).sum().backward()
    return float(_full(probe.weight.grad).item())


def _fsdp_group_sets(model: Any) -> list[list[str]]:
    """Module paths grouped by FSDP2 state: ``fully_shard([a, b])`` gives one entry with both paths."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    sets: dict[int, list[str]] = {}
    for path, m in model.named_modules(remove_duplicate=False):
        if isinstance(m, FSDPModule):
            paths = sets.setdefault(id(fully_shard.state(m)), [])
            if path not in paths:
                paths.append(path)
    return list(sets.values())


def _fsdp_group_paths(model: Any) -> list[str]:
    """Paths of the modules that are FSDP2 groups ("" is the root), in ``named_modules`` order."""
    from torch.distributed.fsdp import FSDPModule

    return [path for path, m in model.named_modules() if isinstance(m, FSDPModule)]
