"""accelerate adapter: ``fsdp2_prepare_model`` runs as it is; fsdp-compat checks its groups and adds its run-time layer.

accelerate (``accelerate`` on PyPI) shards a model for FSDP2 in ``accelerate.utils.fsdp_utils.fsdp2_prepare_model(
accelerator, model)``, which ``Accelerator.prepare`` calls when the process state is FSDP with ``fsdp_version=2``
(the HF Trainer's and TRL's path with ``fsdp_version: 2``). 1.15's selection: every module of a
``_no_split_modules`` class (or ``transformer_cls_names_to_wrap``), bottom up; the input embedding alone when it is
not tied to the output embedding; one group ``[final norm, output embedding]`` (tied: ``[final norm, input, output
embedding]``) with ``reshard_after_forward=False``; then the root. It never gives any other embedding a group, so
GLM4V's vision position table (read raw by its parent) stays in the root: no wrap crash. What does break is a step
where one rank has images and another none: the vision blocks have groups of their own, the text-only rank never
all-gathers them, and gloo aborts ("Received data size doesn't match expected size"; NCCL hangs).

=============  ======================================================================================================
accelerate     replaced
=============  ======================================================================================================
1.15.0 (run)   ``fsdp2_prepare_model`` in ``accelerate.utils.fsdp_utils``, rebound in its by-name importers
1.16.0 (run)   ``accelerate.utils`` and ``accelerate.accelerator`` (``Accelerator._prepare_fsdp2`` calls it)
=============  ======================================================================================================

The replacement calls accelerate's own function with every argument it was given (a grown signature passes through)
and changes nothing of what it does: accelerate imports ``fully_shard`` from torch inside the function, so its
selection cannot be narrowed without patching torch, and this adapter does not. Around it, under an analyzed policy
(``auto``): the model's code is read before accelerate shards it (the static evidence, as every adapter uses it),
and afterwards accelerate's groups as they are (each ``fully_shard`` state: its modules and whether it reshards
after forward) are checked with fsdp-compat's safety checker (:func:`fsdp_compat.safety.settle`). Safe (GLM4V,
Qwen2.5-VL, text models): one INFO line on rank 0. Unsafe: one WARNING on rank 0 naming each group, why, and that the
run-time guard unshards it on demand; the job goes on (a drop-in never turns a working job into a crash, and a
failing check only warns). Then :func:`fsdp_compat.runtime.install_runtime` goes on the prepared model: the run-time
guard and the mixed micro-batch alignment (a rank without images runs the vision tower on a zero dummy). Under
``FSDP_COMPAT_POLICY=legacy`` & co the check is skipped; the run-time layer is installed all the same (it changes no
grouping; ``FSDP_COMPAT_GUARD`` and ``FSDP_COMPAT_MIXED_BATCHES`` switch its parts off).

Activation: the installed ``.pth`` hook when ``accelerate.utils.fsdp_utils`` is imported (``import accelerate``
imports it), or ``import fsdp_compat.adapters.accelerate``; ``FSDP_COMPAT=off`` disables both. accelerate 1.14 and
older and 1.17 and newer are outside the range (not run): they warn once and are left alone unless
``FSDP_COMPAT_FORCE=1``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from fsdp_compat.activation import Release, Replacement, declare, logger

from . import trigger

__all__ = [
    "ADAPTER",
    "IMPORTERS",
    "RELEASES",
    "check_groups",
    "is_patched",
    "make_fsdp2_prepare_model",
    "patch",
    "sharded_groups",
    "unpatch",
]

FSDP_UTILS = trigger("accelerate")
#: ``from .fsdp_utils import fsdp2_prepare_model`` (``accelerate.utils``) and ``from .utils import ...``
#: (``accelerate.accelerator``, whose ``Accelerator._prepare_fsdp2`` calls it): every by-name importer in 1.15/1.16.
IMPORTERS = ("accelerate.utils", "accelerate.accelerator")
FRAMEWORK = "accelerate"


def _model_argument(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The ``model`` of ``fsdp2_prepare_model(accelerator, model, ...)``, by keyword or position (None if absent)."""
    return kwargs["model"] if "model" in kwargs else (args[1] if len(args) > 1 else None)


def _is_rank_zero() -> bool:
    try:
        import torch.distributed as dist

        return not dist.is_initialized() or dist.get_rank() == 0
    except Exception:  # pragma: no cover - torch without distributed
        return True


def _root_module(model: Any) -> Any:
    """The module accelerate sharded: a ``torch.compile`` wrapper's ``_orig_mod`` when that is the FSDP2 root."""
    from torch.distributed.fsdp import FSDPModule

    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, FSDPModule) and not isinstance(model, FSDPModule) else model


def _reshards(state: Any) -> bool:
    """Whether a ``fully_shard`` state reshards after its forward (its param groups keep a post-forward mesh)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch < 2.10: one group per state
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return any(getattr(group, "post_forward_mesh_info", None) is not None for group in groups)


def sharded_groups(model: Any) -> list[tuple[tuple[str, ...], bool]]:
    """The FSDP2 groups below ``model``'s root as they are: (module paths of one ``fully_shard`` call, whether it
    reshards after forward), in ``named_modules`` order; the root's own group is left out (it encloses the rest)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    root = _root_module(model)
    root_state = fully_shard.state(root) if isinstance(root, FSDPModule) else None
    groups: dict[int, tuple[Any, list[str]]] = {}
    for path, module in root.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        state = fully_shard.state(module)
        if state is root_state:
            continue
        groups.setdefault(id(state), (state, []))[1].append(path)
    return [(tuple(paths), _reshards(state)) for state, paths in groups.values()]


def _evidence(model: Any) -> tuple[Any, list[Any]] | None:
    """The module tree and the static evidence of ``model`` before accelerate shards it (its code and its Parameter
    objects as they are), or None (with one warning) when the analysis cannot run."""
    try:
        from fsdp_compat.analysis import find_raw_reads
        from fsdp_compat.tree import ModuleTree

        tree = ModuleTree.build(model)
        return tree, list(find_raw_reads(model, tree).events)
    except Exception as exc:
        logger.warning(
            "%s: the safety check of %s could not read its code (%s: %s); accelerate's FSDP2 groups are kept as "
            "they are, with fsdp-compat's run-time guard",
            FRAMEWORK,
            type(model).__name__,
            type(exc).__name__,
            exc,
        )
        return None


def check_groups(tree: Any, events: list[Any], groups: list[tuple[tuple[str, ...], bool]]) -> list[tuple[str, str]]:
    """fsdp-compat's safety checker on a grouping that exists already: (group, why) for each group that some
    evidence shows would be read while it is sharded, or that splits a Parameter's sharers (deepest first, as
    :func:`fsdp_compat.safety.settle` finds them); empty when the grouping is safe."""
    from fsdp_compat.safety import Layout, settle, sharer_sets

    known = [(paths, {} if reshards else {"reshard_after_forward": False}) for paths, reshards in groups]
    layout = Layout.of((paths, overrides) for paths, overrides in known if all(p in tree.modules for p in paths))
    return [(" + ".join(p.key), p.describe()) for p in settle(tree, layout, events, sharer_sets(tree))]


def _report(model: Any, evidence: tuple[Any, list[Any]]) -> None:
    """Check accelerate's groups and say so on rank 0 (never raises: a failing check warns)."""
    try:
        groups = sharded_groups(model)
        unsafe = check_groups(*evidence, groups)
    except Exception as exc:
        logger.warning(
            "%s: the safety check of %s's FSDP2 groups failed (%s: %s); they are kept as they are, with "
            "fsdp-compat's run-time guard",
            FRAMEWORK,
            type(model).__name__,
            type(exc).__name__,
            exc,
        )
        return
    if not _is_rank_zero():
        return
    name = type(_root_module(model)).__name__.removeprefix("FSDP")
    if not unsafe:
        logger.info(
            "%s: %s: accelerate's %d FSDP2 groups below the root pass fsdp-compat's safety check (kept as they are); "
            "run-time guard and mixed micro-batch alignment installed",
            FRAMEWORK,
            name,
            len(groups),
        )
        return
    logger.warning(
        "%s: %s: fsdp-compat's safety check cannot show that these FSDP2 groups of accelerate are unsharded whenever "
        "their parameters are read: %s. accelerate's grouping is kept as it is (accelerate applies it itself); if "
        "such a read finds its group sharded, fsdp-compat's run-time guard unshards the group there (one more "
        "all-gather; the group then stays unsharded until the end of backward) and logs it. To avoid it, keep these "
        "modules out of accelerate's groups (the plugin's transformer_cls_names_to_wrap), or shard with "
        "fsdp_compat.apply_fsdp2.",
        FRAMEWORK,
        name,
        "; ".join(f"{group} ({why})" for group, why in unsafe),
    )


def make_fsdp2_prepare_model(original: Callable[..., Any], policy: str) -> Callable[..., Any]:
    """accelerate's ``fsdp2_prepare_model(accelerator, model, ...)`` with every argument passed on, its result
    returned; its groups checked (analyzed policies) and fsdp-compat's run-time layer installed on the result."""

    @functools.wraps(original)
    def fsdp2_prepare_model(*args: Any, **kwargs: Any) -> Any:
        from torch import nn
        from torch.distributed.fsdp import FSDPModule

        from fsdp_compat.policies import resolve_policy
        from fsdp_compat.runtime import install_runtime

        model = _model_argument(args, kwargs)
        evidence = None
        fresh = isinstance(model, nn.Module) and not isinstance(_root_module(model), FSDPModule)  # else: as it came
        if fresh and resolve_policy(policy).analyzed:
            evidence = _evidence(model)
        result = original(*args, **kwargs)
        prepared = result if isinstance(result, nn.Module) else model
        if not isinstance(prepared, nn.Module):
            return result
        if evidence is not None:
            _report(prepared, evidence)
        install_runtime(_root_module(prepared))  # the run-time guard, and mixed micro-batches kept in step
        return result

    fsdp2_prepare_model.__fsdp_compat__ = True  # type: ignore[attr-defined]
    return fsdp2_prepare_model


#: The supported range is the index row (``fsdp_compat.adapters.ADAPTERS``); this row covers it.
RELEASES: tuple[Release, ...] = (
    Release(">=1.15.0", (Replacement(FSDP_UTILS, "fsdp2_prepare_model", make_fsdp2_prepare_model, IMPORTERS),)),
)

ADAPTER = declare("accelerate", RELEASES)
patch, unpatch, is_patched = ADAPTER.patch, ADAPTER.unpatch, ADAPTER.is_patched
