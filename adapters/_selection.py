"""What every adapter does with the framework's own selection: keep it, minus what is unsafe; never crash a job.

The adapters start from exactly the modules the framework release would give their own FSDP2 group and remove
only those that static analysis shows would crash (a parameter read raw outside the module's forward, unreadable
code above it, a parameter shared with a module outside it). So a text model keeps exactly the framework's groups.

A wrap list that matches no module of the model (an outdated ``fsdp_config.wrap_policy.transformer_layer_cls_to_wrap``)
is not an error in adapter context, because the framework itself trains with it (sharding only what its other
rules pick): one warning names the classes and the model's repeated block classes, and the job goes on with the
framework's selection minus what is unsafe. The direct API (``plan_wrap``, ``apply_fsdp2``) keeps raising.

A framework's signatures grow between releases (a new keyword, a new step inside the function). A replacement
passes the arguments it does not know to the framework's own code: :class:`DeferredShards` lets the framework's
ORIGINAL function run and changes only which of its ``fully_shard`` calls take effect; a replacement that
re-implements the function and meets :func:`foreign_arguments` runs the framework's own function with them instead.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable
from typing import Any

from fsdp_compat.log import logger
from fsdp_compat.paths import within
from fsdp_compat.policies import Policy

__all__ = [
    "DeferredShards",
    "children_first",
    "configured_wrap_list",
    "foreign_arguments",
    "keep_safe",
    "layer_class_names",
    "make_deferring_fully_shard",
    "outdated_fallback",
    "unmatched",
    "unsafe_targets",
    "untied_embeddings",
    "warn_unmatched",
]

_warned: set[tuple[str, str, tuple[str, ...]]] = set()
_foreign_warned: set[tuple[str, str, tuple[str, ...]]] = set()
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
    kept = children_first(model, [m for m in targets if id(m) not in why])
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


def children_first(model: Any, targets: list[Any]) -> list[Any]:
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
    targets = children_first(model, targets)
    paths = {id(m): p for p, m in model.named_modules()}
    warn_unmatched(framework, model, outdated, [paths.get(id(m), "?") for m in targets])
    return targets


# ---------------------------------------------------------------------- arguments a replacement does not know


def foreign_arguments(framework: str, function: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a call brought arguments beyond the signature the replacement was written for (a newer release).

    Only the framework knows what they mean, so the replacement then hands all of them to the framework's own
    function (and keeps the run-time guard) rather than dropping them: one warning per process, framework and
    argument shape."""
    if not args and not kwargs:
        return False
    shape = (*(f"#{i}" for i in range(len(args))), *sorted(kwargs))
    key = (framework, function, shape)
    with _lock:
        first = key not in _foreign_warned
        _foreign_warned.add(key)
    if first:
        logger.warning(
            "%s: %s was called with arguments this fsdp-compat does not know (extra %s): they go to %s's own %s, "
            "and fsdp-compat's run-time guard stays installed (a read while sharded unshards its group instead of "
            "crashing). A newer fsdp-compat may know this release.",
            framework,
            function,
            ", ".join(shape),
            framework,
            function,
        )
    return True


# ------------------------------------------------- the framework's own fully_shard calls, minus what is unsafe

_scopes = threading.local()  # the open DeferredShards of this thread, innermost last


class DeferredShards:
    """The ``fully_shard`` calls a framework's own function makes for ``model``, held back until its root call.

    Open it around the framework's ORIGINAL function (whose module's ``fully_shard`` is
    :func:`make_deferring_fully_shard`'s): every call for a module other than ``model`` is recorded with its own
    arguments; at the call for ``model`` (the root, last in FSDP2) the recorded modules minus what is unsafe are
    sharded children first, each with the arguments the framework gave it, then the root call runs as made. So
    the framework's selection rule (a set or a list of layer classes, whatever a release computes), its new
    keywords and its other steps stay its own. A call this cannot judge (several modules at once) keeps every
    call as the framework made it. Without a root call the rest is applied when the scope closes."""

    def __init__(self, framework: str, model: Any) -> None:
        self.framework = framework
        self.model = model
        self.pending: list[tuple[Callable[..., Any], Any, tuple[Any, ...], dict[str, Any]]] = []
        self.calls = 0  # fully_shard calls seen (the root's included)

    def __enter__(self) -> DeferredShards:
        _scopes.__dict__.setdefault("stack", []).append(self)
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        _scopes.stack.remove(self)
        if exc_type is None:
            self.flush()

    def submit(self, shard: Callable[..., Any], module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.calls += 1
        if module is not self.model:
            self.pending.append((shard, module, args, kwargs))
            return module  # what the framework gets back is the module it passed (fully_shard's return, unwrapped)
        self.flush()
        return shard(module, *args, **kwargs)

    def flush(self) -> None:
        from torch import nn

        pending, self.pending = self.pending, []
        if not all(isinstance(module, nn.Module) for _, module, _, _ in pending):
            for shard, module, args, kwargs in pending:  # a group of several modules: the framework's calls as made
                shard(module, *args, **kwargs)
            return
        first: dict[int, tuple[Callable[..., Any], Any, tuple[Any, ...], dict[str, Any]]] = {}
        for call in pending:
            first.setdefault(id(call[1]), call)  # a module selected twice is sharded once
        for module in keep_safe(self.framework, self.model, [call[1] for call in first.values()]):
            shard, _, args, kwargs = first[id(module)]
            shard(module, *args, **kwargs)


def make_deferring_fully_shard(original: Callable[..., Any], _policy: Policy) -> Callable[..., Any]:
    """The ``fully_shard`` a framework module bound by name: inside an open :class:`DeferredShards` of this thread
    the call goes to it, everywhere else straight to ``original``."""

    @functools.wraps(original)
    def fully_shard(module: Any, *args: Any, **kwargs: Any) -> Any:
        stack = getattr(_scopes, "stack", None)
        if not stack:
            return original(module, *args, **kwargs)
        return stack[-1].submit(original, module, args, kwargs)

    fully_shard.__fsdp_compat__ = True  # type: ignore[attr-defined]
    return fully_shard
