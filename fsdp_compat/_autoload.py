"""The switches and fsdp-compat's one import-hook engine; what ``fsdp_compat.pth`` runs.

Everything here must stay cheap, because the installed ``.pth`` calls :func:`install` in every Python process of
the environment (SkyRL's Ray workers, verl's critic worker): this module imports only ``sys``, ``_thread`` (which
every interpreter has loaded already), the switch reader :mod:`fsdp_compat.switches` (``os`` and ``sys``) and the
adapter index :mod:`fsdp_compat.adapters` (constants only). Importing it has no side effect.

**The engine.** :class:`ImportHooks` is a single meta-path finder that answers only for module names somebody
watches (one dict lookup per import otherwise) and runs callbacks right after such a module has executed, before
the ``import`` statement that loaded it returns. It serves three clients:

- the ``.pth`` triggers: :func:`install` watches every adapter's trigger modules and, when one loads, imports the
  adapter module and lets it patch (``activated by pth-hook``);
- late triggers: an adapter imported before its framework watches the framework's trigger modules;
- late importers: a patched adapter watches the modules that bind the replaced name with ``from x import name``
  (and deferred replacements), so they are rebound the moment they load.

The adapters and their triggers come from :data:`fsdp_compat.adapters.ADAPTERS`, the index that lives with them.
"""

from __future__ import annotations

import _thread
import sys

import fsdp_compat.switches as switches
from fsdp_compat.adapter_index import ADAPTERS

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is not loaded at interpreter start; keep it that way
    from collections.abc import Callable
    from types import ModuleType

# ------------------------------------------------------------------------------------------------------ switches
# Read by fsdp_compat.switches, the one reader (one vocabulary of on and off); at start-up a value it does not
# understand is a warning and the default, never an error.

ENV_SWITCH = switches.SWITCH  #: off: no automatic activation at all (explicit patch() still works)
ENV_AUTOLOAD = switches.AUTOLOAD  #: off: only the .pth start-up hook is off
ENV_POLICY = switches.POLICY  #: the wrap policy the adapters use (default auto)
ENV_FORCE = switches.FORCE  #: on: patch a framework version outside the supported range
ENV_LOG = switches.LOG  #: quiet: drop the INFO lines
PREFIX = switches.PREFIX
warn = switches.warn


def automatic_activation_enabled() -> bool:
    """False when ``FSDP_COMPAT`` is off: no .pth hook, entry point or import-time patching."""
    return switches.flag(ENV_SWITCH, True)


def autoload_enabled() -> bool:
    """False when automatic activation is off or ``FSDP_COMPAT_AUTOLOAD`` is off (only the .pth hooks are off)."""
    return automatic_activation_enabled() and switches.flag(ENV_AUTOLOAD, True)


def force_enabled() -> bool:
    """``FSDP_COMPAT_FORCE`` on: patch an unknown or unsupported framework version anyway (with a warning)."""
    return switches.flag(ENV_FORCE, False)


def quiet() -> bool:
    """``FSDP_COMPAT_LOG=quiet`` (or off, or warning): INFO lines are dropped, warnings stay."""
    return switches.log_level() == "quiet"


# ------------------------------------------------------------------------------------------------------- engine


class _HookLoader:
    """Wraps the real loader of a watched module to run the callbacks right after the module executed."""

    def __init__(self, loader: object, hooks: ImportHooks) -> None:
        self._fsdp_compat_loader = loader
        self._fsdp_compat_hooks = hooks

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
        self._fsdp_compat_hooks.fire(module)  # type: ignore[arg-type]


class ImportHooks:
    """The meta-path finder: post-import callbacks per module name, keyed so that registering twice is a no-op.

    Callbacks stay registered (a module deleted from ``sys.modules`` and imported again fires them again); each
    decides for itself whether there is anything left to do. A callback that raises is reported and skipped: it
    never breaks the user's import.
    """

    def __init__(self) -> None:
        self._hooks: dict[str, dict[object, Callable[[ModuleType], None]]] = {}
        self._lock = _thread.allocate_lock()
        self._busy: set[tuple[int, str]] = set()

    # -- registration ------------------------------------------------------------------------------------

    def watch(self, name: str, key: object, callback: Callable[[ModuleType], None], *, now: bool = True) -> None:
        """Run ``callback(module)`` every time ``name`` finishes importing; at once too if loaded and ``now``."""
        with self._lock:
            self._hooks.setdefault(name, {})[key] = callback
        module = sys.modules.get(name)
        if now and module is not None and getattr(getattr(module, "__spec__", None), "_initializing", False) is False:
            self._call(name, callback, module)

    def unwatch(self, key: object, names: tuple[str, ...] | None = None) -> None:
        """Drop the callbacks registered under ``key`` (for ``names``, or everywhere)."""
        with self._lock:
            for name in list(self._hooks) if names is None else names:
                callbacks = self._hooks.get(name)
                if callbacks is not None:
                    callbacks.pop(key, None)
                    if not callbacks:
                        del self._hooks[name]

    def watched(self, key: object | None = None) -> list[str]:
        """The watched module names (that ``key`` watches, or any)."""
        with self._lock:
            return sorted(n for n, cbs in self._hooks.items() if key is None or key in cbs)

    def fire(self, module: ModuleType) -> None:
        name = getattr(module, "__name__", "")
        with self._lock:
            callbacks = list(self._hooks.get(name, {}).values())
        for callback in callbacks:
            self._call(name, callback, module)

    @staticmethod
    def _call(name: str, callback: Callable[[ModuleType], None], module: ModuleType) -> None:
        try:
            callback(module)
        except Exception as exc:  # runs inside the user's import: report, never raise
            warn(f"a hook on the import of {name} failed: {type(exc).__name__}: {exc}")

    # -- the finder protocol -----------------------------------------------------------------------------

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> object:
        if fullname not in self._hooks:
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
        spec.loader = _HookLoader(loader, self)  # type: ignore[union-attr]
        return spec

    def invalidate_caches(self) -> None:
        """Nothing cached here; present because importlib.invalidate_caches() calls it on every finder."""


_HOOKS: ImportHooks | None = None
_PTH_KEY = "fsdp-compat .pth"
_source = {"value": None}  # which automatic path is importing an adapter right now (read by activation)


def hooks() -> ImportHooks:
    """The process's one engine, first in ``sys.meta_path`` (created on first use)."""
    global _HOOKS
    engine = _HOOKS
    if engine is None:
        engine = _HOOKS = ImportHooks()
    if engine not in sys.meta_path:
        sys.meta_path.insert(0, engine)
    return engine


def activation_source() -> str | None:
    """``"pth-hook"`` while :func:`install`'s callback imports an adapter module, else None."""
    return _source["value"]


def _on_trigger(key: str) -> Callable[[ModuleType], None]:
    def activate(module: ModuleType) -> None:
        """Activate the adapter for the distribution whose trigger just loaded, by one call; never raises.

        Not loaded yet: importing the adapter module is the activation (its last line patches what is loaded,
        with ``pth-hook`` as the source). Loaded already (say by verl's entry point): its ``on_trigger``.
        """
        if not autoload_enabled():
            return
        trigger = getattr(module, "__name__", "?")
        try:
            entry = ADAPTERS[key]
            loaded = sys.modules.get(entry.module)
            if loaded is None:
                previous, _source["value"] = _source["value"], "pth-hook"
                try:
                    __import__(entry.module)
                finally:
                    _source["value"] = previous
                return
            on_trigger = getattr(getattr(loaded, "ADAPTER", None), "on_trigger", None)
            if callable(on_trigger):  # a module still initialising has no ADAPTER: its own last line activates
                on_trigger(trigger, "pth-hook")
        except Exception as exc:
            warn(f"the {key} adapter could not be activated after importing {trigger}: {type(exc).__name__}: {exc}")

    return activate


def is_installed() -> bool:
    """True when this process runs the start-up hook (its trigger watches sit in the engine)."""
    return _HOOKS is not None and _HOOKS in sys.meta_path and any(_HOOKS.watched((_PTH_KEY, k)) for k in ADAPTERS)


def install() -> bool:
    """Watch every adapter's trigger modules (what the .pth does); returns whether it is active. Never raises.

    Calling it again re-reads :data:`ADAPTERS`. A trigger imported before this call is activated now.
    """
    try:
        if not autoload_enabled():
            return False
        engine = hooks()
        for key, entry in ADAPTERS.items():
            for trigger in entry.activating:
                engine.watch(trigger, (_PTH_KEY, key), _on_trigger(key))
        return True
    except Exception as exc:
        warn(f"start-up hook not installed: {type(exc).__name__}: {exc}")
        return False


def uninstall() -> None:
    """Drop the start-up hook's watches (tests, or a process that wants no .pth activation from now on)."""
    engine = _HOOKS
    if engine is None:
        return
    for key in ADAPTERS:
        engine.unwatch((_PTH_KEY, key))
    if not engine.watched():
        try:  # noqa: SIM105
            sys.meta_path.remove(engine)
        except ValueError:
            pass
