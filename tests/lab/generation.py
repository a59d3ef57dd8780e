"""Rank routines of tests/runtime/test_generation.py: every forward that is not a training forward, on a sharded
vision-language model, against an unsharded copy of the same model on the same rank.

Each rank builds the zoo model, keeps a deep copy as its one-process reference, shards the model (``cfg["plan"]``)
and runs ``cfg["cases"]`` in order on its own prompt (``cfg["variants"][rank]``: an image prompt or a text one), so
the cases see the model as a job would: a ``generate`` before any forward, a log-prob pass, ``generate`` again after
it, a training step at the end. ``extra[case]`` gets what a test asserts: exact equality flags, the largest
difference, and the rank's mixed-batch counters during the case. Every case ends in an all-reduce, so a rank that runs
more or fewer collectives than its peers shows as a collective mismatch (or a hang the launcher ends), not a pass.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

NEW_TOKENS = 3  # per generate call: the prefill and two decode steps (the sampling case: 2 and 4 by rank)


# ------------------------------------------------------------------------------------------------ set-up


def prompt(name: str, seed: int, variant: str, device: torch.device) -> dict[str, torch.Tensor]:
    """The zoo's micro-batch as a generation prompt: no labels, rows left-padded (``generate`` appends on the
    right)."""
    from fsdp_compat.testing.zoo import make_batch

    batch = make_batch(name, seed=seed, variant=variant, device=device)
    batch.pop("labels")
    lengths = batch["attention_mask"].sum(-1).tolist()
    for key in ("input_ids", "attention_mask", "mm_token_type_ids"):
        if key in batch:
            rows = [torch.cat([row[n:], row[:n]]) for row, n in zip(batch[key], lengths, strict=True)]
            batch[key] = torch.stack(rows)
    return batch


def _shard(model: nn.Module, plan: str, mesh: Any) -> None:
    from torch.distributed.fsdp import fully_shard

    if plan == "auto":  # fsdp-compat's applier (it installs the runtime)
        from fsdp_compat.apply import apply_fsdp2

        apply_fsdp2(model, {"mesh": mesh})
        return
    if plan == "blocks":  # a framework's own plain wrap: every vision block and text layer, then the root
        inner = model.model
        for block in [*inner.visual.blocks, *inner.language_model.layers]:
            fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)  # "root": one group for everything
    if not plan.endswith("-bare"):
        from fsdp_compat.runtime import install_runtime

        install_runtime(model)


def counters(model: nn.Module) -> dict[str, int]:
    from fsdp_compat.runtime.mixed_batches import mixed_batches_of

    installed = mixed_batches_of(model)
    names = ("exchanges", "dummy_calls", "audio_dummy_calls", "outside_calls", "decode_steps")
    return {n: sum(getattr(m, n) for m in installed) for n in names}


def _delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after}


def _max_diff(got: torch.Tensor, ref: torch.Tensor) -> float:
    if got.shape != ref.shape:
        return float("inf")
    diff = (got.detach().float() - ref.detach().float()).abs()
    return float(diff.max()) if diff.numel() else 0.0


# ------------------------------------------------------------------------------------------------ cases


def _generate(model: nn.Module, ref: nn.Module, p: dict[str, Any], seed: int | None, **kw: Any) -> dict[str, Any]:
    kw = {"max_new_tokens": NEW_TOKENS, "do_sample": False, "output_scores": True,
          "return_dict_in_generate": True, "pad_token_id": 0, **kw}  # fmt: skip
    outs = []
    for m in (model, ref):
        if seed is not None:
            torch.manual_seed(seed)
        outs.append(m.generate(**p, **kw))
    got, want = outs
    return {
        "tokens": got.sequences.tolist(),
        "ref_tokens": want.sequences.tolist(),
        "scores_equal": len(got.scores) == len(want.scores)
        and all(torch.equal(a, b) for a, b in zip(got.scores, want.scores, strict=True)),
        "max_score_diff": max((_max_diff(a, b) for a, b in zip(got.scores, want.scores, strict=False)), default=0.0),
        "new_tokens": got.sequences.shape[1] - p["input_ids"].shape[1],
    }


def _log_probs(model: nn.Module, p: dict[str, Any]) -> torch.Tensor:
    logits = model(**p).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, p["input_ids"][:, 1:, None])[..., 0]


def case_generate(ctx: dict[str, Any]) -> dict[str, Any]:
    """Greedy generation of a few tokens."""
    with torch.no_grad():
        return _generate(ctx["model"], ctx["ref"], ctx["prompt"], None)


def case_sample(ctx: dict[str, Any]) -> dict[str, Any]:
    """Sampling, a different number of new tokens per rank (2, 4, ...): the ranks stop at different lengths.
    ``synced_gpus`` is left to its default unless the case config sets it."""
    extra = {} if ctx["synced_gpus"] is None else {"synced_gpus": ctx["synced_gpus"]}
    with torch.no_grad():
        return _generate(ctx["model"], ctx["ref"], ctx["prompt"], 1234 + ctx["rank"],
                         max_new_tokens=2 + 2 * (ctx["rank"] % 2), do_sample=True, top_k=0, **extra)  # fmt: skip


def case_eos(ctx: dict[str, Any]) -> dict[str, Any]:
    """Greedy, one prompt row per rank, and an end-of-sequence token that rank 0 generates at its second step
    (found on the reference): rank 0 stops early, the others run on."""
    rank, ref = ctx["rank"], ctx["ref"]
    row0 = {k: v[:1] for k, v in ctx["prompts"][0].items() if k not in ("pixel_values", "image_grid_thw")}
    first = ctx["prompts"][0]
    if "image_grid_thw" in first:  # row 0's image only
        grid = first["image_grid_thw"][:1]
        row0["image_grid_thw"], row0["pixel_values"] = grid, first["pixel_values"][: int(grid.prod())]
    with torch.no_grad():
        probe = copy.deepcopy(ref).generate(**row0, max_new_tokens=2, do_sample=False, pad_token_id=0)
    eos = int(probe[0, -1])
    mine = {k: v[:1] for k, v in ctx["prompt"].items() if k not in ("pixel_values", "image_grid_thw")}
    if "image_grid_thw" in ctx["prompt"]:
        grid = ctx["prompt"]["image_grid_thw"][:1]
        mine["image_grid_thw"], mine["pixel_values"] = grid, ctx["prompt"]["pixel_values"][: int(grid.prod())]
    with torch.no_grad():
        out = _generate(ctx["model"], ref, mine, None, max_new_tokens=NEW_TOKENS + 2, eos_token_id=eos)
    out["eos"] = eos
    out["rank"] = rank
    return out


def case_logprobs(ctx: dict[str, Any]) -> dict[str, Any]:
    """A log-prob pass (``torch.no_grad()``) and the same under ``model.eval()``."""
    model, ref, p = ctx["model"], ctx["ref"], ctx["prompt"]
    out = {}
    with torch.no_grad():
        out["no_grad"] = _max_diff(_log_probs(model, p), _log_probs(ref, p))
        model.eval(), ref.eval()
        try:
            out["eval"] = _max_diff(_log_probs(model, p), _log_probs(ref, p))
        finally:
            model.train(), ref.train()
    return out


def _tower_input(p: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor] | None:
    if "pixel_values" in p:
        return p["pixel_values"], p["image_grid_thw"]
    return None


def case_features(ctx: dict[str, Any]) -> dict[str, Any]:
    """``model.get_image_features`` outside any forward (what transformers >= 5.2x's generate does), on the image
    ranks only; then every rank runs a log-prob pass."""
    return _outside(ctx, lambda m, px, grid: m.get_image_features(px, grid))


def case_visual(ctx: dict[str, Any]) -> dict[str, Any]:
    """A direct ``model.model.visual(...)`` call outside any forward, on the image ranks only; then every rank runs a
    log-prob pass."""
    return _outside(ctx, lambda m, px, grid: m.model.visual(px, grid_thw=grid))


def _outside(ctx: dict[str, Any], call: Any) -> dict[str, Any]:
    from fsdp_compat.runtime.mixed_batches import _floating_tensors

    model, ref, p = ctx["model"], ctx["ref"], ctx["prompt"]
    out: dict[str, Any] = {"called": False}
    with torch.no_grad():
        tower_input = _tower_input(p)
        if tower_input is not None:
            got = list(_floating_tensors(call(model, *tower_input)))
            want = list(_floating_tensors(call(ref, *tower_input)))
            out["called"] = True
            out["features"] = len(got)
            out["max_feature_diff"] = max(_max_diff(a, b) for a, b in zip(got, want, strict=True))
        out["logprobs"] = _max_diff(_log_probs(model, p), _log_probs(ref, p))
    return out


def case_train(ctx: dict[str, Any]) -> dict[str, Any]:
    """One data-parallel AdamW step on the ranks' training micro-batches (the zoo's, with labels) against the
    reference training on all of them: the FSDP2 state the cases before left behind is a sound one."""
    from fsdp_compat.testing.parity import Diff, forget_image_positions, loss_scale, twin_step
    from fsdp_compat.testing.zoo import make_batch

    model, ref = ctx["model"], ctx["ref"]
    name, dev, variants = ctx["name"], ctx["device"], ctx["variants"]
    batches = [make_batch(name, seed=r, variant=variants[r], device=dev) for r in range(len(variants))]
    forget_image_positions(model)
    forget_image_positions(ref)
    grads, params = Diff(), Diff()
    twin_step(model, ref, ctx["opts"], batches, ctx["rank"], (grads, params), scale=loss_scale(ctx["mesh"]))
    return {"grad_diff": grads.abs, "param_diff": params.abs, "worst_param": params.where, "worst_grad": grads.where}


CASES = {
    "generate": case_generate,
    "sample": case_sample,
    "eos": case_eos,
    "logprobs": case_logprobs,
    "features": case_features,
    "visual": case_visual,
    "train": case_train,
}


# ------------------------------------------------------------------------------------- the exchange's devices


class DeviceSpy(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the device of every tensor an op takes or returns while entered."""

    def __init__(self) -> None:
        super().__init__()
        self.devices: set[str] = set()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        flat = torch.utils._pytree.tree_leaves((args, kwargs or {}, out))
        self.devices.update(str(t.device.type) for t in flat if isinstance(t, torch.Tensor))
        self.ops += 1
        return out


class MetaTypedMesh:
    """A device mesh that says its device is ``meta`` (a stand-in for a GPU mesh on a machine without one) and
    otherwise answers as the real one."""

    device_type = "meta"

    def __init__(self, mesh: Any) -> None:
        self._mesh = mesh

    def __getattr__(self, name: str) -> Any:
        return getattr(self._mesh, name)


@contextlib.contextmanager
def spy_on_exchanges(record: dict[str, Any]) -> Iterator[None]:
    """Every mixed-batch exchange runs under a :class:`DeviceSpy` (and with ``meta`` as the default device, so a
    tensor made without a device would be a meta tensor); ``dist.all_reduce`` records the backend of its group."""
    import fsdp_compat.runtime.exchange as wire

    real_exchange, real_all_reduce = wire.exchange, dist.all_reduce
    record.update(devices=[], backends=[], exchanges=0, ops=0)

    def all_reduce(tensor: torch.Tensor, *args: Any, group: Any = None, **kwargs: Any) -> Any:
        record["backends"].append(str(dist.get_backend(group)))
        record.setdefault("groups", []).append(group.group_name if group is not None else "default")
        return real_all_reduce(tensor, *args, group=group, **kwargs)

    def exchange(ranks: tuple[int, ...], values: tuple[int, ...]) -> dict[int, tuple[int, ...]]:
        spy = DeviceSpy()
        dist.all_reduce = all_reduce
        try:
            with torch.device("meta"), spy:
                counts = real_exchange(ranks, values)
        finally:
            dist.all_reduce = real_all_reduce
        record["devices"] = sorted(set(record["devices"]) | spy.devices)
        record["exchanges"] += 1
        record["ops"] += spy.ops
        return counts

    wire.exchange = exchange
    try:
        yield
    finally:
        wire.exchange = real_exchange


def device_exchange_control(mesh: Any, value: int) -> list[str]:
    """The spy on an exchange made the way fsdp-compat made it before (a vector on the mesh's device, read back with
    ``.tolist()``): it must see the device tensor (here ``meta``), else the spy proves nothing."""
    spy = DeviceSpy()
    with spy:
        vector = torch.zeros(2, dtype=torch.int64, device=torch.device(mesh.device_type))
        vector[0] = value
    return sorted(spy.devices)


# ------------------------------------------------------------------------------------------------ the routine


def generation_ranks(cfg: dict[str, Any], rank: int, extra: dict[str, Any]) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_compat.testing.parity import init_group
    from fsdp_compat.testing.zoo import build_model

    dev = init_group(cfg, rank)
    name, variants = cfg["model"], cfg["variants"]
    model = build_model(name, device=dev)
    ref = copy.deepcopy(model)
    mesh = init_device_mesh(dev.type, (cfg["world_size"],))
    prompts = [prompt(name, r, variants[r], dev) for r in range(len(variants))]
    if cfg.get("forward_before_shard"):  # a forward before fully_shard (e.g. a framework's warm-up)
        from fsdp_compat.runtime import install_runtime

        install_runtime(model)
        with torch.no_grad():
            model(**prompts[rank])
        extra["hooks_before_shard"] = counters(model)
    _shard(model, cfg["plan"], mesh)
    # the optimizers are made while every group is sharded, as a job makes them: FSDP2 keeps the root unsharded
    # after a no-grad forward, and model.parameters() would then hand an optimizer the unsharded root parameters
    opts = torch.optim.AdamW(model.parameters(), lr=1e-3), torch.optim.AdamW(ref.parameters(), lr=1e-3)
    record: dict[str, Any] = {}
    spying = cfg.get("meta_mesh") and contextlib.ExitStack()
    if spying:  # every exchange sees a mesh that says "meta": no tensor of it may leave the CPU
        import fsdp_compat.runtime.mixed_batches as mb

        real_mesh_of = mb._mesh_of
        mb._mesh_of = lambda *modules: MetaTypedMesh(real_mesh_of(*modules))
        spying.enter_context(spy_on_exchanges(record))
        extra["control_devices"] = device_exchange_control(MetaTypedMesh(mesh), 1)
    ctx = {"model": model, "ref": ref, "rank": rank, "prompt": prompts[rank], "prompts": prompts, "name": name,
           "device": dev, "variants": variants, "mesh": mesh, "opts": opts,
           "synced_gpus": cfg.get("synced_gpus")}  # fmt: skip
    extra["is_fsdp_managed_module"] = bool(getattr(model, "_is_fsdp_managed_module", False))
    try:
        for i, case in enumerate(cfg["cases"]):
            before = counters(model)
            print(f"rank {rank}: case {i}:{case} started", flush=True)
            result = CASES[case](ctx)
            print(f"rank {rank}: case {i}:{case} finished", flush=True)
            result["counters"] = _delta(before, counters(model))
            extra[f"{i}:{case}"] = result
            dist.all_reduce(torch.ones(1, device=dev))  # the ranks are in step here (a mismatch, not a wait)
    finally:
        if spying:
            spying.close()
    extra["exchange_spy"] = record
    extra["mesh_group"] = mesh.get_group(0).group_name
