"""Rank-side code for the verl real-engine tests: verl's own ``TrainingWorker`` on the tiny GLM4V, case after case.

Runs in fresh rank interpreters started by ``fsdp_compat.testing.launch.run_ranks`` (``tests/`` on PYTHONPATH).
It never imports fsdp_compat's adapter: whatever patches verl here is the installed wheel's ``verl.plugins`` entry
point or ``.pth`` hook. What each case does is what verl's SFT trainer does (``verl/trainer/sft_trainer.py``):
``TrainingWorker(TrainingWorkerConfig(...))``, ``set_loss_fn(partial(sft_loss, config=None))``, ``reset()``, then
``train_batch`` on a TensorDict built by verl's own ``SFTTensorCollator`` (no padding, nested tensors, 4-row
GLM4V position ids, per-sample ``multi_modal_inputs``); ``train_batch`` runs ``forward_backward_batch`` and
``optimizer_step``. Weight sync is ``engine.get_per_tensor_param()``.

On CPU the only test-side piece is ``lab.stacks.verl_cpu_platform`` (verl's public platform registry) plus
``VERL_ENGINE_DEVICE=cuda`` (verl's documented engine-device override: the FSDP engine registers cuda/npu only);
cases with ``flash_stand_in`` (``use_remove_padding=True``) also get a pure-torch stand-in for flash-attn's varlen
kernel when flash-attn is not installed (:func:`install_flash_stand_in`).
With ``device == "cuda"`` verl's own CUDA platform and NCCL are used and nothing is overridden.
"""

from __future__ import annotations

import copy
import math
import os
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

IMAGE_TOKEN = 10  #: the tiny GLM4V's image placeholder token (fsdp_compat.testing.zoo)

#: the only exception lines the cases record instead of raising (everything else fails the rank)
EXPECTED_ERRORS = (
    "got mixed torch.Tensor and DTensor",  # FSDP_COMPAT=off: the grid_sampler crash
    "Cannot access accelerator device when none is available",  # CPUOffloadPolicy(pin_memory=True) on CPU
    "Found no NVIDIA driver on your system",  # the same, with a CUDA build of torch (verl's pin, torch 2.11.0)
    # use_remove_padding=True without flash-attn: verl's GLM4V text attention (glm4v_attn_forward) reads flash-attn
    # settings that verl/models/transformers/glm4v.py defines only when flash-attn (or an NPU) is available
    "name '_flash_use_top_left_mask' is not defined",
    # verl 0.9.0's glm4v_attn_forward imports a function transformers 5 no longer has (0.9.1 uses apply_rotary_pos_emb)
    "cannot import name 'apply_multimodal_rotary_pos_emb' from 'transformers.models.glm4v.modeling_glm4v'",
    # use_remove_padding=True with an fp32 MixedPrecisionPolicy: verl's GLM4V attention casts fp32 q/k/v to bf16 for
    # flash-attn (fa_peft_integration_check(target_dtype=torch.bfloat16)) and hands the bf16 output to the fp32 o_proj
    "to have the same dtype, but got: c10::BFloat16 != float",  # m1/m2 (CPU), mat1/mat2 (CUDA)
)


def _setup(cfg: dict[str, Any], rank: int) -> str:
    """Environment verl's Worker reads, the platform, then the process group (TrainingWorker skips its own)."""
    world = cfg["world_size"]
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank if cfg["device"] == "cuda" else 0),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(cfg["port"]),
    )
    import torch
    import torch.distributed as dist

    if cfg["device"] == "cuda":
        torch.cuda.set_device(rank)
        backend = "nccl"
    else:
        os.environ["VERL_PLATFORM"] = "cpu"
        os.environ["VERL_ENGINE_DEVICE"] = "cuda"
        import lab.stacks.verl_cpu_platform as verl_cpu_platform  # noqa: F401  (registers "cpu"; importing verl loads the plugins)

        torch.set_num_threads(1)  # two ranks share the CPU cores
        backend = "gloo"
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://127.0.0.1:{cfg['port']}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=cfg.get("collective_timeout_s", cfg["timeout_s"])),
    )
    return backend


def adapter_state() -> dict[str, Any]:
    """What fsdp-compat did in this process, read from sys.modules only (never imports the adapter)."""
    import sys

    adapter = getattr(sys.modules.get("fsdp_compat.adapters.verl"), "ADAPTER", None)
    glm4v = sys.modules.get("verl.models.transformers.glm4v")
    embeds = getattr(glm4v, "_get_input_embeds", None)
    return {
        "patched": bool(adapter and adapter.is_patched()),
        "activated_by": getattr(adapter, "activated_by", None),
        "describe": adapter.describe() if adapter else [],
        "glm4v_repaired": bool(getattr(embeds, "__fsdp_compat__", False)),
    }


# ------------------------------------------------------------------------------------------------------ the batch


def sft_batch(world_size: int, seed: int = 0) -> Any:
    """The zoo's two GLM4V rows as verl's SFT dataset yields them (no padding), collated by verl's own
    ``SFTTensorCollator`` and wrapped with the SFT trainer's meta info; the same batch on every rank."""
    from fsdp_compat.testing.verl_smoke import glm4v_position_ids
    from fsdp_compat.testing.zoo import build_model, make_batch

    batch = make_batch("glm4v", seed=seed)
    positions = glm4v_position_ids(build_model("glm4v", seed=seed), batch)  # (4, B, L): text row + 3 mrope rows
    return collate(batch, positions, world_size)


def collate(batch: dict[str, Any], positions: Any, world_size: int, remove_padding: bool = False) -> Any:
    """Right-padded rows (images optional per row) as verl's SFT dataset yields them, through verl's collator.
    ``remove_padding``: the ``use_remove_padding`` meta the trainer copies from the model config (verl's engine
    then packs the micro-batch's rows into one (1, total tokens) row with (4, 1, total) position ids)."""
    samples, start, image = [], 0, 0
    for i in range(batch["input_ids"].shape[0]):
        n = int(batch["attention_mask"][i].sum())
        multi_modal: dict[str, Any] = {}
        if bool((batch["input_ids"][i, :n] == IMAGE_TOKEN).any()):  # a text-only row has no multi-modal input
            grid = batch["image_grid_thw"][image : image + 1]
            patches = int(grid.prod())
            multi_modal = {"pixel_values": batch["pixel_values"][start : start + patches], "image_grid_thw": grid}
            start, image = start + patches, image + 1
        samples.append(
            {
                "input_ids": batch["input_ids"][i, :n],
                "position_ids": positions[:, i, :n].contiguous(),
                "loss_mask": (batch["labels"][i, :n] != -100).long(),
                "multi_modal_inputs": multi_modal,
            }
        )
    return sft_tensordict(samples, world_size, remove_padding)


def sft_tensordict(samples: list[dict[str, Any]], world_size: int, remove_padding: bool = False) -> Any:
    """verl SFT samples (``input_ids``, ``position_ids``, ``loss_mask``, ``multi_modal_inputs``) through verl's own
    ``SFTTensorCollator`` (no padding: nested tensors), with the SFT trainer's meta info."""
    import torch
    from verl.utils import tensordict_utils as tu
    from verl.utils.dataset.dataset_utils import DatasetPadMode, SFTTensorCollator

    data = SFTTensorCollator(DatasetPadMode.NO_PADDING)(samples)
    meta = {
        "use_remove_padding": remove_padding,
        "use_dynamic_bsz": False,
        "max_token_len_per_gpu": 4096,
        "micro_batch_size_per_gpu": len(samples),
        "temperature": 1.0,
        "global_batch_size": len(samples) * world_size,
        "pad_mode": DatasetPadMode.NO_PADDING,
        "pad_token_id": 0,
    }
    td = tu.get_tensordict(tensor_dict=data, non_tensor_dict=meta)
    # The trainer also assigns global_token_num, which only feeds verl's MFU metric; verl estimates GLM4V flops
    # from a top-level config.hidden_size that this tiny transformers-5 config keeps in text_config only.
    tu.assign_non_tensor(td, update_lr_scheduler=True)
    assert isinstance(td["input_ids"], torch.Tensor) and td["input_ids"].is_nested
    return td


# ------------------------------------------------------------------------------------------------- one engine


def _worker(cfg: dict[str, Any], case: dict[str, Any]) -> Any:
    from functools import partial

    from verl.trainer.config.config import CheckpointConfig
    from verl.workers.config import (
        FSDPEngineConfig,
        FSDPOptimizerConfig,
        HFModelConfig,
        TrainingWorkerConfig,
    )
    from verl.workers.engine_workers import TrainingWorker
    from verl.workers.utils.losses import sft_loss

    model = HFModelConfig(
        path=cfg[case.get("model_dir", "model_dir")],
        load_tokenizer=False,
        use_remove_padding=bool(case.get("remove_padding", False)),
        override_config={"attn_implementation": "eager"},
        **case.get("model", {}),
    )
    engine = FSDPEngineConfig(
        strategy="fsdp2",
        use_torch_compile=False,
        use_dynamic_bsz=False,
        micro_batch_size_per_gpu=2,
        infer_micro_batch_size_per_gpu=2,
        **case.get("engine", {}),
    )
    optimizer = FSDPOptimizerConfig(lr=1e-2, total_training_steps=case.get("steps", 2), **case.get("optimizer", {}))
    worker = TrainingWorker(
        TrainingWorkerConfig(
            model_type="language_model",
            model_config=model,
            engine_config=engine,
            optimizer_config=optimizer,
            checkpoint_config=CheckpointConfig(),
        )
    )
    worker.set_loss_fn(partial(sft_loss, config=None))
    return worker


class _SelectorSpy:
    """Records what verl's (patched) selector saw and chose on this rank: whether the model was on meta, and the
    selected module paths. Wraps whatever ``fsdp_utils._select_fsdp2_wrap_targets`` is now and delegates."""

    def __init__(self) -> None:
        import verl.utils.fsdp_utils as utils

        self.utils, self.inner, self.calls = utils, utils._select_fsdp2_wrap_targets, []

    def __enter__(self) -> _SelectorSpy:
        def spy(model: Any, *args: Any, **kwargs: Any) -> Any:
            targets = self.inner(model, *args, **kwargs)
            paths = {id(m): p for p, m in model.named_modules()}
            self.calls.append(
                {
                    "meta_params": sum(p.is_meta for p in model.parameters()),
                    "params": sum(1 for _ in model.parameters()),
                    "targets": [paths.get(id(m), "?") for m in targets],
                    "patched_selector": bool(getattr(self.inner, "__fsdp_compat__", False)),
                }
            )
            return targets

        self.utils._select_fsdp2_wrap_targets = spy
        return self

    def __exit__(self, *exc: Any) -> None:
        self.utils._select_fsdp2_wrap_targets = self.inner


def reference_loss(engine: Any, cfg: dict[str, Any], loss_fn: Any) -> dict[str, Any]:
    """Step-1 loss of the same verl forward on one unsharded process: the checkpoint loaded again with verl's
    auto class (fp32, no FSDP; its classes already carry verl's GLM4V forward from ``apply_monkey_patch``), run
    through the engine's own ``forward_step`` (``prepare_model_inputs`` -> model -> ``prepare_model_outputs``
    -> ``sft_loss``) with ``dp_size`` 1 and this rank's token count, i.e. no collective at all. Also calls the
    unrepaired ``_get_input_embeds`` (``__wrapped__``) once to record what verl's own function does."""
    import torch
    from verl.utils import tensordict_utils as tu
    from verl.utils.model import get_hf_auto_model_class

    hf_config = engine.model_config.hf_config
    module = get_hf_auto_model_class(hf_config=hf_config).from_pretrained(
        cfg["model_dir"], torch_dtype=torch.float32, config=hf_config
    )
    from verl.utils.device import get_device_name

    module.to(get_device_name()).train()
    data = sft_batch(1)
    tu.assign_non_tensor(data, sp_size=1, dp_size=1, batch_num_tokens=int(data["loss_mask"].sum()))
    single = copy.copy(engine)
    single.module = module
    out: dict[str, Any] = {}
    try:
        loss, _ = single.forward_step(data, loss_function=loss_fn, forward_only=False)
        out["loss"] = float(loss.detach())
    except Exception as exc:  # recorded, not raised: this runs on one rank, and the other must not wait for it
        out["error"] = traceback.format_exception_only(type(exc), exc)[-1].strip()
    import verl.models.transformers.glm4v as glm4v

    original = getattr(glm4v._get_input_embeds, "__wrapped__", None)
    if original is not None:  # the repaired function keeps verl's own as __wrapped__ (functools.wraps)
        from fsdp_compat.testing.zoo import make_batch

        b = make_batch("glm4v")
        try:
            original(module.model, b["input_ids"], b["attention_mask"], b["pixel_values"], None, b["image_grid_thw"])
            out["unrepaired"] = "ran"
        except Exception as exc:
            out["unrepaired"] = traceback.format_exception_only(type(exc), exc)[-1].strip()
    return out


def fsdp_groups(module: Any) -> list[str]:
    from torch.distributed.fsdp import FSDPModule

    return [path for path, m in module.named_modules() if isinstance(m, FSDPModule)]


def run_case(cfg: dict[str, Any], case: dict[str, Any], rank: int, out: dict[str, Any]) -> dict[str, Any]:
    """Build verl's engine for ``case``, train ``steps`` batches, sync weights; figures go into ``out`` as they
    are measured (so a case that stops part-way still reports what came before)."""
    import torch
    import torch.distributed as dist
    from verl.utils import tensordict_utils as tu

    t0 = time.perf_counter()
    worker = _worker(cfg, case)
    with _SelectorSpy() as spy:
        worker.reset()
    engine = worker.engine
    out["selector_calls"] = spy.calls
    out["groups"] = fsdp_groups(engine.module)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (out["groups"], [c["targets"] for c in spy.calls]))
    out["plans_agree"] = all(x == everyone[0] for x in everyone)
    out["setup_s"] = time.perf_counter() - t0
    if case.get("reference") and rank == 0:
        out["reference"] = reference_loss(engine, cfg, worker.loss_fn)
    inner = getattr(engine.module, "_fsdp_wrapped_module", engine.module)
    out["gradient_checkpointing"] = bool(getattr(inner, "is_gradient_checkpointing", False))
    out["compute_dtype"] = str(getattr(engine, "_autocast_dtype", None))
    out["losses"], out["grad_norms"] = [], []
    for _ in range(case.get("steps", 2)):
        t = time.perf_counter()
        if engine.engine_config.forward_only:  # the ref model: verl's infer_batch (log-probs, loss, no step)
            result = worker.infer_batch(sft_batch(cfg["world_size"]))
        else:  # train_batch = forward_backward_batch + optimizer_step (verl's BaseEngine.train_batch)
            result = worker.train_batch(sft_batch(cfg["world_size"]))
        metrics = tu.get(result, "metrics")
        out["losses"].append(float(metrics["loss"]))
        if "grad_norm" in metrics:
            out["grad_norms"].append(float(metrics["grad_norm"]))
        out.setdefault("step_s", []).append(time.perf_counter() - t)
    per_tensor, peft_config = engine.get_per_tensor_param()
    synced = {name: tuple(t.shape) for name, t in per_tensor}
    out["synced"] = sorted(synced)
    out["synced_numel"] = sum(int(torch.Size(s).numel()) for s in synced.values())
    out["peft"] = peft_config is not None
    out["trainable"] = sorted(n for n, p in engine.module.named_parameters() if p.requires_grad)
    out["all_params"] = sorted(n for n, _ in engine.module.named_parameters())
    return out


def run_expected_failure(cfg: dict[str, Any], case: dict[str, Any], rank: int) -> dict[str, Any]:
    """A case that must stop with one of EXPECTED_ERRORS (:func:`stopped`)."""
    return stopped(run_parity if case.get("kinds") else run_case, cfg, case, rank, EXPECTED_ERRORS)


def stopped(
    run: Any, cfg: dict[str, Any], case: dict[str, Any], rank: int, expected: tuple[str, ...]
) -> dict[str, Any]:
    """``run(cfg, case, rank, out)``, a case that must stop with one of ``expected``: the exception line, where it was
    raised and every frame (relative to their ``sys.path`` entry: ``verl/...``), the traceback's end; with
    ``case["hold_s"]`` the process then stays alive that long (as a Ray actor's process does after its method
    raised, so that a rank waiting on it waits as on a cluster). Anything else is raised again."""
    out: dict[str, Any] = {"error": None}
    try:
        run(cfg, case, rank, out)
    except Exception as exc:
        line = traceback.format_exception_only(type(exc), exc)[-1].strip()
        print(f"verl-progress rank {rank}: {case.get('name', '')}: stopped: {line[:300]}", flush=True)
        if not any(text in line for text in expected):
            raise
        frames = [f"{_relative(f.filename)}:{f.lineno} {f.name}" for f in traceback.extract_tb(exc.__traceback__)]
        out.update(error=line, where=frames[-1].split()[0], frames=frames, traceback=traceback.format_exc()[-3000:])
        if case.get("hold_s"):
            time.sleep(case["hold_s"])
    return out


def _relative(filename: str) -> str:
    """``filename`` relative to its ``sys.path`` entry (``verl/utils/fsdp_utils.py``)."""
    roots = sorted((p.rstrip("/") + "/" for p in sys.path if p and filename.startswith(p.rstrip("/") + "/")), key=len)
    return filename[len(roots[-1]) :] if roots else filename


# ---------------------------------------------------- different data on every rank, parity, mixed image/text ranks

#: a tiny GLM4V whose vision tower takes verl's text-only dummy: ``_get_input_embeds`` feeds ``zeros(16, 1176)`` with
#: grid [[1, 4, 4]] when a micro-batch has no image, and 1176 = 3 channels * 2 frames * 14 * 14 (patch size 14)
P14_VISION = dict(
    depth=2,
    hidden_size=32,
    num_heads=2,
    intermediate_size=64,
    out_hidden_size=64,
    in_channels=3,
    image_size=56,
    patch_size=14,
    temporal_patch_size=2,
    spatial_merge_size=2,
)
P14_PATCH_DIM = 3 * 2 * 14 * 14
#: per kind of micro-batch, each row's image grid (None: a text-only row). Rows differ in length and count of
#: image tokens from rank to rank, so each rank's share of the global token count differs too.
P14_ROWS: dict[str, list[list[int] | None]] = {
    "image": [[1, 4, 4], [1, 4, 8]],
    "image2": [[1, 8, 4], [1, 8, 8]],
    "text": [None, None],
}


def build_glm4v_p14(seed: int = 0) -> Any:
    """The zoo's tiny GLM4V (untied) with a patch-14 vision tower, fp32, eager."""
    import torch
    from transformers import Glm4vForConditionalGeneration

    from fsdp_compat.testing.zoo import glm4v_config

    config = glm4v_config(vision=P14_VISION)
    assert config.image_token_id == IMAGE_TOKEN
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Glm4vForConditionalGeneration(config)
    return model.float().train()


def p14_batch(kind: str, seed: int) -> dict[str, Any]:
    """Right-padded rows for the patch-14 model: text around one image per image row, text only otherwise."""
    import torch

    g = torch.Generator().manual_seed(1000 + seed)
    rows: list[list[int]] = []
    mm: list[list[int]] = []
    grids = [grid for grid in P14_ROWS[kind] if grid is not None]
    for i, grid in enumerate(P14_ROWS[kind]):
        before = torch.randint(16, 128, (5,), generator=g).tolist()
        after = torch.randint(16, 128, (4 + 3 * i + seed % 3,), generator=g).tolist()
        n = 0 if grid is None else grid[0] * grid[1] * grid[2] // 4
        middle = [12, *([IMAGE_TOKEN] * n), 13] if grid is not None else []
        rows.append([*before, *middle, *after])
        mm.append([0] * len(before) + [0, *([1] * n), 0][: len(middle)] + [0] * len(after))
    length = max(len(r) for r in rows)
    input_ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    mm_types = torch.zeros_like(input_ids)
    for i, (r, k) in enumerate(zip(rows, mm, strict=True)):
        input_ids[i, : len(r)], mask[i, : len(r)], mm_types[i, : len(k)] = torch.tensor(r), 1, torch.tensor(k)
    labels = input_ids.clone()
    labels[(mask == 0) | (mm_types != 0)] = -100
    batch: dict[str, Any] = {
        "input_ids": input_ids,
        "attention_mask": mask,
        "labels": labels,
        "mm_token_type_ids": mm_types,
    }
    if grids:
        batch["image_grid_thw"] = torch.tensor(grids, dtype=torch.long)
        batch["pixel_values"] = torch.randn(sum(t * h * w for t, h, w in grids), P14_PATCH_DIM, generator=g)
    return batch


def p14_sft_batch(kind: str, seed: int, world_size: int, remove_padding: bool = False) -> Any:
    """:func:`p14_batch` with verl's 4-row GLM4V position ids, collated by verl's SFT collator."""
    from fsdp_compat.testing.verl_smoke import glm4v_position_ids

    batch = p14_batch(kind, seed)
    return collate(batch, glm4v_position_ids(_p14_model(), batch), world_size, remove_padding)


_P14: list[Any] = []


def _p14_model() -> Any:
    """One patch-14 model per process, only for its ``get_rope_index`` (position ids depend on config only)."""
    if not _P14:
        _P14.append(build_glm4v_p14())
    return _P14[0]


def _full(tensor: Any) -> Any:
    """A detached copy of the whole tensor (a collective for a sharded DTensor: every rank calls it)."""
    from fsdp_compat.testing.parity import full_tensor

    return full_tensor(tensor).detach().clone()


def _seed(step: int, rank: int) -> int:
    return 10 * step + rank


def recording_worker(cfg: dict[str, Any], case: dict[str, Any]) -> tuple[Any, list[float], list[dict[str, Any]]]:
    """verl's ``TrainingWorker`` for ``case``, reset (its engine built), with two records that fill as it trains:
    the rank's own loss of each step (verl's loss function wrapped to be read) and the full gradients verl's
    ``optimizer_step`` receives (read there: verl sets every ``.grad`` to None when ``train_batch`` leaves
    ``engine.train_mode``, ``EngineTrainModeCtx.__exit__`` -> ``optimizer_zero_grad``, ``zero_grad_on_exit=True`` in
    verl 0.9.1)."""
    worker = _worker(cfg, case)
    losses: list[float] = []
    grads: list[dict[str, Any]] = []
    verl_loss = worker.loss_fn

    def recorded(*args: Any, **kwargs: Any) -> Any:
        loss, metrics = verl_loss(*args, **kwargs)
        losses.append(float(loss.detach()))
        return loss, metrics

    worker.set_loss_fn(recorded)
    worker.reset()
    engine = worker.engine
    step_optimizer = engine.optimizer_step

    def optimizer_step() -> Any:
        grads.append({n: None if p.grad is None else _full(p.grad) for n, p in engine.module.named_parameters()})
        return step_optimizer()

    engine.optimizer_step = optimizer_step
    return worker, losses, grads


def run_parity(cfg: dict[str, Any], case: dict[str, Any], rank: int, out: dict[str, Any]) -> dict[str, Any]:
    """verl's engine trains ``steps`` steps, rank r on its own micro-batch (kind ``case["kinds"][r]``, seed per step
    and rank); then rank 0 trains one unsharded process on all ranks' micro-batches the same way and compares.

    Recorded per rank and step: the rank's own loss (verl's ``sft_loss`` value, wrapped here to be read), the vision
    tower's calls (a forward pre-hook on ``model.visual``: the input shape of each call) and the lr. Full gradients
    (as verl's ``optimizer_step`` receives them; its clip is a no-op at ``clip_grad`` 1e9) and post-AdamW parameters
    are gathered to every rank.

    ``remove_padding``: verl's ``use_remove_padding=True`` (model config and batch meta). Recorded too: what the
    model was called with (a forward pre-hook on the root: verl packs the micro-batch into one row) and, with
    ``flash_stand_in``, each call of the stand-in for flash-attn's varlen kernel (how many sequences it was cut into).
    """
    import torch.distributed as dist

    world = dist.get_world_size()
    kinds = case["kinds"]
    remove_padding = bool(case.get("remove_padding"))
    worker, losses, grads = recording_worker(cfg, case)
    engine = worker.engine
    out["groups"] = fsdp_groups(engine.module)
    inner = getattr(engine.module, "_fsdp_wrapped_module", engine.module)
    out["gradient_checkpointing"] = bool(getattr(inner, "is_gradient_checkpointing", False))
    out["compute_dtype"] = str(getattr(engine, "_autocast_dtype", None))
    out["flash_attn"] = _has_flash_attn()
    stand_in = case.get("flash_stand_in") and not out["flash_attn"]
    attention = install_flash_stand_in() if stand_in else []
    out["flash_stand_in"] = bool(stand_in)
    calls: list[list[int]] = []
    visual = engine.module.model.visual
    visual.register_forward_pre_hook(lambda _m, args: calls.append(list(args[0].shape)) and None)
    model_inputs: list[dict[str, Any]] = []
    out["vision_calls"], out["model_inputs"] = calls, model_inputs  # filled as it runs: a case that stops shows them
    engine.module.register_forward_pre_hook(
        lambda _m, _a, kw: model_inputs.append(_shapes(kw)) and None, with_kwargs=True
    )
    out["steps"], params = [], []
    for step in range(case.get("steps", 2)):
        lr, first = engine.optimizer.param_groups[0]["lr"], len(calls)
        batch = p14_sft_batch(kinds[rank % len(kinds)], _seed(step, rank), world, remove_padding)
        out.setdefault("rows", []).append(int(batch["input_ids"].shape[0]))
        seen, attended = len(model_inputs), len(attention)
        worker.train_batch(batch)
        out["steps"].append(
            {
                "lr": lr,
                "loss": losses[-1],
                "vision_calls": calls[first:],
                "model_inputs": model_inputs[seen:],
                "attention_calls": attention[attended:],  # the stand-in's calls: sequences per call
            }
        )
        params.append({n: _full(p) for n, p in engine.module.named_parameters()})
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, out["steps"])
    out["all_ranks_steps"] = everyone
    if rank == 0:
        out["reference"] = parity_reference(engine, cfg, case, everyone, grads, params)
    return out


def _shapes(kwargs: dict[str, Any]) -> dict[str, Any]:
    """What the model's forward received: each tensor's shape (None for None), e.g. the packed input of
    ``use_remove_padding``."""
    keys = ("input_ids", "position_ids", "attention_mask", "pixel_values")
    return {k: None if kwargs.get(k) is None else list(kwargs[k].shape) for k in keys}


# ------------------------------------------------ use_remove_padding=True where flash-attn is not installed (CPU)

#: the names verl/models/transformers/glm4v.py binds only when flash-attn (or an NPU) is available
FLASH_NAMES = ("flash_attn_varlen_func", "_flash_use_top_left_mask", "_flash_supports_deterministic")


def _has_flash_attn() -> bool:
    import verl.models.transformers.glm4v as glm4v

    return all(name in vars(glm4v) for name in FLASH_NAMES)


def cpu_varlen_attention(
    q: Any,
    k: Any,
    v: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    max_seqlen_q: Any = None,
    max_seqlen_k: Any = None,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    **_: Any,
) -> Any:
    """A pure-torch stand-in for flash-attn's ``flash_attn_varlen_func``, with its contract: packed
    ``(total, heads, head_dim)`` q/k/v cut into sequences at ``cu_seqlens``, attention within each sequence only
    (causal; q and k lengths are equal, so top-left and bottom-right alignment agree), softmax in fp32, the output in
    q's dtype (flash-attn returns its input dtype). No dropout (verl passes 0.0 in training: attention_dropout 0)."""
    import torch

    assert dropout_p == 0.0, dropout_p
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    pieces = []
    with torch.autocast(q.device.type, enabled=False):
        for i in range(cu_seqlens_q.numel() - 1):
            qs, qe = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
            ks, ke = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
            qi, ki, vi = (t.transpose(0, 1).float() for t in (q[qs:qe], k[ks:ke], v[ks:ke]))  # (heads, len, dim)
            scores = (qi @ ki.transpose(-1, -2)) * scale
            if causal:
                keep = torch.ones(qe - qs, ke - ks, dtype=torch.bool, device=q.device).tril(ke - ks - (qe - qs))
                scores = scores.masked_fill(~keep, float("-inf"))
            pieces.append((scores.softmax(-1) @ vi).transpose(0, 1).to(q.dtype))
    return torch.cat(pieces)


def install_flash_stand_in() -> list[int]:
    """Bind :func:`cpu_varlen_attention` and the two flash-attn settings in verl's glm4v module (as verl binds them
    from flash-attn: ``_flash_use_top_left_mask`` False for flash-attn >= 2.1, ``_flash_supports_deterministic``
    False: no ``deterministic`` keyword). Returns the list each call appends its number of sequences to. Nothing
    else in verl changes; :func:`verl_globals_restored` undoes it after the case."""
    import verl.models.transformers.glm4v as glm4v

    calls: list[int] = []

    def varlen(q: Any, k: Any, v: Any, cu_seqlens_q: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(int(cu_seqlens_q.numel()) - 1)
        return cpu_varlen_attention(q, k, v, cu_seqlens_q, *args, **kwargs)

    varlen.stand_in = True  # type: ignore[attr-defined]
    glm4v.flash_attn_varlen_func = varlen
    glm4v._flash_use_top_left_mask = False
    glm4v._flash_supports_deterministic = False
    return calls


@contextmanager
def verl_globals_restored() -> Iterator[None]:
    """What a ``use_remove_padding=True`` case leaves behind in this process, undone when the case ends:
    ``apply_monkey_patch`` replaces ``Glm4vTextAttention.forward`` (verl's ``glm4v_attn_forward``) and transformers'
    ``flash_attention._flash_attention_forward`` class- and module-wide, and the flash-attn stand-in binds names in
    verl's glm4v module. The next case of the launch then starts as a fresh process would."""
    from transformers.integrations import flash_attention
    from transformers.models.glm4v.modeling_glm4v import Glm4vTextAttention

    attention, flash = Glm4vTextAttention.forward, flash_attention._flash_attention_forward
    try:
        yield
    finally:
        Glm4vTextAttention.forward = attention
        flash_attention._flash_attention_forward = flash
        glm4v = sys.modules.get("verl.models.transformers.glm4v")
        if getattr(getattr(glm4v, "flash_attn_varlen_func", None), "stand_in", False):
            for name in FLASH_NAMES:
                delattr(glm4v, name)


def _worst(got: dict[str, Any], want: dict[str, Any]) -> tuple[float, str, list[str]]:
    """Largest absolute difference over every tensor (NaN counts as worst, a shape mismatch is inf), its name, and
    names missing a side."""
    from fsdp_compat.testing.parity import worse

    worst, where, missing = 0.0, "", []
    for name, ref in want.items():
        mine = got.get(name)
        if (mine is None) != (ref is None):
            missing.append(f"{name} ({'absent' if name not in got else 'None'} in the engine, reference {ref is None})")
            continue
        if ref is None:
            continue
        if tuple(mine.shape) != tuple(ref.shape):  # a broadcast must not hide a wrong shape
            x = math.inf
        else:
            x = float((mine.float() - ref.float()).abs().max()) if ref.numel() else 0.0
        if not math.isnan(worst) and not (x <= worst):
            where = name
        worst = worse(worst, x)  # NaN-sticky: a later finite value never replaces a NaN
    return worst, where, missing


def _cast_floating(dtype: Any, *, in_recompute: bool) -> Any:
    """A forward pre-hook casting every floating tensor of the inputs to ``dtype``: FSDP2's ``cast_forward_inputs``
    (``FSDPState._cast_forward_inputs``: ``_apply_to_tensors`` over args and kwargs, ints left alone). With
    ``in_recompute`` False it leaves the inputs of an activation-checkpoint recompute (a forward run inside backward)
    as they come, as :func:`fsdp_casts_recompute_inputs` finds FSDP2 does on older torch."""
    import torch
    from torch.distributed.utils import _apply_to_tensors

    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and torch.is_floating_point(x) and x.dtype != dtype:
            return x.to(dtype)
        return x

    def hook(_module: Any, args: Any, kwargs: Any) -> Any:
        if not in_recompute and torch._C._current_graph_task_id() != -1:  # inside backward: a recompute
            return args, kwargs
        return _apply_to_tensors(cast, args), _apply_to_tensors(cast, kwargs)

    return hook


def fsdp_casts_recompute_inputs() -> bool:
    """Whether this torch's FSDP2 casts a group's inputs to ``param_dtype`` when activation checkpointing runs the
    group's forward again in backward. torch 2.11's ``FSDPState._pre_forward`` returns the recompute's args as they
    come (its ``TrainingState.PRE_BACKWARD`` branch skips ``cast_forward_inputs``); torch 2.13's returns
    ``self._cast_forward_inputs(args, kwargs)``. Under verl's recipe on torch 2.11 a checkpointed vision block's
    recompute therefore reads the fp32 rotary tables where its forward read their bf16 casts: the gradients differ
    from those of the forward that was run (measured: 3.05e-05 on the patch embedding's gradient at step 1)."""
    import inspect

    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    source = inspect.getsource(FSDPState._pre_forward)
    recompute = source[source.index("TrainingState.PRE_BACKWARD") :]
    first_return = next(line for line in recompute.splitlines() if line.strip().startswith("return "))
    return "_cast_forward_inputs" in first_return


def parity_reference(
    engine: Any, cfg: dict[str, Any], case: dict[str, Any], ranks: list[Any], grads: list[Any], params: list[Any]
) -> dict[str, Any]:
    """One process, no FSDP, verl's own GLM4V forward (the classes carry it since ``apply_monkey_patch``) through the
    engine's ``forward_step`` and ``sft_loss``, on every rank's micro-batch of each step: ``(loss_r / W).backward()``
    per rank batch r (loss_r normalised by the global token count and multiplied by W, as verl does), then the same
    AdamW (the engine optimizer's class, defaults and per-step lr). Halving is exact and a+b commutative, so with 2
    ranks every figure below can be 0.0.

    With verl's default bf16 policy (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32,
    cast_forward_inputs=True)`` and the engine's bf16 autocast) the reference does by hand what FSDP2 does: fp32
    master weights and AdamW on them; the model computes with bf16 copies of them (buffers stay fp32, as in the
    engine); every module that is an FSDP2 group in the engine casts its floating inputs to bf16 first; each rank
    batch's bf16 gradients (``.grad`` cleared between batches, so nothing accumulates in bf16) are cast to fp32 and
    summed in fp32. FSDP2 reduce-scatters the fp32 casts with AVG: (a + b) / 2, which equals a/2 + b/2 exactly
    (halving a bf16 or fp32 value is exact), so 0.0 is possible here too. Gradient checkpointing as the engine set
    it, and a recompute's inputs cast only where this torch's FSDP2 casts them (:func:`fsdp_casts_recompute_inputs`)."""
    import torch
    from verl.utils import tensordict_utils as tu
    from verl.utils.model import get_hf_auto_model_class

    world = len(ranks)
    kinds = case["kinds"]
    hf_config = engine.model_config.hf_config
    module = get_hf_auto_model_class(hf_config=hf_config).from_pretrained(
        cfg[case["model_dir"]], torch_dtype=torch.float32, config=hf_config
    )
    from verl.utils.device import get_device_name

    module.to(get_device_name()).train()
    single = copy.copy(engine)
    single.module = module
    import inspect

    compute = getattr(engine, "_autocast_dtype", torch.float32)
    mixed = compute != torch.float32
    named = dict(module.named_parameters())
    master = {n: p.detach().clone().requires_grad_(True) for n, p in named.items()} if mixed else named
    if engine.module.is_gradient_checkpointing:  # verl's default, as the engine set it (transformer_impl.py)
        module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if mixed:
        for p in named.values():
            p.data = p.data.to(compute)
        cast = _cast_floating(compute, in_recompute=fsdp_casts_recompute_inputs())
        for name in fsdp_groups(engine.module):
            module.get_submodule(name).register_forward_pre_hook(cast, with_kwargs=True)
    kind = type(engine.optimizer)  # AdamW; its defaults hold keys its constructor does not take (AdamW over Adam)
    accepted = inspect.signature(kind).parameters
    optimizer = kind(master.values(), **{k: v for k, v in engine.optimizer.defaults.items() if k in accepted})
    calls: list[list[int]] = []
    module.model.visual.register_forward_pre_hook(lambda _m, args: calls.append(list(args[0].shape)) and None)
    out: dict[str, Any] = {"steps": [], "mixed_precision": mixed}
    remove_padding = bool(case.get("remove_padding"))
    for step in range(case.get("steps", 2)):
        for group in optimizer.param_groups:
            group["lr"] = ranks[0][step]["lr"]
        optimizer.zero_grad(set_to_none=True)
        if mixed:  # FSDP2's all-gather of the bf16 cast of each fp32 shard
            with torch.no_grad():
                for n, p in named.items():
                    p.copy_(master[n])
        batches = [p14_sft_batch(kinds[r % len(kinds)], _seed(step, r), world, remove_padding) for r in range(world)]
        tokens = sum(int(b["loss_mask"].sum()) for b in batches)
        losses, first = [], len(calls)
        summed: dict[str, Any] = {}
        for batch in batches:
            tu.assign_non_tensor(batch, sp_size=1, dp_size=world, batch_num_tokens=tokens)
            if mixed:
                module.zero_grad(set_to_none=True)
            loss, _ = single.forward_step(batch, loss_function=engine_loss(), forward_only=False)
            (loss / world).backward()
            losses.append(float(loss.detach()))
            if mixed:  # the reduce dtype (fp32), summed over ranks
                for n, p in named.items():
                    if p.grad is not None:
                        g = p.grad.float()
                        summed[n] = g if n not in summed else summed[n] + g
        if mixed:
            for n, m in master.items():
                m.grad = summed.get(n)
        grad_diff, grad_at, grad_missing = _worst(grads[step], {n: p.grad for n, p in master.items()})
        optimizer.step()
        param_diff, param_at, param_missing = _worst(params[step], {n: p.detach() for n, p in master.items()})
        from fsdp_compat.testing.parity import worse

        loss_diff = 0.0
        for r in range(world):
            loss_diff = worse(loss_diff, abs(ranks[r][step]["loss"] - losses[r]))
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
                    sum(p.grad.float().pow(2).sum() for n, p in master.items() if "visual" in n and p.grad is not None)
                ),
                "params": len(master),
            }
        )
    return out


def assert_reference_steps_exact(reference: dict[str, Any], steps: int, label: str = "") -> None:
    """Every step of a one-process reference (:func:`parity_reference` and its kin) against the engine's ranks: no
    parameter missing on either side, losses, gradients and post-AdamW parameters 0.0, the ranks' losses different
    (each its own data) and finite."""
    assert len(reference["steps"]) == steps, reference
    for step, ref in enumerate(reference["steps"]):
        assert ref["missing"] == [], (label, step, ref["missing"])
        assert ref["loss_diff"] == 0.0, (label, step, ref["loss_diff"], ref["losses"])
        assert ref["grad_diff"] == 0.0, (label, step, ref["grad_diff"], ref["grad_at"])
        assert ref["param_diff"] == 0.0, (label, step, ref["param_diff"], ref["param_at"])
        assert ref["losses"][0] != ref["losses"][1], f"{label}: both ranks saw the same data: {ref['losses']}"
        assert all(math.isfinite(x) for x in ref["losses"]), (label, ref["losses"])


def engine_loss() -> Any:
    """verl's SFT loss as the SFT trainer binds it."""
    from functools import partial

    from verl.workers.utils.losses import sft_loss

    return partial(sft_loss, config=None)


def engine_ranks(cfg: dict[str, Any], rank: int, extra: dict[str, Any]) -> None:
    """The rank body: one process group, then every case of ``cfg["cases"]`` in order (results in ``extra``)."""
    extra["backend"] = _setup(cfg, rank)
    import torch.distributed as dist

    extra["cases"] = {}
    for case in cfg["cases"]:
        t0 = time.perf_counter()
        with verl_globals_restored():
            if case.get("expect_failure"):
                extra["cases"][case["name"]] = run_expected_failure(cfg, case, rank)
            elif case.get("kinds"):
                extra["cases"][case["name"]] = run_parity(cfg, case, rank, {})
            else:
                extra["cases"][case["name"]] = run_case(cfg, case, rank, {})
        extra["cases"][case["name"]]["case_s"] = time.perf_counter() - t0
        extra["state"] = adapter_state()
        stopped = case.get("expect_failure") and extra["cases"][case["name"]]["error"]
        if stopped and not (case.get("at_setup") or case.get("same_stop")):
            return  # FSDP crashed mid-forward: collectives may be left unmatched, so no barrier; rank_entry exits
        if stopped:  # every rank stopped at the same point after the same collectives: the launch goes on
            dist.barrier()
    dist.barrier()


# ----------------------------------------------------------------------------- verl's GLM4V forward, one process


def forward_probe() -> dict[str, Any]:
    """verl's own GLM4V forward against transformers' own, one process, no FSDP, on the zoo batch.

    The order of a worker: ``verl.utils.fsdp_utils`` imported (activates fsdp-compat), then
    ``apply_monkey_patch`` (imports verl's glm4v module and swaps the class forwards). Logits of transformers'
    forward are taken before the swap; verl's forward gets the 4-row position ids its datasets build. On
    transformers 5 the unrepaired function (``__wrapped__``) is called too, to show what verl's own code does.
    """
    import importlib.util
    import logging
    import sys

    import torch

    if importlib.util.find_spec("verl.models.transformers.glm4v") is None:
        return {"has_glm4v_forward": False}
    logged: list[str] = []
    keep = logging.Handler()
    keep.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("fsdp_compat").addHandler(keep)
    import verl.utils.fsdp_utils  # noqa: F401  (what every worker imports before the model is built)

    loaded_early = "verl.models.transformers.glm4v" in sys.modules  # the repair waits for verl to import it
    from verl.models.transformers.monkey_patch import apply_monkey_patch

    from fsdp_compat.testing.verl_smoke import glm4v_position_ids
    from fsdp_compat.testing.zoo import build_model, make_batch

    model, batch = build_model("glm4v"), make_batch("glm4v")
    batch.pop("labels")
    with torch.no_grad():
        reference = model(**batch).logits
    apply_monkey_patch(model=model, use_remove_padding=False)
    import verl.models.transformers.glm4v as glm4v

    out: dict[str, Any] = {"has_glm4v_forward": True, "state": adapter_state(), "glm4v_loaded_early": loaded_early}
    out["repair_logged"] = any("repaired verl.models.transformers.glm4v._get_input_embeds" in m for m in logged)
    inputs = {k: v for k, v in batch.items() if k != "mm_token_type_ids"}  # verl's datasets drop it
    inputs["position_ids"] = glm4v_position_ids(model, batch)
    try:
        with torch.no_grad():
            logits = model(**inputs).logits
        out["max_abs_logit_diff"] = float((logits - reference).abs().max())
    except Exception as exc:
        out["error"] = traceback.format_exception_only(type(exc), exc)[-1].strip()
    original = getattr(glm4v._get_input_embeds, "__wrapped__", None)
    if original is not None:
        try:
            original(
                model.model,
                batch["input_ids"],
                batch["attention_mask"],
                batch["pixel_values"],
                None,
                batch["image_grid_thw"],
            )
            out["unrepaired"] = "ran"
        except Exception as exc:
            out["unrepaired"] = traceback.format_exception_only(type(exc), exc)[-1].strip()
    adapter = getattr(sys.modules.get("fsdp_compat.adapters.verl"), "ADAPTER", None)
    if adapter is not None and original is not None:
        adapter.unpatch()
        out["unpatch_restores_verls_function"] = glm4v._get_input_embeds is original
    return out


def forward_first_probe() -> dict[str, Any]:
    """The order of a reference or evaluation pass: verl's GLM4V forward is used before anything has imported
    ``verl.utils.fsdp_utils`` (``apply_monkey_patch`` + one image forward, one process, no FSDP)."""
    import sys

    import torch
    from verl.models.transformers.monkey_patch import apply_monkey_patch

    from fsdp_compat.testing.verl_smoke import glm4v_position_ids
    from fsdp_compat.testing.zoo import build_model, make_batch

    out: dict[str, Any] = {"utils_loaded_first": "verl.utils.fsdp_utils" in sys.modules}
    model, batch = build_model("glm4v"), make_batch("glm4v")
    batch.pop("labels")
    with torch.no_grad():
        reference = model(**batch).logits
    apply_monkey_patch(model=model, use_remove_padding=False)
    out["state"] = adapter_state()
    inputs = {k: v for k, v in batch.items() if k != "mm_token_type_ids"}  # verl's datasets drop it
    inputs["position_ids"] = glm4v_position_ids(model, batch)
    try:
        with torch.no_grad():
            out["max_abs_logit_diff"] = float((model(**inputs).logits - reference).abs().max())
    except Exception as exc:
        out["error"] = traceback.format_exception_only(type(exc), exc)[-1].strip()
    return out


if __name__ == "__main__":
    import json
    import sys

    if sys.argv[1:] == ["forward-probe"]:
        print(json.dumps(forward_probe()))
