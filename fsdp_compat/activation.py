"""Switches, the :class:`Adapter` base class and the import hooks that put adapters into frameworks.

An adapter reads like a table ("for these versions, in these modules, this name becomes that function"); the
mechanics live here once: version gate, all-or-nothing replacement under a lock, rebinding of modules that
imported the name with ``from x import name`` (already loaded, or loaded later via wrapt post-import hooks),
exact restore on :meth:`Adapter.unpatch`, and one log line per process saying what was patched.

Modelled on OpenTelemetry's ``BaseInstrumentor``. Imports no torch and no framework.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, ClassVar

import wrapt
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from fsdp_compat._autoload import (
    ADAPTER_MODULES,
    ENV_AUTOLOAD,
    ENV_SWITCH,
    autoload_enabled,
    automatic_activation_enabled,
)
from fsdp_compat.errors import FsdpCompatError

__all__ = [
    "ADAPTER_MODULES",
    "ENV_AUTOLOAD",
    "ENV_FORCE",
    "ENV_LOG",
    "ENV_POLICY",
    "ENV_SWITCH",
    "Adapter",
    "FsdpCompatWarning",
    "Replacement",
    "activate_on_import",
    "autoload_enabled",
    "automatic_activation_enabled",
    "force_enabled",
    "logger",
    "policy_from_env",
]

ENV_POLICY = "FSDP_COMPAT_POLICY"
ENV_FORCE = "FSDP_COMPAT_FORCE"
ENV_LOG = "FSDP_COMPAT_LOG"
_ON_VALUES = frozenset({"1", "true", "yes", "on"})


class FsdpCompatWarning(UserWarning):
    """An adapter did not patch (unsupported version, failed replacement) or patched despite a risk."""


# --------------------------------------------------------------------------------------------------- switches


def force_enabled() -> bool:
    """``FSDP_COMPAT_FORCE=1``: patch an unknown or unsupported framework version anyway (with a warning)."""
    return os.environ.get(ENV_FORCE, "").strip().lower() in _ON_VALUES


def policy_from_env() -> str:
    """The policy that ``FSDP_COMPAT_POLICY`` names (default "auto"); a bad name raises, listing the valid."""
    raw = os.environ.get(ENV_POLICY, "").strip()
    if not raw:
        return "auto"
    from fsdp_compat.policies import POLICY_NAMES  # lazy: the policies import torch

    name = raw.lower()
    if name not in POLICY_NAMES:
        raise FsdpCompatError(
            f"{ENV_POLICY}={raw!r} is not a policy name; set it to one of {', '.join(POLICY_NAMES)} "
            f"or unset it for 'auto'."
        )
    return name


# ---------------------------------------------------------------------------------------------------- logging

logger = logging.getLogger("fsdp_compat")


class _DefaultStderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Shows fsdp_compat records on stderr while the application configured no logging of its own.

    Once the root logger has handlers, records only propagate to them: nothing is printed twice, and an
    application's own configuration (level, format, destination) wins.
    """

    def emit(self, record: logging.LogRecord) -> None:
        if logger.propagate and logging.getLogger().handlers:
            return
        self.stream = sys.stderr  # the current stderr (pytest, Ray and notebooks swap it)
        super().emit(record)


class _QuietFilter(logging.Filter):
    """``FSDP_COMPAT_LOG=quiet`` drops INFO and below, read at emit time."""

    def filter(self, record: logging.LogRecord) -> bool:
        quiet = os.environ.get(ENV_LOG, "").strip().lower() in {"quiet", "off", "0", "warning"}
        return record.levelno >= logging.WARNING or not quiet


def _setup_logger() -> None:
    if not any(isinstance(h, _DefaultStderrHandler) for h in logger.handlers):
        handler = _DefaultStderrHandler()
        handler.setFormatter(logging.Formatter("[fsdp_compat pid %(process)d] %(levelname)s %(message)s"))
        logger.addHandler(handler)
    if not any(isinstance(f, _QuietFilter) for f in logger.filters):
        logger.addFilter(_QuietFilter())
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)


_setup_logger()

# ----------------------------------------------------------------------------------------------- replacements


@dataclass(frozen=True)
class Replacement:
    """Replace ``module.name`` with ``make(original)``; rebind it in modules that imported it by name."""

    module: str
    name: str
    make: Callable[[Any], Any]
    importers: tuple[str, ...] = ()

    @property
    def target(self) -> str:
        return f"{self.module}.{self.name}"


@dataclass
class _Applied:
    """One replacement in effect: the exact objects, and every module namespace that now holds ``new``."""

    replacement: Replacement
    original: Any
    new: Any
    bound: list[ModuleType] = field(default_factory=list)

    def holds(self, module: ModuleType) -> bool:
        return any(m is module for m in self.bound)


_MISSING = object()


def _namespace(module: Any) -> dict[str, Any] | None:
    try:
        namespace = vars(module)
    except TypeError:
        return None
    return namespace if isinstance(namespace, dict) else None


# --------------------------------------------------------------------------------------------------- adapters


class Adapter:
    """One framework's patch set: supported versions, what to replace, and safe patch/unpatch.

    Subclasses set ``name``, ``supported`` (distribution -> PEP 440 specifier), ``trigger_modules`` and
    implement :meth:`plan_patches`. ``patch`` is idempotent, thread-safe and all-or-nothing; ``unpatch`` puts
    the exact original objects back wherever the replacement was bound.
    """

    name: ClassVar[str] = "adapter"
    supported: ClassVar[dict[str, str]] = {}
    trigger_modules: ClassVar[tuple[str, ...]] = ()

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._applied: list[_Applied] = []
        self._patched = False
        self._hooked_importers: set[str] = set()
        self._hooked_triggers = False
        self._warned: set[str] = set()
        self._logged = False
        self.activated_by: str | None = None
        self.version: tuple[str, Version] | None = None
        self.policy_name: str | None = None

    # -- what subclasses provide -------------------------------------------------------------------------

    def installed(self) -> tuple[str, Version] | None:
        """The first installed distribution of ``supported`` and its version (no framework import)."""
        from importlib import metadata

        for distribution in self.supported:
            try:
                raw = metadata.version(distribution)
            except metadata.PackageNotFoundError:
                continue
            try:
                return distribution, Version(raw)
            except InvalidVersion:
                self._warn_once(
                    f"version:{distribution}", f"{distribution} reports an invalid version {raw!r}."
                )
        return None

    def plan_patches(self, distribution: str, version: Version) -> list[Replacement]:
        """The replacements for this release; subclasses implement it."""
        raise NotImplementedError(f"{type(self).__name__} must implement plan_patches()")

    def policy(self) -> str:
        """The policy the replacements use (validated); subclasses may override."""
        return policy_from_env()

    # -- state ----------------------------------------------------------------------------------------------

    def is_patched(self) -> bool:
        return self._patched

    def is_supported(self, distribution: str, version: Version) -> bool:
        """Whether ``version`` of ``distribution`` falls in the declared range (pre-releases included)."""
        spec = self.supported.get(distribution)
        if spec is None:
            return False
        try:
            return SpecifierSet(spec).contains(version, prereleases=True)
        except InvalidSpecifier as exc:
            raise FsdpCompatError(
                f"{type(self).__name__}.supported[{distribution!r}] = {spec!r}: {exc}"
            ) from exc

    def supported_text(self) -> str:
        return "; ".join(f"{dist} {spec}" for dist, spec in self.supported.items()) or "nothing declared"

    def describe(self) -> list[str]:
        """One line per binding now replaced: ``verl.utils.fsdp_utils.x -> fsdp_compat (policy auto)``."""
        with self._lock:
            lines = []
            for rec in self._applied:
                holders = list(rec.bound)
                # An importer that was mid-import when the patch happened bound the replacement by itself.
                for name in rec.replacement.importers:
                    module = sys.modules.get(name)
                    if (
                        module is not None
                        and not rec.holds(module)
                        and vars(module).get(rec.replacement.name, _MISSING) is rec.new
                    ):
                        holders.append(module)
                for module in holders:
                    lines.append(
                        f"{module.__name__}.{rec.replacement.name} -> fsdp_compat (policy {self.policy_name})"
                    )
            return lines

    # -- patch / unpatch --------------------------------------------------------------------------------

    def patch(self, *, activated_by: str = "explicit") -> bool:
        """Apply every replacement or none. Returns True when patched (now or before).

        An unknown or unsupported version warns once and patches nothing unless ``FSDP_COMPAT_FORCE=1``. Any
        other failure rolls back what was done; an explicit call re-raises it, an automatic one warns.
        """
        if self._patched:
            return True
        explicit = activated_by == "explicit"
        found = self._check_version()
        if found is None:
            return False
        try:
            policy = self.policy()
            plan = list(self.plan_patches(*found))
            # Import the defining modules outside the lock: their import may fire other hooks (and this one).
            for rep in plan:
                if rep.module not in sys.modules:
                    importlib.import_module(rep.module)
        except Exception as exc:
            return self._failed(exc, explicit, applied=False)
        with self._lock:
            if self._patched:
                return True
            applied: list[_Applied] = []
            try:
                for rep in plan:
                    applied.append(self._apply(rep))
            except BaseException as exc:
                for rec in reversed(applied):
                    self._restore(rec)
                if isinstance(exc, Exception):
                    return self._failed(exc, explicit, applied=bool(applied))
                raise
            self._applied = applied
            self._patched = True
            self.activated_by = activated_by
            self.version = found
            self.policy_name = policy
            self._log_patched()
        self._hook_importers()
        return True

    def unpatch(self) -> None:
        """Put the exact original objects back in the definer and every module that holds the replacement."""
        with self._lock:
            if not self._patched:
                return
            for rec in reversed(self._applied):
                self._restore(rec)
            self._applied = []
            self._patched = False
            self.activated_by = None
            logger.debug("%s: unpatched", self.name)

    # -- internals --------------------------------------------------------------------------------------

    def _check_version(self) -> tuple[str, Version] | None:
        found = self.installed()
        if found is None:
            self._warn_once(
                "missing",
                f"{self.name} adapter: no installed distribution of "
                f"{', '.join(self.supported) or self.name} was found (importlib.metadata), so its version is "
                f"unknown; nothing was patched. Supported: "
                f"{self.supported_text()}. Install the framework as a distribution (pip install ...).",
            )
            return None
        distribution, version = found
        if self.is_supported(distribution, version):
            return found
        if force_enabled():
            self._warn_once(
                f"forced:{version}",
                f"{self.name} adapter: {distribution} {version} is outside the supported range "
                f"({self.supported_text()}); patching anyway because {ENV_FORCE}=1.",
            )
            return found
        self._warn_once(
            f"unsupported:{version}",
            f"{self.name} adapter: {distribution} {version} is not supported (supported: "
            f"{self.supported_text()}); nothing was patched. Set {ENV_FORCE}=1 to patch anyway.",
        )
        return None

    def _apply(self, rep: Replacement) -> _Applied:
        module = sys.modules.get(rep.module)
        namespace = _namespace(module)
        if module is None or namespace is None:
            raise FsdpCompatError(f"{rep.module} is not an importable module; cannot replace {rep.target}.")
        original = namespace.get(rep.name, _MISSING)
        if original is _MISSING:
            raise FsdpCompatError(
                f"{rep.target} does not exist in this release; the {self.name} adapter does not match it."
            )
        new = rep.make(original)
        if new is None:
            raise FsdpCompatError(f"the replacement factory for {rep.target} returned None.")
        rec = _Applied(rep, original, new)
        setattr(module, rep.name, new)
        rec.bound.append(module)
        for importer in rep.importers:
            loaded = sys.modules.get(importer)
            if loaded is not None:
                self._bind(rec, loaded)
        return rec

    def _bind(self, rec: _Applied, module: ModuleType) -> None:
        """Rebind ``name`` in an importer that holds the original; record one that already holds ``new``."""
        namespace = _namespace(module)
        if namespace is None or rec.holds(module):
            return
        value = namespace.get(rec.replacement.name, _MISSING)
        if value is rec.original:
            setattr(module, rec.replacement.name, rec.new)
            rec.bound.append(module)
        elif value is rec.new:
            rec.bound.append(module)
        elif value is not _MISSING:
            logger.debug(
                "%s: %s.%s holds another object; left alone", self.name, module.__name__, rec.replacement.name
            )

    def _restore(self, rec: _Applied) -> None:
        name = rec.replacement.name
        holders = list(rec.bound)
        # Modules that imported the replacement by name without being declared importers get it back too.
        for module in list(sys.modules.values()):
            namespace = _namespace(module)
            if namespace is not None and namespace.get(name, _MISSING) is rec.new and not rec.holds(module):
                holders.append(module)
        for module in holders:
            namespace = _namespace(module)
            if namespace is None:
                continue
            current = namespace.get(name, _MISSING)
            if current is rec.new:
                setattr(module, name, rec.original)
            else:
                logger.warning(
                    "%s: %s.%s was replaced again after fsdp_compat patched it; left as it is",
                    self.name,
                    getattr(module, "__name__", "?"),
                    name,
                )
        rec.bound.clear()

    def _hook_importers(self) -> None:
        """Rebind importers that are not loaded yet the moment they are imported (only while patched)."""
        with self._lock:
            pending = {
                importer
                for rec in self._applied
                for importer in rec.replacement.importers
                if importer not in self._hooked_importers
            }
            self._hooked_importers |= pending
        for importer in sorted(pending):
            wrapt.register_post_import_hook(self._on_importer_loaded, importer)

    def _on_importer_loaded(self, module: ModuleType) -> None:
        # Runs inside the importer's import: it must never raise, or that import fails.
        try:
            with self._lock:
                self._hooked_importers.discard(module.__name__)
                if not self._patched:
                    return
                for rec in self._applied:
                    if module.__name__ in rec.replacement.importers:
                        self._bind(rec, module)
        except Exception:
            logger.warning(
                "%s: could not rebind %s", self.name, getattr(module, "__name__", "?"), exc_info=True
            )

    def _hook_triggers(self, source: str) -> None:
        with self._lock:
            if self._hooked_triggers:
                return
            self._hooked_triggers = True

        def on_trigger(module: ModuleType) -> None:
            try:
                if automatic_activation_enabled():
                    self.patch(activated_by=source)
            except Exception:
                logger.warning(
                    "%s: activation after importing %s failed", self.name, module.__name__, exc_info=True
                )

        for trigger in self.trigger_modules:
            wrapt.register_post_import_hook(on_trigger, trigger)

    def _failed(self, exc: Exception, explicit: bool, *, applied: bool) -> bool:
        if explicit:
            raise exc
        what = "rolled back; nothing stays patched" if applied else "nothing was patched"
        self._warn_once(
            f"failed:{type(exc).__name__}:{exc}",
            f"{self.name} adapter could not patch ({what}): {type(exc).__name__}: {exc}",
        )
        logger.debug("%s: patch failure", self.name, exc_info=exc)
        return False

    def _warn_once(self, key: str, message: str) -> None:
        with self._lock:
            if key in self._warned:
                return
            self._warned.add(key)
        warnings.warn(message, FsdpCompatWarning, stacklevel=4)

    def _log_patched(self) -> None:
        if self._logged:
            return
        self._logged = True
        distribution, version = self.version or ("?", "?")
        names = ", ".join(
            f"{module.__name__}.{rec.replacement.name}" for rec in self._applied for module in rec.bound
        )
        logger.info(
            "patched %s %s (policy %s, activated by %s): %s",
            distribution,
            version,
            self.policy_name,
            self.activated_by,
            names or "nothing to replace",
        )


# ------------------------------------------------------------------------------------------------- activation

_source_override = threading.local()


@contextmanager
def _activation_source(source: str) -> Iterator[None]:
    """Label activations that happen while an adapter module is imported by a hook (e.g. ``pth-hook``)."""
    previous = getattr(_source_override, "value", None)
    _source_override.value = source
    try:
        yield
    finally:
        _source_override.value = previous


def activate_on_import(adapter: Adapter, source: str = "import") -> None:
    """Called at the bottom of each adapter module: patch now if a trigger is loaded, else on its import.

    Does nothing when ``FSDP_COMPAT`` is off. Never raises: a failure warns and leaves the framework as is.
    """
    if not automatic_activation_enabled():
        logger.debug("%s: automatic activation is off (%s)", adapter.name, ENV_SWITCH)
        return
    source = getattr(_source_override, "value", None) or source
    try:
        if any(trigger in sys.modules for trigger in adapter.trigger_modules):
            adapter.patch(activated_by=source)
        else:
            adapter._hook_triggers(source)
    except Exception:
        logger.warning("%s: activation failed", adapter.name, exc_info=True)


def _activate_from_pth(key: str, trigger: str) -> None:
    """What the .pth trigger finder calls after ``trigger`` was imported: import the adapter and patch."""
    if not autoload_enabled():
        return
    module_name, _ = ADAPTER_MODULES[key]
    with _activation_source("pth-hook"):
        module = importlib.import_module(module_name)
    adapter = getattr(module, "ADAPTER", None)
    if isinstance(adapter, Adapter):
        adapter.patch(activated_by="pth-hook")
