"""Rank-side code for the VeOmni tests: build, shard and step a model through VeOmni's own trainer code, and compare
data-parallel training against one process.

Imported in fresh rank interpreters (``tests/`` on PYTHONPATH). It imports no fsdp_compat adapter: fsdp-compat has
none for VeOmni, so whatever changes the run here is the ``.pth`` start-up hook's generic layer on every FSDP2 root
(or nothing, with ``FSDP_COMPAT=off``).

VeOmni's path, as its ``VLMTrainer.__init__`` composes it (``BaseTrainer.__new__`` and its helpers one by one), run as
far as a CPU machine without a network allows:

- ``BaseTrainer._setup``: VeOmni's ``init_parallel_state`` (its device mesh, ``dp_shard`` over the 2 ranks), seeds.
  It would call ``dist.init_process_group(backend=get_dist_comm_backend())``, which raises on a machine without an
  accelerator ("No available distributed communication backend"); it skips that when a group exists, so the rank
  joins a gloo group first (the one departure in the setup).
- ``VLMTrainer._build_model``: ``build_foundation_model`` from a local checkpoint directory (the tiny model's config
  and weights, :func:`_save_checkpoint`), on the meta device, as VeOmni requires for FSDP2. With
  ``MODELING_BACKEND=hf`` (VeOmni's switch, set by the tests for zoo models) it builds transformers' own class (GLM4V
  has no VeOmni modeling: its registry raises and names that switch); by default, Qwen2.5-VL is VeOmni's own generated
  modeling (``veomni.models.transformers.qwen2_5vl.generated``), whose forward runs ``visual.dummy_forward()`` for
  each of the image and video inputs a micro-batch lacks.
- ``VLMTrainer._freeze_model_module`` (nothing frozen by default).
- Not run: ``_build_model_assets`` / ``_build_data_transform`` / ``_build_dataset`` / ``_build_collate_fn`` /
  ``_build_dataloader``. They need the model's processor and tokenizer files (hub downloads, unreachable here) and a
  dataset; each rank instead gets a zoo micro-batch with the keys VeOmni's collator adds for Qwen-VL
  (``image_mask`` / ``video_mask``, which VeOmni's Qwen2.5-VL forward otherwise derives by all-gathering
  ``input_ids`` over its sequence-parallel group).
- ``BaseTrainer._build_parallelized_model``: ``build_parallelize_model`` -> ``parallelize_model_fsdp2`` (a group
  per ``_no_split_modules`` class, children first, then the root) -> ``_materialize_and_load_weights`` (each rank
  loads its shards from the checkpoint directory). The one setting that departs from VeOmni's defaults: fp32
  parameters and reductions (``mixed_precision.param_dtype="float32"``; the default is bf16), and eager kernels
  (``ops_implementation`` all ``eager``: the defaults are Liger / flash-attention, GPU only).
- ``BaseTrainer._build_training_context`` and, per micro-batch, ``BaseTrainer.forward_backward_step`` (VeOmni's
  ``preforward``, the model call, ``postforward``'s ``mean_global_loss``: the loss weighted by this rank's share of
  the step's loss tokens times the FSDP size, then ``backward``), with the token counts ``train_step`` sets first.
- ``VLMTrainer._build_optimizer`` (VeOmni's ``build_optimizer``: fused AdamW, the vision parameters at ``vit_lr``)
  and ``optimizer.step()``; the reference gets the same optimizer from the same builder. Not run: ``train_step``'s
  callbacks (wandb, checkpoints, meters), gradient clipping and the LR scheduler (on the reference's side they would
  be a second implementation).

The reference, in every rank: the unsharded model (the checkpoint's weights; :func:`_reference`) on all
ranks' micro-batches with VeOmni's own weighting (each micro-batch's loss times its share of the loss tokens), one
optimizer step.
"""

from __future__ import annotations

import copy
import functools
import logging
import os
import tempfile
from typing import Any

from fsdp_compat.testing.parity import Diff, init_group, reference_backward, runtime_counters
from lab.observe import LogLines, fsdp_groups

__all__ = ["VEOMNI_QWEN", "build_tiny", "tiny_batch", "veomni_rank"]

#: The zoo's tiny Qwen2.5-VL with the patch size VeOmni's ``dummy_forward`` hard-codes (its dummy is 4 patches of
#: 3 x 2 x 14 x 14 values on a 1 x 2 x 2 grid; the zoo's patch size 4 does not fit it) and a window that patch size
#: divides (``window_size // spatial_merge_size // patch_size`` windows of merged patches: 112 // 2 // 14 = 4).
VEOMNI_QWEN = "veomni-qwen2.5-vl"
_QWEN_PATCH = 14
_QWEN_WINDOW = 112


def build_tiny(name: str) -> Any:
    """The tiny model a test runs: a zoo model, or :data:`VEOMNI_QWEN` (transformers' Qwen2.5-VL class, seed 0)."""
    import torch

    from fsdp_compat.testing.zoo import build_model

    if name != VEOMNI_QWEN:
        return build_model(name, seed=0)
    import transformers

    base = build_model("qwen2.5-vl", seed=0)
    config = copy.deepcopy(base.config)
    config.vision_config.patch_size = _QWEN_PATCH
    config.vision_config.window_size = _QWEN_WINDOW
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = transformers.Qwen2_5_VLForConditionalGeneration(config)
    return model.to(torch.float32).train()


def tiny_batch(name: str, seed: int, variant: str) -> dict[str, Any]:
    """The zoo's micro-batch of ``variant`` for ``name`` (for :data:`VEOMNI_QWEN`: the same rows, patches of
    3 x 2 x 14 x 14 values)."""
    from fsdp_compat.testing import zoo

    if name != VEOMNI_QWEN:
        return zoo.make_batch(name, seed=seed, variant=variant)
    import torch

    g = torch.Generator().manual_seed(seed + 12345)
    return zoo._vlm_batch("qwen2.5-vl", g, variant, patch=_QWEN_PATCH, vocab=zoo._GLM_TEXT["vocab_size"])


def _reference(name: str, tiny: Any) -> Any:
    """The unsharded reference: ``tiny`` itself (transformers' class), or for :data:`VEOMNI_QWEN` VeOmni's own
    Qwen2.5-VL class with ``tiny``'s weights (its forward runs the same ``dummy_forward`` calls as the sharded model;
    transformers' own forward computes a different loss on the same weights and micro-batch)."""
    if name != VEOMNI_QWEN:
        return tiny
    from veomni.models.loader import MODELING_REGISTRY

    cls = MODELING_REGISTRY[tiny.config.model_type](tiny.config.architectures[0])
    reference = cls._from_config(copy.deepcopy(tiny.config), attn_implementation="eager")
    reference.load_state_dict(tiny.state_dict())
    return reference.train()


def _veomni_keys(batch: dict[str, Any], config: Any) -> dict[str, Any]:
    """What VeOmni's Qwen-VL collator adds: the image and video placeholder masks."""
    ids = batch["input_ids"]
    return {**batch, "image_mask": ids == config.image_token_id, "video_mask": ids == config.video_token_id}


def _loss(loss: Any) -> Any:
    """A transformers forward's ``.loss`` under VeOmni: with VeOmni's modeling backend, ``import veomni`` binds its
    cross-entropy into transformers' ``LOSS_MAPPING["ForCausalLM"]``, which returns ``(loss, logits, aux)`` (its own
    generated forwards unpack it); transformers' own Qwen2.5-VL forward passes the tuple on as ``.loss``."""
    return loss[0] if isinstance(loss, tuple) else loss


def _weighted(model: Any, batch: dict[str, Any], *, total: Any, world: int) -> Any:
    """VeOmni's ``mean_global_loss`` for one micro-batch: its loss times its share of the step's ``total`` loss
    tokens, times the FSDP size (FSDP2 averages over the ranks)."""
    from veomni.utils.loss_utils import count_loss_token

    return _loss(model(**batch).loss) * count_loss_token(batch)["foundation_tokens"] / total * world


def _arguments(checkpoint: str, output_dir: str) -> Any:
    from veomni.arguments.arguments_types import (
        AcceleratorConfig,
        CheckpointConfig,
        FSDPConfig,
        GradientCheckpointingConfig,
        MixedPrecisionConfig,
        OpsImplementationConfig,
    )
    from veomni.trainer.vlm_trainer import (
        VeOmniVLMArguments,
        VLMMDataArguments,
        VLMMModelArguments,
        VLMTrainingArguments,
    )

    eager = {
        f: "eager"
        for f in (
            "attn_implementation",
            "moe_implementation",
            "cross_entropy_loss_implementation",
            "rms_norm_implementation",
            "swiglu_mlp_implementation",
            "rotary_pos_emb_implementation",
            "rotary_pos_emb_vision_implementation",
            "load_balancing_loss_implementation",
        )
    }
    fp32 = MixedPrecisionConfig(param_dtype="float32", reduce_dtype="float32", cast_forward_inputs=False)
    return VeOmniVLMArguments(
        model=VLMMModelArguments(
            config_path=checkpoint, model_path=checkpoint, ops_implementation=OpsImplementationConfig(**eager)
        ),
        data=VLMMDataArguments(train_path=checkpoint),
        train=VLMTrainingArguments(
            init_device="meta",
            accelerator=AcceleratorConfig(fsdp_config=FSDPConfig(fsdp_mode="fsdp2", mixed_precision=fp32)),
            gradient_checkpointing=GradientCheckpointingConfig(enable=False),
            checkpoint=CheckpointConfig(output_dir=output_dir),
        ),
    )


def veomni_rank(cfg: dict[str, Any], rank: int, extra: dict[str, Any]) -> None:
    """``cfg["model"]`` (a zoo name or :data:`VEOMNI_QWEN`) built, sharded and stepped through VeOmni's trainer code
    (module doc), this rank training on its own micro-batch (``cfg["variants"][rank]``, seed 100 + rank) for
    ``cfg["steps"]`` steps; every rank also trains the unsharded reference on all ranks' micro-batches. ``extra``:
    the groups, the model class's module, the log lines, the vision tower's calls per forward, fsdp-compat's
    mixed-batch counters, the losses and the worst differences (gradients after each backward, parameters after each
    step)."""
    lines = LogLines()
    logging.getLogger("fsdp_compat").addHandler(lines)
    extra["log"] = lines.lines  # filled as it goes: a failing rank reports what was logged until then
    world = cfg["world_size"]
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    init_group(cfg, rank)  # gloo: VeOmni's own _setup would ask for an accelerator's backend
    # under the test's own folder (``cfg["workdir"]``): a rank that gloo aborts leaves its directory to pytest's cleanup
    with tempfile.TemporaryDirectory(prefix=f"veomni-rank{rank}-", dir=cfg.get("workdir")) as work:
        _train(cfg, rank, extra, work)


def _save_checkpoint(model: Any, path: str) -> None:
    """``model``'s config and weights under the names of its own ``state_dict`` (the names VeOmni's loader matches).
    Not ``save_pretrained``: transformers 5.9 writes Qwen2.5-VL in the Hub's layout (``model.layers.*``,
    ``visual.*``), which VeOmni 0.1.12's ``load_model_weights`` does not map to its class's names: it logs each
    tensor as an unexpected key and initialises every weight matrix at random."""
    from safetensors.torch import save_file

    model.config.architectures = [type(model).__name__]  # what save_pretrained records; VeOmni's loader reads it
    model.config.save_pretrained(path)
    weights = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(weights, os.path.join(path, "model.safetensors"))


def _train(cfg: dict[str, Any], rank: int, extra: dict[str, Any], work: str) -> None:
    from veomni.distributed.parallel_state import use_parallel_state
    from veomni.trainer.base import BaseTrainer
    from veomni.trainer.vlm_trainer import VLMTrainer
    from veomni.utils.loss_utils import count_loss_token, reduce_global_loss_token

    name, world = cfg["model"], cfg["world_size"]
    checkpoint = os.path.join(work, "checkpoint")
    tiny = build_tiny(name)
    _save_checkpoint(tiny, checkpoint)
    reference = _reference(name, tiny)  # the checkpoint's weights, unsharded

    trainer = VLMTrainer.__new__(VLMTrainer)  # VLMTrainer.__init__'s steps, one by one (module doc)
    trainer.base = BaseTrainer.__new__(BaseTrainer)
    trainer.base.args = _arguments(checkpoint, os.path.join(work, "output"))
    trainer.base._setup()
    with use_parallel_state("base"):
        trainer._build_model()
        trainer._freeze_model_module()
        trainer.base._build_parallelized_model()
        trainer.base._build_training_context()
        trainer._build_optimizer()
    base = trainer.base
    model = base.model
    extra["model_module"] = type(model.model).__module__  # model.model: no FSDP2 group of its own
    extra["groups"] = fsdp_groups(model)

    tower = model.model.visual
    calls: list[int] = []
    tower.register_forward_pre_hook(lambda *_: calls.__setitem__(-1, calls[-1] + 1))

    # the reference's optimizer from VeOmni's own builder, with the same parameter groups
    shell = VLMTrainer.__new__(VLMTrainer)
    shell.base = BaseTrainer.__new__(BaseTrainer)
    shell.base.args, shell.base.model = base.args, reference
    shell._build_optimizer()
    opts = [base.optimizer, shell.base.optimizer]

    kinds = cfg["variants"]
    batches = [tiny_batch(name, 100 + r, kinds[r]) for r in range(world)]
    if name == VEOMNI_QWEN:
        batches = [_veomni_keys(b, model.config) for b in batches]
    loaded = Diff()  # what VeOmni's loader put into the shards, against the checkpoint's weights
    loaded.add_params(model, dict(reference.named_parameters()))
    extra["load_diff"], extra["worst_loaded"] = loaded.abs, loaded.where
    grads, params = Diff(), Diff()  # NaN-failing
    extra["losses"], extra["reference_losses"], extra["tower_calls"] = [], [], []
    for _ in range(cfg["steps"]):
        # what BaseTrainer.train_step sets before its micro-batches (one micro-batch per step here)
        mine = batches[rank]
        base.micro_batches_token_len = count_loss_token([mine])
        base.global_micro_batches_token_len = reduce_global_loss_token(base.micro_batches_token_len)
        base.micro_batch_token_len = count_loss_token(mine)
        total = base.global_micro_batches_token_len["foundation_tokens"]
        calls.append(0)
        loss, _, _ = base.forward_backward_step(dict(mine))
        extra["tower_calls"].append(calls[-1])

        weighted = functools.partial(_weighted, total=total, world=world)
        ref_losses = reference_backward(reference, batches, loss=weighted)
        ref_params = dict(reference.named_parameters())
        grads.add_grads(model, {n: p.grad for n, p in ref_params.items()})
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        params.add_params(model, ref_params)
        extra["losses"].append(float(loss.detach()))
        extra["reference_losses"].append(float(ref_losses[rank]))
    extra["grad_diff"], extra["param_diff"] = grads.abs, params.abs
    extra["worst_grad_param"], extra["worst_param"] = grads.where, params.where
    extra.update(runtime_counters(model))
