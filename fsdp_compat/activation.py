"""The :class:`Adapter`: gate versions, run one all-or-nothing patch transaction per distribution, log.

An adapter module is a declaration: its release table (distribution and version range -> replacements, by-name
importers, repairs, conditions) as :class:`Release` rows, the replacement factories beside it, and one last line
that builds the adapter and activates it::

    RELEASES = (Release(">=5.20", (Replacement("transformers.integrations.fsdp", "fn", make_fn),)),)

    ADAPTER = declare("transformers", RELEASES)
    patch, unpatch, is_patched = ADAPTER.patch, ADAPTER.unpatch, ADAPTER.is_patched

What must be known before the module is imported (its trigger modules, the supported range) is its row in the
index :data:`fsdp_compat.adapters.ADAPTERS`. Everything else lives here once: the version gate
(``FSDP_COMPAT_FORCE``), the policy (``FSDP_COMPAT_POLICY``), the transaction (:mod:`fsdp_compat.patching`, which
also rebinds late importers through the import-hook engine of :mod:`fsdp_compat._autoload`), activation on import
of the trigger modules (``FSDP_COMPAT``) and its one record (who activated each distribution: ``pth-hook``,
``import``, a framework's own hook, ``explicit``), exact restore on :meth:`Adapter.unpatch`, and the
``fsdp-compat: patched ...`` line: logged when a replacement is first *called* (the job uses what fsdp-compat
changed), not when its module is imported, and at most one such line per process
(:func:`fsdp_compat.log.announce_once`). Importing a framework's FSDP2 code without using it prints nothing.

Each distribution of an adapter is patched on its own, when its trigger module is imported (skyrl-train and skyrl
installed side by side are two transactions and two log lines). Imports no torch and no framework.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import threading
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import TYPE_CHECKING, Any, ClassVar

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from fsdp_compat import _autoload, switches
from fsdp_compat._autoload import (
    ENV_AUTOLOAD,
    ENV_FORCE,
    ENV_LOG,
    ENV_POLICY,
    ENV_SWITCH,
    PREFIX,
    autoload_enabled,
    automatic_activation_enabled,
    force_enabled,
)
from fsdp_compat.adapter_index import ADAPTERS, AdapterEntry
from fsdp_compat.errors import FsdpCompatError
from fsdp_compat.log import announce_once, logger
from fsdp_compat.patching import Applied, Patch, Reexport, Replacement, apply, import_modules
from fsdp_compat.policies import POLICY_NAMES, Policy, resolve_policy

if TYPE_CHECKING:  # loaded only when a release newer than the tested range is gated
    from fsdp_compat.fingerprints import Verdict

__all__ = [
    "ENV_AUTOLOAD",
    "ENV_FORCE",
    "ENV_LOG",
    "ENV_POLICY",
    "ENV_SWITCH",
    "PREFIX",
    "Adapter",
    "FsdpCompatWarning",
    "Reexport",
    "Release",
    "Replacement",
    "activate_on_import",
    "autoload_enabled",
    "automatic_activation_enabled",
    "declare",
    "force_enabled",
    "logger",
    "policy_from_env",
]

#: Adapters whose replacement announces itself when it changes something the job uses: the generic layer's
#: ``FSDPState._root_pre_forward`` runs at every FSDP2 root, with or without fsdp-compat's layer, so
#: :mod:`fsdp_compat.runtime.every_root` calls :func:`fsdp_compat.log.announce_once` when a root gets the layer.
SELF_ANNOUNCING = frozenset({"fsdp2"})


class FsdpCompatWarning(UserWarning):
    """An adapter did not patch (unsupported version, failed replacement) or patched despite a risk."""


def policy_from_env() -> str:
    """The policy that ``FSDP_COMPAT_POLICY`` names (default "auto"); a bad name raises, listing the valid."""
    return switches.choice(ENV_POLICY, POLICY_NAMES, "auto", what="a policy name", strict=True)


# ----------------------------------------------------------------------------------------------- declarations


@dataclass(frozen=True)
class Release:
    """One row of an adapter's table: for ``versions`` (of ``distribution``, or of any of the adapter's
    distributions when None), apply these replacements and repairs as one transaction."""

    versions: str
    replacements: tuple[Replacement, ...]
    repairs: tuple[Reexport, ...] = ()
    distribution: str | None = None

    def matches(self, distribution: str, version: Version) -> bool:
        if self.distribution not in (None, distribution):
            return False
        return SpecifierSet(self.versions).contains(version, prereleases=True)

    @property
    def patch(self) -> Patch:
        return Patch(self.replacements, self.repairs)

    @property
    def name(self) -> str:
        """The (first) replaced name."""
        return self.replacements[0].name

    @property
    def importers(self) -> tuple[str, ...]:
        """The by-name importers of the (first) replaced name."""
        return self.replacements[0].importers


@dataclass
class _State:
    """One distribution patched in this process."""

    applied: Applied
    version: Version
    activated_by: str


# --------------------------------------------------------------------------------------------------- adapters


class Adapter:
    """Gates versions and runs one all-or-nothing transaction per distribution; an adapter module only declares.

    ``key`` names the row of the index :data:`fsdp_compat.adapters.ADAPTERS` (trigger modules, supported
    versions); ``releases`` is the release table. ``patch`` is idempotent, thread-safe and all-or-nothing per
    distribution; ``unpatch`` puts the exact original objects back wherever the replacement was bound and undoes
    the repairs. (Tests subclass it to pin a version; a subclass may set ``key`` and ``releases`` as attributes.)
    """

    key: ClassVar[str] = ""
    releases: ClassVar[tuple[Release, ...]] = ()

    def __init__(self, key: str = "", releases: tuple[Release, ...] = ()) -> None:
        if key:
            self.key = key  # type: ignore[misc]
        if releases:
            self.releases = releases  # type: ignore[misc]
        self._lock = threading.RLock()
        self._state: dict[str, _State] = {}
        self._warned: set[str] = set()
        self._logged: set[str] = set()
        self._basis: dict[str, Version] = {}  # distribution -> the tested release whose row a newer one uses

    # -- the declaration ---------------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self.key

    @property
    def entry(self) -> AdapterEntry:
        return ADAPTERS[self.key]

    @property
    def supported(self) -> dict[str, str]:
        """distribution -> supported versions (from the index row)."""
        return self.entry.supported

    @property
    def trigger_modules(self) -> tuple[str, ...]:
        return tuple(self.entry.triggers)

    def version_of(self, distribution: str) -> Version | None:
        """The installed version of ``distribution`` (importlib.metadata: no framework import), else None."""
        try:
            raw = metadata.version(distribution)
        except metadata.PackageNotFoundError:
            return None
        try:
            return Version(raw)
        except InvalidVersion:
            self._warn_once(f"version:{distribution}", f"{distribution} reports an invalid version {raw!r}.")
            return None

    def installed(self) -> list[tuple[str, Version]]:
        """Every installed distribution of this adapter with its version, in index order."""
        found = []
        for distribution in self.supported:
            version = self.version_of(distribution)
            if version is not None:
                found.append((distribution, version))
        return found

    def release_for(self, distribution: str, version: Version) -> Release | None:
        """The first table row for this release, else None."""
        return next((row for row in self.releases if row.matches(distribution, version)), None)

    def plan(self, distribution: str, version: Version) -> Patch:
        """What one transaction does for this release (the table row; an adapter may refine it)."""
        basis = self._basis.get(distribution)
        row = self.release_for(distribution, basis if basis is not None else version)
        if row is None:
            raise FsdpCompatError(f"{distribution} {version}: no row of the {self.key} adapter's table matches.")
        return row.patch

    def policy(self) -> Policy:
        """The policy the replacements use: ``FSDP_COMPAT_POLICY`` read and resolved once per transaction (an adapter's
        replacement receives this object, not the name)."""
        return resolve_policy(policy_from_env())

    def is_supported(self, distribution: str, version: Version) -> bool:
        """Whether ``version`` of ``distribution`` falls in the declared range (pre-releases included)."""
        spec = self.supported.get(distribution)
        if spec is None:
            return False
        try:
            return SpecifierSet(spec).contains(version, prereleases=True)
        except InvalidSpecifier as exc:
            raise FsdpCompatError(f"the {self.key} index row: {distribution} {spec!r}: {exc}") from exc

    def fingerprint_verdict(self, distribution: str, version: Version) -> Verdict | None:
        """For a release newer than the tested range: whether what this adapter replaces is unchanged from the
        newest tested release (:mod:`fsdp_compat.fingerprints`, loaded only here); None for any other version.
        Never raises: a failure to judge is a difference (stand aside), never a patch."""
        spec = self.supported.get(distribution)
        if spec is None:
            return None
        from fsdp_compat import fingerprints

        try:
            newest = fingerprints.newest_tested(distribution, spec)
            row = self.release_for(distribution, newest) if newest is not None else None
            targets = fingerprints.targets_of(row.replacements) if row is not None else None
            return fingerprints.judge(distribution, version, spec, targets)
        except Exception as exc:
            failure = f"the fingerprint check failed: {type(exc).__name__}: {exc}"
            return fingerprints.Verdict(str(version), None, [failure])

    def supported_text(self) -> str:
        return "; ".join(f"{dist} {spec}" for dist, spec in self.supported.items()) or "nothing declared"

    # -- state ----------------------------------------------------------------------------------------------

    def is_patched(self, distribution: str | None = None) -> bool:
        with self._lock:
            return distribution in self._state if distribution else bool(self._state)

    def patched(self) -> dict[str, tuple[Version, str, str]]:
        """distribution -> (version, activated by, policy) for every distribution patched now."""
        with self._lock:
            return {d: (s.version, s.activated_by, s.applied.policy.name) for d, s in self._state.items()}

    def _first(self) -> _State | None:
        with self._lock:
            return next(iter(self._state.values()), None)

    @property
    def activated_by(self) -> str | None:
        """How the first patched distribution was activated (``pth-hook``, ``import``, ``explicit``, ...)."""
        state = self._first()
        return state.activated_by if state else None

    @property
    def version(self) -> tuple[str, Version] | None:
        with self._lock:
            return next(((d, s.version) for d, s in self._state.items()), None)

    @property
    def policy_name(self) -> str | None:
        state = self._first()
        return state.applied.policy.name if state else None

    def describe(self) -> list[str]:
        """One line per binding now replaced (``verl.utils.fsdp_utils.x -> fsdp-compat (policy auto)``) or repaired."""
        with self._lock:
            return [line for state in self._state.values() for line in state.applied.lines()]

    # -- patch / unpatch --------------------------------------------------------------------------------

    def patch(self, *, activated_by: str = "explicit", distribution: str | None = None) -> bool:
        """Patch ``distribution`` (default: every installed one). Returns True when all of them are patched.

        An unknown or unsupported version warns once and patches nothing unless ``FSDP_COMPAT_FORCE=1``. Any
        other failure rolls back that distribution's transaction; an explicit call re-raises it, an automatic
        one warns. An explicit call imports the modules it patches; an automatic one runs when they are loaded.
        """
        if distribution is not None:
            return self._patch_one(distribution, activated_by)
        found = [d for d in self.supported if self.version_of(d) is not None]
        if not found:
            self._warn_missing(", ".join(self.supported))
            return False
        return all([self._patch_one(d, activated_by) for d in found])

    def unpatch(self, distribution: str | None = None) -> None:
        """Put the exact original objects back in the definer and every module that holds the replacement."""
        with self._lock:
            names = [distribution] if distribution else list(self._state)
            for name in names:
                state = self._state.pop(name, None)
                if state is None:
                    continue
                for binding in state.applied.restore():
                    logger.warning("%s was replaced again after fsdp-compat patched it; left as it is", binding)
                logger.debug("unpatched %s %s", name, state.version)

    def on_trigger(self, trigger: str, source: str) -> None:
        """A trigger module finished importing: patch its distribution (automatic: never raises)."""
        if not automatic_activation_enabled():
            return
        distribution = self.entry.activating.get(trigger)
        if distribution is None:
            return
        try:
            self._patch_one(distribution, source)
        except Exception:  # _patch_one warns on automatic failures; this is a last line of defence
            logger.warning("activation after importing %s failed", trigger, exc_info=True)

    def activate(self, source: str) -> None:
        """Patch every distribution whose trigger is loaded; watch the other triggers. Never raises."""
        for trigger, distribution in self.entry.activating.items():
            try:
                if trigger in sys.modules:
                    self._patch_one(distribution, source)
                else:
                    _autoload.hooks().watch(
                        trigger,
                        ("fsdp-compat adapter", self.key),
                        lambda module, source=source: self.on_trigger(module.__name__, source),
                        now=False,
                    )
            except Exception:
                logger.warning("%s adapter: activation for %s failed", self.key, distribution, exc_info=True)

    # -- internals --------------------------------------------------------------------------------------

    def _patch_one(self, distribution: str, activated_by: str) -> bool:
        if self.is_patched(distribution):
            return True
        explicit = activated_by == "explicit"
        version = self._gate(distribution)
        if version is None:
            return False
        try:
            policy = self.policy()
            patch = self.plan(distribution, version)
            import_modules(patch)  # outside the lock: an import may fire other hooks (and this one)
        except Exception as exc:
            return self._failed(distribution, exc, explicit, rolled_back=False)
        if self.key not in SELF_ANNOUNCING:
            patch = self._announcing(patch, distribution)
        with self._lock:
            if distribution in self._state:
                return True
            try:
                applied = apply(patch, policy)
            except Exception as exc:
                return self._failed(distribution, exc, explicit, rolled_back=True)
            self._state[distribution] = _State(applied, version, activated_by)
        self._log_patched(distribution)
        return True

    def _gate(self, distribution: str) -> Version | None:
        version = self.version_of(distribution)
        if version is None:
            self._warn_missing(distribution)
            return None
        if self.is_supported(distribution, version):
            return version
        verdict = self.fingerprint_verdict(distribution, version)
        if verdict is not None and verdict.unchanged:
            self._basis[distribution] = Version(verdict.basis)  # named again in the line that announces the patch
            logger.debug(
                "%s %s is newer than the tested range (%s); what fsdp-compat replaces is unchanged from %s "
                "(fingerprint), patching (logged at INFO when first used)",
                distribution,
                version,
                self.supported_text(),
                verdict.basis,
            )
            return version
        if force_enabled():
            self._warn_once(
                f"forced:{distribution}:{version}",
                f"{self.key} adapter: {distribution} {version} is outside the supported range "
                f"({self.supported_text()}); patching anyway because {ENV_FORCE}=1.",
            )
            return version
        if verdict is not None:
            self._warn_once(
                f"fingerprint:{distribution}:{version}",
                f"{self.key} adapter: {distribution} {version} is newer than the tested range "
                f"({self.supported_text()}) and what fsdp-compat replaces may have changed"
                f"{f' since {verdict.basis}' if verdict.basis else ''}: {'; '.join(verdict.changes)}; nothing was "
                f"patched (the framework runs as without fsdp-compat). Set {ENV_FORCE}=1 to patch anyway.",
            )
            return None
        self._warn_once(
            f"unsupported:{distribution}:{version}",
            f"{self.key} adapter: {distribution} {version} is not supported (supported: "
            f"{self.supported_text()}); nothing was patched. Set {ENV_FORCE}=1 to patch anyway.",
        )
        return None

    def _warn_missing(self, what: str) -> None:
        self._warn_once(
            f"missing:{what}",
            f"{self.key} adapter: no installed distribution of {what} was found (importlib.metadata), so its "
            f"version is unknown; nothing was patched. Supported: {self.supported_text()}. Install the "
            "framework as a distribution (pip install ...).",
        )

    def _failed(self, distribution: str, exc: Exception, explicit: bool, *, rolled_back: bool) -> bool:
        if explicit:
            raise exc
        what = "rolled back; nothing stays patched" if rolled_back else "nothing was patched"
        self._warn_once(
            f"failed:{distribution}:{type(exc).__name__}:{exc}",
            f"{self.key} adapter could not patch {distribution} ({what}): {type(exc).__name__}: {exc}",
        )
        logger.debug("%s: patch failure", distribution, exc_info=exc)
        return False

    def _warn_once(self, key: str, message: str) -> None:
        with self._lock:
            if key in self._warned:
                return
            self._warned.add(key)
        warnings.warn(f"{PREFIX} {message}", FsdpCompatWarning, stacklevel=4)

    def _announcing(self, patch: Patch, distribution: str) -> Patch:
        """``patch`` with each replacement's factory wrapped so that the replacement's first call announces this
        distribution (:meth:`_announce`): the job uses what fsdp-compat changed."""

        def wrap(make: Callable[[Any, Policy], Any]) -> Callable[[Any, Policy], Any]:
            def make_announcing(original: Any, policy: Policy) -> Any:
                return _announce_on_first_call(make(original, policy), lambda: self._announce(distribution))

            return make_announcing

        replacements = tuple(dataclasses.replace(rep, make=wrap(rep.make)) for rep in patch.replacements)
        return Patch(replacements, patch.repairs)

    def _patched_line(self, distribution: str, state: _State) -> str:
        """What this distribution's transaction installed, as the INFO line says it (deferred replacements that are
        not in place yet are left out: the line names only what is installed)."""
        installed = [line.split(" -> ")[0] for line in state.applied.lines() if " (deferred: " not in line]
        how = f"(policy {state.applied.policy.name}, activated by {state.activated_by}): "
        what = "; ".join(installed) or "nothing to replace"
        basis = self._basis.get(distribution)
        if basis is None:
            return f"patched {distribution} {state.version} {how}{what}"
        return (
            f"{distribution} {state.version} is newer than the tested range ({self.supported_text()}); what "
            f"fsdp-compat replaces is unchanged from {basis} (fingerprint), patched {how}{what}"
        )

    def _announce(self, distribution: str) -> None:
        """The job used this distribution's replacement: say what was patched, once per distribution, as the
        process's one INFO line if it is the first (:func:`fsdp_compat.log.announce_once`). Never raises."""
        try:
            with self._lock:
                state = self._state.get(distribution)
                if state is None or distribution in self._logged:
                    return
                self._logged.add(distribution)
                line = self._patched_line(distribution, state)
            announce_once("%s", line)
        except Exception:  # runs inside the user's call of the replacement
            logger.debug("announcing %s failed", distribution, exc_info=True)

    def _log_patched(self, distribution: str) -> None:
        """At patch time: DEBUG only where a replacement announces its first call (or the adapter announces itself:
        :data:`SELF_ANNOUNCING`); a transaction with nothing callable to watch (repairs only) is announced now."""
        with self._lock:
            state = self._state.get(distribution)
            if state is None:
                return
            watched = bool(state.applied.pending) or any(
                getattr(rec.new, _ANNOUNCER, False) for rec in state.applied.bound
            )
            line = self._patched_line(distribution, state)
        if self.key in SELF_ANNOUNCING or watched:
            logger.debug("%s (logged at INFO when first used)", line)
        else:
            self._announce(distribution)


_ANNOUNCER = "__fsdp_compat_announcer__"


def _announce_on_first_call(new: Any, announce: Callable[[], None]) -> Any:
    """``new`` (a replacement) wrapped to call ``announce`` before its first call; anything but a plain function is
    returned as it is. The wrapper looks like ``new`` (name, marks, ``__wrapped__``: the framework's original)."""
    if not isinstance(new, types.FunctionType):
        return new
    called: list[bool] = []

    @functools.wraps(new)
    def first_call(*args: Any, **kwargs: Any) -> Any:
        if not called:
            called.append(True)
            announce()
        return new(*args, **kwargs)

    first_call.__wrapped__ = getattr(new, "__wrapped__", new)  # type: ignore[attr-defined]
    setattr(first_call, _ANNOUNCER, True)
    return first_call


# ------------------------------------------------------------------------------------------------- activation


def activate_on_import(adapter: Adapter, source: str | Callable[[], str] = "import") -> None:
    """Patch what is loaded now, the rest when it is imported: what importing an adapter module does.

    Does nothing when ``FSDP_COMPAT`` is off. Never raises: a failure warns and leaves the framework as is. The
    record of who activated it: ``pth-hook`` when the start-up hook imports the module, else ``source`` (a
    callable is asked, e.g. verl's adapter tells its entry point from ``external_lib``).
    """
    if not automatic_activation_enabled():
        logger.debug("%s adapter: automatic activation is off (%s)", adapter.key, ENV_SWITCH)
        return
    loaded_by = _autoload.activation_source()
    if loaded_by is None:
        loaded_by = source() if callable(source) else source
    adapter.activate(loaded_by)


def declare(key: str, releases: tuple[Release, ...], *, source: str | Callable[[], str] = "import") -> Adapter:
    """The last line of an adapter module: build the adapter for the index row ``key`` and activate it."""
    if key not in ADAPTERS:
        raise FsdpCompatError(f"no adapter {key!r} in fsdp_compat.adapters.ADAPTERS; add its row there first.")
    adapter = Adapter(key, releases)
    activate_on_import(adapter, source)
    return adapter
