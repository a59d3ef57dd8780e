"""What Python can tell from constants alone, and what an ``isinstance`` or name test guarantees where it guards.

The collector's first job, kept apart from its walk of the function body: names bound only to constant strings,
module-level constants, and the narrowing of names inside ``if isinstance(m, T):`` or ``if name == "..."``
(``Constants`` is a base of ``Collector``; the collector's ``__init__`` fills the state it reads).
"""

from __future__ import annotations

import ast
import builtins
import inspect
import types
from typing import Any

from fsdp_compat.analysis.names import MAX_CONSTS, MISSING
from fsdp_compat.analysis.refs import Ref, Refs


def is_builtin(func: ast.AST, names: str | frozenset[str], stored: set[str]) -> bool:
    """``func`` is a plain name of one of these builtins, not shadowed by a local of the function."""
    wanted = {names} if isinstance(names, str) else names
    return isinstance(func, ast.Name) and func.id in wanted and func.id not in stored


def count_stores(tree: ast.AST | list[Any], skip: ast.AST | None = None, declarations: bool = True) -> dict[str, int]:
    """How many places bind each name in ``tree`` (nested scopes included; ``skip``'s own parameters left out;
    ``global``/``nonlocal`` count as unknowably many with ``declarations``)."""
    own = set()
    if skip is not None and hasattr(skip, "args"):
        a = skip.args  # type: ignore[attr-defined]
        own = {id(x) for x in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg) if x is not None}
    counts: dict[str, int] = {}

    def add(name: str | None, n: int = 1) -> None:
        if name:
            counts[name] = counts.get(name, 0) + n

    for root in tree if isinstance(tree, list) else [tree]:
        for node in ast.walk(root):
            if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
                add(node.id)
            elif isinstance(node, ast.arg) and id(node) not in own:
                add(node.arg)  # parameters of nested functions and lambdas
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node is not skip:
                add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for alias in node.names:
                    add((alias.asname or alias.name).split(".")[0])
            elif isinstance(node, ast.ExceptHandler):
                add(node.name)
            elif isinstance(node, (ast.Global, ast.Nonlocal)) and declarations:
                for name in node.names:
                    add(name, 1 << 20)  # rebound from elsewhere: never a known value
            elif isinstance(node, (ast.MatchAs, ast.MatchStar)):
                add(node.name)
            elif isinstance(node, ast.MatchMapping):
                add(node.rest)
    return counts


def _product(a: frozenset[str] | None, b: frozenset[str] | None) -> frozenset[str] | None:
    if a is None or b is None or len(a) * len(b) > MAX_CONSTS:
        return None
    return frozenset(x + y for x in a for y in b)


def _strs(value: Any) -> frozenset[str] | None:
    """A constant string, or a constant collection of strings, as a set (None otherwise)."""
    if isinstance(value, str):
        return frozenset({value})
    if isinstance(value, (tuple, list, set, frozenset)) and value and all(isinstance(v, str) for v in value):
        return frozenset(value) if len(value) <= MAX_CONSTS else None
    return None


class Constants:
    """Constant folding and narrowing for one function (state set up by ``Collector.__init__``)."""

    globals: dict[str, Any]
    free: frozenset[str]
    params: set[str]
    stores: dict[str, int]
    stored: set[str]
    sites: dict[str, list[tuple[str, ast.AST]]]
    pairs: dict[str, str]
    _consts: dict[str, frozenset[str] | None]
    narrowed: dict[int, tuple[Any, ...]]

    # -- constants: names bound only to constant strings, module-level constants -----------------------------

    def _site(self, target: ast.AST, value: ast.AST, kind: str) -> None:
        if isinstance(target, ast.Name):
            self.sites.setdefault(target.id, []).append((kind, value))
        elif (
            kind == "value" and isinstance(target, (ast.Tuple, ast.List)) and isinstance(value, (ast.Tuple, ast.List))
            and len(target.elts) == len(value.elts)
            and not any(isinstance(e, ast.Starred) for e in (*target.elts, *value.elts))
        ):
            for t, v in zip(target.elts, value.elts, strict=True):
                self._site(t, v, kind)

    def _static(self, node: ast.AST) -> Any:
        """The value of a module-level name or a dotted path through modules and classes (else _MISSING)."""
        if isinstance(node, ast.Name):
            if node.id in self.params or node.id in self.stored or node.id in self.free:
                return MISSING
            if node.id in self.globals:
                return self.globals[node.id]
            return getattr(builtins, node.id, MISSING)
        if isinstance(node, ast.Attribute):
            base = self._static(node.value)
            if isinstance(base, types.ModuleType):
                return base.__dict__.get(node.attr, MISSING)
            if isinstance(base, type):
                value = inspect.getattr_static(base, node.attr, MISSING)
                return value if isinstance(value, (type, str, tuple)) else MISSING
        return MISSING

    def _const_strs(self, node: ast.AST, depth: int = 0) -> frozenset[str] | None:
        """The strings ``node`` may evaluate to when Python can tell from constants alone (None: computed)."""
        if depth > 8:
            return None
        if isinstance(node, ast.Constant):
            return frozenset({node.value}) if isinstance(node.value, str) else None
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return _product(self._const_strs(node.left, depth + 1), self._const_strs(node.right, depth + 1))
        if isinstance(node, ast.JoinedStr):
            out: frozenset[str] | None = frozenset({""})
            for part in node.values:
                if isinstance(part, ast.FormattedValue):
                    if part.conversion != -1 or part.format_spec is not None:
                        return None
                    part = part.value
                out = _product(out, self._const_strs(part, depth + 1))
            return out
        if isinstance(node, ast.IfExp):
            a, b = self._const_strs(node.body, depth + 1), self._const_strs(node.orelse, depth + 1)
            return None if a is None or b is None or len(a | b) > MAX_CONSTS else a | b
        if isinstance(node, ast.Name) and (node.id in self.params or node.id in self.stored):
            return self._name_consts(node.id, depth)
        value = self._static(node)
        return frozenset({value}) if isinstance(value, str) else None

    def _const_iter(self, node: ast.AST, depth: int) -> frozenset[str] | None:
        """The strings a ``for`` over ``node`` binds (a literal or module-level collection of constants)."""
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and node.elts:
            out: frozenset[str] = frozenset()
            for elt in node.elts:
                part = self._const_strs(elt, depth + 1)
                if part is None:
                    return None
                out |= part
            return out if len(out) <= MAX_CONSTS else None
        return _strs(self._static(node))

    def _name_consts(self, name: str, depth: int) -> frozenset[str] | None:
        if name in self._consts:
            return self._consts[name]
        self._consts[name] = None  # while computing (a cycle): unknown
        sites = self.sites.get(name, [])
        if name in self.params or not sites or len(sites) != self.stores.get(name, 0):
            return None  # bound somewhere the value is not known (an argument, a with, an import...)
        out: frozenset[str] = frozenset()
        for kind, expr in sites:
            part = self._const_strs(expr, depth + 1) if kind == "value" else self._const_iter(expr, depth + 1)
            if part is None:
                return None
            out |= part
        if len(out) > MAX_CONSTS:
            return None
        self._consts[name] = out
        return out

    # -- narrowing: ``isinstance(m, T)`` and name tests on ``for n, v in ...`` hold where they guard ------------

    def _types(self, node: ast.AST) -> tuple[type, ...] | None:
        if isinstance(node, ast.Tuple):
            parts = [self._types(e) for e in node.elts]
            return None if not parts or any(p is None for p in parts) else tuple(t for p in parts for t in p)
        value = self._static(node)
        if isinstance(value, type):
            return (value,)
        if isinstance(value, tuple) and value and all(isinstance(v, type) for v in value):
            return value
        return None

    def _conds(self, test: ast.AST) -> tuple[dict[str, tuple[Any, ...]], dict[str, tuple[Any, ...]]]:
        """What holds when ``test`` is true, and when it is false: {name: constraints}."""
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            true, false = self._conds(test.operand)
            return false, true
        if isinstance(test, ast.BoolOp):
            merged: dict[str, tuple[Any, ...]] = {}
            for value in test.values:
                part = self._conds(value)[0 if isinstance(test.op, ast.And) else 1]
                for name, cs in part.items():
                    merged[name] = merged.get(name, ()) + cs
            return (merged, {}) if isinstance(test.op, ast.And) else ({}, merged)
        if isinstance(test, ast.Call) and not test.keywords and len(test.args) == 2:
            subject = test.args[0]
            if is_builtin(test.func, "isinstance", self.stored) and isinstance(subject, ast.Name):
                found = self._types(test.args[1])
                return ({subject.id: (("isa", found),)}, {}) if found else ({}, {})
        if isinstance(test, ast.Call) and not test.keywords and len(test.args) == 1:
            func = test.func
            named = isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
            if named and func.attr in ("startswith", "endswith"):  # type: ignore[union-attr]
                arg = test.args[0]
                strs = self._const_iter(arg, 0) if isinstance(arg, ast.Tuple) else self._const_strs(arg)
                if strs is not None:
                    return {func.value.id: (("name", (func.attr, tuple(sorted(strs)))),)}, {}  # type: ignore
        if isinstance(test, ast.Compare) and len(test.ops) == 1:
            left, op, right = test.left, test.ops[0], test.comparators[0]
            if isinstance(op, (ast.Eq, ast.NotEq)):
                for name, other in ((left, right), (right, left)):
                    strs = self._const_strs(other)
                    if isinstance(name, ast.Name) and name.id in self.pairs and strs is not None:
                        c = {name.id: (("name", ("eq", strs)),)}
                        return (c, {}) if isinstance(op, ast.Eq) else ({}, c)
            if isinstance(op, (ast.In, ast.NotIn)) and isinstance(left, ast.Name):
                strs = self._const_iter(right, 0)
                if strs is not None:
                    c = {left.id: (("name", ("eq", strs)),)}
                    return (c, {}) if isinstance(op, ast.In) else ({}, c)
        return {}, {}

    def _extend(self, env: dict[str, tuple[Any, ...]], conds: dict[str, tuple[Any, ...]],
                region: list[Any]) -> dict[str, tuple[Any, ...]]:
        """``env`` plus ``conds`` for the names ``region`` never rebinds (a rebinding would void the test)."""
        if not conds:
            return env
        rebound = count_stores(region)
        new = dict(env)
        for name, cs in conds.items():
            if name in rebound:
                continue
            for c in cs:
                if c[0] == "isa":
                    new[name] = (*new.get(name, ()), c)
                    continue
                value = self.pairs.get(name)  # a test on the name of ``for name, value in ...``
                if value is not None and value not in rebound:
                    new[value] = (*new.get(value, ()), ("sel", c[1]))
        return new

    def _narrow_stmts(self, stmts: list[Any], env: dict[str, tuple[Any, ...]]) -> None:
        for i, s in enumerate(stmts):
            if not isinstance(s, ast.If):
                self._narrow(s, env)
                continue
            true, false = self._conds(s.test)
            self._narrow(s.test, env)
            self._narrow_stmts(s.body, self._extend(env, true, s.body))
            self._narrow_stmts(s.orelse, self._extend(env, false, s.orelse))
            exits = (ast.Continue, ast.Break, ast.Return, ast.Raise)
            if not s.orelse and s.body and isinstance(s.body[-1], exits):
                env = self._extend(env, false, stmts[i + 1:])  # ``if not isinstance(m, T): continue``

    def _narrow(self, node: ast.AST, env: dict[str, tuple[Any, ...]]) -> None:
        """Record, for each name read in ``node``, the constraints that hold there."""
        if isinstance(node, ast.Name):
            if isinstance(node.ctx, ast.Load) and node.id in env:
                self.narrowed[id(node)] = env[node.id]
            return
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            # The body runs later (a closure sees the name's value then): nothing from here holds inside.
            outer = [*getattr(node, "decorator_list", ())]
            if not isinstance(node, ast.ClassDef):
                outer += [*node.args.defaults, *(d for d in node.args.kw_defaults if d is not None)]
            for part in outer:
                self._narrow(part, env)
            body = node.body if isinstance(node.body, list) else [node.body]
            self._narrow_stmts(body, {})
            return
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            inner = {} if isinstance(node, ast.GeneratorExp) else env  # a generator runs later
            elts = [node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]
            for k, gen in enumerate(node.generators):
                self._narrow(gen.iter, env if k == 0 else inner)
                for j, test in enumerate(gen.ifs):
                    self._narrow(test, inner)
                    later = [*gen.ifs[j + 1:], *node.generators[k + 1:], *elts]
                    inner = self._extend(inner, self._conds(test)[0], later)
            for elt in elts:
                self._narrow(elt, inner)
            return
        if isinstance(node, ast.IfExp):
            self._narrow(node.test, env)
            true, false = self._conds(node.test)
            self._narrow(node.body, self._extend(env, true, [node.body]))
            self._narrow(node.orelse, self._extend(env, false, [node.orelse]))
            return
        if isinstance(node, ast.BoolOp):
            for i, value in enumerate(node.values):
                self._narrow(value, env)
                conds = self._conds(value)[0 if isinstance(node.op, ast.And) else 1]
                env = self._extend(env, conds, node.values[i + 1:])
            return
        for _, value in ast.iter_fields(node):
            if isinstance(value, list):
                if any(isinstance(v, ast.stmt) for v in value):
                    self._narrow_stmts(value, env)
                else:
                    for v in value:
                        if isinstance(v, ast.AST):
                            self._narrow(v, env)
            elif isinstance(value, ast.AST):
                self._narrow(value, env)

    @staticmethod
    def _constrain(refs: Refs, constraints: tuple[Any, ...]) -> Refs:
        out = set(refs)
        for c in constraints:
            if c[0] == "isa":
                out = {r.plus(c) for r in out}
            else:  # keep only the item of ``for name, value in ...`` whose name passes the test
                narrowed = set()
                for r in out:
                    if len(r.steps) >= 2 and r.steps[-2] == ("[]", None) and r.steps[-1] == ("[]", 1):
                        r = Ref(r.root, (*r.steps[:-2], ("[]", ("sel", c[1])), ("[]", 1)))
                    narrowed.add(r)
                out = narrowed
        return frozenset(out)
