"""A :class:`~fsdp_compat.plan.WrapPlan` as transformers' ``fsdp_plan`` (``DistributedConfig(fsdp_plan=...)``).

transformers' format is ``{module path: "free_full_weight" | "keep_full_weight"}``: one ``fully_shard`` per entry
(keep = ``reshard_after_forward=False``), a layer index written as ``.*`` that stands for *every* index, and the
user's dict merged over the model's built-in plan (``model_plan | override``). What it cannot express:

- groups of several modules (shared or tied weights held by several modules, e.g. T5's ``shared`` and both
  ``embed_tokens``): one entry each would split one Parameter across groups, so their members are left out and
  their parameters stay in the enclosing group (transformers itself bundles only a kept final norm with the head);
- a group for some, but not all, modules behind one ``.*`` key (transformers rejects concrete indices that its
  wildcard plan does not list), and different styles behind one ``.*`` key: left out;
- "no group here": an entry of the built-in plan cannot be removed by an override. Where fsdp-compat's plan gives a
  built-in entry no group (GLM4V's vision table is not one, but untied Gemma4's ``embed_tokens`` is), only the
  installed adapter (``fsdp_compat.adapters.transformers``) drops it while transformers applies the plan;
- module paths of another class: a plan made for ``Glm4vModel`` names ``visual...``, the
  ``Glm4vForConditionalGeneration`` checkpoint ``model.visual...``; plan the class you load.

Everything left out is named in one warning (``strict=True`` raises instead).
"""

from __future__ import annotations

import re
import warnings
from typing import TYPE_CHECKING, Any

from fsdp_compat.errors import FsdpCompatError

if TYPE_CHECKING:
    from fsdp_compat.plan import WrapPlan

__all__ = ["to_transformers_fsdp_plan", "wildcard"]

FREE, KEEP = "free_full_weight", "keep_full_weight"


def wildcard(path: str) -> str:
    """transformers' key for a module path: every ``.<digits>`` segment becomes ``.*``."""
    return re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), path)


def to_transformers_fsdp_plan(plan: WrapPlan, model: Any = None, *, strict: bool = False) -> dict[str, str]:
    """``plan``'s single-module groups as an ``fsdp_plan`` dict, bottom-up; see the module docstring for the limits.

    Pass the ``model`` the plan was made for so that a ``.*`` key is only emitted when every module it stands for
    is a group of the plan (without it, a layer index is assumed to cover all of them).
    """
    skipped: list[str] = []
    by_key: dict[str, dict[str, str]] = {}
    for group in plan.groups:
        if len(group.modules) > 1:
            skipped.append(f"{group.name} (one group of {len(group.modules)} modules)")
            continue
        path = group.paths[0]
        if not path:
            continue
        style = KEEP if group.overrides.get("reshard_after_forward") is False else FREE
        by_key.setdefault(wildcard(path), {})[path] = style
    everything = _paths_by_key(model) if model is not None else None
    out: dict[str, str] = {}
    for key, members in by_key.items():
        styles = set(members.values())
        if len(styles) > 1:
            skipped.append(f"{key} (its modules need different styles: {sorted(styles)})")
            continue
        if everything is not None and set(everything.get(key, ())) != set(members):
            missing = sorted(set(everything.get(key, ())) - set(members))
            skipped.append(f"{key} (only some of its modules are groups; not {', '.join(missing[:3])})")
            continue
        out[key] = styles.pop()
    if skipped:
        message = (
            "fsdp-compat: to_transformers_fsdp_plan left out what transformers' fsdp_plan cannot express; those "
            "parameters stay in the enclosing group: " + "; ".join(skipped)
        )
        if strict:
            raise FsdpCompatError(message + ". Use fsdp_compat.apply_fsdp2 for this plan instead.")
        warnings.warn(message, stacklevel=2)
    return out


def _paths_by_key(model: Any) -> dict[str, list[str]]:
    paths: dict[str, list[str]] = {}
    for path, _ in model.named_modules():
        if path:
            paths.setdefault(wildcard(path), []).append(path)
    return paths
