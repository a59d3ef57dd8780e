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

from collections.abc import Callable
from typing import Any

from fsdp_compat.activation import Release, Replacement, declare
from fsdp_compat.policies import Policy

from . import trigger
from ._existing import check_groups, sharded_groups
from ._prepare import make_prepare_model

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
ADVICE = "keep these modules out of accelerate's groups (the plugin's transformer_cls_names_to_wrap)"


def make_fsdp2_prepare_model(original: Callable[..., Any], policy: Policy) -> Callable[..., Any]:
    """accelerate's ``fsdp2_prepare_model(accelerator, model, ...)`` with every argument passed on, its result
    returned; its groups checked (analyzed policies) and fsdp-compat's run-time layer installed on the result (the
    one wrapper, :mod:`fsdp_compat.adapters._prepare`, that axolotl's replacement of it gets too)."""
    return make_prepare_model(original, policy, framework=FRAMEWORK, advice=ADVICE)


#: The supported range is the index row (``fsdp_compat.adapters.ADAPTERS``); this row covers it.
RELEASES: tuple[Release, ...] = (
    Release(">=1.15.0", (Replacement(FSDP_UTILS, "fsdp2_prepare_model", make_fsdp2_prepare_model, IMPORTERS),)),
)

ADAPTER = declare("accelerate", RELEASES)
patch, unpatch, is_patched = ADAPTER.patch, ADAPTER.unpatch, ADAPTER.is_patched
