"""Rank-side code for the LLaMA-Factory tests: shard through LLaMA-Factory's FSDP2 engine and compare data-parallel
training against one process.

Imported in fresh rank interpreters (``tests/`` on PYTHONPATH). :func:`engine_rank` imports no fsdp_compat adapter,
so whatever patches ``FSDP2Engine.prepare_model`` there is the ``.pth`` hook (or nothing, with ``FSDP_COMPAT=off``).

0.9.5's path is the one LLaMA-Factory's v1 ``BaseTrainer._shard_model`` takes: ``DistributedInterface`` (its process
group and its 2-D ``(mp_replicate, mp_shard)`` model mesh, built from the torchrun variables set here; on a CPU-only
machine it picks gloo and a CPU mesh), then ``DistributedPlugin("fsdp2")(model, dist_config, bf16=False)``, which
builds an ``FSDP2Engine`` and calls ``shard_model`` -> ``prepare_model``. :func:`main_engine_rank` runs main's
engine shape instead (``lab.stacks.llamafactory_main``, installed under the real module's name, then activated the way a
custom entry point does: ``import fsdp_compat.adapters.llamafactory``).
"""

from __future__ import annotations

import copy
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

from fsdp_compat.testing.parity import Diff, twin_step

__all__ = ["engine_rank", "main_engine_rank"]

FSDP2_MODULE = "llamafactory.v1.plugins.trainer_plugins.distributed.fsdp2"


def _torchrun_env(cfg: dict[str, Any], rank: int) -> None:
    import torch

    world = cfg["world_size"]
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cfg["port"]),
    )  # fmt: skip
    torch.set_num_threads(1)


def _batches(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's batch (seed 100 + rank); ``cfg["variants"]`` e.g. ["image", "text"]: rank 1 without images."""
    from fsdp_compat.testing.zoo import make_batch

    kinds = cfg.get("variants") or [None] * cfg["world_size"]
    return [make_batch(cfg["model"], seed=100 + r, **({"variant": k} if k else {})) for r, k in enumerate(kinds)]


def _train_exactly(model: Any, reference: Any, cfg: dict[str, Any], rank: int, extra: dict[str, Any]) -> None:
    """``cfg["steps"]`` AdamW steps: this rank's batch; the reference, in every rank, ``(ref(**batch_r).loss /
    W).backward()`` for every rank's batch, then one step. The worst absolute differences go to ``extra``."""
    import torch

    batches = _batches(cfg)
    opts = (torch.optim.AdamW(model.parameters(), lr=1e-3), torch.optim.AdamW(reference.parameters(), lr=1e-3))
    grads, params = Diff(), Diff()  # NaN-failing
    for _ in range(cfg["steps"]):
        twin_step(model, reference, opts, batches, rank, (grads, params))
    extra["grad_diff"], extra["param_diff"] = grads.abs, params.abs


def engine_rank(cfg: dict[str, Any], rank: int, extra: dict[str, Any]) -> None:
    """Shard zoo model ``cfg["model"]`` through LLaMA-Factory 0.9.5's ``fsdp2`` plugin and train it exactly against
    one process. ``extra``: the groups, whether the engine's ``prepare_model`` is fsdp-compat's, the differences."""
    _torchrun_env(cfg, rank)
    from llamafactory.v1.accelerator.interface import DistributedInterface
    from llamafactory.v1.config.arg_utils import PluginConfig
    from llamafactory.v1.plugins.trainer_plugins.distributed.hub import DistributedPlugin

    from fsdp_compat.testing.zoo import build_model
    from lab.transformers_smoke import fsdp_groups

    interface = DistributedInterface()
    extra["mesh"] = str(interface.model_device_mesh)
    model = build_model(cfg["model"], seed=0)
    reference = copy.deepcopy(model)
    model = DistributedPlugin("fsdp2")(model, PluginConfig(name="fsdp2"), bf16=False)
    engine = sys.modules[FSDP2_MODULE]
    extra["patched"] = bool(getattr(engine.FSDP2Engine.prepare_model, "__fsdp_compat__", False))
    extra["groups"] = fsdp_groups(model)
    _train_exactly(model, reference, cfg, rank, extra)


def _install_main_shape() -> Any:
    """Main's engine shape under the real module's name (nothing has imported 0.9.5's), then the adapter."""
    path = Path(__file__).with_name("llamafactory_main.py")
    spec = importlib.util.spec_from_file_location(FSDP2_MODULE, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[FSDP2_MODULE] = module
    spec.loader.exec_module(module)
    import fsdp_compat.adapters.llamafactory  # noqa: F401  (activates, unless FSDP_COMPAT=off)

    return module


def main_engine_rank(cfg: dict[str, Any], rank: int, extra: dict[str, Any]) -> None:
    """Shard ``cfg["model"]`` through main's engine shape: ``cfg["engine"]`` ``"fsdp2"`` or ``"fsdpturbo"`` (whose
    ``prepare_model`` calls ``super().prepare_model(model, ignored_params=...)`` for ``cfg["ignored"]``, module
    name patterns, frozen here); ``cfg["bf16"]`` with gradient checkpointing: main's norms step, 2 plain steps;
    otherwise fp32 exact against one process. ``extra``: the groups, the ignored parameters' kinds, the norms
    carrying main's hook, the losses or the differences."""
    import torch

    _torchrun_env(cfg, rank)
    main = _install_main_shape()
    from fsdp_compat.testing.zoo import build_model
    from lab.transformers_smoke import fsdp_groups

    model = build_model(cfg["model"], seed=0)
    ignored = [name for name, _ in model.named_modules() if any(name == p for p in cfg.get("ignored", []))]
    for name in ignored:
        model.get_submodule(name).requires_grad_(False)  # what the engine leaves alone gets no gradient here
    reference = copy.deepcopy(model)
    bf16 = bool(cfg.get("bf16"))
    if bf16:
        model.gradient_checkpointing_enable()
    model = main.shard(model, cfg["engine"], {"fsdp_ignored_modules": ignored}, bf16=bf16)
    extra["patched"] = bool(getattr(main.FSDP2Engine.prepare_model, "__fsdp_compat__", False))
    extra["groups"] = fsdp_groups(model)
    extra["ignored_kinds"] = sorted({type(p).__name__ for n in ignored for p in model.get_submodule(n).parameters()})
    hooked = main._norm_input_to_weight_dtype
    extra["hooked_norms"] = [
        name
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.LayerNorm) and any(h is hooked for h in m._forward_pre_hooks.values())
    ]
    if not bf16:
        _train_exactly(model, reference, cfg, rank, extra)
        return
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = _batches(cfg)[rank]
    extra["losses"] = []
    for _ in range(cfg["steps"]):
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        extra["losses"].append(float(loss))
