"""One wrapper for every ``fsdp2_prepare_model(accelerator, model, ...)``: accelerate's own, and the replacements
frameworks install over it (axolotl). The framework's function runs as it is (its selection, its memory); around it
the groups are checked and fsdp-compat's run-time layer is installed on what it returns.

Shared so that accelerate's function and a framework's replacement of it behave and log alike, each under its own
name (the group check's lines say whose groups they are, and how a user of that framework keeps a module out).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from fsdp_compat.policies import Policy

from ._existing import evidence, report, root_module

__all__ = ["make_prepare_model", "model_argument"]


def model_argument(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The ``model`` of ``fsdp2_prepare_model(accelerator, model, ...)``, by keyword or position (None if absent)."""
    return kwargs["model"] if "model" in kwargs else (args[1] if len(args) > 1 else None)


def make_prepare_model(
    original: Callable[..., Any], policy: Policy, *, framework: str, advice: str
) -> Callable[..., Any]:
    """``original(accelerator, model, ...)`` with every argument passed on, its result returned; its groups checked
    (analyzed policies) and the run-time layer installed on the result. A model that arrives sharded already is not
    read again (its groups were made elsewhere); it gets the run-time layer, which is installed once."""

    @functools.wraps(original)
    def fsdp2_prepare_model(*args: Any, **kwargs: Any) -> Any:
        from torch import nn
        from torch.distributed.fsdp import FSDPModule

        from fsdp_compat.runtime import install_runtime

        model = model_argument(args, kwargs)
        found = None
        fresh = isinstance(model, nn.Module) and not isinstance(root_module(model), FSDPModule)  # else: as it came
        if fresh and policy.analyzed:
            found = evidence(framework, model)
        result = original(*args, **kwargs)
        prepared = result if isinstance(result, nn.Module) else model
        if not isinstance(prepared, nn.Module):
            return result
        if found is not None:
            report(framework, prepared, found, advice)
        install_runtime(root_module(prepared))  # the run-time guard, and mixed micro-batches kept in step (idempotent)
        return result

    fsdp2_prepare_model.__fsdp_compat__ = True  # type: ignore[attr-defined]
    return fsdp2_prepare_model
