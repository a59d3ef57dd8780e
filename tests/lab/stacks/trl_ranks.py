"""Rank-side code for the TRL tests: tiny GLM4V trained by TRL's own ``SFTTrainer`` (the HF Trainer underneath:
``Accelerator.prepare`` -> accelerate's ``fsdp2_prepare_model``) with ``fsdp_config={"version": 2}`` on 2 gloo ranks.

Imported in fresh rank interpreters, with ``tests/`` on PYTHONPATH (the accelerate
helpers: the GPU-type state, the log handler, the groups). It imports no fsdp_compat adapter: what patches accelerate
here is the ``.pth`` hook. The Trainer builds its own ``Accelerator``; ``accelerator_config={"use_configured_state":
True}`` (a documented TrainingArguments option) makes it use the ``PartialState`` built here, the one field of which
is set to ``MULTI_GPU`` (``gpu_type_state``), so TRL/the Trainer take accelerate's FSDP2 path on CPU.

No tokenizer or processor exists for the zoo's tiny model: a 128-token word-level tokenizer stands in (TRL requires
one), dataset preparation is skipped, and the data collator hands each rank its zoo batch (rank 0 images, rank 1
text only). The comparison hooks into the Trainer's own callbacks: at ``on_pre_optimizer_step`` the one-process
reference runs both ranks' batches with the mean loss and every gradient is compared; at ``on_optimizer_step`` the
reference steps and every parameter is compared.
"""

from __future__ import annotations

import copy
import logging
import os
from typing import Any

from fsdp_compat.testing.parity import Diff, full_tensor, init_group, reference_backward
from lab.stacks.accelerate_ranks import LogLines, accelerate_env, fsdp_groups, gpu_type_state

__all__ = ["sft_rank"]


def _plain_loss(outputs: Any, labels: Any, num_items_in_batch: Any = None) -> Any:
    """transformers' causal-LM loss on the model's logits (TRL's ``compute_loss_func`` hook): the head runs its own
    forward, as in a plain Trainer, instead of TRL's fused LM head."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    vocab = outputs.logits.shape[-1]
    return ForCausalLMLoss(outputs.logits, labels, vocab_size=vocab, num_items_in_batch=num_items_in_batch)


def sft_rank(cfg: dict[str, Any], rank: int, extra: dict[str, Any]) -> None:
    """``cfg["steps"]`` steps of TRL's ``SFTTrainer`` on ``cfg["model"]`` (``cfg["variants"][rank]``, seed 100 + rank;
    ``cfg["same_batch"]``: rank 0's batch everywhere), constant lr 1e-3, no weight decay, no clipping, torch AdamW
    (``optim="adamw_torch"``, the reference's); ``cfg["plain_loss"]``: transformers' loss through
    ``compute_loss_func``, else TRL's default fused LM head. ``extra``: groups, log lines, losses, the worst
    differences (and where), the norm ratio of ``lm_head.weight``'s gradient to the reference's at each step."""
    lines = LogLines()
    logging.getLogger("fsdp_compat").addHandler(lines)
    extra["log"] = lines.lines
    accelerate_env(cfg, rank)
    init_group(cfg, rank)

    import torch
    from datasets import Dataset
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from fsdp_compat.runtime.mixed_batches import mixed_batches_of
    from fsdp_compat.testing.zoo import build_model, make_batch

    gpu_type_state()
    vocab = {f"t{i}": i for i in range(128)}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t1")), pad_token="t0", eos_token="t2"
    )
    model = build_model(cfg["model"], seed=0)
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.0)
    kinds = cfg["variants"]
    seeds = [100 if cfg.get("same_batch") else 100 + r for r in range(cfg["world_size"])]
    batches = [make_batch(cfg["model"], seed=seeds[r], variant=kinds[r]) for r in range(cfg["world_size"])]
    grads, params = Diff(), Diff()
    extra["lm_head_grad_ratio"], extra["step_grad_diff"] = [], []

    class Compare(TrainerCallback):
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **_: Any) -> None:
            reference_backward(reference, batches)
            ref = dict(reference.named_parameters())
            step = Diff()
            step.add_grads(model, {name: p.grad for name, p in ref.items()})
            grads.add_grads(model, {name: p.grad for name, p in ref.items()})
            head = full_tensor(dict(model.named_parameters())["lm_head.weight"].grad)
            extra["lm_head_grad_ratio"].append(float(head.norm() / ref["lm_head.weight"].grad.norm()))
            extra["step_grad_diff"].append((step.abs, step.where))

        def on_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **_: Any) -> None:
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
            params.add_params(model, dict(reference.named_parameters()))

    args = SFTConfig(
        output_dir=os.path.join(cfg["out"], f"rank{rank}"), per_device_train_batch_size=1, max_steps=cfg["steps"],
        learning_rate=1e-3, weight_decay=0.0, lr_scheduler_type="constant", max_grad_norm=0.0, optim="adamw_torch",
        logging_steps=1, save_strategy="no", report_to=[], remove_unused_columns=False, seed=0,
        dataset_kwargs={"skip_prepare_dataset": True}, accelerator_config={"use_configured_state": True},
        fsdp="full_shard", fsdp_config={"version": 2}, average_tokens_across_devices=False, bf16=False,
    )  # fmt: skip
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=Dataset.from_dict({"labels": [[0]] * 8}), processing_class=tokenizer,
        data_collator=lambda _examples: dict(batches[rank]), callbacks=[Compare()],
        **({"compute_loss_func": _plain_loss} if cfg.get("plain_loss") else {}),
    )  # fmt: skip
    extra["is_fsdp2"] = bool(trainer.accelerator.is_fsdp2)
    trainer.train()
    extra["groups"] = fsdp_groups(trainer.model_wrapped)
    extra["losses"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    extra["grad_diff"], extra["param_diff"] = grads.abs, params.abs
    extra["worst_grad_param"], extra["worst_param"] = grads.where, params.where
    extra["dummy_calls"] = sum(m.dummy_calls for m in mixed_batches_of(trainer.model_wrapped))
