"""LLaMA-Factory adapter: the v1 FSDP2 engine runs as it is; only its unsafe ``fully_shard`` calls are left out.

LLaMA-Factory (``llamafactory`` on PyPI, the v1 trainer, ``USE_V1=1``) shards in the method
``FSDP2Engine.prepare_model`` of ``llamafactory.v1.plugins.trainer_plugins.distributed.fsdp2`` (called by
``FSDP2Engine.shard_model``): with a LoRA model every trainable leaf first, then in ``named_modules`` order every
module of the classes ``get_transformer_layer_cls`` finds and, when ``model.config.tie_word_embeddings`` is false,
every ``nn.Embedding``; then the root, each with the engine's mesh, ``reshard_after_forward``, mixed precision and
CPU offload. GLM4V's vision embeddings read ``position_embedding.weight`` raw and ``F.grid_sample`` gets a sharded
table (``aten.grid_sampler_2d.default got mixed torch.Tensor and DTensor``). The releases differ:

==============================  ===================================================================================
llamafactory                    ``prepare_model`` and what it runs
==============================  ===================================================================================
0.9.5 (measured)                ``(self, model)``; ``get_transformer_layer_cls`` returns one class (or None)
main, 0.9.6.dev0 (stub-tested,  ``(self, model, ignored_params=None)``, called with ``ignored_params=`` by
read at ff6d4d1)                ``fsdpturbo.FSDPTurboFSDP2Engine``; a *set* of the ``layers``/``blocks`` classes,
                                vision blocks included; each ``fully_shard`` gets ``ignored_params=``; with
                                gradient checkpointing under bf16, ``_make_norms_dtype_safe`` hooks every LayerNorm
==============================  ===================================================================================

Two names in that module are replaced, for both. ``fully_shard`` (bound there by name) becomes
:func:`~fsdp_compat.adapters._selection.make_deferring_fully_shard`: a pass-through, except inside the replaced
``prepare_model``, which runs LLaMA-Factory's ORIGINAL method with every argument it was given inside a
:class:`~fsdp_compat.adapters._selection.DeferredShards`: the engine's own selection (one class, a set, whatever a
release computes), its own keywords on every call and its own other steps stay its own; at the root call the
modules static analysis shows would be read while sharded stay in the root group, the rest are sharded children
first with their own arguments, then the root, and the run-time guard is installed. That is what survives a
release best: nothing of the method is re-implemented, so a new step or argument needs no new row; only the
meaning of ``fully_shard`` and "the root comes last" (FSDP2's own rule) are assumed. A release that no longer
shards through this module's ``fully_shard`` keeps its own selection, with the guard and one warning.
``FSDP_COMPAT_POLICY=legacy`` & co run the original method untouched.

Activation: the installed ``.pth`` hook when the ``fsdp2`` module is imported, or
``import fsdp_compat.adapters.llamafactory``; ``FSDP_COMPAT=off`` disables both.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from fsdp_compat.activation import Release, Replacement, declare
from fsdp_compat.log import logger
from fsdp_compat.policies import Policy

from . import trigger
from ._selection import make_deferring_fully_shard

__all__ = [
    "ADAPTER",
    "RELEASES",
    "is_patched",
    "make_prepare_model",
    "patch",
    "unpatch",
]

FSDP2 = trigger("llamafactory")


def _is_sharded(model: Any) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def make_prepare_model(original: Callable[..., Any], policy: Policy) -> Callable[..., Any]:
    """``FSDP2Engine.prepare_model(self, model, ...)``: the release's own method, every argument passed on, its
    ``fully_shard`` calls minus the unsafe groups."""

    @functools.wraps(original)
    def prepare_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        from fsdp_compat.runtime import install_runtime

        from ._selection import DeferredShards

        model = kwargs.get("model", args[0] if args else None)
        if model is None or not policy.analyzed:
            return original(self, *args, **kwargs)  # legacy & co: LLaMA-Factory's method as it is
        with DeferredShards("LLaMA-Factory", model) as calls:
            result = original(self, *args, **kwargs)
        if not _is_sharded(model):
            return result  # no mesh: the engine warned and wrapped nothing
        if not calls.calls:
            logger.warning(
                "LLaMA-Factory: %s.prepare_model sharded %s without the fully_shard of %s: its own selection is "
                "kept as it is, with fsdp-compat's run-time guard",
                type(self).__name__,
                type(model).__name__,
                FSDP2,
            )
        install_runtime(model)  # the run-time guard, and mixed micro-batches kept in step
        return result

    prepare_model.__fsdp_compat__ = True  # type: ignore[attr-defined]
    return prepare_model


#: 0.9.4 and older have no v1 FSDP2 engine. A release without a module-level ``fully_shard`` still gets
#: ``prepare_model`` (which then warns and keeps the engine's selection, with the guard).
RELEASES: tuple[Release, ...] = (
    Release(
        ">=0.9.5",
        (
            Replacement(FSDP2, "fully_shard", make_deferring_fully_shard, optional=True),
            Replacement(FSDP2, "FSDP2Engine.prepare_model", make_prepare_model),
        ),
    ),
)

ADAPTER = declare("llamafactory", RELEASES)
patch, unpatch, is_patched = ADAPTER.patch, ADAPTER.unpatch, ADAPTER.is_patched
