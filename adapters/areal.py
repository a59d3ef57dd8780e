"""AReaL adapter: AReaL's FSDP2 engine keeps its own selection, minus what would crash.

AReaL (``areal`` on PyPI, 1.0.x) shards in ``areal.engine.fsdp_utils.apply_fsdp2(model, fsdp_kwargs, wrap_policy)``,
a copy of verl's rule: every module of a layer class (``wrap_policy.transformer_layer_cls_to_wrap``, else
``model._no_split_modules``) and, when ``model.config.tie_word_embeddings`` is false, every ``nn.Embedding`` gets
its own ``fully_shard`` group, then the root. GLM4V's vision embeddings read ``position_embedding.weight`` raw and
``F.grid_sample`` gets a sharded table (``aten.grid_sampler_2d.default got mixed torch.Tensor and DTensor``).
The engine calls it from ``areal.engine.fsdp_utils.parallel.parallelize_model``, which imported it by name.

The replacement keeps AReaL's contract (same arguments, ``fsdp_kwargs`` on every group, the root last inside
AReaL's ``maybe_patch_fsdp_module``, None returned) and AReaL's selection, minus the modules that static analysis
shows would be read while sharded (their parameters stay in the root), children first, and installs the run-time
guard. ``FSDP_COMPAT_POLICY=legacy`` & co run AReaL's own function. A wrap list that matches nothing warns once
and shards what AReaL would (never an exception in adapter context).

Activation: the installed ``.pth`` hook when ``areal.engine.fsdp_utils`` is imported, or
``import fsdp_compat.adapters.areal``; ``FSDP_COMPAT=off`` disables both.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

from fsdp_compat.activation import Release, Replacement, declare
from fsdp_compat.policies import Policy

from . import trigger
from ._selection import configured_wrap_list, layer_class_names

__all__ = [
    "ADAPTER",
    "RELEASES",
    "configured_layer_classes",
    "is_patched",
    "make_apply_fsdp2",
    "patch",
    "unpatch",
]

UTILS = trigger("areal")
PARALLEL = "areal.engine.fsdp_utils.parallel"  # ``from areal.engine.fsdp_utils import apply_fsdp2``


def configured_layer_classes(model: Any, wrap_policy: Any) -> list[str]:
    """What AReaL computes: ``wrap_policy.transformer_layer_cls_to_wrap`` when set and non-empty, else
    ``model._no_split_modules`` (a str, list or, in transformers 5, a set)."""
    configured = layer_class_names(configured_wrap_list({"wrap_policy": wrap_policy}))
    return configured or layer_class_names(getattr(model, "_no_split_modules", None)) or []


def areal_selection(model: Any, layer_classes: list[str]) -> list[Any]:
    """AReaL's own rule, in its order: layer-class modules and (untied) every ``nn.Embedding``."""
    from torch import nn

    untied = not getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    return [
        module
        for _, module in model.named_modules()
        if type(module).__name__ in layer_classes or (untied and isinstance(module, nn.Embedding))
    ]


def make_apply_fsdp2(original: Callable[..., Any], policy: Policy) -> Callable[..., None]:
    """AReaL's ``apply_fsdp2(model, fsdp_kwargs, wrap_policy)`` with the unsafe groups left out; called with
    arguments this adapter does not know, AReaL's own function with all of them, and the run-time guard."""

    @functools.wraps(original)
    def apply_fsdp2(model: Any, fsdp_kwargs: Any, wrap_policy: Any = None, *args: Any, **kwargs: Any) -> None:
        from fsdp_compat.runtime import install_runtime

        from ._selection import foreign_arguments, keep_safe, outdated_fallback, unmatched

        if not policy.analyzed:  # legacy & co: AReaL's rule as it is
            return original(model, fsdp_kwargs, wrap_policy, *args, **kwargs)
        if foreign_arguments("AReaL", "apply_fsdp2", args, kwargs):  # a newer release: its own function knows them
            install_runtime(model)
            return original(model, fsdp_kwargs, wrap_policy, *args, **kwargs)
        utils = sys.modules[original.__module__]
        kwargs = dict(fsdp_kwargs or {})
        names = configured_layer_classes(model, wrap_policy)
        outdated = unmatched(model, names)
        if outdated is not None:
            targets = outdated_fallback("AReaL", model, outdated, True)
        else:
            targets = keep_safe("AReaL", model, areal_selection(model, names))
        for module in targets:
            utils.fully_shard(module, **kwargs)
        with utils.maybe_patch_fsdp_module(model):
            utils.fully_shard(model, **kwargs)  # the root last; FSDP2 keeps it unsharded through the forward
        install_runtime(model)  # the run-time guard, and mixed micro-batches kept in step
        return None

    apply_fsdp2.__fsdp_compat__ = True  # type: ignore[attr-defined]
    return apply_fsdp2


RELEASES: tuple[Release, ...] = (
    Release(">=1.0.4", (Replacement(UTILS, "apply_fsdp2", make_apply_fsdp2, (PARALLEL,)),)),
)


ADAPTER = declare("areal", RELEASES)
patch, unpatch, is_patched = ADAPTER.patch, ADAPTER.unpatch, ADAPTER.is_patched
