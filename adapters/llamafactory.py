"""LLaMA-Factory adapter: the v1 FSDP2 engine keeps its own selection, minus what would crash.

LLaMA-Factory 0.9.5 (``llamafactory`` on PyPI, the v1 trainer, ``USE_V1=1``) shards in the method
``FSDP2Engine.prepare_model(model)`` of ``llamafactory.v1.plugins.trainer_plugins.distributed.fsdp2`` (called by
``FSDP2Engine.shard_model``, which the ``fsdp2`` distributed plugin runs): with a LoRA model every trainable leaf
module first, then in ``named_modules`` order every module of the one layer class ``get_transformer_layer_cls``
finds and, when ``model.config.tie_word_embeddings`` is false, every ``nn.Embedding``; then the root, each with the
engine's mesh, ``reshard_after_forward``, mixed-precision policy and CPU offload. GLM4V's vision embeddings read
``position_embedding.weight`` raw and ``F.grid_sample`` gets a sharded table (``aten.grid_sampler_2d.default got
mixed torch.Tensor and DTensor``).

The replacement is the class attribute ``FSDP2Engine.prepare_model`` (every engine, however the class was
imported, calls it). It keeps the method's contract (the model returned, the warning and no wrapping without a
mesh, the input-grad hook when gradient checkpointing is on) and LLaMA-Factory's selection and settings, minus the
modules that static analysis shows would be read while sharded (their parameters stay in the root), children
first, the root last, and installs the run-time guard. ``FSDP_COMPAT_POLICY=legacy`` & co run the original method.

Activation: the installed ``.pth`` hook when the ``fsdp2`` module is imported, or
``import fsdp_compat.adapters.llamafactory``; ``FSDP_COMPAT=off`` disables both.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

from fsdp_compat.activation import Release, Replacement, declare

from . import trigger

__all__ = [
    "ADAPTER",
    "RELEASES",
    "is_patched",
    "llamafactory_selection",
    "make_prepare_model",
    "patch",
    "unpatch",
]

FSDP2 = trigger("llamafactory")


def llamafactory_selection(fsdp2: Any, engine: Any, model: Any) -> list[Any]:
    """What ``prepare_model`` shards besides the root, in its order (each module once): trainable LoRA leaves,
    then modules of exactly ``fsdp2.get_transformer_layer_cls(model)`` and (untied, the default being tied) every
    ``nn.Embedding``. The framework's own helpers decide the layer class and whether the model has LoRA."""
    from torch import nn

    targets: list[Any] = []
    if engine.is_lora_module_wrap(model):
        targets += [
            m
            for m in model.modules()
            if not any(True for _ in m.children()) and any(p.requires_grad for p in m.parameters(recurse=False))
        ]
    layer_cls = fsdp2.get_transformer_layer_cls(model)
    untied = not getattr(getattr(model, "config", None), "tie_word_embeddings", True)
    targets += [m for m in model.modules() if type(m) is layer_cls or (untied and isinstance(m, nn.Embedding))]
    return list({id(m): m for m in targets}.values())


def _input_grads(model: Any) -> None:
    """With gradient checkpointing on, the inputs of the first checkpointed block must require grad (what the
    engine does before sharding the root): the model's own switch, else a hook on the input embeddings."""
    if not getattr(model, "is_gradient_checkpointing", False):
        return
    if hasattr(model, "enable_input_require_grads"):
        model.enable_input_require_grads()
        return

    def require_grad(_module: Any, _args: Any, output: Any) -> None:
        output.requires_grad_(True)

    model.get_input_embeddings().register_forward_hook(require_grad)


def make_prepare_model(original: Callable[..., Any], policy: str) -> Callable[..., Any]:
    """``FSDP2Engine.prepare_model(self, model)`` with the unsafe groups left out."""

    @functools.wraps(original)
    def prepare_model(self: Any, model: Any) -> Any:
        from fsdp_compat.policies import resolve_policy
        from fsdp_compat.runtime import install_runtime

        from ._selection import keep_safe

        if not resolve_policy(policy).analyzed or getattr(self, "fsdp_mesh", None) is None:
            return original(self, model)  # legacy & co; no mesh: the engine warns and wraps nothing
        fsdp2 = sys.modules[original.__module__]
        offload = fsdp2.CPUOffloadPolicy(pin_memory=self.pin_memory) if self.offload_params else None
        kwargs = {
            "mesh": self.fsdp_mesh,
            "reshard_after_forward": self.reshard_after_forward,
            "mp_policy": self.get_mp_policy(),
            "offload_policy": offload,
        }
        targets = llamafactory_selection(fsdp2, self, model)
        for module in keep_safe("LLaMA-Factory", model, targets):
            fsdp2.fully_shard(module, **kwargs)
        _input_grads(model)
        fsdp2.fully_shard(model, **kwargs)  # the root last; FSDP2 keeps it unsharded through the forward
        install_runtime(model)  # the run-time guard, and mixed micro-batches kept in step
        return model

    prepare_model.__fsdp_compat__ = True  # type: ignore[attr-defined]
    return prepare_model


#: 0.9.4 and older have no v1 FSDP2 engine.
RELEASES: tuple[Release, ...] = (
    Release(">=0.9.5", (Replacement(FSDP2, "FSDP2Engine.prepare_model", make_prepare_model),)),
)

ADAPTER = declare("llamafactory", RELEASES)
patch, unpatch, is_patched = ADAPTER.patch, ADAPTER.unpatch, ADAPTER.is_patched
