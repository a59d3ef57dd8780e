"""axolotl adapter: axolotl's own ``fsdp2_prepare_model`` runs as it is; fsdp-compat checks its groups and adds its
run-time layer.

axolotl (``axolotl`` on PyPI) does not use accelerate's ``fsdp2_prepare_model``: whenever ``fsdp_config`` is set,
``PatchManager._apply_fsdp_patches`` (``axolotl/loaders/patch_manager.py``) calls ``patch_accelerate_fsdp2()``, which
assigns ``accelerate.accelerator.fsdp2_prepare_model = fsdp2_prepare_model`` (its own, in
``axolotl.monkeypatch.accelerate.fsdp2``); ``Accelerator._prepare_fsdp2`` calls that name, so accelerate's function,
and fsdp-compat's accelerate adapter on it, never run. axolotl's selection is accelerate's auto-wrap policy (every
``_no_split_modules`` class or ``fsdp_config.transformer_layer_cls_to_wrap``), minus container modules and modules it
must leave unwrapped (LoRA tied to an embedding, NF4 adapter children), then the root; no embedding gets a group of
its own, so GLM4V's vision position table stays in the root. What breaks is a step with images on one rank and none
on another: the vision blocks' groups are all-gathered on one rank only (gloo: "Received data size doesn't match
expected size"; NCCL hangs). axolotl's own code knows it: one model's support module forbids vision blocks in the
wrap list because "ranks whose microbatch has no images hang".

=============  ======================================================================================================
axolotl        replaced
=============  ======================================================================================================
0.19.0 (run)   ``fsdp2_prepare_model`` in ``axolotl.monkeypatch.accelerate.fsdp2`` (``patch_accelerate_fsdp2`` and
               axolotl's TRL ``prepare_fsdp`` read that module global when called), and ``accelerate.accelerator``
               where it holds axolotl's function already; axolotl pins accelerate 1.13 (outside the accelerate range)
0.20.0 (read)  the same: the same function name and the same ``patch_accelerate_fsdp2``
0.21.0 (run)   the same; axolotl pins accelerate 1.15.0, which the accelerate adapter patches first
=============  ======================================================================================================

axolotl defines ``fsdp2_prepare_model`` from 0.12 on (0.10 patched accelerate's module differently); the range is what
was run or read here. The replacement (:func:`._prepare.make_prepare_model`, the accelerate adapter's wrapper under
axolotl's name) runs axolotl's function with every argument, its selection and memory unchanged (it imports
``fully_shard`` inside the function: nothing is narrowed, and nothing needs to be for the families it leaves safe);
before it the model's code is read, after it axolotl's groups are checked (one INFO or one WARNING per run on rank 0,
never an error) and :func:`fsdp_compat.runtime.install_runtime` goes on the prepared model (guard, mixed micro-batch
alignment).

Whichever comes first, fsdp-compat's wrapper is what accelerate calls, once: patched before axolotl's
``patch_accelerate_fsdp2`` runs, axolotl itself assigns the wrapper (it reads its module global); patched after, the
transaction rebinds ``accelerate.accelerator`` (a declared importer holding axolotl's function). The accelerate
adapter rebinds only bindings that hold accelerate's own function, so it never wraps axolotl's; axolotl's function
never calls accelerate's. ``fsdp-compat doctor`` says whose function ``accelerate.accelerator`` holds.

Activation: the installed ``.pth`` hook when ``axolotl.monkeypatch.accelerate.fsdp2`` is imported (``PatchManager``
imports it before it patches), or ``import fsdp_compat.adapters.axolotl``; ``FSDP_COMPAT=off`` disables both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fsdp_compat.activation import Release, Replacement, declare
from fsdp_compat.policies import Policy

from . import trigger
from ._prepare import make_prepare_model

__all__ = ["ADAPTER", "IMPORTERS", "RELEASES", "is_patched", "make_fsdp2_prepare_model", "patch", "unpatch"]

FSDP2 = trigger("axolotl")
#: ``patch_accelerate_fsdp2`` assigns the function here (not a ``from`` import: declared so that an adapter activated
#: after axolotl patched rebinds it).
IMPORTERS = ("accelerate.accelerator",)
FRAMEWORK = "axolotl"
ADVICE = "keep these modules out of axolotl's groups (fsdp_config.transformer_layer_cls_to_wrap)"


def make_fsdp2_prepare_model(original: Callable[..., Any], policy: Policy) -> Callable[..., Any]:
    """axolotl's ``fsdp2_prepare_model(accelerator, model)``, run as it is, with fsdp-compat's check and run-time
    layer around it."""
    return make_prepare_model(original, policy, framework=FRAMEWORK, advice=ADVICE)


#: The supported range is the index row (``fsdp_compat.adapters.ADAPTERS``); this row covers it.
RELEASES: tuple[Release, ...] = (
    Release(">=0.19.0", (Replacement(FSDP2, "fsdp2_prepare_model", make_fsdp2_prepare_model, IMPORTERS),)),
)

ADAPTER = declare("axolotl", RELEASES)
patch, unpatch, is_patched = ADAPTER.patch, ADAPTER.unpatch, ADAPTER.is_patched
