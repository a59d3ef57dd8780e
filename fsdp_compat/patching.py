"""The patch transaction: replace names in modules, rebind by-name importers, run repairs, restore exactly.

A :class:`Patch` is plain data (what an adapter's release table row says); :func:`apply` turns it into an
:class:`Applied` record or raises having changed nothing; :meth:`Applied.restore` puts back the exact original
objects wherever the replacement was bound. Nothing here imports torch or a framework, and nothing here knows
about versions, switches or logging: that is :mod:`fsdp_compat.activation`.

Late arrivals (a declared importer, or the module of a ``deferred`` replacement, imported after the patch) are
handled through the one import-hook engine of :mod:`fsdp_compat._autoload`.
"""

from __future__ import annotations

import importlib
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from fsdp_compat._autoload import hooks, warn
from fsdp_compat.errors import FsdpCompatError
from fsdp_compat.policies import Policy

__all__ = ["Applied", "Patch", "Reexport", "Replacement", "apply"]

_MISSING = object()


@dataclass(frozen=True)
class Replacement:
    """``module.name`` becomes ``make(original, policy)`` (the :class:`~fsdp_compat.policies.Policy`, resolved once
    per transaction); modules in ``importers`` that bound it by name too.

    ``optional``: skip it when the name does not exist (a selector only some releases ship). ``unless``: skip it
    when ``module`` has this attribute (a release that ships a better hook point, replaced by another row).
    ``deferred``: do not import ``module``; replace the name when it is imported (now if it is loaded). A module
    still being imported (the trigger was imported from inside it: transformers' ``core_model_loading`` imports
    ``transformers.distributed.fsdp`` before it defines its loader) waits too: its name is replaced at the first
    import the transaction watches after the module finished.
    ``when``: a condition checked when the transaction is applied, not when the table is declared (e.g. "the
    installed transformers is 5.x"); false: the replacement is left out of this transaction.
    A ``name`` of the form ``Class.attr`` replaces an attribute of a class defined in ``module`` (a method):
    every holder of the class sees it, so ``importers`` do not apply.
    """

    module: str
    name: str
    make: Callable[[Any, str], Any]
    importers: tuple[str, ...] = ()
    optional: bool = False
    unless: str | None = None
    deferred: bool = False
    when: Callable[[], bool] | None = None

    @property
    def target(self) -> str:
        return f"{self.module}.{self.name}"

    def applies(self) -> bool:
        """Whether the row's condition (if any) holds now."""
        return self.when is None or bool(self.when())


@dataclass(frozen=True)
class Reexport:
    """A repair: give ``module`` the name ``name`` (taken from ``source``) when a release forgot to import it."""

    module: str
    name: str
    source: str
    why: str = ""

    @property
    def target(self) -> str:
        return f"{self.module}.{self.name}"


@dataclass(frozen=True)
class Patch:
    """Everything one transaction does: replacements and repairs, applied together or not at all."""

    replacements: tuple[Replacement, ...] = ()
    repairs: tuple[Reexport, ...] = ()

    def modules(self) -> list[str]:
        """The modules the transaction imports first (deferred replacements wait for their module; repairs'
        sources are imported here too, so that nothing is imported while a lock is held)."""
        names = [r.module for r in self.replacements if not r.deferred and r.applies()]
        names += [name for r in self.repairs for name in (r.module, r.source.partition(":")[0])]
        return list(dict.fromkeys(names))


def _namespace(module: Any) -> dict[str, Any] | None:
    try:
        namespace = vars(module)
    except TypeError:
        return None
    return namespace if isinstance(namespace, dict) else None


def _slot(module: Any, name: str) -> tuple[Any, str, Any]:
    """(holder, attribute, current value) for ``name`` in ``module``: the module itself, or for ``Class.attr`` the
    class (its own ``__dict__``, not inherited); the value is ``_MISSING`` when absent, the holder None if unusable."""
    owner, dot, attr = name.rpartition(".")
    holder = (_namespace(module) or {}).get(owner) if dot else module
    if dot and not isinstance(holder, type):
        return None, attr, _MISSING
    if holder is None or (not dot and _namespace(holder) is None):
        return None, attr, _MISSING
    return holder, attr, vars(holder).get(attr, _MISSING)


@dataclass
class _Bound:
    """One replacement in effect: the exact objects, and every module namespace that now holds ``new``."""

    replacement: Replacement
    original: Any
    new: Any
    bound: list[ModuleType] = field(default_factory=list)

    def holds(self, module: ModuleType) -> bool:
        return any(m is module for m in self.bound)

    def bind(self, module: ModuleType) -> None:
        """Rebind ``name`` in an importer that holds the original; record one that already holds ``new``."""
        holder, attr, value = _slot(module, self.replacement.name)
        if holder is None or self.holds(module):
            return
        if value is self.original:
            setattr(holder, attr, self.new)
            self.bound.append(module)
        elif value is self.new:
            self.bound.append(module)


@dataclass
class Applied:
    """A transaction in effect. ``restore`` undoes it exactly; ``lines`` says what it changed."""

    patch: Patch
    policy: Policy
    bound: list[_Bound] = field(default_factory=list)
    repaired: list[tuple[ModuleType, Reexport, Any]] = field(default_factory=list)
    pending: list[Replacement] = field(default_factory=list)  # deferred, their module not (wholly) imported yet
    warnings: list[str] = field(default_factory=list)
    _lock: threading.RLock = field(default_factory=threading.RLock, repr=False)
    _active: bool = True

    # -- late arrivals ---------------------------------------------------------------------------------------

    def watch(self) -> None:
        """Ask the engine to call back when a declared importer or a deferred module is imported."""
        engine = hooks()
        names = {imp for rec in self.bound for imp in rec.replacement.importers}
        names |= {name for rep in self.pending for name in (rep.module, *rep.importers)}
        for name in sorted(names):
            engine.watch(name, ("fsdp-compat patch", id(self)), self._on_import, now=False)

    def _on_import(self, module: ModuleType) -> None:
        """Runs inside the user's import: every step is tried on its own and reported, never raised."""
        with self._lock:
            if not self._active:
                return
            for rep in [r for r in self.pending if r.module == module.__name__ or _loaded(r.module)]:
                self.pending.remove(rep)
                owner = module if rep.module == module.__name__ else sys.modules[rep.module]
                try:
                    if not _skipped(rep, owner):
                        self.bound.append(_replace(rep, owner, self.policy))
                except Exception as exc:
                    message = f"deferred replacement of {rep.target} failed: {type(exc).__name__}: {exc}"
                    self.warnings.append(message)
                    warn(message)
            for rec in self.bound:
                if module.__name__ in rec.replacement.importers:
                    rec.bind(module)

    # -- undo ------------------------------------------------------------------------------------------------

    def restore(self) -> list[str]:
        """Put the original objects back; returns a line for each binding someone replaced again (left as is)."""
        with self._lock:
            self._active = False
            hooks().unwatch(("fsdp-compat patch", id(self)))
            left: list[str] = []
            for rec in reversed(self.bound):
                left += _restore(rec)
            for module, rep, value in reversed(self.repaired):
                if _namespace(module) is not None and vars(module).get(rep.name, _MISSING) is value:
                    delattr(module, rep.name)
            self.bound.clear()
            self.repaired.clear()
            self.pending.clear()
            return left

    # -- reporting -------------------------------------------------------------------------------------------

    def lines(self) -> list[str]:
        """One line per binding now replaced or added (``module.name -> fsdp-compat``)."""
        with self._lock:
            out = []
            for rec in self.bound:
                holders = list(rec.bound)
                # An importer that was mid-import during the patch bound the replacement by itself.
                for name in rec.replacement.importers:
                    module = sys.modules.get(name)
                    if module is not None and not rec.holds(module):
                        namespace = _namespace(module) or {}
                        if namespace.get(rec.replacement.name, _MISSING) is rec.new:
                            holders.append(module)
                policy = self.policy.name
                out += [f"{m.__name__}.{rec.replacement.name} -> fsdp-compat (policy {policy})" for m in holders]
            out += [f"{rep.target} (deferred: replaced when {rep.module} is imported)" for rep in self.pending]
            for module, rep, _ in self.repaired:
                out.append(f"{module.__name__}.{rep.name} re-exported from {rep.source} ({rep.why or 'repair'})")
            return out


def _replace(rep: Replacement, module: ModuleType, policy: Policy) -> _Bound:
    if _namespace(module) is None:
        raise FsdpCompatError(f"{rep.module} is not an importable module; cannot replace {rep.target}.")
    holder, attr, original = _slot(module, rep.name)
    if original is _MISSING:
        raise FsdpCompatError(f"{rep.target} does not exist in this release; the adapter does not match it.")
    new = rep.make(original, policy)
    if new is None:
        raise FsdpCompatError(f"the replacement factory for {rep.target} returned None.")
    rec = _Bound(rep, original, new)
    setattr(holder, attr, new)
    rec.bound.append(module)
    for importer in rep.importers:
        loaded = sys.modules.get(importer)
        if loaded is not None:
            rec.bind(loaded)
    return rec


def _restore(rec: _Bound) -> list[str]:
    name = rec.replacement.name
    holders = list(rec.bound)
    # Modules that imported the replacement by name without being declared importers get it back too.
    for module in list(sys.modules.values()):
        namespace = _namespace(module)
        if namespace is not None and namespace.get(name, _MISSING) is rec.new and not rec.holds(module):
            holders.append(module)
    left = []
    for module in holders:
        holder, attr, value = _slot(module, name)
        if holder is None:
            continue
        if value is rec.new:
            setattr(holder, attr, rec.original)
        else:
            left.append(f"{getattr(module, '__name__', '?')}.{name}")
    rec.bound.clear()
    return left


def _loaded(name: str) -> bool:
    """Whether module ``name`` is imported and finished executing (not one still being imported)."""
    module = sys.modules.get(name)
    return module is not None and getattr(getattr(module, "__spec__", None), "_initializing", False) is not True


def _defined(rep: Replacement) -> bool:
    """Whether ``rep``'s module, even one still being imported, already defines the name it replaces (the first part
    of ``Class.attr``): then it is replaced now, as a loaded module's would be (verl's GLM4V forward module imports
    the trigger after defining what is repaired); a name not defined yet waits for the module to finish."""
    namespace = _namespace(sys.modules.get(rep.module))
    return namespace is not None and rep.name.partition(".")[0] in namespace


def _skipped(rep: Replacement, module: ModuleType) -> bool:
    namespace = _namespace(module) or {}
    if rep.unless is not None and callable(namespace.get(rep.unless)):
        return True
    return rep.optional and _slot(module, rep.name)[2] is _MISSING


def _resolve(source: str) -> Any:
    module_name, _, attr = source.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, attr) if attr else module


def import_modules(patch: Patch) -> None:
    """Import what the transaction needs, outside any lock (an import may fire other hooks, this one too)."""
    for name in patch.modules():
        if name not in sys.modules:
            importlib.import_module(name)


def apply(patch: Patch, policy: Policy) -> Applied:
    """Apply every replacement and repair of ``patch``, or none: a failure restores what was done and re-raises.

    The modules must be imported (:func:`import_modules`); the caller holds its own lock.
    """
    applied = Applied(patch, policy)
    try:
        for rep in patch.repairs:  # first: a repair may be what lets a by-name importer load at all
            module = sys.modules[rep.module]
            if rep.name not in (_namespace(module) or {}):
                value = _resolve(rep.source)
                setattr(module, rep.name, value)
                applied.repaired.append((module, rep, value))
        for rep in patch.replacements:
            if not rep.applies():
                continue
            if rep.deferred and not _loaded(rep.module) and not _defined(rep):
                applied.pending.append(rep)
                continue
            module = sys.modules[rep.module]
            if _skipped(rep, module):
                continue
            applied.bound.append(_replace(rep, module, policy))
    except BaseException:
        applied.restore()
        raise
    if not applied.bound and not applied.pending and not applied.repaired:
        applied.restore()
        raise FsdpCompatError("nothing of this release matches the adapter's table; nothing was patched.")
    applied.watch()
    return applied
