"""transformers adapter: the native FSDP2 of ``from_pretrained(..., distributed_config=DistributedConfig(...))``.

transformers shards a model while loading it. The plan (``base_model_fsdp_plan``, the head's ``_fsdp_plan``, the
user's ``DistributedConfig(fsdp_plan=...)`` merged on top) maps module paths to ``"free_full_weight"``
(``reshard_after_forward=True``) or ``"keep_full_weight"`` (``False``); each entry gets its own ``fully_shard``, a kept
(final norm, head) pair one together, then the root. What is replaced, per release:

================  ==============================================================================================
transformers      replaced in ``transformers.distributed.fsdp``
================  ==============================================================================================
5.23.0 - 5.25.x   ``apply_fully_sharded_data_parallelism(model, mesh_manager, fsdp_plan, ep_plan)`` (the resolved,
                  expanded plan arrives as an argument; rebound in ``transformers.distributed.mixin``)
5.16.1 - 5.22.x   ``expand_fsdp_plan(model, fsdp_plan)`` (the function that turns the plan into the target lists;
                  ``apply_fully_sharded_data_parallelism`` looks it up at call time)
================  ==============================================================================================

5.24.0 and 5.25.0 are tested end to end; 5.23.0's and 5.25.0's ``fsdp.py`` are identical to 5.24.0's (one
fingerprint: a newer release over that code is patched too, :mod:`fsdp_compat.fingerprints`); 5.16.1's row ran in one
process (planning only); 5.17 - 5.22 were read, not run.

Some plans crash: untied Gemma4 reads ``embed_tokens.weight[pad_token_id]`` after that group resharded
(``aten.where.self got mixed torch.Tensor and DTensor``); a user plan listing GLM4V's
``model.visual.embeddings.position_embedding`` hands a sharded table to ``F.grid_sample``. The replacement checks
the plan against the planner's evidence first (:func:`fix_fsdp_plan`, via :mod:`fsdp_compat.repair`): an entry whose
parameters are read while sharded becomes ``keep_full_weight`` when that covers every read (reads after its own
forward), and is otherwise dropped, so its parameters join the enclosing group; modules that hold (or will hold,
``all_tied_weights_keys``) one Parameter end up in one group. Every change is logged (``fsdp-compat: ...``); safe
plans pass through untouched, and transformers' own function applies the result. Policies that reproduce upstream
rules (``FSDP_COMPAT_POLICY=legacy`` & co) leave the plan as transformers made it.

Activation: the installed ``.pth`` hook when ``transformers.distributed.fsdp`` is imported (``from_pretrained``
imports it), or ``import fsdp_compat.adapters.transformers``; ``FSDP_COMPAT=off`` disables both.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from fsdp_compat import export
from fsdp_compat.activation import Release, Replacement, declare
from fsdp_compat.policies import Policy

from . import trigger

if TYPE_CHECKING:  # the repair imports torch and the analysis: loaded when a plan is checked, not with the adapter
    from fsdp_compat.repair import Change, ForeignGroup

__all__ = [
    "ADAPTER",
    "FREE",
    "FSDP_MODULE",
    "KEEP",
    "RELEASES",
    "fix_fsdp_plan",
    "is_patched",
    "make_apply_fully_sharded_data_parallelism",
    "make_expand_fsdp_plan",
    "patch",
    "plan_groups",
    "unpatch",
]

FSDP_MODULE = trigger("transformers")
MIXIN_MODULE = "transformers.distributed.mixin"  # binds apply_fully_sharded_data_parallelism by name
FREE, KEEP = export.FREE, export.KEEP  # transformers' two plan styles; one home: fsdp_compat.export

PairTest = Callable[[list[tuple[str, Any]], Any], bool]


def _never_pair(_targets: list[tuple[str, Any]], _model: Any) -> bool:
    return False


def plan_groups(model: Any, fsdp_plan: Mapping[str, str], is_pair: PairTest = _never_pair) -> list[ForeignGroup]:
    """The ``fully_shard`` calls transformers makes for ``fsdp_plan``: each entry alone, except the kept
    (final norm, head) pair that ``is_pair`` (transformers' ``is_norm_and_head_pair``) bundles into one group."""
    from fsdp_compat.repair import ForeignGroup

    keep = [(name, model.get_submodule(name)) for name, style in fsdp_plan.items() if style == KEEP]
    groups = [ForeignGroup((name,)) for name, style in fsdp_plan.items() if style != KEEP]
    if keep and is_pair(keep, model):
        groups.append(ForeignGroup(tuple(name for name, _ in keep), reshard_after_forward=False))
    else:
        groups.extend(ForeignGroup((name,), reshard_after_forward=False) for name, _ in keep)
    return groups


def tied_module_sets(model: Any) -> list[tuple[str, ...]]:
    """Module paths whose weights transformers ties after sharding (``all_tied_weights_keys``: target -> source)."""
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    sets: dict[str, set[str]] = {}
    for target, source in dict(tied).items():
        a, b = str(target).rpartition(".")[0], str(source).rpartition(".")[0]
        sets.setdefault(b, {b}).add(a)
    return [tuple(sorted(s)) for s in sets.values()]


def fix_fsdp_plan(
    model: Any, fsdp_plan: Mapping[str, str], is_pair: PairTest = _never_pair
) -> tuple[dict[str, str], list[Change]]:
    """``fsdp_plan`` made safe for ``model``, in its order, and the changes; a safe plan comes back equal.

    Once the repair is safe, transformers' grouping of the result (which can bundle the kept tail differently once an
    entry changed style) is repaired again: :func:`plan_groups` is the repair's ``regroup``.
    """
    from fsdp_compat.repair import repair_groups

    def styles(groups: list[ForeignGroup]) -> dict[str, str]:
        style = {path: (FREE if g.reshard_after_forward else KEEP) for g in groups for path in g.paths}
        return {name: style[name] for name in fsdp_plan if name in style}

    def regroup(groups: list[ForeignGroup]) -> list[ForeignGroup]:
        return plan_groups(model, styles(groups), is_pair)

    groups = plan_groups(model, dict(fsdp_plan), is_pair)
    kept, changes = repair_groups(model, groups, sharers=tied_module_sets(model), regroup=regroup)
    return (styles(kept) if changes else dict(fsdp_plan)), changes


def _is_rank_zero() -> bool:
    try:
        import torch.distributed as dist

        return not dist.is_initialized() or dist.get_rank() == 0
    except Exception:  # pragma: no cover - torch without distributed
        return True


def _fixed(model: Any, fsdp_plan: dict[str, str], original: Callable[..., Any], policy: Policy) -> dict[str, str]:
    """The plan to apply under ``policy``, each change logged once (rank 0); transformers' own pairing rule is read
    from the module that defines ``original``."""
    import sys

    from fsdp_compat.log import logger

    if not fsdp_plan or not policy.analyzed:
        return fsdp_plan
    is_pair = getattr(sys.modules.get(original.__module__), "is_norm_and_head_pair", _never_pair)
    fixed, changes = fix_fsdp_plan(model, fsdp_plan, is_pair)
    if _is_rank_zero():
        for change in changes:
            logger.warning("fsdp-compat: %s fsdp_plan: %s", type(model).__name__, change.describe())
    return fixed


def make_apply_fully_sharded_data_parallelism(original: Callable[..., Any], policy: Policy) -> Callable[..., Any]:
    """transformers' ``apply_fully_sharded_data_parallelism(model, mesh_manager, fsdp_plan, ep_plan)`` applied to
    the plan :func:`fix_fsdp_plan` returns (``legacy`` & co: the plan as it is)."""

    @functools.wraps(original)
    def apply_fully_sharded_data_parallelism(
        model: Any, mesh_manager: Any, fsdp_plan: dict[str, str], *args: Any, **kwargs: Any
    ) -> Any:
        from fsdp_compat.runtime import install_runtime

        result = original(model, mesh_manager, _fixed(model, fsdp_plan, original, policy), *args, **kwargs)
        install_runtime(model)  # the guard, and a rank without images still runs the vision tower's collectives
        return result

    apply_fully_sharded_data_parallelism.__fsdp_compat__ = True  # type: ignore[attr-defined]
    return apply_fully_sharded_data_parallelism


def make_expand_fsdp_plan(original: Callable[..., Any], policy: Policy) -> Callable[..., Any]:
    """transformers 5.16 - 5.22 ``expand_fsdp_plan(model, fsdp_plan) -> (reshard targets, no-reshard targets)``,
    each a list of ``(path, module)``, with the targets of :func:`fix_fsdp_plan` (a fixed entry may change list)."""

    @functools.wraps(original)
    def expand_fsdp_plan(model: Any, fsdp_plan: Any, *args: Any, **kwargs: Any) -> Any:
        from fsdp_compat.runtime import install_runtime

        reshard, no_reshard = original(model, fsdp_plan, *args, **kwargs)
        install_runtime(model)  # before transformers' fully_shard calls: both find the groups at the first forward
        concrete = {name: FREE for name, _ in reshard} | {name: KEEP for name, _ in no_reshard}
        fixed = _fixed(model, concrete, original, policy)
        targets = [*reshard, *no_reshard]
        return (
            [(n, m) for n, m in targets if fixed.get(n) == FREE],
            [(n, m) for n, m in targets if fixed.get(n) == KEEP],
        )

    expand_fsdp_plan.__fsdp_compat__ = True  # type: ignore[attr-defined]
    return expand_fsdp_plan


# --------------------------------------------------------------------------------------------- release table

RELEASES: tuple[Release, ...] = (
    Release(
        ">=5.23.0",
        (
            Replacement(
                FSDP_MODULE,
                "apply_fully_sharded_data_parallelism",
                make_apply_fully_sharded_data_parallelism,
                (MIXIN_MODULE,),
            ),
        ),
    ),
    Release(">=5.16.1,<5.23.0", (Replacement(FSDP_MODULE, "expand_fsdp_plan", make_expand_fsdp_plan),)),
)


ADAPTER = declare("transformers", RELEASES)
patch, unpatch, is_patched = ADAPTER.patch, ADAPTER.unpatch, ADAPTER.is_patched
