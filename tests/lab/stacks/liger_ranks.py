"""Rank-side code of the liger-kernel tests: a zoo VLM with liger's fused linear + cross-entropy forward, sharded by a
trainer's own rule (:func:`own_apply_fsdp2_with_lm_head`: every ``_no_split_modules``-class module, every
``nn.Embedding`` and the output embedding its own group, then the root), one forward + backward on this rank's image
batch.

Imported in fresh rank interpreters; nothing of fsdp-compat is imported before the model is sharded, so whatever
protects the job is the installed ``.pth`` hook (the generic layer). liger's Triton kernel needs a GPU driver, so on
CPU the step cannot finish: what it shows is *where* it stops (the rank records the error instead of raising).
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn
from torch.distributed.fsdp import fully_shard  # bound by name at import, as such trainers do

from fsdp_compat.testing.parity import init_group, runtime_counters
from lab.observe import LogLines, fsdp_groups

__all__ = ["apply_liger", "liger_rank", "own_apply_fsdp2_with_lm_head"]


def own_apply_fsdp2_with_lm_head(model: nn.Module, fsdp_kwargs: dict[str, Any]) -> None:
    """A trainer's own sharding that gives ``lm_head`` a group (as the legacy rule and accelerate's do; the zoo
    models are untied): layer classes, every embedding, the output embedding, then the root."""
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    output = model.get_output_embeddings()  # type: ignore[operator]
    targets = [
        m for m in model.modules() if type(m).__name__ in layer_classes or isinstance(m, nn.Embedding) or m is output
    ]
    for module in reversed(targets):  # children first, as FSDP2 requires
        fully_shard(module, **fsdp_kwargs)
    fully_shard(model, **fsdp_kwargs)


def apply_liger(model: Any, name: str) -> None:
    """liger's VLM forward on this instance only (``model=``: the class stays transformers'); fused linear +
    cross-entropy on, liger's RMSNorm / SwiGLU / RoPE off, since those replace module classes process-wide."""
    from liger_kernel.transformers import apply_liger_kernel_to_glm4v, apply_liger_kernel_to_qwen2_5_vl

    apply = {"glm4v": apply_liger_kernel_to_glm4v, "qwen2.5-vl": apply_liger_kernel_to_qwen2_5_vl}[name]
    apply(rope=False, rms_norm=False, swiglu=False, fused_linear_cross_entropy=True, model=model)


def liger_rank(cfg: dict[str, Any], rank: int, extra: dict[str, Any]) -> None:
    """Zoo model ``cfg["model"]`` (liger's forward when ``cfg["liger"]``) sharded by the trainer's own rule; one
    step on this rank's image batch. ``extra``: groups, fsdp-compat's log lines, the error (or None), guard state."""
    lines = LogLines()
    logging.getLogger("fsdp_compat").addHandler(lines)
    extra["log"] = lines.lines
    init_group(cfg, rank)
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_compat.testing.zoo import build_model, make_batch

    model = build_model(cfg["model"], seed=0)
    if cfg["liger"]:
        apply_liger(model, cfg["model"])
    own_apply_fsdp2_with_lm_head(model, {"mesh": init_device_mesh("cpu", (cfg["world_size"],))})
    extra["groups"] = fsdp_groups(model)
    try:
        model(**make_batch(cfg["model"], seed=100 + rank)).loss.backward()
        extra["error"] = None
    except Exception as exc:  # the point of the run: where it stops
        extra["error"] = f"{type(exc).__name__}: {exc}"
    extra.update(runtime_counters(model))
    from fsdp_compat.runtime.guard import guard_of

    guard = guard_of(model)
    extra["guard_armed"] = None if guard is None else guard.armed
