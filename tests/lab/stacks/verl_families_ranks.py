"""Rank-side code for verl 0.9.1's engine on one tiny family of each tower kind (issue 30 item 5): 2 ranks, verl's
own ``TrainingWorker`` and ``train_batch``, rank 0 image rows, rank 1 text-only rows
(tests/stacks/verl_sp/test_verl_engine_families.py).

verl has forwards of its own for the Qwen-VL, GLM4V and Kimi-VL families only (``apply_monkey_patch``); every other
family keeps transformers' forward, which calls the vision tower only when the micro-batch has images. What verl
gives that forward is its engine's ``prepare_model_inputs`` (``verl/workers/engine/fsdp/transformer_impl.py``):
with ``use_remove_padding=False``, the padded ``input_ids``, an ``attention_mask`` built from the nested rows,
``position_ids`` (B, L) as the dataset wrote them, and ``extract_multi_modal_inputs`` (``verl/utils/model.py``) of
the rows' ``multi_modal_inputs``: each key's per-row tensors ``torch.cat`` along dim 0 (``mm_token_type_ids``, one
of ``_VARLEN_MULTI_MODAL_KEYS``, right-padded first). So a family runs here when its image inputs split by image
along dim 0: each image row's ``multi_modal_inputs`` holds its image's slice of every vision key (as verl's datasets
hold one processor output per sample).

Batches: ``fsdp_compat.testing.zoo.make_batch(model, variant=kind)`` (two rows, one image each, or text only: the
families test's batches), right-padding free, position ids ``0 .. n-1``, ``loss_mask`` where the labels are kept,
collated by verl's ``SFTTensorCollator``. The reference: one process, no FSDP, the checkpoint loaded again with verl's
auto class, through the engine's own ``forward_step`` and ``sft_loss`` on both ranks' micro-batches,
``(loss_r / 2).backward()``, the engine's AdamW (fp32 policy: the comparison can be exact).
"""

from __future__ import annotations

import copy
import inspect
import sys
import time
from typing import Any

import lab.stacks.verl_engine_ranks as base

#: the exception lines a case with ``expect_failure`` records instead of raising
EXPECTED_ERRORS = (
    *base.EXPECTED_ERRORS,
    # gloo's collective timeout: a rank left waiting in a collective that another rank never makes
    "Timed out waiting",
    # verl's selector picks a vision embeddings module (a ``_no_split_modules`` class) and its nn.Embedding child:
    # fully_shard of the child, after its parent's, meets parameters that are DTensors already
    "Cannot concatenate overlapping meshes",
    # a tower reading a sharded weight outside its group's forward (a DTensor op that cannot propagate)
    "Sharding propagation failed",
)
#: the batch keys that are not vision inputs; ``mm_token_type_ids`` is dropped as verl's datasets drop it (the SFT
#: dataset, ``verl/utils/dataset/multiturn_sft_dataset.py``; the agent loop uses it for position ids only)
TEXT_KEYS = ("input_ids", "attention_mask", "labels", "mm_token_type_ids")
#: the families whose forward needs ``mm_token_type_ids`` to train (transformers 5.25's Molmo2: "ValueError:
#: `mm_token_type_ids` is required as a model input when training", modeling_molmo2.py:835), which verl 0.9.1's own
#: data paths drop (the SFT dataset, multiturn_sft_dataset.py:330; the agent loop pops it after the position ids,
#: agent_loop.py:937): with them no step runs, fsdp-compat or not. Their rows keep it, as a dataset of the user's own
#: that keeps the processor's output would; the engine takes it (``_VARLEN_MULTI_MODAL_KEYS``: right-padded, joined)
KEEPS_MM_TOKEN_TYPES = frozenset({"lab.vlms:molmo2"})


def _progress(rank: int, text: str) -> None:
    print(f"families-progress rank {rank}: {text}", flush=True)


# ------------------------------------------------------------------------------------------------------ the batch


#: a per-image size key -> the rows each image has along dim 0 of the keys laid out by it: patches
#: (``image_grid_thw``: Qwen-VL-like grids; ``image_grid_hw``: Nemotron-H Omni), pooled tokens (``image_grids``:
#: Molmo2's ``image_token_pooling``, high-resolution rows x columns plus the low-resolution part's), packed patches
#: (``target_sizes``, MiniCPM-V 4.6: columns of a strip, below)
_PER_IMAGE_ROWS = {
    "image_grid_thw": lambda sizes: sizes.prod(-1),
    "image_grid_hw": lambda sizes: sizes.prod(-1),
    "image_grids": lambda sizes: sizes[:, 0] * sizes[:, 1] + sizes[:, 2] * sizes[:, 3],
    "target_sizes": lambda sizes: sizes.prod(-1),
}


def _image_slice(batch: dict[str, Any], key: str, images: int, image: int) -> Any:
    """Image ``image``'s part of vision key ``key``, as a processor run on that image alone lays it out: one entry
    per image along dim 0 (most kinds), the image's rows (:data:`_PER_IMAGE_ROWS`: patches or pooled tokens along
    dim 0), or its columns of a NaViT-packed ``(1, C, p, columns)`` strip (``target_sizes``: MiniCPM-V 4.6)."""
    value = batch[key]
    if value.shape[0] == images:
        return value[image : image + 1]
    for sizes, rows in _PER_IMAGE_ROWS.items():
        if sizes not in batch or key == sizes:
            continue
        counts = [int(c) for c in rows(batch[sizes])]
        if sizes != "target_sizes" and value.shape[0] == sum(counts):
            return value[sum(counts[:image]) : sum(counts[: image + 1])]
        if sizes == "target_sizes" and value.shape[0] == 1 and value.shape[-1] == sum(counts) * value.shape[-2]:
            step = value.shape[-2]
            return value[..., sum(counts[:image]) * step : sum(counts[: image + 1]) * step]
    raise ValueError(f"{key} {tuple(value.shape)}: no per-image layout known ({images} images)")


def row_inputs(
    batch: dict[str, Any], row: int, images: int, image_row: int | None, keep_types: bool = False
) -> dict[str, Any]:
    """Row ``row``'s ``multi_modal_inputs``: every per-token key (shaped like ``input_ids``) cut to the row, every
    vision key cut to the row's image ``image_row`` (:func:`_image_slice`; None: a text row, no vision key);
    ``mm_token_type_ids`` only with ``keep_types`` (:data:`KEEPS_MM_TOKEN_TYPES`)."""
    ids = batch["input_ids"]
    n = int(batch["attention_mask"][row].sum())
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if key in TEXT_KEYS and not (keep_types and key == "mm_token_type_ids"):
            continue
        if tuple(value.shape[:2]) == tuple(ids.shape):  # per token (mm_token_type_ids, token_type_ids)
            out[key] = value[row : row + 1, :n]
        elif image_row is not None:
            out[key] = _image_slice(batch, key, images, image_row)
    return out


def collate_rows(batch: dict[str, Any], image_token: int, world_size: int, keep_types: bool = False) -> Any:
    """The rows as verl's SFT dataset yields them (no padding, per-row ``multi_modal_inputs``), through verl's own
    ``SFTTensorCollator``, with the SFT trainer's meta (``use_remove_padding`` False: the padded path)."""
    import torch

    ids = batch["input_ids"]
    has_image = [bool((ids[i] == image_token).any()) for i in range(ids.shape[0])]
    images = sum(has_image)
    samples, image = [], 0
    for i in range(ids.shape[0]):
        n = int(batch["attention_mask"][i].sum())
        samples.append(
            {
                "input_ids": ids[i, :n],
                "position_ids": torch.arange(n),
                "loss_mask": (batch["labels"][i, :n] != -100).long(),
                "multi_modal_inputs": row_inputs(batch, i, images, image if has_image[i] else None, keep_types),
            }
        )
        image += has_image[i]
    return base.sft_tensordict(samples, world_size)


def image_token(model: str) -> int:
    """The placeholder token of ``model``'s batches (lab.vlms models name theirs; the zoo's families use 10)."""
    from fsdp_compat.testing.zoo import _external

    return int(getattr(_external(model), "image_token_id", 10)) if ":" in model else 10


def sft_batch(model: str, kind: str, seed: int, world_size: int) -> Any:
    from fsdp_compat.testing.zoo import make_batch

    batch = make_batch(model, seed=seed, variant=kind)
    return collate_rows(batch, image_token(model), world_size, model in KEEPS_MM_TOKEN_TYPES)


# ------------------------------------------------------------------------------------------------- the engine


def _tower(module: Any) -> Any:
    from lab.stack_families import tower_paths

    return module.get_submodule(tower_paths(module)[0])


def _first_shape(args: Any, kwargs: dict[str, Any]) -> list[int]:
    import torch

    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return list(value.shape)
    return []


def _count_calls(module: Any) -> list[list[int]]:
    """The vision tower's calls on ``module``: the shape of each call's first tensor argument."""
    calls: list[list[int]] = []
    _tower(module).register_forward_pre_hook(
        lambda _m, args, kwargs: calls.append(_first_shape(args, kwargs)) and None, with_kwargs=True
    )
    return calls


def _dummy_calls(module: Any) -> int:
    runtime = sys.modules.get("fsdp_compat.runtime.mixed_batches")
    return sum(h.dummy_calls for h in runtime.mixed_batches_of(module)) if runtime else 0


def run_family(cfg: dict[str, Any], case: dict[str, Any], rank: int, out: dict[str, Any]) -> dict[str, Any]:
    """verl's engine trains ``steps`` steps, rank r on micro-batch kind ``case["kinds"][r]`` (seed per step and
    rank); full gradients (as ``optimizer_step`` gets them; the clip a no-op) and post-AdamW parameters gathered to
    every rank; then rank 0 trains one process on both micro-batches and compares (:func:`reference`)."""
    import torch.distributed as dist

    world = dist.get_world_size()
    kinds, model = case["kinds"], cfg["model"]
    case = {"model_dir": "model_dir", **case}
    _progress(rank, f"{case['name']}: reset")
    worker, losses, grads = base.recording_worker(cfg, case)
    engine = worker.engine
    out["groups"] = base.fsdp_groups(engine.module)
    out["model_class"] = type(engine.module).__name__
    out["compute_dtype"] = str(getattr(engine, "_autocast_dtype", None))
    calls = _count_calls(engine.module)
    out["vision_calls"] = calls
    inputs: list[list[str]] = []
    engine.module.register_forward_pre_hook(lambda _m, _a, kw: inputs.append(sorted(kw)) and None, with_kwargs=True)
    params: list[dict[str, Any]] = []
    out["steps"] = []
    for step in range(case.get("steps", 2)):
        lr, first, seen = engine.optimizer.param_groups[0]["lr"], len(calls), len(inputs)
        kind = kinds[rank % len(kinds)]
        batch = sft_batch(model, kind, base._seed(step, rank), world)
        dummies = _dummy_calls(engine.module)
        _progress(rank, f"{case['name']}: step {step + 1} starts ({kind} rows)")
        worker.train_batch(batch)
        _progress(rank, f"{case['name']}: step {step + 1} done, loss {losses[-1]!r}")
        out["steps"].append(
            {
                "lr": lr,
                "loss": losses[-1],
                "vision_calls": calls[first:],
                "model_inputs": inputs[seen:],
                "alignment_dummies": _dummy_calls(engine.module) - dummies,
            }
        )
        params.append({n: base._full(p) for n, p in engine.module.named_parameters()})
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, out["steps"])
    if rank == 0:
        _progress(rank, f"{case['name']}: reference")
        out["reference"] = reference(engine, cfg, case, everyone, grads, params)
    return out


def reference(
    engine: Any, cfg: dict[str, Any], case: dict[str, Any], ranks: list[Any], grads: list[Any], params: list[Any]
) -> dict[str, Any]:
    """One process, no FSDP: the checkpoint loaded again with verl's auto class (fp32), gradient checkpointing as
    the engine set it, through the engine's ``forward_step`` and ``sft_loss`` on every rank's micro-batch of each
    step (``dp_size`` the world, the global token count): ``(loss_r / W).backward()``, then the engine optimizer's
    class and defaults at each step's lr. With W = 2 halving is exact and a + b commutative: 0.0 is possible."""
    import torch
    from verl.utils import tensordict_utils as tu
    from verl.utils.device import get_device_name
    from verl.utils.model import get_hf_auto_model_class

    from fsdp_compat.testing.parity import worse

    world, kinds, model = len(ranks), case["kinds"], cfg["model"]
    hf_config = engine.model_config.hf_config
    module = get_hf_auto_model_class(hf_config=hf_config).from_pretrained(
        cfg["model_dir"], torch_dtype=torch.float32, config=hf_config
    )
    module.to(get_device_name()).train()
    inner = getattr(engine.module, "_fsdp_wrapped_module", engine.module)
    if getattr(inner, "is_gradient_checkpointing", False):
        module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    single = copy.copy(engine)
    single.module = module
    accepted = inspect.signature(type(engine.optimizer)).parameters
    optimizer = type(engine.optimizer)(
        module.parameters(), **{k: v for k, v in engine.optimizer.defaults.items() if k in accepted}
    )
    calls = _count_calls(module)
    out: dict[str, Any] = {"steps": []}
    for step in range(case.get("steps", 2)):
        for group in optimizer.param_groups:
            group["lr"] = ranks[0][step]["lr"]
        optimizer.zero_grad(set_to_none=True)
        batches = [sft_batch(model, kinds[r % len(kinds)], base._seed(step, r), world) for r in range(world)]
        tokens = sum(int(b["loss_mask"].sum()) for b in batches)
        losses, first = [], len(calls)
        for batch in batches:
            tu.assign_non_tensor(batch, sp_size=1, dp_size=world, batch_num_tokens=tokens)
            loss, _ = single.forward_step(batch, loss_function=base.engine_loss(), forward_only=False)
            (loss / world).backward()
            losses.append(float(loss.detach()))
        named = dict(module.named_parameters())
        grad_diff, grad_at, grad_missing = base._worst(grads[step], {n: p.grad for n, p in named.items()})
        optimizer.step()
        param_diff, param_at, param_missing = base._worst(params[step], {n: p.detach() for n, p in named.items()})
        loss_diff = 0.0
        for r in range(world):
            loss_diff = worse(loss_diff, abs(ranks[r][step]["loss"] - losses[r]))
        tower = {id(p) for p in _tower(module).parameters()}
        out["steps"].append(
            {
                "losses": losses,
                "loss_diff": loss_diff,
                "grad_diff": grad_diff,
                "grad_at": grad_at,
                "param_diff": param_diff,
                "param_at": param_at,
                "missing": grad_missing + param_missing,
                "vision_calls": calls[first:],
                "grad_norm_vision": float(
                    sum(p.grad.pow(2).sum() for p in named.values() if id(p) in tower and p.grad is not None)
                ),
                "params": len(named),
            }
        )
    return out


def run_expected_failure(cfg: dict[str, Any], case: dict[str, Any], rank: int) -> dict[str, Any]:
    """A case that must stop with one of :data:`EXPECTED_ERRORS` (:func:`lab.stacks.verl_engine_ranks.stopped`)."""
    return base.stopped(run_family, cfg, case, rank, EXPECTED_ERRORS)


def families_ranks(cfg: dict[str, Any], rank: int, extra: dict[str, Any]) -> None:
    """The rank body: one process group, then every case of ``cfg["cases"]`` in order (results in ``extra``)."""
    extra["backend"] = base._setup(cfg, rank)
    import torch.distributed as dist

    extra["cases"] = {}
    for case in cfg["cases"]:
        t0 = time.perf_counter()
        result = (
            run_expected_failure(cfg, case, rank) if case.get("expect_failure") else run_family(cfg, case, rank, {})
        )
        result["case_s"] = time.perf_counter() - t0
        extra["cases"][case["name"]] = result
        extra["state"] = base.adapter_state()
        if case.get("expect_failure") and result["error"]:
            return  # stopped mid-forward: collectives may be left unmatched, so no barrier
    dist.barrier()
