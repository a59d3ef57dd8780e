"""transformers' native FSDP2 on W gloo ranks: ``from_pretrained(dir, distributed_config=...)`` vs one process.

The user's real path in transformers >= 5.2x: a checkpoint directory, ``DistributedConfig(fsdp_size=W[,
fsdp_plan=...])``, and transformers applies its own FSDP2 plan while loading. :func:`run_native` saves nothing
itself; :func:`save_tiny` writes a tiny real model with ``save_pretrained``. Each rank is a fresh interpreter (so the
``.pth`` hook, or ``FSDP_COMPAT=off``, behaves as in a real launch), loads the checkpoint twice (sharded by
transformers, and unsharded as the single-process reference) and trains both for ``steps`` AdamW steps,
data-parallel: each rank on its own micro-batch (seed ``seed + rank``, ``variants[rank]`` for a vision-language
model, e.g. ``["image", "text"]``), the reference on all the ranks' micro-batches with the mean loss
(:func:`~fsdp_compat.testing.parity.twin_step`). It reports the largest gradient and parameter differences; with 2
ranks they are exactly 0.0 where the plan is correct. Process handling is
:func:`~fsdp_compat.testing.launch.run_ranks`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fsdp_compat.testing.launch import RankResult, RunResult, run_ranks
from fsdp_compat.testing.parity import Diff, loss_scale, rank_batches, runtime_counters, twin_step
from fsdp_compat.testing.zoo import builder

__all__ = [
    "GLM4V_USER_PLAN",
    "TINY",
    "aborts_then_exact",
    "assert_native_exact",
    "assert_unaligned_aborts",
    "build_tiny",
    "load_differences",
    "model_class",
    "run_native",
    "save_tiny",
    "tiny_batches",
    "train_native",
]

#: GLM4V plan entry that a user adds to shard the vision position table on its own (crashes in grid_sample).
GLM4V_USER_PLAN = {"model.visual.embeddings.position_embedding": "free_full_weight"}


def _gemma4() -> Any:
    """Gemma4ForConditionalGeneration, text only, untied, with per-layer inputs (PLE): 101,200 parameters."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    text = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        global_head_dim=32,
        max_position_embeddings=256,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
        vocab_size_per_layer_input=128,
        hidden_size_per_layer_input=16,
        tie_word_embeddings=False,
        pad_token_id=0,
    )
    special = dict(
        image_token_id=120,
        video_token_id=121,
        audio_token_id=122,
        boi_token_id=123,
        eoi_token_id=124,
        boa_token_id=125,
        eoa_token_index=126,
    )
    config = Gemma4Config(text_config=text, vision_config=None, audio_config=None, tie_word_embeddings=False, **special)
    config._attn_implementation = "eager"
    return Gemma4ForConditionalGeneration(config)


#: name -> (builder, transformers class name that loads the checkpoint, zoo batch name)
TINY: dict[str, tuple[Callable[[], Any], str, str]] = {
    "gemma4": (_gemma4, "Gemma4ForConditionalGeneration", "qwen2"),
    "glm4v": (builder("glm4v"), "Glm4vForConditionalGeneration", "glm4v"),
    "qwen2": (builder("qwen2"), "Qwen2ForCausalLM", "qwen2"),
}


def _entry(name: str) -> tuple[Callable[[], Any], str, str]:
    """:data:`TINY`'s entry; any other zoo name (e.g. ``"lab.vlms:<model_type>"``, a family's tiny model) is its own
    batch name, loaded through its own class (``"module:qualname"``)."""
    if name in TINY:
        return TINY[name]
    if name in _ENTRIES:
        return _ENTRIES[name]
    from fsdp_compat.testing.zoo import build_model, is_vlm

    if not is_vlm(name):
        from fsdp_compat.errors import FsdpCompatError

        raise FsdpCompatError(f"unknown tiny model {name!r}; choose one of {', '.join(TINY)} or a zoo VLM")

    def build() -> Any:
        return build_model(name)

    cls = type(build())
    _ENTRIES[name] = build, f"{cls.__module__}:{cls.__qualname__}", name
    return _ENTRIES[name]


_ENTRIES: dict[str, tuple[Callable[[], Any], str, str]] = {}


def model_class(name: str) -> Any:
    """The class whose ``from_pretrained`` loads tiny model ``name``'s checkpoint."""
    import importlib

    import transformers

    spec = _entry(name)[1]
    module, _, qualname = spec.rpartition(":")
    return getattr(importlib.import_module(module), qualname) if module else getattr(transformers, qualname)


def build_tiny(name: str, *, seed: int = 0) -> Any:
    """A tiny model of :data:`TINY` (or a zoo VLM), fp32, weights a function of ``seed`` only."""
    import torch

    build = _entry(name)[0]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build()
    return model.float()


def save_tiny(
    name: str, directory: str | os.PathLike[str], *, seed: int = 0, original_format: bool = True
) -> Path:
    """``save_pretrained`` a tiny model into ``directory/name`` and return that path: in the checkpoint's original
    layout (transformers' default, reverted through the family's conversion mapping), or with
    ``original_format=False`` in transformers' own layout, which loads with no conversion."""
    path = Path(directory) / name.replace(":", "-")
    build_tiny(name, seed=seed).save_pretrained(path, save_original_format=original_format)
    return path


def tiny_batches(name: str, world_size: int, *, seed: int = 0, variants: list[str] | None = None) -> list[Any]:
    """Every rank's micro-batch (:func:`~fsdp_compat.testing.parity.rank_batches`): rank r's seed
    is ``seed + r``, ``variants[r]`` its kind for a vision-language model."""
    cfg = {"model": _entry(name)[2], "seed": seed, "world_size": world_size, "variants": variants}
    return rank_batches(cfg, "cpu")


def run_native(
    name: str,
    model_dir: str | os.PathLike[str],
    *,
    fsdp_plan: dict[str, str] | None = None,
    world_size: int = 2,
    steps: int = 2,
    timeout_s: float = 120.0,
    env: dict[str, str | None] | None = None,
    variants: list[str] | None = None,
    seed: int = 0,
) -> RunResult:
    """Load ``model_dir`` with ``DistributedConfig(fsdp_size=world_size, fsdp_plan=fsdp_plan)`` on fresh gloo ranks
    and train it ``steps`` AdamW steps, each rank on its own micro-batch (``variants[rank]``: a vision-language
    model's kind of batch), next to an unsharded copy trained on all of them with the mean loss; each rank's
    ``extra`` holds the applied groups, the reference's losses of its own batch and the mixed-batch counters."""
    if variants is not None and len(variants) != world_size:
        from fsdp_compat.errors import FsdpCompatError

        raise FsdpCompatError(f"variants names one batch kind per rank: {len(variants)} for {world_size} ranks")
    cfg = {"name": name, "model_dir": str(model_dir), "fsdp_plan": fsdp_plan, "steps": steps}
    cfg |= {"variants": variants, "seed": seed}
    return run_ranks(f"{__name__}:train_native", cfg, world_size=world_size, timeout_s=timeout_s, env=env)


# ------------------------------------------------------------------------------------------------------------
# Rank side


def init_gloo(cfg: dict[str, Any], rank: int) -> None:
    """The process group transformers expects to exist (it only creates one from RANK/WORLD_SIZE itself)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        backend="gloo",
        init_method=f"tcp://127.0.0.1:{cfg['port']}",
        rank=rank,
        world_size=cfg["world_size"],
        timeout=timedelta(seconds=cfg["timeout_s"]),
    )


def fsdp_groups(model: Any) -> list[list[str]]:
    """The FSDP2 groups as module paths (``fully_shard([a, b])`` is one entry with both; "" is the root)."""
    from fsdp_compat.testing.parity import _fsdp_group_sets

    return _fsdp_group_sets(model)


def train_against_reference(
    model: Any, reference: Any, batches: list[dict[str, Any]], rank: int, steps: int, *, scale: float = 1.0
) -> dict[str, Any]:
    """``steps`` AdamW steps of ``model`` (sharded, on ``batches[rank]``) and ``reference`` (one process, on all
    ``batches`` with the mean loss); the worst relative and absolute gradient/parameter differences (full tensors
    gathered: every rank calls this). ``scale`` multiplies the sharded loss (1 / the gradient reduction factor)."""
    import torch

    for m in (model, reference):
        m.train()
        for module in m.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
    opts = torch.optim.AdamW(model.parameters(), lr=1e-3), torch.optim.AdamW(reference.parameters(), lr=1e-3)
    grads, params = Diff(), Diff()
    losses: list[float] = []
    ref_losses: list[float] = []
    for _ in range(steps):
        step = twin_step(model, reference, opts, batches, rank, (grads, params), scale=scale)
        ref_losses.append(float(step.ref_losses[rank]))
        losses.append(float(step.loss.detach()))
    return {
        "losses": losses,
        "reference_losses": ref_losses,
        "max_abs_grad_diff": grads.abs,
        "max_rel_grad_diff": grads.rel,
        "max_abs_param_diff": params.abs,
        "max_rel_param_diff": params.rel,
        "worst": params.where or grads.where,
    }


def train_native(cfg: dict[str, Any], rank: int, extra: dict[str, Any]) -> RankResult:
    import torch
    import transformers

    init_gloo(cfg, rank)
    cls = model_class(cfg["name"])
    distributed = transformers.DistributedConfig(fsdp_size=cfg["world_size"], fsdp_plan=cfg["fsdp_plan"])
    load = {"dtype": torch.float32, "attn_implementation": "eager"}
    model = cls.from_pretrained(cfg["model_dir"], distributed_config=distributed, **load)
    extra["fsdp_groups"] = fsdp_groups(model)
    reference = cls.from_pretrained(cfg["model_dir"], **load)
    from torch.distributed.device_mesh import init_device_mesh

    scale = loss_scale(init_device_mesh("cpu", (cfg["world_size"],)))  # torch 2.8 + gloo sums gradients
    batches = tiny_batches(cfg["name"], cfg["world_size"], seed=cfg.get("seed", 0), variants=cfg.get("variants"))
    result = train_against_reference(model, reference, batches, rank, cfg["steps"], scale=scale)
    extra["worst_param"] = result.pop("worst")
    extra["reference_losses"] = result.pop("reference_losses")
    extra["mixed_batches"] = runtime_counters(model)["mixed_batches"]
    return RankResult(rank=rank, ok=True, extra=extra, **result)


def load_differences(name: str, model_dir: str | os.PathLike[str], *, world_size: int = 2, env=None) -> RunResult:
    """Load ``model_dir`` once sharded (``DistributedConfig(fsdp_size=world_size)``, the built-in plan) and once
    plainly on each of ``world_size`` gloo ranks; each rank's ``extra["differences"]`` maps every parameter whose
    gathered full tensor differs from the plain load's to the largest absolute difference."""
    cfg = {"name": name, "model_dir": str(model_dir)}
    return run_ranks(f"{__name__}:compare_loads", cfg, world_size=world_size, timeout_s=120.0, env=env)


def compare_loads(cfg: dict[str, Any], rank: int, extra: dict[str, Any]) -> RankResult:
    import torch
    import transformers
    from torch.distributed.tensor import DTensor

    init_gloo(cfg, rank)
    cls = model_class(cfg["name"])
    load = {"dtype": torch.float32, "attn_implementation": "eager"}
    sharded = cls.from_pretrained(cfg["model_dir"], distributed_config=transformers.DistributedConfig(
        fsdp_size=cfg["world_size"]), **load)  # fmt: skip
    plain = dict(cls.from_pretrained(cfg["model_dir"], **load).named_parameters())
    differences = {}
    for path, param in sharded.named_parameters():
        full = param.full_tensor() if isinstance(param, DTensor) else param
        gap = (full.detach() - plain[path].detach()).abs().max().item()
        if gap != 0.0:
            differences[path] = gap
    extra["differences"] = differences
    return RankResult(rank=rank, ok=True, extra=extra)


def assert_native_exact(run: RunResult) -> None:
    """Difference 0.0 (not a tolerance): gradients and post-AdamW parameters, and each rank's own-batch loss; the
    ranks' losses differ (different data on every rank)."""
    run.raise_for_error()
    assert run.max_abs_grad_diff == 0.0, (run.max_abs_grad_diff, run.ranks[0].extra.get("worst_param"))
    assert run.max_abs_param_diff == 0.0, (run.max_abs_param_diff, run.ranks[0].extra.get("worst_param"))
    for rank in run.ranks:
        assert rank.losses == rank.extra["reference_losses"], (rank.rank, rank.losses, rank.extra["reference_losses"])
    assert run.ranks[0].losses != run.ranks[1].losses


def assert_unaligned_aborts(name: str, path: Any, plan: dict[str, str] | None, variants: list[str]) -> None:
    """``variants`` per rank through transformers' native FSDP2 with ``plan``, fsdp-compat's alignment off
    (:data:`lab.support.MIXED_OFF`): gloo aborts on the collective mismatch."""
    from fsdp_compat.testing.crashes import GLOO_MISMATCH
    from fsdp_compat.testing.launch import current_wording
    from lab.support import MIXED_OFF

    off = run_native(name, path, fsdp_plan=plan, env=MIXED_OFF, variants=variants, timeout_s=60)
    assert not off.ok, describe(off)
    text = "\n".join((r.error or "") + str(r.extra.get("log_tail", "")) for r in off.ranks)
    assert GLOO_MISMATCH in current_wording(text), text[-3000:]


def aborts_then_exact(name: str, path: Any, plan: dict[str, str] | None, variants: list[str]) -> RunResult:
    """:func:`assert_unaligned_aborts`, then the same with fsdp-compat's defaults (:data:`lab.support.ON`): both
    ranks equal one process (:func:`assert_native_exact`). Returns the exact run."""
    from lab.support import ON

    assert_unaligned_aborts(name, path, plan, variants)
    run = run_native(name, path, fsdp_plan=plan, env=ON, variants=variants)
    assert_native_exact(run)
    return run


def describe(run: RunResult) -> str:
    """One line: the crash, or the parity figures."""
    if not run.ok:
        return f"crash: {run.exception}"
    return f"exact: Δgrad={run.max_rel_grad_diff:.3g} Δparam={run.max_rel_param_diff:.3g} ({run.seconds:.1f}s)"
