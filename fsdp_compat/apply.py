"""Turn a :class:`~fsdp_compat.plan.WrapPlan` into ``fully_shard`` calls: groups bottom-up, then the root."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from fsdp_compat.plan import LayerClasses, WrapPlan, plan_wrap
from fsdp_compat.policies import Policy, resolve_policy


def apply_fsdp2(
    model: nn.Module,
    fsdp_kwargs: Mapping[str, Any] | None = None,
    layer_classes: LayerClasses = None,
    *,
    policy: str | Policy = "auto",
) -> WrapPlan:
    """Shard ``model`` with FSDP2 following ``plan_wrap``; returns the plan that was applied.

    Every group gets ``fsdp_kwargs`` plus its own overrides (e.g. ``reshard_after_forward=False``). Groups are applied
    children first, whatever the policy, because ``fully_shard(parent)`` before ``fully_shard(child)`` fails. The
    run-time layer (:func:`fsdp_compat.runtime.install_runtime`: the guard, ``FSDP_COMPAT_GUARD=off`` disables it, its
    per-op check off where the policy's analysis made the plan, and the mixed micro-batch alignment) is installed on
    ``model``. A bad switch value raises before anything is sharded.
    """
    from torch.distributed.fsdp import fully_shard

    from fsdp_compat.runtime import check_runtime_switches, install_runtime

    check_runtime_switches()  # a bad FSDP_COMPAT_GUARD / _MIXED_BATCHES raises before anything is sharded
    plan = plan_wrap(model, layer_classes, policy=policy)
    kwargs = dict(fsdp_kwargs or {})
    for group in plan.groups:
        target: nn.Module | list[nn.Module] = list(group.modules) if len(group.modules) > 1 else group.modules[0]
        fully_shard(target, **{**kwargs, **group.overrides})
    fully_shard(model, **kwargs)
    # fsdp-compat's own plan keeps every read inside its group's window: the guard's per-op check runs only where
    # the policy skipped the analysis (legacy & co)
    install_runtime(model, armed=not resolve_policy(policy).analyzed)
    return plan
