"""SkyRL adapter: every released ``skyrl-train`` and ``skyrl`` shards GLM4V-style models with fsdp-compat.

Every SkyRL release gives each untied ``nn.Embedding`` its own FSDP2 group inside ``apply_fsdp2(model,
fsdp_kwargs, config)``, which crashes models that read an embedding's weight outside its forward (GLM4V:
``aten.grid_sampler_2d.default got mixed torch.Tensor and DTensor``); skyrl-train 0.1.0-0.3.1 and skyrl 0.1.0
also index transformers 5's *set* ``_no_split_modules`` with ``[0]`` (``TypeError: 'set' object is not
subscriptable``). The replacement keeps SkyRL's contract (same arguments, the config's
``wrap_policy.transformer_layer_cls_to_wrap`` override, ``fsdp_kwargs`` passed to every ``fully_shard``, the
root wrapped last, returns None) and lets :func:`fsdp_compat.apply.apply_fsdp2` choose the groups.

``fsdp_strategy`` binds ``apply_fsdp2`` by name, so it is rebound there too, whether it is imported before or
after the patch. A future release that ships the upstream selector ``modules_to_wrap_fsdp2`` gets that function
replaced instead (its own ``apply_fsdp2`` already looks the selector up at call time).

skyrl-train and skyrl can be installed side by side (an upgraded environment): each is its own transaction,
applied when its own ``fsdp_utils`` is imported, and logged on its own line. skyrl-train 0.3.1's missing
``MixedPrecisionPolicy`` re-export is repaired inside that release's transaction (table row ``==0.3.1``).

Activation: the ``.pth`` start-up hook (SkyRL's Ray workers share the driver's environment), or
``import fsdp_compat.adapters.skyrl`` in a custom entry point; ``FSDP_COMPAT=off`` disables both.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from fsdp_compat.activation import Reexport, Release, Replacement, declare
from fsdp_compat.log import logger
from fsdp_compat.policies import Policy

from . import trigger
from ._selection import configured_wrap_list, layer_class_names

__all__ = [
    "ADAPTER",
    "PACKAGES",
    "RELEASES",
    "SUPPORTED",
    "configured_layer_classes",
    "is_patched",
    "make_apply_fsdp2",
    "make_modules_to_wrap_fsdp2",
    "patch",
    "unpatch",
]

#: distribution -> the package holding ``fsdp_utils`` (the trigger) and its by-name importer ``fsdp_strategy``.
PACKAGES: dict[str, str] = {dist: trigger(dist).rpartition(".")[0] for dist in ("skyrl-train", "skyrl")}

UPSTREAM_SELECTOR = "modules_to_wrap_fsdp2"


# ---------------------------------------------------------------------------------------------- replacements


def configured_layer_classes(config: Any) -> list[str] | None:
    """``config.wrap_policy.transformer_layer_cls_to_wrap`` when set, else None (the model's layer classes).

    Accepts what each release passes: skyrl-train's ``config.get("wrap_policy", {})`` on a DictConfig and
    skyrl's ``getattr(config, "wrap_policy", {})`` on its ``FSDPConfig`` dataclass or a DictConfig. An unset,
    None or empty override means "use ``model._no_split_modules``" (upstream crashed on None or empty).
    """
    return layer_class_names(configured_wrap_list(config))


def make_apply_fsdp2(original: Callable[..., Any], policy: Policy) -> Callable[..., None]:
    """SkyRL's ``apply_fsdp2(model, fsdp_kwargs, config)``, with groups chosen by fsdp-compat's planner; called with
    arguments this adapter does not know, SkyRL's own function with all of them, and the run-time guard."""

    @functools.wraps(original)
    def apply_fsdp2(model: Any, fsdp_kwargs: Any, config: Any = None, *args: Any, **kwargs: Any) -> None:
        from fsdp_compat.apply import apply_fsdp2 as core_apply_fsdp2

        from ._selection import foreign_arguments, outdated_fallback, unmatched

        if foreign_arguments("SkyRL", "apply_fsdp2", args, kwargs):  # a newer release: its own function knows them
            from fsdp_compat.runtime import install_runtime

            install_runtime(model)
            return original(model, fsdp_kwargs, config, *args, **kwargs)
        names = configured_layer_classes(config)
        outdated = unmatched(model, names if names is not None else getattr(model, "_no_split_modules", None))
        if outdated is not None:  # SkyRL trains with such a list (embeddings only): so do we, with a warning
            from torch.distributed.fsdp import fully_shard

            from fsdp_compat.runtime import install_runtime

            for module in outdated_fallback("SkyRL", model, outdated, policy.analyzed):
                fully_shard(module, **dict(fsdp_kwargs or {}))
            fully_shard(model, **dict(fsdp_kwargs or {}))  # the root last, as SkyRL does
            install_runtime(model)  # the run-time guard, and mixed micro-batches kept in step
            return
        plan = core_apply_fsdp2(model, fsdp_kwargs, names, policy=policy)
        logger.debug("skyrl apply_fsdp2 (policy %s):\n%s", policy, plan)

    apply_fsdp2.__fsdp_compat__ = True  # type: ignore[attr-defined]
    return apply_fsdp2


def make_modules_to_wrap_fsdp2(original: Callable[..., Any], policy: Policy) -> Callable[..., list[Any]]:
    """The upstream selector ``modules_to_wrap_fsdp2(model, cls_names)``: fsdp-compat's bottom-up targets; called
    with arguments this adapter does not know, SkyRL's own selection with them, minus what is unsafe."""

    @functools.wraps(original)
    def modules_to_wrap_fsdp2(model: Any, cls_names: Any = None, *args: Any, **kwargs: Any) -> list[Any]:
        from fsdp_compat.plan import select_wrap_targets
        from fsdp_compat.runtime import install_runtime

        from ._selection import foreign_arguments, keep_safe, outdated_fallback, unmatched

        names = layer_class_names(cls_names)
        outdated = unmatched(model, names)
        if foreign_arguments("SkyRL", UPSTREAM_SELECTOR, args, kwargs):  # SkyRL's own candidates, minus the unsafe
            targets = list(original(model, cls_names, *args, **kwargs))
            if policy.analyzed:
                targets = keep_safe("SkyRL", model, targets)
        elif outdated is not None:  # SkyRL trains with such a list (embeddings only): so do we, with a warning
            targets = outdated_fallback("SkyRL", model, outdated, policy.analyzed)
        else:
            targets = select_wrap_targets(model, names, policy=policy)
        # after the analysis (which reads the model's own forwards), before SkyRL's own fully_shard calls
        install_runtime(model)
        return targets

    modules_to_wrap_fsdp2.__fsdp_compat__ = True  # type: ignore[attr-defined]
    return modules_to_wrap_fsdp2


# --------------------------------------------------------------------------------------------- release table


def _replacements(distribution: str) -> tuple[Replacement, ...]:
    """``fsdp_utils.apply_fsdp2`` (rebound in ``fsdp_strategy``); a release that ships the upstream selector gets
    the selector replaced instead (its own ``apply_fsdp2`` looks it up at call time)."""
    utils, strategy = f"{PACKAGES[distribution]}.fsdp_utils", f"{PACKAGES[distribution]}.fsdp_strategy"
    return (
        Replacement(utils, UPSTREAM_SELECTOR, make_modules_to_wrap_fsdp2, (strategy,), optional=True),
        Replacement(utils, "apply_fsdp2", make_apply_fsdp2, (strategy,), unless=UPSTREAM_SELECTOR),
    )


#: skyrl-train 0.3.1's fsdp_strategy imports MixedPrecisionPolicy from fsdp_utils, which stopped importing it
#: (0.3.0 had it), so fsdp_strategy cannot be imported at all; the repair runs inside the same transaction.
MPP_REPAIR = Reexport(
    f"{PACKAGES['skyrl-train']}.fsdp_utils",
    "MixedPrecisionPolicy",
    "torch.distributed.fsdp:MixedPrecisionPolicy",
    why="skyrl-train 0.3.1's fsdp_strategy imports it from here",
)

RELEASES: tuple[Release, ...] = (
    Release("==0.3.1", _replacements("skyrl-train"), (MPP_REPAIR,), distribution="skyrl-train"),
    Release(">=0.1.0", _replacements("skyrl-train"), distribution="skyrl-train"),
    Release(">=0.1.0", _replacements("skyrl"), distribution="skyrl"),
)


ADAPTER = declare("skyrl", RELEASES)
patch, unpatch, is_patched = ADAPTER.patch, ADAPTER.unpatch, ADAPTER.is_patched
SUPPORTED: dict[str, str] = ADAPTER.supported  #: distribution -> supported versions (the index row's)
