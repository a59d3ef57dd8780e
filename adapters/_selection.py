"""What every adapter does with the framework's own selection: keep it, minus what is unsafe; never crash a job.

The adapters start from exactly the modules the framework release would give their own FSDP2 group and remove
only those that static analysis shows would crash (a parameter read raw outside the module's forward, unreadable
code above it, a parameter shared with a module outside it). So a text model keeps exactly the framework's groups.

A wrap list that matches no module of the model (an outdated ``fsdp_config.wrap_policy.transformer_layer_cls_to_wrap``)
is not an error in adapter context, because the framework itself trains with it (sharding only what its other
rules pick): one warning names the classes and the model's repeated block classes, and the job goes on with the
framework's selection minus what is unsafe. The direct API (``plan_wrap``, ``apply_fsdp2``) keeps raising.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from fsdp_compat.activation import logger
from fsdp_compat.paths import within

__all__ = [
    "bottom_up",
    "configured_wrap_list",
    "keep_safe",
    "layer_class_names",
    "outdated_fallback",
    "unmatched",
    "unsafe_targets",
    "untied_embeddings",
    "warn_unmatched",
]

_warned: set[tuple[str, str, tuple[str, ...]]] = set()
_lock = threading.Lock()


def unsafe_targets(model: Any, targets: list[Any]) -> dict[int, str]:
    """:func:`fsdp_compat.safety.unsafe_targets`, the one safety checker, imported when first needed: the adapters
    import this module at load time, and the checker imports torch and the analysis (about 6 ms)."""
    from fsdp_compat.safety import unsafe_targets as check

    return check(model, targets)


# ----------------------------------------------------------------------------------------- the configured list


def layer_class_names(value: Any) -> list[str] | None:
    """A wrap list as class names, whatever the framework passes: a str (one class), a list, tuple, ListConfig or
    the *set* ``_no_split_modules`` of transformers 5, classes or names. None or empty: None (= not configured)."""
    if value is None or (isinstance(value, str) and not value):
        return None
    if isinstance(value, str):
        return [value]
    names = [v if isinstance(v, str) else getattr(v, "__name__", str(v)) for v in value]
    return names or None


def _field(holder: Any, name: str) -> Any:
    """``holder[name]`` for a dict or DictConfig (``.get``), else the attribute (a dataclass); None if absent."""
    if holder is None:
        return None
    get = getattr(holder, "get", None)
    return get(name, None) if callable(get) else getattr(holder, name, None)


def configured_wrap_list(config: Any) -> Any:
    """``config.wrap_policy.transformer_layer_cls_to_wrap`` as every framework spells its config (a dict, a
    DictConfig, a dataclass, at both levels), or None: the frameworks fall back to ``model._no_split_modules``."""
    return _field(_field(config, "wrap_policy"), "transformer_layer_cls_to_wrap")


# ------------------------------------------------------------------------------------- the selection made safe


def keep_safe(framework: str, model: Any, targets: list[Any], also_unsafe: dict[int, str] | None = None) -> list[Any]:
    """The framework's own ``targets`` minus what static analysis shows would be read while sharded (and the
    framework-specific ``also_unsafe``: module id -> why), children first. One INFO line names what stays in the
    root group and why; a text model's selection comes back unchanged."""
    why = unsafe_targets(model, targets)
    why.update(also_unsafe or {})
    kept = bottom_up(model, [m for m in targets if id(m) not in why])
    paths = {id(m): p for p, m in model.named_modules()}
    dropped = [f"{paths.get(id(m), '?')} ({why[id(m)]})" for m in targets if id(m) in why]
    if dropped:
        logger.info(
            "%s: %s keeps %d of %s's %d FSDP2 groups; in the root group instead: %s",
            framework,
            type(model).__name__,
            len(kept),
            framework,
            len(targets),
            "; ".join(dropped),
        )
    return kept


def unmatched(model: Any, names: Iterable[str] | None) -> list[str] | None:
    """The configured layer class names when none of them matches a module of ``model`` (else None)."""
    if not names:
        return None
    wanted = sorted({str(n) for n in names})
    present = {type(m).__name__ for m in model.modules()}
    return None if set(wanted) & present else wanted


def warn_unmatched(framework: str, model: Any, names: list[str], kept: list[str]) -> None:
    """One warning per process, model class and wrap list: what matched nothing and what is sharded instead."""
    from fsdp_compat.tree import repeated_block_classes  # imports torch: only when there is something to say

    key = (framework, type(model).__name__, tuple(names))
    with _lock:
        if key in _warned:
            return
        _warned.add(key)
    blocks = repeated_block_classes(model)
    logger.warning(
        "%s: the layer classes to wrap %s match no module of %s (fsdp_config.wrap_policy."
        "transformer_layer_cls_to_wrap is outdated?); its repeated block classes are %s. Going on as %s does "
        "without them: sharding %s (what %s selects, minus what is unsafe), the rest stays in the root group. "
        "Set transformer_layer_cls_to_wrap to the block classes (or leave it unset) to shard the layers.",
        framework,
        names,
        type(model).__name__,
        ", ".join(blocks) or "none found",
        framework,
        ", ".join(kept) or "nothing",
        framework,
    )


def bottom_up(model: Any, targets: list[Any]) -> list[Any]:
    """``targets`` in the framework's order, except that a module's descendants in the list move right before it
    (``fully_shard`` needs children first; verl's list can put a peft wrapper before the embedding inside it)."""
    paths = {id(m): p for p, m in model.named_modules()}
    done: set[int] = set()
    out: list[Any] = []

    def emit(target: Any) -> None:
        if id(target) in done:
            return
        done.add(id(target))
        path = paths.get(id(target))
        if path is not None:
            for other in targets:
                other_path = paths.get(id(other))
                if other is not target and other_path is not None and within(other_path, path) and other_path != path:
                    emit(other)
        out.append(target)

    for target in targets:
        emit(target)
    return out


def untied_embeddings(model: Any) -> list[Any]:
    """What verl 0.4-0.7.0 and every SkyRL release select when no layer class matches: each ``nn.Embedding``
    when ``model.config.tie_word_embeddings`` is false."""
    from torch import nn

    if getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        return []
    return [m for m in model.modules() if isinstance(m, nn.Embedding)]


def outdated_fallback(framework: str, model: Any, outdated: list[str], analyzed: bool) -> list[Any]:
    """The modules to shard when the wrap list matched nothing: the framework's embeddings rule, minus what is
    unsafe under an analyzed policy (``legacy`` & co keep the framework's choice as it is), children first."""
    targets = untied_embeddings(model)
    if analyzed:
        why = unsafe_targets(model, targets)
        targets = [m for m in targets if id(m) not in why]
    targets = bottom_up(model, targets)
    paths = {id(m): p for p, m in model.named_modules()}
    warn_unmatched(framework, model, outdated, [paths.get(id(m), "?") for m in targets])
    return targets
