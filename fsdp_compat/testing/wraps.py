"""Wrap functions for :func:`fsdp_compat.testing.parity.run_training`, named as ``"module:function"``.

``core_<policy>(model, fsdp_kwargs)`` applies fsdp-compat's own planner with that policy and returns the plan
as text (``"fsdp_compat.testing.wraps:core_auto"``).
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = [
    "core_auto",
    "core_input_only",
    "core_layers_only",
    "core_legacy",
    "core_legacy_skyrl",
]


def _core(model: nn.Module, fsdp_kwargs: dict[str, Any], policy: Any) -> str:
    from fsdp_compat.apply import apply_fsdp2

    return str(apply_fsdp2(model, fsdp_kwargs, policy=policy))


def core_auto(model: nn.Module, fsdp_kwargs: dict[str, Any]) -> str:
    """fsdp-compat's default plan."""
    return _core(model, fsdp_kwargs, "auto")


def core_legacy(model: nn.Module, fsdp_kwargs: dict[str, Any]) -> str:
    """The verl>=0.7.1 selection rule (crashes on GLM4V; for demonstrations)."""
    return _core(model, fsdp_kwargs, "legacy")


def core_legacy_skyrl(model: nn.Module, fsdp_kwargs: dict[str, Any]) -> str:
    """The SkyRL / verl 0.4-0.7.0 selection rule (crashes on GLM4V; for demonstrations)."""
    return _core(model, fsdp_kwargs, "legacy-skyrl")


def core_input_only(model: nn.Module, fsdp_kwargs: dict[str, Any]) -> str:
    """Layers plus only get_input_embeddings() (the proposed upstream fix)."""
    return _core(model, fsdp_kwargs, "input-only")


def core_layers_only(model: nn.Module, fsdp_kwargs: dict[str, Any]) -> str:
    """Layers only; everything else stays in the root."""
    return _core(model, fsdp_kwargs, "layers-only")
