"""Start-up hook: the installed ``fsdp_compat.pth`` calls :func:`install` in every Python process.

It activates the adapters where no framework hook can (SkyRL's Ray workers, verl's critic worker, old verl
releases): the moment a framework's trigger module finishes importing, the matching adapter module is imported
and patches it. Until then it costs one dict lookup per import.

Why not wrapt here: ``import wrapt`` (2.x) pulls in asyncio, inspect and importlib.metadata, about 50 ms
that every interpreter of the environment would pay at start. This module imports only ``os``, ``sys`` and
``_thread`` (loaded at start anyway); :mod:`fsdp_compat.activation` uses wrapt once a framework is imported.

This module also holds the switches and the adapter registry, because it must stay import-cheap:
:mod:`fsdp_compat.activation` re-exports them. Importing it has no side effect; only :func:`install` does.
"""

from __future__ import annotations

import _thread
import os
import sys

ENV_SWITCH = "FSDP_COMPAT"
ENV_AUTOLOAD = "FSDP_COMPAT_AUTOLOAD"
_OFF_VALUES = frozenset({"off", "0", "false", "no"})

#: adapter key -> (adapter module, trigger modules: importing any of them activates the adapter)
ADAPTER_MODULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "verl": ("fsdp_compat.adapters.verl", ("verl.utils.fsdp_utils",)),
    "skyrl": (
        "fsdp_compat.adapters.skyrl",
        ("skyrl_train.distributed.fsdp_utils", "skyrl.backends.skyrl_train.distributed.fsdp_utils"),
    ),
}


def _is_off(variable: str) -> bool:
    return os.environ.get(variable, "").strip().lower() in _OFF_VALUES


def automatic_activation_enabled() -> bool:
    """False when ``FSDP_COMPAT`` is off/0/false/no: no .pth hook, entry point or import-time patching."""
    return not _is_off(ENV_SWITCH)


def autoload_enabled() -> bool:
    """False when automatic activation is off or ``FSDP_COMPAT_AUTOLOAD=0`` (only the .pth hooks are off)."""
    return automatic_activation_enabled() and not _is_off(ENV_AUTOLOAD)


def _trigger_table() -> dict[str, str]:
    return {trigger: key for key, (_, triggers) in ADAPTER_MODULES.items() for trigger in triggers}


def _warn(message: str) -> None:
    """Report on stderr without importing logging or warnings (this runs at interpreter start)."""
    try:  # noqa: SIM105 - contextlib is not imported at start; keep it that way
        sys.stderr.write(f"fsdp_compat: {message}\n")
    except Exception:  # no usable stderr (pythonw, closed pipe): nothing more to do
        pass


def _activate(key: str, trigger: str) -> None:
    """Import the adapter and patch; never raises, so the user's import of the framework always goes on."""
    if not autoload_enabled():
        return
    try:
        from fsdp_compat.activation import _activate_from_pth

        _activate_from_pth(key, trigger)
    except Exception as exc:
        _warn(
            f"the {key} adapter could not be activated after importing {trigger}: {type(exc).__name__}: {exc}"
        )


class _HookLoader:
    """Wraps the real loader of a trigger module to run the adapter right after the module executed."""

    def __init__(self, loader: object, key: str) -> None:
        self._fsdp_compat_loader = loader
        self._fsdp_compat_key = key

    def __getattr__(self, name: str) -> object:
        return getattr(self._fsdp_compat_loader, name)

    def create_module(self, spec: object) -> object:
        create = getattr(self._fsdp_compat_loader, "create_module", None)
        return None if create is None else create(spec)

    def exec_module(self, module: object) -> None:
        loader = self._fsdp_compat_loader
        # From here on the module and its spec name the real loader (inspect, importlib.resources, reloads).
        spec = getattr(module, "__spec__", None)
        if spec is not None and getattr(spec, "loader", None) is self:
            spec.loader = loader
        if getattr(module, "__loader__", None) is self:
            module.__loader__ = loader  # type: ignore[attr-defined]
        loader.exec_module(module)  # type: ignore[attr-defined]
        _activate(self._fsdp_compat_key, getattr(module, "__name__", "?"))


class _TriggerFinder:
    """Meta-path finder that reacts only to the trigger module names and defers to the other finders."""

    def __init__(self, triggers: dict[str, str]) -> None:
        self.triggers = triggers
        self._busy: set[tuple[int, str]] = set()

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> object:
        key = self.triggers.get(fullname)
        if key is None:
            return None
        token = (_thread.get_ident(), fullname)
        if token in self._busy:  # another finder called back into the import system: stay out of the way
            return None
        self._busy.add(token)
        try:
            spec = None
            for finder in list(sys.meta_path):
                if finder is self:
                    continue
                find_spec = getattr(finder, "find_spec", None)
                if find_spec is None:
                    continue
                spec = find_spec(fullname, path, target)
                if spec is not None:
                    break
        finally:
            self._busy.discard(token)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module") or isinstance(loader, _HookLoader):
            return spec
        spec.loader = _HookLoader(loader, key)  # type: ignore[union-attr]
        return spec

    def invalidate_caches(self) -> None:
        """Nothing cached here; present because importlib.invalidate_caches() calls it on every finder."""


_FINDER: _TriggerFinder | None = None


def is_installed() -> bool:
    """True when this process runs the start-up hook (the finder sits in ``sys.meta_path``)."""
    return _FINDER is not None and _FINDER in sys.meta_path


def install() -> bool:
    """Install the trigger finder (what the .pth does); returns whether it is active. Never raises.

    Calling it again re-reads :data:`ADAPTER_MODULES` (the finder stays the same object).
    """
    global _FINDER
    try:
        if not autoload_enabled():
            return False
        triggers = _trigger_table()
        if is_installed():
            _FINDER.triggers = triggers  # type: ignore[union-attr]
            return True
        _FINDER = _TriggerFinder(triggers)
        sys.meta_path.insert(0, _FINDER)
        # A trigger imported before this call (a later, explicit install()) is activated now.
        for trigger, key in triggers.items():
            if trigger in sys.modules:
                _activate(key, trigger)
        return True
    except Exception as exc:
        _warn(f"start-up hook not installed: {type(exc).__name__}: {exc}")
        return False


def uninstall() -> None:
    """Remove the trigger finder (tests, or a process that wants no automatic activation from now on)."""
    global _FINDER
    finder, _FINDER = _FINDER, None
    if finder is not None:
        try:  # noqa: SIM105
            sys.meta_path.remove(finder)
        except ValueError:
            pass
