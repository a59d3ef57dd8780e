"""verl-derived copies: trainers whose own module-level ``apply_fsdp2`` is verl's old rule, one table row each.

Several trainers copied verl 0.4-0.7.0's ``apply_fsdp2`` into their own code: every module of a layer class (their
wrap list, else ``model._no_split_modules``) and, when ``model.config.tie_word_embeddings`` is false, every
``nn.Embedding`` gets its own ``fully_shard`` group, then the root. GLM4V's vision embeddings read
``position_embedding.weight`` raw and ``F.grid_sample`` gets a sharded table (``aten.grid_sampler_2d.default got
mixed torch.Tensor and DTensor``); their VLM forwards skip the vision tower on a rank whose micro-batch has no
images, so image|text ranks fall out of step.

One declaration shape covers them (:class:`VerlCopy`): where the function lives (the index row's trigger module),
which modules bound it by name, the position of its model argument, and the module whose ``fully_shard`` it calls.
Nothing else of the copy is re-implemented: the replacement runs the copy's ORIGINAL function with every argument
inside a :class:`~fsdp_compat.adapters._selection.DeferredShards`, and that module's ``fully_shard`` becomes
:func:`~fsdp_compat.adapters._selection.make_deferring_fully_shard` (a pass-through outside it). So the copy's own
wrap-list handling, keyword arguments and mixed precision stay its own (no kwargs or layer-class positions to
declare); at its root call the groups static analysis shows would be read while sharded stay in the root, the rest
are sharded children first with the copy's own arguments, and the run-time guard and the mixed micro-batch
alignment are installed. A text model keeps exactly the copy's groups. ``FSDP_COMPAT_POLICY=legacy`` & co run the
copy untouched. (AReaL's ``areal.engine.fsdp_utils.apply_fsdp2`` is the same shape and could be the row
``VerlCopy("areal", ">=1.0.4", ("areal.engine.fsdp_utils.parallel",))``; ``adapters/areal.py`` re-implements it
instead, with AReaL's outdated-wrap-list fallback.)

=============  =====================================  ==================================  ========================
distribution   ``apply_fsdp2`` in (the trigger)        bound by name in                    ``fully_shard`` from
=============  =====================================  ==================================  ========================
lmms-engine    ``lmms_engine.utils.fsdp2_utils``       ``lmms_engine.train.fsdp2.          its own module
0.1.4          ``(model, fsdp_kwargs,                  fsdp2_trainer``
               fsdp_transformer_layer_cls_to_wrap)``
siirl 0.2.0    ``siirl.utils.model_utils.fsdp_utils``  ``siirl.engine.fsdp_workers``       its own module
               ``(model, fsdp_kwargs, config)``
trinity-rft    ``trinity.trainer.verl_legacy.utils``   ``trinity.trainer.verl_legacy.      ``verl.utils.fsdp_utils``
0.6.0          ``(model, fsdp_kwargs, config)``        fsdp_workers``                      (imported in the call)
=============  =====================================  ==================================  ========================

Read, not declared (no index row until a test runs it): miles-rl 0.0.2
(``miles.backends.experimental.fsdp_utils.actor`` imports ``ring_flash_attn``, which needs CUDA's ``flash_attn``;
its ``apply_fsdp2(model, mesh, cpu_offload, args)`` imports ``fully_shard`` from torch inside the call, which only
a layer on torch's own ``fully_shard`` reaches, and forces bf16 or fp16 parameters).

Activation: the installed ``.pth`` hook when a trigger module is imported, or
``import fsdp_compat.adapters.verl_copies``; ``FSDP_COMPAT=off`` disables both.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fsdp_compat.activation import Release, Replacement, declare
from fsdp_compat.log import logger
from fsdp_compat.policies import Policy

from . import trigger
from ._selection import make_deferring_fully_shard

__all__ = ["ADAPTER", "COPIES", "RELEASES", "VerlCopy", "is_patched", "make_apply_fsdp2", "patch", "unpatch"]

VERL_UTILS = "verl.utils.fsdp_utils"  # trinity-rft's legacy copy takes verl 0.7.1's fully_shard


@dataclass(frozen=True)
class VerlCopy:
    """One trainer's copy of verl's old ``apply_fsdp2``: the one row this adapter needs per distribution.

    ``versions``: the releases that ship this copy (the index row caps them at those run). ``importers``: modules
    that bind the function by name. ``model``: the position of the model argument (keyword ``model`` too).
    ``shards_in``: the module whose ``fully_shard`` the copy calls (default: the module that defines it).
    """

    distribution: str
    versions: str
    importers: tuple[str, ...] = ()
    function: str = "apply_fsdp2"
    model: int = 0
    shards_in: str | None = None

    @property
    def module(self) -> str:
        """Where the function lives: the index row's trigger module (named once, there)."""
        return trigger(self.distribution)

    def release(self) -> Release:
        """This row as a release-table row: ``fully_shard`` deferred, the function wrapped, one transaction."""
        make = functools.partial(make_apply_fsdp2, self)
        return Release(
            self.versions,
            (
                Replacement(self.shards_in or self.module, "fully_shard", make_deferring_fully_shard, optional=True),
                Replacement(self.module, self.function, make, self.importers),
            ),
            distribution=self.distribution,
        )


def _is_sharded(model: Any) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def make_apply_fsdp2(copy: VerlCopy, original: Callable[..., Any], policy: Policy) -> Callable[..., Any]:
    """The copy's own ``apply_fsdp2``, every argument passed on, its ``fully_shard`` calls minus the unsafe groups,
    then the run-time guard and the mixed micro-batch alignment."""

    @functools.wraps(original)
    def apply_fsdp2(*args: Any, **kwargs: Any) -> Any:
        from fsdp_compat.runtime import install_runtime

        from ._selection import DeferredShards

        model = kwargs.get("model", args[copy.model] if len(args) > copy.model else None)
        if model is None or not policy.analyzed:
            return original(*args, **kwargs)  # legacy & co: the copy's rule as it is
        with DeferredShards(copy.distribution, model) as calls:
            result = original(*args, **kwargs)
        if not _is_sharded(model):
            return result
        if not calls.calls:
            logger.warning(
                "%s: %s sharded %s without the fully_shard of %s: its own groups are kept, with fsdp-compat's "
                "run-time guard",
                copy.distribution,
                copy.function,
                type(model).__name__,
                copy.shards_in or copy.module,
            )
        install_runtime(model)  # the run-time guard, and mixed micro-batches kept in step
        return result

    apply_fsdp2.__fsdp_compat__ = True  # type: ignore[attr-defined]
    return apply_fsdp2


#: one row per distribution; the supported range (what was run) is the index row's
COPIES: tuple[VerlCopy, ...] = (
    VerlCopy("lmms-engine", ">=0.1.4", ("lmms_engine.train.fsdp2.fsdp2_trainer",)),
    VerlCopy("siirl", ">=0.2.0", ("siirl.engine.fsdp_workers",)),
    VerlCopy("trinity-rft", ">=0.6.0", ("trinity.trainer.verl_legacy.fsdp_workers",), shards_in=VERL_UTILS),
)

RELEASES: tuple[Release, ...] = tuple(row.release() for row in COPIES)

ADAPTER = declare("verl_copies", RELEASES)
patch, unpatch, is_patched = ADAPTER.patch, ADAPTER.unpatch, ADAPTER.is_patched
