"""fsdp-compat: safe FSDP2 wrap plans, a run-time guard and mixed micro-batch alignment; adapters that put them into
verl, SkyRL, AReaL, LLaMA-Factory, transformers' native FSDP2, accelerate, axolotl, NeMo Automodel and the
verl-derived RL stacks; and a generic layer that gives every other FSDP2 root the run-time layer.

The package imports lazily: ``import fsdp_compat`` costs almost nothing and imports no torch (not even ``typing``),
because the ``.pth`` start-up hook imports :mod:`fsdp_compat._autoload` in every Python process of an environment.
"""

from __future__ import annotations

import importlib

TYPE_CHECKING = False

__version__ = "0.1.0"

_EXPORTS = {
    "plan_wrap": "fsdp_compat.plan",
    "select_wrap_targets": "fsdp_compat.plan",
    "WrapPlan": "fsdp_compat.plan",
    "Group": "fsdp_compat.plan",
    "RootEntry": "fsdp_compat.plan",
    "apply_fsdp2": "fsdp_compat.apply",
    "install_runtime": "fsdp_compat.runtime",
    "register_family": "fsdp_compat.runtime.vlm_families",
    "VisionFamily": "fsdp_compat.runtime.vlm_families",
    "audit_raw_reads": "fsdp_compat.audit",
    "RawRead": "fsdp_compat.analysis",
    "Policy": "fsdp_compat.policies",
    "Auto": "fsdp_compat.policies",
    "Legacy": "fsdp_compat.policies",
    "InputOnly": "fsdp_compat.policies",
    "LayersOnly": "fsdp_compat.policies",
    "POLICY_NAMES": "fsdp_compat.policies",
    "FsdpCompatError": "fsdp_compat.errors",
}

__all__ = ["__version__", *sorted(_EXPORTS)]

if TYPE_CHECKING:
    from typing import Any

    from fsdp_compat.analysis import RawRead as RawRead
    from fsdp_compat.apply import apply_fsdp2 as apply_fsdp2
    from fsdp_compat.audit import audit_raw_reads as audit_raw_reads
    from fsdp_compat.errors import FsdpCompatError as FsdpCompatError
    from fsdp_compat.plan import Group as Group
    from fsdp_compat.plan import RootEntry as RootEntry
    from fsdp_compat.plan import WrapPlan as WrapPlan
    from fsdp_compat.plan import plan_wrap as plan_wrap
    from fsdp_compat.plan import select_wrap_targets as select_wrap_targets
    from fsdp_compat.policies import POLICY_NAMES as POLICY_NAMES
    from fsdp_compat.policies import Auto as Auto
    from fsdp_compat.policies import InputOnly as InputOnly
    from fsdp_compat.policies import LayersOnly as LayersOnly
    from fsdp_compat.policies import Legacy as Legacy
    from fsdp_compat.policies import Policy as Policy
    from fsdp_compat.runtime import install_runtime as install_runtime
    from fsdp_compat.runtime.vlm_families import VisionFamily as VisionFamily
    from fsdp_compat.runtime.vlm_families import register_family as register_family


def __getattr__(name: str) -> Any:
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'fsdp_compat' has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
