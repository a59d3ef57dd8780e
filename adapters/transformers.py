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

The loading, 5.23.0 - 5.25.x (``transformers.core_model_loading.convert_and_load_state_dict_in_model``, rebound in
``modeling_utils`` and ``modeling_layers``; the three releases' function is one fingerprint): transformers slices each
checkpoint tensor to the rank's shard *before* the family's conversion ops run (huggingface/transformers#48519), so a
checkpoint in its original layout loads other weights sharded than plainly (Kimi K2.5's ``PermuteForRope``, the
``Chunk`` of fused q/k/v) or fails (Molmo2's ``Split``, Inkling's ``Interleave``). The replacement
(:class:`WholeThenShard`) takes every converted weight whose target parameter is sharded out of transformers' pass,
converts it whole with transformers' own converter and slices the result with transformers' own shard-on-read
(``DtensorShardOperation``): each rank gets exactly the shard of a plain load. The rest, and per-expert lists that
``MergeModulelist`` stacks on the sharded axis 0 (each rank's experts arrive whole), load as transformers loads
them. What it cannot repair (a quantizer, disk offload) raises :class:`ShardedConversionError`. 5.16.1 - 5.22.x load
with other code (read, not run): left as they are.

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
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from fsdp_compat import export
from fsdp_compat.activation import Release, Replacement, declare
from fsdp_compat.errors import FsdpCompatError
from fsdp_compat.policies import Policy

from . import trigger

if TYPE_CHECKING:  # the repair imports torch and the analysis: loaded when a plan is checked, not with the adapter
    from fsdp_compat.repair import Change, ForeignGroup

__all__ = [
    "ADAPTER",
    "FREE",
    "FSDP_MODULE",
    "KEEP",
    "LOADING_MODULE",
    "RELEASES",
    "ShardedConversionError",
    "WholeThenShard",
    "fix_fsdp_plan",
    "is_patched",
    "make_apply_fully_sharded_data_parallelism",
    "make_convert_and_load_state_dict_in_model",
    "make_expand_fsdp_plan",
    "patch",
    "plan_groups",
    "unpatch",
]

FSDP_MODULE = trigger("transformers")
MIXIN_MODULE = "transformers.distributed.mixin"  # binds apply_fully_sharded_data_parallelism by name
LOADING_MODULE = "transformers.core_model_loading"  # convert_and_load_state_dict_in_model, the checkpoint loader
LOADING_IMPORTERS = ("transformers.modeling_layers", "transformers.modeling_utils")  # bind it by name
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


# ------------------------------------------------------------------------------------------ the checkpoint loader


class ShardedConversionError(FsdpCompatError):
    """A distributed ``from_pretrained`` whose checkpoint conversion fsdp-compat cannot run on whole tensors (a
    quantizer, disk offload, a loader without the helpers :class:`WholeThenShard` uses): transformers would load other
    weights than a plain load, so the load stops here, naming the way out."""


def _sharded_dims(param: Any) -> list[int]:
    """The tensor dims a DTensor ``param`` is split on (``Shard`` and ``_StridedShard`` placements); [] otherwise."""
    dims = [placement.dim for placement in getattr(param, "placements", ()) if hasattr(placement, "dim")]
    return sorted({d if d >= 0 else d + param.ndim for d in dims})


#: what :class:`WholeThenShard` uses of ``transformers.core_model_loading`` besides the function it replaces
LOADING_HELPERS = (
    "DtensorShardOperation",
    "SkipParameters",
    "WeightConverter",
    "WeightRenaming",
    "build_glob_alternation",
    "dot_natural_key",
    "get_device",
    "is_dtensor",
    "rename_source_key",
    "set_param_for_module",
    "spawn_materialize",
)


def _has_dtensor(model: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed: nothing can be sharded
        return False
    return any(isinstance(param, DTensor) for param in model.parameters())


def _source_ndim(tensor: Any) -> int:
    shape = tensor.shape if hasattr(tensor, "shape") else tensor.get_shape()  # a tensor, or a safetensors slice
    return len(shape)


class WholeThenShard:
    """transformers 5.23 - 5.25's ``convert_and_load_state_dict_in_model(model, state_dict, load_config,
    disk_offload_index=None)`` with every converted weight whose target parameter is sharded converted whole, then
    sliced to the rank's shard (huggingface/transformers#48519: transformers slices first, then converts).

    The checkpoint's keys are routed exactly as transformers routes them (its ``rename_source_key``, over the same
    renamings and converters, in the same order); a group of keys a ``WeightConverter`` turns into a sharded DTensor
    parameter is taken out of the state dict, unless it is a per-expert list stacked on the only sharded axis 0
    (transformers keeps each rank's experts whole there). transformers loads the rest; then each taken group is
    materialized whole (dtype and device as transformers chooses them), converted by a copy of its converter,
    and each result sliced by transformers' ``DtensorShardOperation`` of the target and set with its
    ``set_param_for_module``. Models without a sharded parameter, and checkpoints without such a group (transformers'
    own layout), pass through untouched. Not a plain function: a plain load through it is no use of what
    fsdp-compat changed, and announces nothing (:mod:`fsdp_compat.activation`).
    """

    __fsdp_compat__ = True

    def __init__(self, original: Callable[..., Any]) -> None:
        functools.update_wrapper(self, original)  # __wrapped__: transformers' function
        self.original = original

    def __call__(self, model: Any, state_dict: Any, load_config: Any, disk_offload_index: Any = None) -> Any:
        core = sys.modules[self.original.__module__]
        taken = self.groups(core, model, state_dict, load_config) if state_dict else {}
        if not taken:
            return self.original(model, state_dict, load_config, disk_offload_index)
        self.refuse(core, taken, load_config)
        keys = {key for _, entries in taken.values() for key, _, _ in entries}
        rest = {key: value for key, value in state_dict.items() if key not in keys}
        loading_info, disk_offload_index = self.original(model, rest, load_config, disk_offload_index)
        count = self.load(core, model, taken, load_config, loading_info)
        if _is_rank_zero():
            from fsdp_compat.log import logger

            logger.debug(
                "fsdp-compat: %s: %d checkpoint conversions run on whole tensors, then sharded "
                "(huggingface/transformers#48519)",
                type(model).__name__,
                count,
            )
        return loading_info, disk_offload_index

    @staticmethod
    def groups(core: Any, model: Any, state_dict: Any, load_config: Any) -> dict[str, tuple[Any, list[Any]]]:
        """first target key -> (its converter, [(checkpoint key, source pattern, tensor), ...]) for every group to
        convert whole, in transformers' order."""
        weight_mapping = list(load_config.weight_mapping or [])
        if not any(hasattr(entry, "operations") for entry in weight_mapping) or not _has_dtensor(model):
            return {}  # no conversion op, or nothing sharded: transformers' load is a plain load
        missing = [name for name in LOADING_HELPERS if not hasattr(core, name)]
        if missing:
            raise ShardedConversionError(
                f"fsdp-compat converts sharded checkpoint weights whole (huggingface/transformers#48519) with "
                f"{core.__name__}'s own helpers, and this transformers lacks {', '.join(missing)}. Set FSDP_COMPAT=off "
                f"to load as transformers does, or load a checkpoint saved with save_original_format=False."
            )
        converters = [entry for entry in weight_mapping if isinstance(entry, core.WeightConverter)]
        meta = model.state_dict()
        renamings = [entry for entry in weight_mapping if isinstance(entry, core.WeightRenaming)]
        by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
        prefix = model.base_model_prefix
        found: dict[str, tuple[Any, list[Any]]] = {}
        for key, tensor in sorted(state_dict.items(), key=lambda item: core.dot_natural_key(item[0])):
            renamed, pattern = core.rename_source_key(key, renamings, converters, prefix, meta)
            if pattern is None or renamed not in meta:
                continue  # renamed only, or not this model's: transformers' own path
            found.setdefault(renamed, (by_pattern[pattern], []))[1].append((key, pattern, tensor))
        taken = {}
        for target, (converter, entries) in found.items():
            param = meta[target]
            dims = _sharded_dims(param) if core.is_dtensor(param) else []
            per_expert = all(_source_ndim(tensor) == param.ndim - 1 for _, _, tensor in entries)
            if dims and not (per_expert and dims == [0]):
                taken[target] = (converter, entries)
        return taken

    @staticmethod
    def refuse(core: Any, taken: dict[str, Any], load_config: Any) -> None:
        """Raise where the whole-tensor conversion cannot stand in for transformers' (quantized or offloaded)."""
        device_map = load_config.device_map or {"": "cpu"}
        disk = [target for target in taken if core.get_device(device_map, target) == "disk"]
        why = (
            f"a quantizer ({type(load_config.hf_quantizer).__name__})"
            if load_config.hf_quantizer is not None
            else (f"disk offload ({disk[0]})" if disk else "")
        )
        if why:
            raise ShardedConversionError(
                f"transformers slices checkpoint tensors to each rank's shard before converting them "
                f"(huggingface/transformers#48519), which loads other weights than a plain load for "
                f"{len(taken)} converted parameters (first: {next(iter(taken))}); fsdp-compat converts them whole "
                f"first, but not with {why}. Save the checkpoint in transformers' own layout "
                f"(save_pretrained(..., save_original_format=False)) and load that, or set FSDP_COMPAT=off to load "
                f"as transformers does."
            )

    @staticmethod
    def load(core: Any, model: Any, taken: dict[str, Any], load_config: Any, loading_info: Any) -> int:
        """Convert each taken group whole, slice each result to this rank's shard, set it; the number of groups."""
        import copy

        import torch

        device_map = load_config.device_map or {"": "cpu"}
        dtype, dtype_plan = load_config.dtype, load_config.dtype_plan or {}
        if dtype_plan:
            alternation, by_group, _ = core.build_glob_alternation(list(dtype_plan.keys()))
        meta = model.state_dict()  # transformers' own look-up of a target's dtype
        done = 0
        for target, (converter, entries) in taken.items():
            param = meta.get(target)
            target_dtype = dtype  # as transformers chooses it (step 3 of its loop; no quantizer here)
            matched = alternation.search(target) if dtype_plan else None
            if matched is not None:
                target_dtype = dtype_plan[by_group[matched.lastgroup]]
            elif param is not None and param.dtype != target_dtype:
                target_dtype = param.dtype
            device = "cpu" if converter.force_cpu else core.get_device(device_map, target, valid_torch_device=True)
            mapping = copy.deepcopy(converter)
            for key, pattern, tensor in entries:
                mapping.add_tensor(target, key, pattern, core.spawn_materialize(None, tensor, device, target_dtype))
            try:
                realized = mapping.convert(
                    target, model=model, config=model.config, hf_quantizer=None, loading_info=loading_info
                )
            except core.SkipParameters:  # transformers recorded the conversion error, as in its own loop
                continue
            for name, value in realized.items():
                value = value[0] if isinstance(value, list) else value
                owner, _, attr = name.rpartition(".")
                ref = getattr(model.get_submodule(owner) if owner else model, attr, None)
                if core.is_dtensor(ref) and tuple(value.shape) == tuple(ref.shape):
                    value = core.DtensorShardOperation(ref).shard_tensor(value)
                    value = value.clone(memory_format=torch.contiguous_format)  # not a view of the whole tensor
                if converter.force_cpu:
                    value = value.to(core.get_device(device_map, name))
                core.set_param_for_module(model, name, value, loading_info, None)
            done += 1
        return done


def make_convert_and_load_state_dict_in_model(original: Callable[..., Any], policy: Policy) -> Callable[..., Any]:
    """transformers' checkpoint loader with the conversions of sharded parameters run whole (:class:`WholeThenShard`);
    under every policy: a policy chooses groups, never which weights a rank loads."""
    return WholeThenShard(original)


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
            # deferred: the trigger is imported from inside core_model_loading, before the loader is defined
            Replacement(
                LOADING_MODULE,
                "convert_and_load_state_dict_in_model",
                make_convert_and_load_state_dict_in_model,
                LOADING_IMPORTERS,
                deferred=True,
            ),
        ),
    ),
    Release(">=5.16.1,<5.23.0", (Replacement(FSDP_MODULE, "expand_fsdp_plan", make_expand_fsdp_plan),)),
)


ADAPTER = declare("transformers", RELEASES)
patch, unpatch, is_patched = ADAPTER.patch, ADAPTER.unpatch, ADAPTER.is_patched
