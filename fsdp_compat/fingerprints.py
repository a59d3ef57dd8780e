"""Forward compatibility by fingerprint: patch a release newer than the tested range when what we replace is unchanged.

An adapter's range ends at the newest release it was tested on, yet most framework releases leave the few functions
fsdp-compat replaces untouched. For every replacement of a tested release this module records a *fingerprint*: a
hash of the replaced definition's syntax tree (docstrings, comments and positions left out, so formatting and
documentation edits do not count), a hash of its signature alone (to say which part changed), and the sorted list of
modules that bind the name with ``from <module> import <name>`` (the by-name importers the transaction must rebind).
The recorded fingerprints live in ``fingerprints.json`` next to this module, written by a command in the test envs
(``python -m fsdp_compat.fingerprints record``), never typed by hand.

On a release newer than the newest tested one, :func:`judge` recomputes the fingerprints and compares: equal means
the tested row applies unchanged (the adapter patches and says so); any difference is named, and the adapter stands
aside. Everything is read from source files, found without importing anything (``sys.modules`` where loaded, else the
top-level package's ``find_spec``), so ``fsdp-compat doctor`` can judge too, and the gate costs a few file reads when
the trigger module loads. Loaded only when a gate decision needs it: never at interpreter start.
"""

from __future__ import annotations

import ast
import hashlib
import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from fsdp_compat import switches

__all__ = ["DATA", "Verdict", "compute", "judge", "locate", "main", "matching", "recorded", "release", "targets_of"]

#: The recorded fingerprints: {distribution: {version: {"module:name": {"code", "signature", "importers", "watched"}}}}
DATA = Path(__file__).with_name("fingerprints.json")

ABSENT = "absent"  #: the name is not defined in the module (an ``optional`` replacement, or a removed function)
NO_SOURCE = "no-source"  #: the module's source file could not be found or read (a sourceless install)

Target = tuple[str, str, Sequence[str]]  # (module, name, declared by-name importers)

_trees: dict[str, ast.Module | None] = {}
_verdicts: dict[tuple[str, str, str, str], Verdict] = {}
_data: dict[str, dict[str, Any]] = {}


def clear_cache() -> None:
    """Forget parsed sources, verdicts and the loaded data file (tests rewrite all three)."""
    _trees.clear()
    _verdicts.clear()
    _data.clear()


# ------------------------------------------------------------------------------------------------ finding source


def locate(module: str) -> Path | None:
    """The source file of ``module`` without importing it: the loaded module's file, else the file under the
    top-level package's search locations (``find_spec`` of a top-level name imports nothing)."""
    loaded = sys.modules.get(module)
    origin = getattr(loaded, "__file__", None) if loaded is not None else None
    if origin:
        return Path(origin) if origin.endswith(".py") else None
    top, _, rest = module.partition(".")
    package = sys.modules.get(top)
    locations = list(getattr(package, "__path__", None) or [])
    if package is None:
        import importlib.util

        try:
            spec = importlib.util.find_spec(top)
        except (ImportError, ValueError):
            return None
        if spec is None:
            return None
        if spec.submodule_search_locations is None:
            return Path(spec.origin) if not rest and spec.origin and spec.origin.endswith(".py") else None
        locations = list(spec.submodule_search_locations)
    parts = rest.split(".") if rest else []
    for location in locations:
        base = Path(location, *parts)
        for candidate in (base / "__init__.py", base.with_name(base.name + ".py") if parts else None):
            if candidate is not None and candidate.is_file():
                return candidate
    return None


def _tree(path: Path | None) -> ast.Module | None:
    """The parsed source of ``path`` (cached per process), or None where it cannot be read or parsed."""
    if path is None:
        return None
    key = str(path)
    if key not in _trees:
        try:
            _trees[key] = ast.parse(path.read_bytes(), filename=key)
        except (OSError, SyntaxError, ValueError):
            _trees[key] = None
    return _trees[key]


# ------------------------------------------------------------------------------------------- the normalised tree


def _module_level(body: list[ast.stmt]) -> Iterable[ast.stmt]:
    """Statements that run at the level of ``body`` (into ``if``/``try``/``with`` blocks, not into definitions)."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, (ast.If, ast.Try, ast.With, ast.AsyncWith)) or type(stmt).__name__ == "TryStar":
            for name in ("body", "orelse", "finalbody"):
                yield from _module_level(getattr(stmt, name, []) or [])
            for handler in getattr(stmt, "handlers", []) or []:
                yield from _module_level(handler.body)


def _defines(stmt: ast.stmt, name: str) -> bool:
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return stmt.name == name
    if isinstance(stmt, ast.Assign):
        return any(isinstance(t, ast.Name) and t.id == name for t in stmt.targets)
    if isinstance(stmt, (ast.AnnAssign, ast.AugAssign)):
        return isinstance(stmt.target, ast.Name) and stmt.target.id == name
    return False


def _definitions(tree: ast.Module, name: str) -> list[ast.stmt]:
    """Every statement that binds ``name`` at module level (``Class.attr``: in the class body), in source order."""
    owner, dot, attr = name.rpartition(".")
    body: list[ast.stmt] = tree.body
    if dot:
        classes = [s for s in _module_level(tree.body) if isinstance(s, ast.ClassDef) and s.name == owner]
        body = [stmt for cls in classes for stmt in cls.body]
    return [stmt for stmt in _module_level(body) if _defines(stmt, attr)]


def _without_docstring(body: list[Any]) -> list[Any]:
    first = body[0] if body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        return body[1:]
    return body


def _canonical(node: Any) -> str:
    """A dump of the tree that leaves out positions, docstrings, type comments and empty or None fields: unlike
    ``ast.dump``, whose defaults changed (3.13 drops empty fields) and whose nodes grew fields (3.12's empty
    ``type_params``), it does not change with the Python that runs it for the same code (recorded on 3.11)."""
    if isinstance(node, ast.AST):
        parts = []
        for name in node._fields:
            if name == "type_comment":
                continue
            value = getattr(node, name, None)
            if name == "body" and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                value = _without_docstring(value)
            if value is None or (isinstance(value, list) and not value):
                continue
            parts.append(f"{name}={_canonical(value)}")
        return f"{type(node).__name__}({','.join(parts)})"
    if isinstance(node, list):
        return "[" + ",".join(_canonical(item) for item in node) + "]"
    return repr(node)


def _signature(stmt: ast.stmt) -> list[Any]:
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return [stmt.decorator_list, stmt.args, stmt.returns]
    if isinstance(stmt, ast.ClassDef):
        return [stmt.decorator_list, stmt.bases, stmt.keywords]
    return [stmt]  # an assignment: what it binds is its whole "signature"


def _digest(nodes: Any) -> str:
    return hashlib.sha256(_canonical(nodes).encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------------- importers


def _package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _binding(tree: ast.Module, importer: str, path: Path, sources: set[str], name: str) -> str | None:
    """How ``importer`` binds ``name`` from one of ``sources`` at module level: ``importer``, ``importer (as x)``,
    or None."""
    for stmt in _module_level(tree.body):
        if not isinstance(stmt, ast.ImportFrom):
            continue
        source = stmt.module or ""
        if stmt.level:
            base = _package_of(importer, path).split(".")
            base = base[: len(base) - (stmt.level - 1)] if stmt.level > 1 else base
            source = ".".join([*base, source] if source else base)
        if source not in sources:
            continue
        for alias in stmt.names:
            if alias.name == name:
                return importer if alias.asname in (None, name) else f"{importer} (as {alias.asname})"
    return None


def _candidates(module: str, path: Path, watched: Iterable[str]) -> dict[str, Path]:
    """Where a by-name importer is looked for: the declared importers and every module of the replaced module's own
    package (a new importer usually sits next to the definer, as ``transformers.distributed.mixin`` does)."""
    package = _package_of(module, path)
    found: dict[str, Path] = {}
    for sibling in sorted(path.parent.glob("*.py")):
        name = package if sibling.name == "__init__.py" else f"{package}.{sibling.stem}"
        found[name] = sibling
    for name in watched:
        where = locate(name)
        if where is not None:
            found[name] = where
    found.pop(module, None)
    return found


def _importers(module: str, path: Path, name: str, watched: Iterable[str]) -> list[str]:
    """The candidates that bind ``name`` by name, from ``module`` or through one that re-exports it (accelerate's
    ``accelerator`` imports ``fsdp2_prepare_model`` from ``accelerate.utils``, which imports it from ``fsdp_utils``)."""
    needle = name.encode()
    trees: dict[str, tuple[ast.Module, Path]] = {}
    for importer, where in _candidates(module, path, watched).items():
        try:
            if needle not in where.read_bytes():  # cheap: most candidates never mention the name
                continue
        except OSError:
            continue
        tree = _tree(where)
        if tree is not None:
            trees[importer] = (tree, where)
    sources, found = {module}, {}
    while True:
        new = {}
        for importer, (tree, where) in trees.items():
            if importer not in found:
                binding = _binding(tree, importer, where, sources, name)
                if binding is not None:
                    new[importer] = binding
        if not new:
            return sorted(found.values())
        found.update(new)
        sources |= {importer for importer, binding in new.items() if binding == importer}


# -------------------------------------------------------------------------------------------------- fingerprints


def fingerprint(module: str, name: str, watched: Sequence[str] = ()) -> dict[str, Any]:
    """The fingerprint of ``module.name`` as installed: code and signature hashes, by-name importers."""
    path = locate(module)
    tree = _tree(path)
    record: dict[str, Any] = {"watched": sorted(watched)}
    if tree is None or path is None:
        return {"code": NO_SOURCE, "signature": NO_SOURCE, "importers": [], **record}
    found = _definitions(tree, name)
    if not found:
        return {"code": ABSENT, "signature": ABSENT, "importers": [], **record}
    importers = [] if "." in name else _importers(module, path, name, watched)  # a method: no by-name binding
    return {
        "code": _digest(found),
        "signature": _digest([_signature(s) for s in found]),
        "importers": importers,
        **record,
    }


def compute(targets: Iterable[Target]) -> dict[str, dict[str, Any]]:
    """``{"module:name": fingerprint}`` for every target."""
    return {f"{module}:{name}": fingerprint(module, name, watched) for module, name, watched in targets}


def targets_of(replacements: Iterable[Any]) -> list[Target]:
    """The targets of an adapter row's replacements (:class:`fsdp_compat.patching.Replacement`)."""
    return [(r.module, r.name, tuple(r.importers)) for r in replacements]


def differences(before: dict[str, dict[str, Any]], now: dict[str, dict[str, Any]]) -> list[str]:
    """What changed, one short phrase per difference (empty: unchanged)."""
    out = []
    for key in sorted(set(before) | set(now)):
        label = key.replace(":", ".")
        old, new = before.get(key), now.get(key)
        if old is None or new is None:
            out.append(f"{label}: {'not recorded' if old is None else 'not replaced by this row any more'}")
            continue
        if new["code"] in (ABSENT, NO_SOURCE) and new["code"] != old["code"]:
            out.append(f"{label}: {'no longer defined' if new['code'] == ABSENT else 'source not readable'}")
        elif new["signature"] != old["signature"]:
            out.append(f"{label}: signature changed")
        elif new["code"] != old["code"]:
            out.append(f"{label}: body changed")
        if new["importers"] != old["importers"]:
            added = sorted(set(new["importers"]) - set(old["importers"]))
            gone = sorted(set(old["importers"]) - set(new["importers"]))
            change = ", ".join([*(f"+{m}" for m in added), *(f"-{m}" for m in gone)])
            out.append(f"by-name importers of {label} changed ({change})")
    return out


# ---------------------------------------------------------------------------------------------------- data file


def load(path: Path | None = None) -> dict[str, Any]:
    """The recorded data (cached)."""
    where = str(path or DATA)
    if where not in _data:
        try:
            _data[where] = json.loads(Path(where).read_text())
        except FileNotFoundError:
            _data[where] = {}
    return _data[where]


def recorded(distribution: str, path: Path | None = None) -> dict[str, dict[str, Any]]:
    """version -> fingerprints recorded for ``distribution``."""
    return dict(load(path).get(distribution, {}))


def release(raw: str) -> str:
    """The release a version string names, without its local suffix (``2.13.0+cpu`` and ``2.13.0+cu128`` are one
    release, ``2.13.0``: a local build of the same source). A string that is not a version is kept as it is."""
    try:
        return Version(raw).public
    except InvalidVersion:
        return raw


def matching(distribution: str, now: dict[str, dict[str, Any]], data: dict[str, Any] | None = None) -> list[str]:
    """The recorded releases of ``distribution`` whose fingerprints equal ``now``: the code decides, not the version
    string (an unrecorded release over recorded code, a local build of a recorded one)."""
    releases = (load() if data is None else data).get(distribution, {})
    return [raw for raw, before in releases.items() if not differences(before, now)]


def write(data: dict[str, Any], path: Path | None = None) -> None:
    where = Path(path or DATA)
    where.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    _data.pop(str(where), None)


# ------------------------------------------------------------------------------------------------------ verdict


@dataclass(frozen=True)
class Verdict:
    """The judgement on a release newer than the tested range: ``basis`` is the newest tested release compared
    with (None: nothing recorded), ``changes`` what differs from it (empty: unchanged, so its row applies)."""

    version: str
    basis: str | None
    changes: list[str] = field(default_factory=list)

    @property
    def unchanged(self) -> bool:
        return self.basis is not None and not self.changes

    def describe(self) -> str:
        if self.unchanged:
            return f"patched by fingerprint (unchanged from {self.basis})"
        return f"left alone: {'; '.join(self.changes)}"


def newest_tested(distribution: str, spec: str, path: Path | None = None) -> Version | None:
    """The newest release inside ``spec`` with recorded fingerprints."""
    tested = []
    for raw in recorded(distribution, path):
        try:
            version = Version(raw)
        except InvalidVersion:
            continue
        if SpecifierSet(spec).contains(version, prereleases=True):
            tested.append(version)
    return max(tested, default=None)


def judge(
    distribution: str,
    version: Version,
    spec: str,
    targets: Sequence[Target] | None = None,
    path: Path | None = None,
) -> Verdict | None:
    """The verdict on ``version`` when it is newer than every tested release of ``spec`` with fingerprints (else
    None: the version gate decides as before). ``targets``: what the adapter's row for the newest tested release
    replaces; they must be what was recorded for it (a stale data file is a difference, never a guess)."""
    if SpecifierSet(spec).contains(version, prereleases=True):
        return None
    key = (distribution, str(version), spec, repr(targets))
    if key in _verdicts:
        return _verdicts[key]
    basis = newest_tested(distribution, spec, path)
    if basis is None or version <= basis:  # nothing recorded, or an older release: the range decides
        return None
    before = recorded(distribution, path)[str(basis)]
    changes: list[str] = []
    if targets is not None:
        recorded_targets = {(k, tuple(v.get("watched", []))) for k, v in before.items()}
        row_targets = {(f"{m}:{n}", tuple(sorted(w))) for m, n, w in targets}
        if recorded_targets != row_targets:
            changes.append(f"fingerprints.json is stale for {distribution} {basis} (re-record it)")
    if not changes:
        watched = [(k.partition(":")[0], k.partition(":")[2], v.get("watched", [])) for k, v in before.items()]
        changes = differences(before, compute(watched))
    verdict = Verdict(str(version), str(basis), changes)
    _verdicts[key] = verdict
    return verdict


# ---------------------------------------------------------------------------------------------------------- CLI


def _installed_rows(names: Sequence[str]) -> list[tuple[str, str, list[Target]]]:
    """(distribution, version, targets of its row) for every installed, supported distribution of the index."""
    import importlib
    from importlib import metadata

    from fsdp_compat.adapter_index import ADAPTERS

    rows = []
    for entry in list(ADAPTERS.values()):
        for distribution, (_, spec) in entry.distributions.items():
            if names and distribution not in names:
                continue
            try:
                raw = metadata.version(distribution)
            except metadata.PackageNotFoundError:
                continue
            if not SpecifierSet(spec).contains(Version(raw), prereleases=True):
                print(f"{distribution} {raw}: outside the tested range {spec}; extend the index row first, skipped")
                continue
            try:
                with switches.switched(switches.SWITCH, "off"):  # importing an adapter module must patch nothing here
                    adapter = importlib.import_module(entry.module).ADAPTER
            except Exception as exc:  # another adapter's module may be broken: record the rest
                print(f"{distribution} {raw}: {entry.module} does not import ({type(exc).__name__}: {exc}), skipped")
                continue
            row = adapter.release_for(distribution, Version(raw))
            if row is None:
                print(f"{distribution} {raw}: no row of {entry.module}'s table matches, skipped")
                continue
            rows.append((distribution, raw, targets_of(row.replacements)))
    return rows


def _closest(releases: dict[str, Any], raw: str) -> str | None:
    """The recorded release to name differences against: the same release, else the newest one not newer than
    ``raw``, else the oldest."""
    known = sorted((Version(v), v) for v in releases if _is_version(v))
    if not known:
        return None
    version = Version(raw)
    same = [v for parsed, v in known if parsed.public == version.public]
    older = [v for parsed, v in known if parsed <= version]
    return (same or older or [known[0][1]])[-1]


def _is_version(raw: str) -> bool:
    try:
        Version(raw)
    except InvalidVersion:
        return False
    return True


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fsdp_compat.fingerprints record|check|show [DISTRIBUTION ...] [--file PATH]``."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m fsdp_compat.fingerprints", description=main.__doc__)
    parser.add_argument("command", choices=("record", "check", "show"))
    parser.add_argument("distributions", nargs="*", help="only these distributions (default: every installed one)")
    parser.add_argument("--file", type=Path, default=None, help=f"the data file (default: {DATA})")
    args = parser.parse_args(argv)
    if args.command == "show":
        print(json.dumps(load(args.file), indent=1, sort_keys=True))
        return 0
    rows = _installed_rows(args.distributions)
    if not rows:
        print("no installed distribution inside a tested range")
        return 1
    data = json.loads(json.dumps(load(args.file)))  # a copy
    failed = 0
    for distribution, raw, targets in rows:
        now = compute(targets)
        releases = data.setdefault(distribution, {}) if args.command == "record" else data.get(distribution, {})
        if args.command == "record":
            for old in [v for v in releases if v != release(raw) and release(v) == release(raw)]:
                del releases[old]  # recorded from another local build of the same release
            releases[release(raw)] = now
            print(f"recorded {distribution} {release(raw)}: " + ", ".join(f"{k} {v['code']}" for k, v in now.items()))
            continue
        if not releases and not args.distributions:
            print(f"{distribution} {raw}: no fingerprint recorded for any release (not checked)")
            continue
        same = matching(distribution, now, data)
        if same:
            print(f"{distribution} {raw}: matches the fingerprint recorded for {', '.join(sorted(same, key=Version))}")
            continue
        failed += 1
        basis = _closest(releases, raw)
        changes = differences(releases[basis], now) if basis is not None else ["not recorded"]
        print(f"{distribution} {raw}: " + (f"differs from {basis}: " if basis else "") + "; ".join(changes))
    if args.command == "record":
        write(data, args.file)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
