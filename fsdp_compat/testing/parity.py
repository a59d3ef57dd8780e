"""The parity loop: W ranks train a model under a wrap fn and compare with one process, exactly.

Data-parallel: every rank its own micro-batch; the single-process reference trains on all of them with the mean
loss (:func:`reference_backward`), so with 2 ranks gradients and post-AdamW parameters are equal (0.0). One step of
both is :func:`twin_step`; the comparator (:class:`Diff`) fails on NaN. Every twin-training loop of the test support
(zoo models here, the guard's and the read corpus's models, peft, transformers' native FSDP2, checkpoints) is built
from these pieces. Processes are :mod:`fsdp_compat.testing.launch`'s.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fsdp_compat.testing.launch import RankResult, RunResult, _jsonable, _resolve, _wrap_spec, run_ranks

__all__ = [
    "GRADIENT_SYNCS",
    "PARITY_TOL",
    "Diff",
    "RankPositions",
    "Step",
    "WrapFn",
    "accumulated_reference_backward",
    "accumulation_step",
    "full_tensor",
    "gradient_reduction_factor",
    "init_group",
    "lm_loss",
    "loss_scale",
    "rank_batches",
    "rank_result",
    "reference_backward",
    "run_training",
    "runtime_counters",
    "sharded_twins_step",
    "twin_step",
    "worse",
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
    absent_is_zero: bool = False,
) -> RunResult:
    """Train zoo model ``model`` for ``steps`` AdamW steps on ``world_size`` ranks under ``wrap``: data-parallel.

    Every rank builds the model with ``seed`` and its own micro-batch (seed ``seed + rank``; ``variants[rank]``
    picks a vision-language model's kind of batch, e.g. ``["image", "text"]``), deep-copies the model as the
    single-process reference, and calls the wrap fn as ``fn(model, fsdp_kwargs)``. The reference trains on all the
    ranks' micro-batches with the mean of their losses (one backward per micro-batch of ``loss / world_size``,
    so that with 2 ranks its gradient sums are the ones FSDP2's reduce-scatter makes: exact, 0.0). Gradients are
    compared after each backward and parameters after each AdamW step. ``same_batch`` gives every rank rank 0's
    micro-batch. ``absent_is_zero``: a gradient on one side only is compared with zeros (default: it fails the
    comparison, see :class:`Diff`). ``env`` is set in each rank before Python starts (a None value unsets that
    variable); ``python`` runs the ranks under another interpreter (e.g. a framework's venv).
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
        "absent_is_zero": absent_is_zero,
    }
    if variants is not None and len(variants) != world_size:
        from fsdp_compat.errors import FsdpCompatError

        raise FsdpCompatError(f"variants names one batch kind per rank: {len(variants)} for {world_size} ranks")
    return run_ranks(
        "fsdp_compat.testing.parity:_train", cfg, world_size=world_size, timeout_s=timeout_s, env=env, python=python
    )


def full_tensor(t: Any) -> Any:
    """A DTensor's full value (a collective: every rank calls it in the same order), else the tensor."""
    if t is None:
        return None
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


def rank_result(
    rank: int, losses: list[float], grads: Diff, params: Diff, extra: dict[str, Any], step_time_s: float = math.nan
) -> RankResult:
    """A rank's successful result from its gradient and parameter comparisons (where each was worst goes in
    ``extra``)."""
    extra["worst_grad_param"], extra["worst_param"] = grads.where, params.where
    return RankResult(
        rank=rank,
        ok=True,
        losses=losses,
        max_abs_grad_diff=grads.abs,
        max_rel_grad_diff=grads.rel,
        max_abs_param_diff=params.abs,
        max_rel_param_diff=params.rel,
        step_time_s=step_time_s,
        extra=extra,
    )


def worse(worst: float, x: float) -> float:
    """The running maximum of a comparator, NaN-sticky: ``max(worst, nan)`` keeps ``worst``, this returns nan, and a
    later finite value does not replace it."""
    return worst if x <= worst or math.isnan(worst) else x


class Diff:
    """Running max of absolute and relative (``|Δ| / max(1, |ref|)``) differences, and where the worst relative one
    was. NaN-sticky (a NaN anywhere stays NaN: every assertion on it fails). Tensors of different shapes count as
    ``inf`` (a broadcast never hides a wrong shape); so does a tensor on one side only (a gradient the sharded model
    lost, or one it should not have), unless ``absent_is_zero``: then it is compared with zeros (a side that
    legitimately leaves ``.grad`` unset for a zero gradient)."""

    def __init__(self, *, absent_is_zero: bool = False) -> None:
        self.abs = 0.0
        self.rel = 0.0
        self.where = ""
        self.absent_is_zero = absent_is_zero

    def add(self, name: str, got: Any, ref: Any) -> None:
        import torch

        if got is None and ref is None:
            return
        one_side = got is None or ref is None
        if (one_side and not self.absent_is_zero) or (not one_side and tuple(got.shape) != tuple(ref.shape)):
            a = r = math.inf
        else:
            got = torch.zeros_like(ref) if got is None else got.detach().float()
            ref = torch.zeros_like(got) if ref is None else ref.detach().float()
            diff = (got - ref).abs()
            if diff.numel() == 0:
                return
            a = float(diff.max())
            r = float((diff / ref.abs().clamp_min(1.0)).max())
        self.abs = worse(self.abs, a)
        if not (r <= self.rel or math.isnan(self.rel)):  # worse(), and where
            self.rel, self.where = r, name

    def add_grads(self, model: Any, ref_grads: Mapping[str, Any]) -> None:
        """Every parameter's gradient (full tensor: a collective) against ``ref_grads[name]``."""
        import torch

        with torch.no_grad():
            for name, p in model.named_parameters():
                self.add(name, full_tensor(p.grad), ref_grads[name])

    def add_params(self, model: Any, ref_params: Mapping[str, Any]) -> None:
        """Every parameter (full tensor: a collective) against ``ref_params[name]``."""
        import torch

        with torch.no_grad():
            for name, p in model.named_parameters():
                self.add(name, full_tensor(p), ref_params[name])


def lm_loss(model: Any, batch: dict[str, Any]) -> Any:
    """A transformers-style model's loss: ``model(**batch).loss``."""
    return model(**batch).loss


@dataclass
class Step:
    """What :func:`twin_step` measured: this rank's (unscaled) loss, the reference's loss of every micro-batch, and
    the seconds of the sharded side (forward, backward, optimizer step)."""

    loss: Any
    ref_losses: list[Any]
    seconds: float


def twin_step(
    model: Any,
    reference: Any,
    opts: tuple[Any, Any],
    batches: list[Any],
    rank: int,
    diffs: tuple[Diff, Diff],
    *,
    scale: float = 1.0,
    loss: Callable[[Any, Any], Any] = lm_loss,
    ref_loss: Callable[[Any, Any], Any] | None = None,
    between: Callable[[], None] | None = None,
    before_compare: Callable[[], None] | None = None,
    sync: Callable[[], None] | None = None,
) -> Step:
    """One data-parallel step of the sharded ``model`` (on ``batches[rank]``, its loss times ``scale``) and of its
    unsharded twin ``reference`` (:func:`reference_backward` on all ``batches``), then each optimizer of ``opts``
    (model's, reference's) steps. ``diffs`` (grads, params; may be one Diff twice) get every gradient after the
    backwards and every parameter after the step. ``loss(model, batch)`` computes a loss (``ref_loss`` the
    reference's, default the same); ``between()`` runs between the sharded forward and backward (an evaluation
    pass), ``before_compare()`` before the gradients are compared (a NaN control); ``sync`` (e.g.
    ``torch.cuda.synchronize``) runs around the timed parts."""
    opt, ref_opt = opts
    grads, params = diffs
    if sync:
        sync()
    t = time.perf_counter()
    out = loss(model, batches[rank])
    if between:
        between()
    (out * scale if scale != 1.0 else out).backward()
    seconds = time.perf_counter() - t
    ref_losses = reference_backward(reference, batches, loss=ref_loss or loss)
    if before_compare:
        before_compare()
    ref_params = dict(reference.named_parameters())
    grads.add_grads(model, {name: p.grad for name, p in ref_params.items()})
    if sync:
        sync()
    t = time.perf_counter()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if sync:
        sync()
    seconds += time.perf_counter() - t
    ref_opt.step()
    ref_opt.zero_grad(set_to_none=True)
    params.add_params(model, ref_params)
    return Step(out, ref_losses, seconds)


def init_group(cfg: dict[str, Any], rank: int) -> Any:
    """Join the process group of a :func:`~fsdp_compat.testing.launch.run_ranks` rank on ``cfg["device"]`` (NCCL,
    one GPU a rank; else gloo, the CPU cores shared among the ranks; no ``device``: cpu); returns this rank's torch
    device. A collective waits ``cfg["collective_timeout_s"]`` (default: the run's deadline) before it raises: a case
    that shows ranks falling out of step ends there instead of at the deadline."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    cuda = cfg.get("device", "cpu").startswith("cuda")
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
        dev = torch.device("cuda", torch.cuda.current_device())
    else:
        dev = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg["world_size"]))  # ranks share the CPU cores
    dist.init_process_group(
        backend="nccl" if cuda else "gloo",
        init_method=f"tcp://127.0.0.1:{cfg['port']}",
        rank=rank,
        world_size=cfg["world_size"],
        timeout=timedelta(seconds=cfg.get("collective_timeout_s") or cfg["timeout_s"]),
    )
    return dev


def _train(cfg: dict[str, Any], rank: int, extra: dict[str, Any]) -> RankResult:
    """Set up the process group, wrap, train and compare; ``extra`` collects facts even when this fails."""
    import copy

    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_compat.testing.zoo import build_model

    world_size, steps, device = cfg["world_size"], cfg["steps"], cfg["device"]
    cuda = device.startswith("cuda")
    extra.update(world_size=world_size, backend="nccl" if cuda else "gloo")
    t0 = time.perf_counter()
    dev = init_group(cfg, rank)
    model = build_model(cfg["model"], seed=cfg["seed"], device=dev)
    reference = copy.deepcopy(model)
    mesh = init_device_mesh(dev.type, (world_size,))
    fsdp_kwargs = {"mesh": mesh, "reshard_after_forward": True, **cfg["wrap_kwargs"]}
    extra["wrap"] = _jsonable(_resolve(cfg["wrap"])(model, fsdp_kwargs))
    extra["fsdp_groups"] = _fsdp_group_paths(model)
    extra["fsdp_group_sets"] = _fsdp_group_sets(model)
    extra["setup_s"] = time.perf_counter() - t0

    batches = rank_batches(cfg, dev)
    scale = 1.0 / gradient_reduction_factor(mesh)  # torch 2.8's FSDP2 over gloo sums gradients instead of averaging
    extra["gradient_reduction_factor"] = 1.0 / scale
    opts = torch.optim.AdamW(model.parameters(), lr=1e-3), torch.optim.AdamW(reference.parameters(), lr=1e-3)
    grads, params = Diff(absent_is_zero=cfg.get("absent_is_zero", False)), Diff()
    losses: list[float] = []
    ref_losses: list[float] = []
    times: list[float] = []
    sync = torch.cuda.synchronize if cuda else None
    for _ in range(steps):
        step = twin_step(model, reference, opts, batches, rank, (grads, params), scale=scale, sync=sync)
        times.append(step.seconds)
        losses.append(float(step.loss.detach()))
        ref_losses.append(float(step.ref_losses[rank]))
    extra["reference_losses"] = ref_losses
    extra.update(runtime_counters(model))
    if cfg.get("probe"):
        extra["probe"] = _jsonable(_resolve(cfg["probe"])())
    return rank_result(rank, losses, grads, params, extra, statistics.median(times) if times else math.nan)


def runtime_counters(model: Any) -> dict[str, Any]:
    """What fsdp-compat's runtime did on this rank: the mixed-batch alignment's dummy vision- and audio-tower calls
    (a replayed media call counts as a dummy call), count exchanges and the generic mechanism's stops
    (``mixed_batches``), and the run-time guard's unshards (``guard_unshards``, None without a
    guard)."""
    from fsdp_compat.runtime.mixed_batches import mixed_batches_of

    installed = mixed_batches_of(model)
    guard = _guard_of(model)
    return {
        "mixed_batches": {
            "installed": len(installed),
            "dummy_calls": sum(m.dummy_calls for m in installed),
            "audio_dummy_calls": sum(m.audio_dummy_calls for m in installed),
            "exchanges": sum(m.exchanges for m in installed),
            "rounds": sum(getattr(m, "rounds", 0) for m in installed),  # the generic mechanism's stops
        },
        "guard_unshards": guard.unshards if guard is not None else None,
    }


def _guard_of(model: Any) -> Any:
    from fsdp_compat.runtime.guard import guard_of

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


def forget_image_positions(model: Any) -> None:
    """Drop the ``rope_deltas`` a Qwen2-VL-family model (GLM4V, Qwen2.5-VL, ...) cached from its last image batch.

    transformers 5.3 adds them to the next text-only *training* forward too (its ``compute_3d_position_ids``: ``elif
    self.rope_deltas is not None``); 5.6, 5.9, 5.10, 5.16 and 5.24 use them only while decoding. The reference
    runs every rank's micro-batch on one model, so rank 0's image positions would shift rank 1's text positions (by
    -3 in the zoo's GLM4V), which the rank itself never sees: equal in exact arithmetic (RoPE is relative), not in
    rounding."""
    for module in model.modules():
        if getattr(module, "rope_deltas", None) is not None:
            module.rope_deltas = None


def reference_backward(reference: Any, batches: list[Any], *, loss: Callable[[Any, Any], Any] = lm_loss) -> list[Any]:
    """One process training on all the ranks' micro-batches with the mean loss: ``(loss_r / W).backward()`` per
    micro-batch, accumulating into ``.grad`` (with W = 2 the halving is exact and the sum commutative: 0.0).
    ``loss(reference, batch)`` computes loss_r. Returns the per-micro-batch losses (unscaled). Each micro-batch
    starts without the previous one's cached image positions (:func:`forget_image_positions`), as on its rank."""
    losses = []
    for b in batches:
        forget_image_positions(reference)
        out = loss(reference, b)
        (out / len(batches)).backward()
        losses.append(out.detach())
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
    return float(full_tensor(probe.weight.grad).item())


_SCALES: dict[int, float] = {}


def loss_scale(mesh: Any) -> float:
    """1 / :func:`gradient_reduction_factor` (cached per mesh): the sharded model's loss is scaled by it so the
    mean-loss comparison holds on every torch and backend."""
    if id(mesh) not in _SCALES:
        _SCALES[id(mesh)] = 1.0 / gradient_reduction_factor(mesh)
    return _SCALES[id(mesh)]


# ------------------------------------------------------------------------------------------------------------
# The whole step: gradient accumulation summed in FSDP2's order, per-rank cached positions, sharded twins.

#: FSDP2's two accumulation modes (:func:`accumulation_step`): ``"last"`` = ``set_requires_gradient_sync(False)`` on
#: all but the last micro-batch (no-sync), ``"every"`` = a reduce-scatter after every micro-batch.
GRADIENT_SYNCS = ("last", "every")


class RankPositions:
    """What each rank's model has cached from its last forward (``rope_deltas``, the image positions of the
    Qwen2-VL family), kept per rank for the one reference model that runs every rank's micro-batches.

    A rank's model carries its cache into its next forward (its next micro-batch, its next step), never another
    rank's: :meth:`restore` before rank r's micro-batch gives the reference rank r's cache (none at first), and
    :meth:`save` after it keeps what that micro-batch left. Unlike :func:`forget_image_positions` (which forgets at
    every micro-batch) this matches a rank whose own micro-batches follow each other, e.g. an image one then a text
    one under gradient accumulation."""

    def __init__(self, model: Any) -> None:
        self._owners = [m for m in model.modules() if hasattr(m, "rope_deltas")]
        self._saved: dict[int, list[Any]] = {}

    def restore(self, rank: int) -> None:
        for owner, value in zip(self._owners, self._saved.get(rank, [None] * len(self._owners)), strict=True):
            owner.rope_deltas = value

    def save(self, rank: int) -> None:
        self._saved[rank] = [owner.rope_deltas for owner in self._owners]


def _ordered_sum(terms: list[Any]) -> Any:
    """``((t0 + t1) + t2) + ...`` over the terms that are not None (None when all are): the left-to-right order
    FSDP2 adds gradients in, a missing gradient being no term (as a parameter autograd never reached)."""
    present = [t for t in terms if t is not None]
    if not present:
        return None
    total = present[0].clone()
    for t in present[1:]:
        total += t
    return total


def accumulated_reference_backward(
    reference: Any,
    micro_batches: list[list[Any]],
    *,
    sync: str = "last",
    loss: Callable[[Any, Any], Any] = lm_loss,
    positions: RankPositions | None = None,
) -> list[list[Any]]:
    """One process training on every rank's micro-batches (``micro_batches[rank][k]``, K per rank) with the mean
    loss, its gradients summed in the order FSDP2 sums them under gradient accumulation; the sum is left in
    ``.grad``. Returns the unscaled losses, ``[rank][k]``.

    Each micro-batch's gradient ``g_rk`` (of ``loss / (W * K)``) is computed alone, then: ``sync="last"`` (no-sync)
    sums each rank's own micro-batches first (autograd accumulating into the unsharded gradient) and then the ranks
    (one reduce-scatter): ``sum_r(sum_k g_rk)``; ``sync="every"`` sums the ranks of each micro-batch (a
    reduce-scatter each) and then accumulates the reduced shards: ``sum_k(sum_r g_rk)``. Floating-point addition is
    not associative, so the order matters (a one-process backward of the micro-batches in a row sums
    ``((g_00 + g_01) + g_10) + g_11``, another rounding); with W = 2 every pairwise sum is commutative and the
    scaling a power of two, so the result is FSDP2's exactly. ``positions`` carries each rank's cached image
    positions (:class:`RankPositions`; default: a fresh one, as for ranks that start now)."""
    import torch

    if sync not in GRADIENT_SYNCS:
        from fsdp_compat.errors import FsdpCompatError

        raise FsdpCompatError(f"sync must be one of {', '.join(GRADIENT_SYNCS)}, got {sync!r}")
    world, micro = len(micro_batches), len(micro_batches[0])
    positions = positions or RankPositions(reference)
    params = dict(reference.named_parameters())
    grads: list[list[dict[str, Any]]] = []  # [rank][k] -> name -> gradient of that micro-batch alone
    losses: list[list[Any]] = []
    for rank, batches in enumerate(micro_batches):
        grads.append([])
        losses.append([])
        for batch in batches:
            for p in params.values():
                p.grad = None
            positions.restore(rank)
            out = loss(reference, batch)
            positions.save(rank)
            (out / (world * micro)).backward()
            losses[rank].append(out.detach())
            grads[rank].append({name: p.grad for name, p in params.items()})
    with torch.no_grad():
        for name, p in params.items():
            if sync == "last":
                per_rank = [_ordered_sum([g[name] for g in grads[r]]) for r in range(world)]
                p.grad = _ordered_sum(per_rank)
            else:
                per_micro = [_ordered_sum([grads[r][k][name] for r in range(world)]) for k in range(micro)]
                p.grad = _ordered_sum(per_micro)
    return losses


def accumulation_step(
    model: Any,
    reference: Any,
    opts: tuple[Any, Any],
    micro_batches: list[list[Any]],
    rank: int,
    diffs: tuple[Diff, Diff],
    *,
    sync: str = "last",
    scale: float = 1.0,
    loss: Callable[[Any, Any], Any] = lm_loss,
    positions: RankPositions | None = None,
    before_compare: Callable[[], None] | None = None,
) -> tuple[list[Any], list[list[Any]]]:
    """One optimizer step of gradient accumulation: the sharded ``model`` runs this rank's K micro-batches
    (``micro_batches[rank]``; each backward of ``loss * scale / K``), FSDP2 syncing gradients on the last only
    (``sync="last"``: ``set_requires_gradient_sync(False)`` before the others) or on every one (``"every"``); the
    reference is :func:`accumulated_reference_backward` in the same order. Then as :func:`twin_step`: ``diffs``
    (grads, params) get every gradient after the backwards (``before_compare()`` runs first: a control's
    perturbation) and every parameter after both optimizers step. Returns this rank's unscaled losses and the
    reference's (``[rank][k]``)."""
    grads, params = diffs
    batches = micro_batches[rank]
    outs = []
    for k, batch in enumerate(batches):
        model.set_requires_gradient_sync(sync == "every" or k == len(batches) - 1)
        out = loss(model, batch)
        (out * (scale / len(batches))).backward()
        outs.append(out.detach())
    ref_losses = accumulated_reference_backward(reference, micro_batches, sync=sync, loss=loss, positions=positions)
    if before_compare:
        before_compare()
    ref_params = dict(reference.named_parameters())
    grads.add_grads(model, {name: p.grad for name, p in ref_params.items()})
    for o in opts:
        o.step()
        o.zero_grad(set_to_none=True)
    params.add_params(model, ref_params)
    return outs, ref_losses


def sharded_twins_step(
    models: list[Any],
    opts: list[Any],
    batch: Any,
    diffs: list[tuple[Diff, Diff]],
    *,
    scale: float = 1.0,
    loss: Callable[[Any, Any], Any] = lm_loss,
) -> list[Any]:
    """One step of several sharded models with the same weights on this rank's ``batch``, each under another
    plan: ``models[0]`` is the reference, ``diffs[i]`` (grads, params) compares ``models[i + 1]`` with it (full
    gradients after the backwards, full parameters after every optimizer of ``opts`` steps). For what one process
    cannot be compared with: under a ``MixedPrecisionPolicy`` each FSDP2 group casts its own inputs, so the
    reference must be sharded too. Returns every model's loss on this rank."""
    import torch

    outs = []
    for model in models:
        out = loss(model, batch)
        (out * scale if scale != 1.0 else out).backward()
        outs.append(out.detach())
    with torch.no_grad():
        ref_grads = {name: full_tensor(p.grad) for name, p in models[0].named_parameters()}
    for model, (grads, _) in zip(models[1:], diffs, strict=True):
        grads.add_grads(model, ref_grads)
    for o in opts:
        o.step()
        o.zero_grad(set_to_none=True)
    with torch.no_grad():
        ref_params = {name: full_tensor(p) for name, p in models[0].named_parameters()}
    for model, (_, params) in zip(models[1:], diffs, strict=True):
        params.add_params(model, ref_params)
    return outs


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
