"""NeMo Automodel adapter: ``apply_fsdp2_sharding_recursively`` runs as it is; fsdp-compat checks its groups and
adds its run-time layer.

NeMo Automodel (``nemo-automodel`` on PyPI) shards a model for FSDP2 in
``nemo_automodel.components.distributed.parallelizer``: ``parallelize_model(model, mesh_context)`` (what
``NeMoAutoModel.from_pretrained`` and the recipes call) -> ``ModelParallelizer._apply`` -> ``_apply_fsdp_sharding``
-> ``apply_fsdp2_sharding_recursively(model, mesh, mp_policy, ...)``, then the untied input and output embeddings
(the output one with ``reshard_after_forward=False``), then the root. 0.7.0's recursive rule: every child of every
``nn.ModuleList`` gets its own group (all but the last of a list reshard after forward, with explicit forward and
backward prefetch chains between them); a fully frozen multimodal module (``visual``, ``vision_tower``, ...) stays
in the root by default, a trainable one is walked like the rest. On GLM4V that is the vision blocks, the text
layers, ``embed_tokens``, ``lm_head`` and the root: the vision position table (read raw by its parent) stays in the
root, so no wrap crash; but a step where one rank has images and another none breaks, because the text-only rank
never all-gathers the vision blocks' groups (gloo: "Received data size doesn't match expected size"; NCCL hangs).

=================  =================================================================================================
nemo-automodel     replaced
=================  =================================================================================================
0.7.0 (run)        ``apply_fsdp2_sharding_recursively`` in ``nemo_automodel.components.distributed.parallelizer``
                   (``_apply_fsdp_sharding`` and its own recursion call it by module global), rebound in its by-name
                   importer ``nemo_automodel._diffusers.parallelization``
=================  =================================================================================================

The replacement calls NeMo's own function with every argument it was given and changes nothing of what it does:
NeMo sets FSDP2 prefetch chains on each list's groups right after making them, so leaving one module out would
break NeMo's own code. Around the outermost call (NeMo's recursion passes straight through), under an analyzed
policy (``auto``): the model's code is read before NeMo shards it, and afterwards the groups this call made are
checked with fsdp-compat's safety checker (``adapters/_existing.py``): safe (GLM4V, Qwen2.5-VL, text models), one
INFO line on rank 0; unsafe, one WARNING on rank 0 naming each group and why, and the run-time guard unshards it on
demand. Then :func:`fsdp_compat.runtime.install_runtime` goes on the model (it finds the embeddings' and the root's
groups, made later by NeMo, at the first forward): the run-time guard and the mixed micro-batch alignment (a rank
without images runs the vision tower on a zero dummy). Under ``FSDP_COMPAT_POLICY=legacy`` & co the check is
skipped; the run-time layer is installed all the same (it changes no grouping).

Activation: the installed ``.pth`` hook when ``nemo_automodel.components.distributed.parallelizer`` is imported
(every FSDP2 path of NeMo Automodel imports it), or ``import fsdp_compat.adapters.nemo_automodel``;
``FSDP_COMPAT=off`` disables both. Releases other than 0.7.x are outside the range (not run; 0.8 is announced to
remove ``FSDP2Manager``): they warn once and are left alone unless ``FSDP_COMPAT_FORCE=1``.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

from fsdp_compat.activation import Release, Replacement, declare
from fsdp_compat.policies import Policy

from . import trigger
from ._existing import evidence, report

__all__ = [
    "ADAPTER",
    "IMPORTERS",
    "RELEASES",
    "is_patched",
    "make_apply_fsdp2_sharding_recursively",
    "patch",
    "unpatch",
]

PARALLELIZER = trigger("nemo-automodel")
#: ``from nemo_automodel.components.distributed.parallelizer import apply_fsdp2_sharding_recursively``: the one
#: by-name importer in 0.7.0 (grep of the wheel); ``parallelizer.py`` itself calls it by module global.
IMPORTERS = ("nemo_automodel._diffusers.parallelization",)
FRAMEWORK = "NeMo Automodel"
ADVICE = (
    "move these modules out of an nn.ModuleList (NeMo gives every ModuleList child a group), freeze the multimodal "
    "module that holds them (distributed.multimodal.frozen_sharding: root)"
)

_inside = threading.local()  # set while this thread runs the outermost call: NeMo's recursion passes through


def _module_argument(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The ``module`` of ``apply_fsdp2_sharding_recursively(module, mesh, ...)``, by keyword or position."""
    return kwargs["module"] if "module" in kwargs else (args[0] if args else None)


def make_apply_fsdp2_sharding_recursively(original: Callable[..., Any], policy: Policy) -> Callable[..., Any]:
    """NeMo's ``apply_fsdp2_sharding_recursively(module, ...)`` with every argument passed on and its result
    returned; on the outermost call of a model its groups are checked (analyzed policies) and fsdp-compat's
    run-time layer installed on the model."""

    @functools.wraps(original)
    def apply_fsdp2_sharding_recursively(*args: Any, **kwargs: Any) -> Any:
        from torch import nn
        from torch.distributed.fsdp import FSDPModule

        module = _module_argument(args, kwargs)
        top = isinstance(module, nn.Module) and not isinstance(module, (nn.ModuleList, nn.ModuleDict))
        if getattr(_inside, "active", False) or not top:
            return original(*args, **kwargs)
        from fsdp_compat.runtime import install_runtime

        found = None
        if policy.analyzed and not isinstance(module, FSDPModule):
            found = evidence(FRAMEWORK, module)
        _inside.active = True
        try:
            result = original(*args, **kwargs)
        finally:
            _inside.active = False
        if found is not None:
            report(FRAMEWORK, module, found, ADVICE)
        install_runtime(module)  # the run-time guard, and mixed micro-batches kept in step
        return result

    apply_fsdp2_sharding_recursively.__fsdp_compat__ = True  # type: ignore[attr-defined]
    return apply_fsdp2_sharding_recursively


#: The supported range is the index row (``fsdp_compat.adapters.ADAPTERS``); this row covers it.
RELEASES: tuple[Release, ...] = (
    Release(
        ">=0.7.0",
        (
            Replacement(
                PARALLELIZER, "apply_fsdp2_sharding_recursively", make_apply_fsdp2_sharding_recursively, IMPORTERS
            ),
        ),
    ),
)

ADAPTER = declare("nemo_automodel", RELEASES)
patch, unpatch, is_patched = ADAPTER.patch, ADAPTER.unpatch, ADAPTER.is_patched
