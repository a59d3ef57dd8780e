"""Facts collection: one walk over a function's source, recording each use of a value that may be a module.

For each expression that may hold a module, a Parameter or a callable it records what is done with it (called,
iterated, stored, returned, used as a value...) and, by a must-analysis over the control flow, which calls ran
before it on every path. Pure syntax: no real object is looked at (the interpreter does that).
"""

from __future__ import annotations

import ast
import dataclasses
import operator
from typing import Any

from fsdp_compat.analysis.constants import Constants, count_stores, is_builtin
from fsdp_compat.analysis.names import INERT_CALLS, ITER_WRAPPERS, MODULE_GETTERS, NAME_LOOKUPS, Step
from fsdp_compat.analysis.refs import NONE, Arg, Ref, Refs, Use


def _is_getter(node: ast.Call) -> bool:
    func = node.func
    return isinstance(func, ast.Attribute) and func.attr in MODULE_GETTERS and not node.args and not node.keywords


class Collector(Constants):
    """Walks one function body in evaluation order, recording uses and which calls must precede each."""

    def __init__(self, fn: ast.AST, globals_: dict[str, Any] | None = None, free: tuple[str, ...] = ()) -> None:
        args = fn.args  # type: ignore[attr-defined]
        self.globals = globals_ or {}
        self.free = frozenset(free)  # closure variables: their values are not the module's
        self.params = {a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)}
        self.params |= {a.arg for a in (args.vararg, args.kwarg) if a is not None}
        self.call_no: dict[int, int] = {}
        for node in ast.walk(fn):
            if isinstance(node, ast.Call):
                self.call_no[id(node)] = len(self.call_no)
        self.stores = count_stores(fn, skip=fn)  # every binding of each name, nested scopes included
        self.stored: set[str] = set(count_stores(fn, skip=fn, declarations=False))
        # Name bindings whose value is known: ``name = <expr>`` and ``for name in <expr>`` (for constants), and
        # ``for n, v in <iterable>`` pairs (a test on the name ``n`` selects which item ``v`` is).
        self.sites: dict[str, list[tuple[str, ast.AST]]] = {}
        self.pairs: dict[str, str] = {}
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    self._site(target, node.value, "value")
            elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
                self._site(node.target, node.value, "value")
            elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
                self._site(node.target, node.iter, "iter")
                t = node.target
                if isinstance(t, ast.Tuple) and len(t.elts) == 2 and all(isinstance(e, ast.Name) for e in t.elts):
                    n, v = t.elts[0].id, t.elts[1].id  # type: ignore[attr-defined]
                    if n != v and self.stores.get(n) == 1 and self.stores.get(v) == 1:
                        self.pairs[n] = v
        self._consts: dict[str, frozenset[str] | None] = {}
        self.narrowed: dict[int, tuple[Any, ...]] = {}  # id(Name node) -> constraints that hold where it is read
        self._narrow_stmts(fn.body if isinstance(fn.body, list) else [fn.body], {})
        self.aliases: dict[str, set[Ref]] = {}
        self._bind_aliases(fn)
        self.uses: list[Use] = []
        self.bind_state: dict[str, frozenset[int]] = {}
        self.cur: frozenset[int] = frozenset()
        self.exits: list[frozenset[int]] = []
        self._nested = 0
        body = fn.body if isinstance(fn.body, list) else [ast.Return(value=fn.body, lineno=fn.body.lineno)]
        final = self._stmts(body, frozenset())
        if final is not None:
            self.exits.append(final)
        # Calls that ran on every path by the time the function returns (what its caller may rely on).
        self.exit_before = self._meet(*self.exits) or frozenset()
        # A Parameter held in a local was fetched when the local was bound (FSDP2 swaps the module's attribute,
        # not the object the local holds): reads through a local get only what ran before every binding of it.
        uses = []
        for u in self.uses:
            local = [b for b in u.bases if b in self.stored and b not in self.params]
            if local:
                u = dataclasses.replace(u, bound=frozenset.intersection(
                    *(self.bind_state.get(b, frozenset()) for b in local)))
            uses.append(u)
        self.uses = uses

    # -- chain-extending calls: getattr, vars, getters, get_submodule/get_parameter, attrgetter ---------------

    def _chain(self, node: ast.Call) -> tuple[ast.AST, list[tuple[Step, ...]]] | None:
        """(the expression a call extends, the step sequences it may add) when a call only looks something up."""
        func = node.func
        if _is_getter(node):
            return func.value, [(("()", func.attr),)]  # type: ignore[attr-defined]
        plain = not node.keywords and not any(isinstance(a, ast.Starred) for a in node.args)
        if is_builtin(func, "getattr", self.stored) and len(node.args) >= 2 and plain:
            strs = self._const_strs(node.args[1])
            return node.args[0], [(s,) for s in sorted(strs)] if strs else [(("?",),)]
        if not plain or len(node.args) != 1:
            return None
        if is_builtin(func, "vars", self.stored):
            return node.args[0], [("__dict__",)]
        if isinstance(func, ast.Attribute) and func.attr in NAME_LOOKUPS:
            strs = self._const_strs(node.args[0])
            if strs is not None:
                return func.value, [(("via", func.attr), *(s.split(".") if s else ())) for s in sorted(strs)]
        getter = isinstance(func, ast.Call) and len(func.args) == 1 and not func.keywords
        if getter and self._static(func.func) is operator.attrgetter:  # type: ignore[union-attr]
            strs = self._const_strs(func.args[0])  # type: ignore[union-attr]
            if strs is not None:
                return node.args[0], [tuple(s.split(".")) for s in sorted(strs)]
        return None

    # -- what an expression may evaluate to --------------------------------------------------------------------

    def refs(self, node: ast.AST) -> Refs:
        if isinstance(node, ast.Name):
            found = set(self.aliases.get(node.id, ()))
            if node.id in self.params or node.id not in self.stored:
                found.add(Ref(node.id, ()))
            constraints = self.narrowed.get(id(node))
            return self._constrain(frozenset(found), constraints) if constraints else frozenset(found)
        if isinstance(node, ast.Attribute):
            return frozenset(r.plus(node.attr) for r in self.refs(node.value))
        if isinstance(node, ast.Subscript):
            base = self.refs(node.value)
            key = node.slice
            if isinstance(key, ast.Slice):
                return base  # a slice of a ModuleList/Sequential holds the same children
            if isinstance(key, ast.Constant) and isinstance(key.value, (int, str)):
                return frozenset(r.plus(("[]", key.value)) for r in base)
            return frozenset(r.plus(("[]", None)) for r in base)
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id == "super" and func.id not in self.stored:
                return frozenset({Ref("super", ())})
            chain = self._chain(node)
            if chain is not None:
                base, options = chain
                out = set()
                for r in self.refs(base):
                    for steps in options:
                        ref = r
                        for step in steps:
                            ref = ref.plus(step)
                        out.add(ref)
                return frozenset(out)
            if self.refs(func):
                return frozenset({Ref(f"#{self.call_no[id(node)]}", ())})
            return NONE
        if isinstance(node, ast.IfExp):
            return self.refs(node.body) | self.refs(node.orelse)
        if isinstance(node, ast.BoolOp):
            return frozenset().union(*(self.refs(v) for v in node.values))
        if isinstance(node, (ast.NamedExpr, ast.Starred)):
            return self.refs(node.value)
        return NONE

    @staticmethod
    def _each(refs: Refs) -> Refs:
        return frozenset(r.plus(("[]", None)) for r in refs)

    def _iter_targets(self, target: ast.AST, iterable: ast.AST) -> list[tuple[ast.AST, Refs]]:
        """(target, what it may hold) for ``for target in iterable``."""
        if isinstance(iterable, ast.Call) and is_builtin(iterable.func, ITER_WRAPPERS, self.stored):
            name, args = iterable.func.id, iterable.args  # type: ignore[attr-defined]
            if name == "enumerate" and args and isinstance(target, ast.Tuple) and len(target.elts) == 2:
                return [(target.elts[1], self._each(self.refs(args[0])))]
            if name == "zip" and isinstance(target, ast.Tuple) and len(target.elts) == len(args):
                return [(t, self._each(self.refs(a))) for t, a in zip(target.elts, args, strict=True)]
            if name in ("reversed", "list", "tuple", "iter", "sorted") and args:
                return [(target, self._each(self.refs(args[0])))]
            return [(target, self._each(frozenset().union(*(self.refs(a) for a in args))))]
        return [(target, self._each(self.refs(iterable)))]

    def _bind(self, target: ast.AST, value: Refs, changed: list[bool]) -> None:
        if not value:
            return
        if isinstance(target, ast.Name):
            known = self.aliases.setdefault(target.id, set())
            if not value <= known:
                known |= value
                changed[0] = True
        elif isinstance(target, (ast.Tuple, ast.List)):
            starred = any(isinstance(e, ast.Starred) for e in target.elts)
            for i, elt in enumerate(target.elts):
                if isinstance(elt, ast.Starred) or starred:
                    inner = elt.value if isinstance(elt, ast.Starred) else elt
                    self._bind(inner, self._each(value), changed)
                else:
                    self._bind(elt, frozenset(r.plus(("[]", i)) for r in value), changed)

    def _bind_value(self, target: ast.AST, value: ast.AST, changed: list[bool]) -> None:
        if (
            isinstance(target, (ast.Tuple, ast.List))
            and isinstance(value, (ast.Tuple, ast.List))
            and len(target.elts) == len(value.elts)
            and not any(isinstance(e, ast.Starred) for e in (*target.elts, *value.elts))
        ):
            for t, v in zip(target.elts, value.elts, strict=True):
                self._bind_value(t, v, changed)
            return
        self._bind(target, self.refs(value), changed)

    def _bind_aliases(self, fn: ast.AST) -> None:
        # Flow-insensitive may-alias sets, iterated to a fixed point (chains are capped, so it terminates).
        for _ in range(8):
            changed = [False]
            for node in ast.walk(fn):
                if isinstance(node, ast.Assign):
                    for target in node.targets:
                        self._bind_value(target, node.value, changed)
                elif isinstance(node, (ast.AnnAssign, ast.AugAssign, ast.NamedExpr)) and node.value is not None:
                    self._bind_value(node.target, node.value, changed)
                elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
                    for target, refs in self._iter_targets(node.target, node.iter):
                        self._bind(target, refs, changed)
                elif isinstance(node, (ast.With, ast.AsyncWith)):
                    for item in node.items:
                        if item.optional_vars is not None:
                            self._bind(item.optional_vars, self.refs(item.context_expr), changed)
            if not changed[0]:
                return

    # -- statements: a must-analysis of which calls ran before ---------------------------------------------------

    def _stmts(self, body: list[ast.stmt], state: frozenset[int] | None) -> frozenset[int] | None:
        for stmt in body:
            if state is None:
                state = frozenset()  # unreachable code: analysed, nothing assumed to have run
                self._stmt(stmt, state)
                state = None
                continue
            state = self._stmt(stmt, state)
        return state

    @staticmethod
    def _meet(*states: frozenset[int] | None) -> frozenset[int] | None:
        live = [s for s in states if s is not None]
        if not live:
            return None
        return frozenset.intersection(*live)

    def _expr(self, node: ast.AST | None, state: frozenset[int], how: str) -> frozenset[int]:
        self.cur = state
        if node is not None:
            self._visit(node, how, False)
        return self.cur

    def _stmt(self, s: ast.stmt, state: frozenset[int]) -> frozenset[int] | None:
        if isinstance(s, ast.Expr):
            return self._expr(s.value, state, "discard")
        if isinstance(s, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = s.targets if isinstance(s, ast.Assign) else [s.target]
            plain = all(self._is_name_target(t) for t in targets) and not isinstance(s, ast.AugAssign)
            if isinstance(s.value, (ast.Tuple, ast.List)):
                # Only element-wise destructuring is an alias; ``pair = (self.a, self.b)`` builds a container.
                plain = plain and all(
                    isinstance(t, (ast.Tuple, ast.List)) and len(t.elts) == len(s.value.elts) for t in targets
                )
            state = self._expr(s.value, state, "bind" if plain else "value")
            for target in targets:
                state = self._store(target, state)
            return state
        if isinstance(s, ast.Return):
            after = self._expr(s.value, state, "return")
            if not self._nested:
                self.exits.append(after)
            return None
        if isinstance(s, ast.Raise):
            self._expr(s.exc, state, "value")
            return None
        if isinstance(s, (ast.Break, ast.Continue)):
            return None
        if isinstance(s, ast.If):
            state = self._expr(s.test, state, "test")
            return self._meet(self._stmts(s.body, state), self._stmts(s.orelse, state))
        if isinstance(s, ast.While):
            state = self._expr(s.test, state, "test")
            self._stmts(s.body, state)
            self._stmts(s.orelse, state)
            return state
        if isinstance(s, (ast.For, ast.AsyncFor)):
            state = self._iter(s.iter, state)
            state = self._store(s.target, state)
            self._stmts(s.body, state)
            self._stmts(s.orelse, state)
            return state
        if isinstance(s, (ast.With, ast.AsyncWith)):
            for item in s.items:
                state = self._expr(item.context_expr, state, "value")
                if item.optional_vars is not None:
                    state = self._store(item.optional_vars, state)
            out = self._stmts(s.body, state)
            return state if out is None else out  # a context manager may swallow an exception
        if isinstance(s, (ast.Try, getattr(ast, "TryStar", ast.Try))):
            body = self._stmts(s.body, state)
            body = self._stmts(s.orelse, body) if body is not None else None
            outs = [body]
            for handler in s.handlers:
                if handler.type is not None:
                    self._expr(handler.type, state, "value")
                outs.append(self._stmts(handler.body, state))
            after = self._meet(*outs)
            final = self._stmts(s.finalbody, state)
            if after is None or final is None:
                return None if after is None else after
            return after | final
        if isinstance(s, ast.Match):
            state = self._expr(s.subject, state, "value")
            outs = [state]
            for case in s.cases:
                if case.guard is not None:
                    self._expr(case.guard, state, "test")
                outs.append(self._stmts(case.body, state))
            return self._meet(*outs)
        if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for dec in s.decorator_list:
                state = self._expr(dec, state, "value")
            if not isinstance(s, ast.ClassDef):
                for default in (*s.args.defaults, *(d for d in s.args.kw_defaults if d is not None)):
                    state = self._expr(default, state, "value")
            saved = self.cur
            self._nested += 1
            self._stmts(s.body, state)  # runs later (if ever): only what ran before the def is assumed
            self._nested -= 1
            self.cur = saved
            return state
        if isinstance(s, ast.Delete):
            for target in s.targets:
                state = self._store(target, state)
            return state
        if isinstance(s, ast.Assert):
            state = self._expr(s.test, state, "test")
            self._expr(s.msg, state, "value")
            return state
        for child in ast.iter_child_nodes(s):  # Global, Nonlocal, Import, Pass, ...
            if isinstance(child, ast.expr):
                state = self._expr(child, state, "value")
        return state

    @staticmethod
    def _is_name_target(t: ast.AST) -> bool:
        if isinstance(t, ast.Name):
            return True
        if isinstance(t, (ast.Tuple, ast.List)):
            return all(Collector._is_name_target(e.value if isinstance(e, ast.Starred) else e) for e in t.elts)
        return False

    def _note_bind(self, name: str, state: frozenset[int]) -> None:
        prev = self.bind_state.get(name)
        self.bind_state[name] = state if prev is None else prev & state

    def _store(self, target: ast.AST, state: frozenset[int]) -> frozenset[int]:
        self.cur = state
        if isinstance(target, ast.Name):
            self._note_bind(target.id, state)
        elif isinstance(target, ast.Starred):
            self._store(target.value, state)
        if isinstance(target, ast.Attribute):
            refs = self.refs(target.value)
            self._visit_inner(target.value)
            if refs:
                self._emit(refs, "store", target, attr=target.attr)
            else:
                self._visit(target.value, "value", False)
        elif isinstance(target, ast.Subscript):
            self._visit(target.value, "value", False)  # writing into a Parameter is a read of it
            self._visit(target.slice, "value", False)
        elif isinstance(target, (ast.Tuple, ast.List)):
            for elt in target.elts:
                self._store(elt.value if isinstance(elt, ast.Starred) else elt, self.cur)
        return self.cur

    def _iter(self, iterable: ast.AST, state: frozenset[int]) -> frozenset[int]:
        self.cur = state
        if (
            isinstance(iterable, ast.Call)
            and isinstance(iterable.func, ast.Name)
            and iterable.func.id in ITER_WRAPPERS
            and iterable.func.id not in self.stored
        ):
            for arg in iterable.args:
                self._visit(arg, "iter", False)
            for kw in iterable.keywords:
                self._visit(kw.value, "value", False)
        else:
            self._visit(iterable, "iter", False)
        return self.cur

    # -- expressions ------------------------------------------------------------------------------------------

    def _emit(self, refs: Refs, how: str, node: ast.AST, *, args: tuple[Arg, ...] = (), call: int = -1,
              attr: str = "", cond: bool = False) -> None:
        index = len(self.uses)
        if isinstance(node, ast.Call) and how == "call":
            parts = [node.func, *node.args, *(k.value for k in node.keywords)]
        else:
            parts = [node]
        bases = tuple(sorted({b for b in map(self._base, parts) if b}))
        self.uses.append(Use(index, refs, how, getattr(node, "lineno", 0), self.cur, args, call, attr, bases))
        if how == "call" and not cond:
            self.cur = self.cur | {index}

    def _base(self, node: ast.AST) -> str:
        """The variable a chain starts from."""
        while True:
            if isinstance(node, (ast.Attribute, ast.Subscript, ast.Starred, ast.NamedExpr)):
                node = node.value
            elif isinstance(node, ast.Call):
                chain = self._chain(node)
                node = chain[0] if chain is not None else node.func
            else:
                return node.id if isinstance(node, ast.Name) else ""

    def _is_chain(self, node: ast.AST) -> bool:
        if isinstance(node, (ast.Name, ast.Attribute, ast.Subscript)):
            return bool(self.refs(node))
        if isinstance(node, ast.Call) and (self._chain(node) is not None or is_builtin(node.func, "super",
                                                                                           self.stored)):
            return bool(self.refs(node))
        return False

    def _visit_inner(self, node: ast.AST, cond: bool = False) -> None:
        """Evaluate the parts of a chain that run before it: subscript keys, calls whose result it extends."""
        if isinstance(node, ast.Attribute):
            self._visit_inner(node.value, cond)
        elif isinstance(node, ast.Subscript):
            self._visit_inner(node.value, cond)
            if not isinstance(node.slice, ast.Constant):
                self._visit(node.slice, "value", cond)
        elif isinstance(node, ast.Call):
            func = node.func
            chain = self._chain(node)
            if chain is not None:
                self._visit_inner(chain[0], cond)
                for arg in node.args:  # the name arguments (constants, or a computed name)
                    if arg is not chain[0]:
                        self._visit(arg, "value", cond)
            elif not (isinstance(func, ast.Name) and func.id == "super"):
                self._call(node, cond)

    def _visit(self, node: ast.AST, how: str, cond: bool) -> None:
        if self._is_chain(node):
            self._visit_inner(node, cond)
            self._emit(self.refs(node), how, node, cond=cond)
            return
        if isinstance(node, ast.Call):
            self._call(node, cond)
            if how != "call":
                refs = self.refs(node)  # what a followed function returned, used here
                if refs:
                    self._emit(refs, how, node, cond=cond)
            return
        if isinstance(node, ast.IfExp):
            self._visit(node.test, "test", cond)
            self._visit(node.body, how, True)
            self._visit(node.orelse, how, True)
            return
        if isinstance(node, ast.BoolOp):
            inner = "test" if how in ("test", "bind", "discard") else how
            for i, value in enumerate(node.values):
                self._visit(value, inner, cond or i > 0)
            return
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            self._visit(node.operand, "test", cond)
            return
        if isinstance(node, ast.FormattedValue):
            self._visit(node.value, "test", cond)  # formatting a module prints its repr; a tensor's data
            if node.format_spec is not None:
                self._visit(node.format_spec, "value", cond)
            return
        if isinstance(node, ast.Compare):
            identity = all(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops)
            for operand in (node.left, *node.comparators):
                self._visit(operand, "inert" if identity else "value", cond)
            return
        if isinstance(node, ast.NamedExpr):
            self._visit(node.value, "bind", cond)
            self._note_bind(node.target.id, self.cur)  # type: ignore[union-attr]
            return
        if isinstance(node, (ast.Tuple, ast.List)) and how == "bind":
            for elt in node.elts:  # ``a, b = self.x, self.y``: each element is aliased, not used
                self._visit(elt.value if isinstance(elt, ast.Starred) else elt, "bind", cond)
            return
        if isinstance(node, ast.Lambda):
            for default in (*node.args.defaults, *(d for d in node.args.kw_defaults if d is not None)):
                self._visit(default, "value", cond)
            saved = self.cur
            self._visit(node.body, "return", True)
            self.cur = saved
            return
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            saved = self.cur
            for i, gen in enumerate(node.generators):
                if i == 0:
                    self.cur = self._iter(gen.iter, self.cur)
                    saved = self.cur
                else:
                    self.cur = self._iter(gen.iter, self.cur)
                self._store(gen.target, self.cur)
                for test in gen.ifs:
                    self._visit(test, "test", True)
            elts = [node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]
            for elt in elts:
                self._visit(elt, "value", True)
            self.cur = saved
            return
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.expr):
                self._visit(child, "value", cond)
            elif isinstance(child, ast.keyword):
                self._visit(child.value, "value", cond)
            elif isinstance(child, ast.comprehension):  # pragma: no cover - handled above
                self._visit(child.iter, "value", cond)

    def _call(self, node: ast.Call, cond: bool) -> None:
        func = node.func
        if isinstance(func, ast.Name) and func.id in INERT_CALLS and func.id not in self.stored:
            for arg in node.args:
                self._visit(arg, "inert", cond)
            for kw in node.keywords:
                self._visit(kw.value, "inert", cond)
            return
        func_refs = self.refs(func)
        if func_refs:
            self._visit_inner(func, cond)
        else:
            self._visit(func, "value", cond)
        args: list[Arg] = []
        for arg in node.args:
            if isinstance(arg, ast.Starred):
                args.append(Arg(self._arg(arg.value, cond), "star"))
            else:
                args.append(Arg(self._arg(arg, cond), "pos"))
        for kw in node.keywords:
            refs = self._arg(kw.value, cond)
            args.append(Arg(refs, "kw", kw.arg) if kw.arg else Arg(refs, "dstar"))
        self._emit(func_refs, "call", node, args=tuple(args), call=self.call_no[id(node)], cond=cond)

    def _arg(self, node: ast.AST, cond: bool) -> Refs:
        """Evaluate an argument; returns what it may hold (its use is decided by the callee)."""
        if self._is_chain(node):
            self._visit_inner(node, cond)
            return self.refs(node)
        if isinstance(node, ast.Call):
            self._call(node, cond)
            return self.refs(node)
        self._visit(node, "value", cond)
        return NONE

