"""Repair of verl's own GLM4V forward on transformers 5: the vision tower returns a model output, not features.

verl's ``verl/models/transformers/glm4v.py`` (0.6.0 - 0.9.1, installed by ``apply_monkey_patch`` for every glm4v
model) does ``image_embeds = model.visual(pixel_values, grid_thw=...)`` and then ``image_embeds.shape[0]`` in
``_get_input_embeds``. transformers 4.57's ``Glm4vVisionModel.forward`` returns the merged features (a tensor);
every transformers 5 release (5.0.0 - 5.24 read) returns ``BaseModelOutputWithPooling(last_hidden_state=...,
pooler_output=<merged features>)``, so the first image batch fails with ``AttributeError:
'BaseModelOutputWithPooling' object has no attribute 'shape'``, with or without FSDP. verl 0.9.x requires
transformers >= 5.5.3, so GLM4V with images cannot train there at all; verl 0.8.0 allows any transformers.

The smallest fix: wrap ``_get_input_embeds`` (verl looks it up in its module at call time) so that, during that
call only, ``model.visual``'s output is its ``pooler_output`` (the tensor transformers 4.57 returned). A forward
hook on the tower does it, so the tower still runs through its own ``__call__`` (FSDP2 hooks, gradient
checkpointing) and nothing else in verl or transformers changes. The replacement's condition (transformers >= 5)
is checked when the transaction is applied; with 4.x it is left out (verl's function works there). The verl
adapter carries :data:`REPAIRS` in its release table, so ``unpatch()`` restores verl's function and
``FSDP_COMPAT=off`` never installs it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from importlib import metadata
from typing import Any

from packaging.version import Version

from fsdp_compat.activation import Replacement
from fsdp_compat.log import logger
from fsdp_compat.policies import Policy

__all__ = [
    "GLM4V_MODULE",
    "QWEN2_VL_MODULE",
    "QWEN2_VL_REPAIRS",
    "REPAIRS",
    "make_get_input_embeds",
    "make_qwen2_vl_get_input_embeds",
    "transformers_5",
    "vision_features",
]

GLM4V_MODULE = "verl.models.transformers.glm4v"
#: verl's Qwen2-VL / Qwen2.5-VL forward (0.9.1): its image and video paths unpack the tower's output
#: (``unpack_visual_output``), but its text-only path (the dummy for "mixed text-image data") does
#: ``model.visual(zeros, grid_thw=[[1, 4, 4]])`` then ``.mean()`` on the output: on transformers 5 every text-only
#: micro-batch fails with ``AttributeError: 'BaseModelOutputWithPooling' object has no attribute 'mean'``. With the
#: repair the tower's output is its features there too (``unpack_visual_output`` of a tensor is the tensor).
QWEN2_VL_MODULE = "verl.models.transformers.qwen2_vl"


def vision_features(output: Any) -> Any:
    """The vision tower's merged features: ``pooler_output`` of a transformers 5 model output, else the output."""
    pooled = getattr(output, "pooler_output", None)
    return output if pooled is None or hasattr(output, "shape") else pooled


def _features_hook(_module: Any, _args: Any, output: Any) -> Any:
    return vision_features(output)


def make_get_input_embeds(
    original: Callable[..., Any], policy: Policy | None = None, module: str = GLM4V_MODULE
) -> Callable[..., Any]:
    """verl's ``_get_input_embeds(model, input_ids, ...)`` with ``model.visual`` returning its features (a repair:
    the same under every policy)."""

    @functools.wraps(original)
    def _get_input_embeds(model: Any, *args: Any, **kwargs: Any) -> Any:
        visual = getattr(model, "visual", None)
        handle = visual.register_forward_hook(_features_hook) if visual is not None else None
        try:
            return original(model, *args, **kwargs)
        finally:
            if handle is not None:
                handle.remove()

    _get_input_embeds.__fsdp_compat__ = True  # type: ignore[attr-defined]
    logger.info(
        "fsdp-compat: repaired %s._get_input_embeds (the vision tower's pooler_output is its features on "
        "transformers 5)",
        module,
    )
    return _get_input_embeds


def make_qwen2_vl_get_input_embeds(original: Callable[..., Any], policy: Policy | None = None) -> Callable[..., Any]:
    """The same repair for verl's Qwen2-VL / Qwen2.5-VL forward (:data:`QWEN2_VL_MODULE`)."""
    return make_get_input_embeds(original, policy, QWEN2_VL_MODULE)


def transformers_5() -> bool:
    """True when the installed transformers returns a model output from ``Glm4vVisionModel`` (5.0 and later)."""
    try:
        return Version(metadata.version("transformers")) >= Version("5.0.0.dev0")
    except (metadata.PackageNotFoundError, ValueError):
        return False


#: the replacement the verl adapter's table row carries (deferred: applied when verl imports its glm4v module,
#: i.e. when ``apply_monkey_patch`` meets a glm4v model; left out where verl's function works as shipped). That
#: import also activates the adapter (the ``repaired`` modules of its index row in ``fsdp_compat.adapters``), so the
#: repair is in place when verl's GLM4V forward is used before anything imported ``verl.utils.fsdp_utils``.
REPAIRS: tuple[Replacement, ...] = (
    Replacement(GLM4V_MODULE, "_get_input_embeds", make_get_input_embeds, deferred=True, when=transformers_5),
)
#: the same for verl's Qwen2-VL / Qwen2.5-VL forward (deferred likewise: applied when ``apply_monkey_patch`` meets
#: a Qwen2-VL or Qwen2.5-VL model)
QWEN2_VL_REPAIRS: tuple[Replacement, ...] = (
    Replacement(
        QWEN2_VL_MODULE,
        "_get_input_embeds",
        make_qwen2_vl_get_input_embeds,
        optional=True,  # read in 0.9.1 only: a release without the function keeps its module as it is
        deferred=True,
        when=transformers_5,
    ),
)
