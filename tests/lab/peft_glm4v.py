"""A user's own peft model around GLM4V's vision position table, trained under ``apply_fsdp2`` against a twin.

peft puts the table behind a wrapper: ``modules_to_save`` (``ModulesToSaveWrapper``: ``original_module`` and
``modules_to_save.default``) or a LoRA target (``lora.Embedding``, the table under ``base_layer``). GLM4V's vision
embeddings still read ``self.position_embedding.weight``, which the wrapper answers from an inner module, so a plan
by module path gives the inner module a group and ``F.grid_sample`` gets a sharded DTensor.
:func:`peft_rank` is a rank routine for :func:`fsdp_compat.testing.launch.run_ranks`.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["PEFT_CONFIGS", "peft_rank"]

PEFT_CONFIGS: dict[str, dict[str, Any]] = {
    "modules-to-save": {"r": 2, "target_modules": ["q_proj"], "modules_to_save": ["position_embedding"]},
    "lora-embedding": {"r": 2, "target_modules": ["q_proj", "position_embedding"]},
}


def build_peft_glm4v(config: str, seed: int = 0) -> Any:
    import torch
    from peft import LoraConfig, get_peft_model

    from fsdp_compat.testing.zoo import build_model

    model = build_model("glm4v", seed=seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed + 1)  # LoRA's A matrices are drawn at wrap time
        return get_peft_model(model, LoraConfig(**PEFT_CONFIGS[config]))


def _case(config: str, policy: str, guard: bool, mesh: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    """Rank r trains on its own batch (seed r); the twin runs every rank's batch with loss / W before each step (the
    mean loss; exact for W <= 2, so the figure is 0.0). ``cfg["poison"]`` multiplies one gradient by NaN first."""
    import torch
    import torch.distributed as dist

    from fsdp_compat.apply import apply_fsdp2
    from fsdp_compat.testing.parity import Diff, loss_scale, twin_step
    from fsdp_compat.testing.zoo import make_batch

    os.environ["FSDP_COMPAT_GUARD"] = "on" if guard else "off"
    world, rank = dist.get_world_size(), dist.get_rank()
    model, twin = build_peft_glm4v(config), build_peft_glm4v(config)
    plan = apply_fsdp2(model, {"mesh": mesh}, policy=policy)
    record: dict[str, Any] = {"groups": [list(g.paths) for g in plan.groups]}
    batches = [make_batch("glm4v", seed=r) for r in range(world)]
    trainable = [p for p in model.parameters() if p.requires_grad]
    twin_trainable = [p for p in twin.parameters() if p.requires_grad]
    opts = torch.optim.AdamW(trainable, lr=1e-3), torch.optim.AdamW(twin_trainable, lr=1e-3)
    diff = Diff()  # a gradient on one side only (e.g. LoRA factors of a raw-read table): inf

    def poison() -> None:
        next(p for p in trainable if p.grad is not None).grad.mul_(float("nan"))

    losses = []
    for _ in range(cfg.get("steps", 2)):
        step = twin_step(model, twin, opts, batches, rank, (diff, diff), scale=loss_scale(mesh),
                         before_compare=poison if cfg.get("poison") else None)
        losses.append(float(step.loss.detach()))
    record.update(max_abs_diff=diff.abs, losses=losses, trainable=len(trainable))
    return record


def peft_rank(cfg: dict[str, Any], rank: int, extra: dict[str, Any]) -> None:
    """Rank routine: every (config, policy, guard) case of ``cfg["cases"]``; a case that raises is recorded."""
    import torch

    from lab.read_corpus import run_cases

    torch.set_num_threads(1)
    extra["results"] = run_cases(cfg, rank, lambda config, policy, guard, mesh: _case(config, policy, guard, mesh, cfg))
