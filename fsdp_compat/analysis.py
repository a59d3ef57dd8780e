"""Static analysis: find parameter reads that happen outside the owning module's forward.

FSDP2 unshards a group only inside its module's forward (and backward). A module may therefore own a group only if
every read of its parameters happens there. This module reads the code that actually runs - each module's current
``forward`` (so a framework's monkey-patched forward counts), ``__call__`` overrides, forward hooks and pre-hooks,
and every Python method, property, function, closure and ``functools.partial`` that code hands a module to - and
reports where that code can reach a Parameter of another module.

It is conservative by construction: it models a short list of constructs exactly and treats everything else as an
*escape*. Modelled: attribute chains through registered children, parameters and plain attributes; constant and
computed indexing of containers; iteration (``for``, comprehensions, ``enumerate``/``zip``/``reversed``); local
aliases (flow-insensitive, tuple unpacking included); calling a module (its hooks run: FSDP2 unshards there);
calling or reading a Python method/property/function/closure/partial (followed, with the modules it is given bound
to its parameters, and its return value tracked); metadata of a Parameter (``.shape``, ``.dtype``...); identity
tests, truth tests and ``isinstance``-style builtins on a module; dynamic access Python resolves from constants
(``getattr`` with a name bound only to constant strings or a module-level constant, ``_modules``/``_parameters``
/``vars(...)``/``__dict__`` with a constant key, ``get_submodule``/``get_parameter``, ``operator.attrgetter``),
``modules()``/``named_parameters()``-style loops narrowed by an ``isinstance`` or constant-name test, and helpers
reached through a namespace object. A Parameter held in a local counts as read when it was fetched. Any other
use of a reference to a module or a Parameter - passed to code that is not followed, stored, returned from a
forward, reflected on (``_modules`` as a whole, ``vars``, ``getattr`` with a computed name), used as a value -
counts as a read, at that point and by the module whose code runs, of every Parameter below the reference (matched
by Parameter identity, so a wrapper that forwards ``.weight`` to an inner module is charged to the inner module).
Source it cannot read makes the module *opaque*: the planner then assumes it may read anything below it.

"After its own forward" is decided by a must-analysis over the control flow (branches, loops, early returns,
``try``): a read counts as after module M's call only if M was called earlier on every path to the read.

Known limits (the run-time guard covers them): objects reached only through ``gc``, C extensions or code
registered after planning; backward hooks; more than four levels of plain Python containers.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import functools
import inspect
import operator
import textwrap
import types
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fsdp_compat.tree import ModuleTree

# Reading these off a Parameter never touches its data, and they are correct on a sharded DTensor too. Not ``type``:
# ``Tensor.type(dtype)`` is a cast that reads every value (only the argument-less ``.type()`` is a type name; the
# analysis cannot tell the two apart from the attribute alone, so both count as a read).
METADATA_ATTRS = frozenset(
    {
        "shape", "dtype", "device", "ndim", "size", "dim", "numel", "nelement", "requires_grad", "is_cuda",
        "is_meta", "layout", "element_size", "is_floating_point", "is_complex", "names", "data_ptr",
        "is_contiguous", "stride", "__class__",
    }
)
# Getters that return submodules; calling them during analysis is safe and resolves the chain.
MODULE_GETTERS = frozenset({"get_input_embeddings", "get_output_embeddings", "get_decoder", "get_encoder"})
# Builtins that look at an object (its type, identity, length) and never at a Parameter's data.
INERT_CALLS = frozenset({"isinstance", "issubclass", "hasattr", "id", "type", "len", "callable"})
# Builtins that hand back (elements of) their argument when iterated.
_ITER_WRAPPERS = frozenset({"enumerate", "zip", "reversed", "list", "tuple", "iter", "sorted"})
# Calling a module through these runs its hooks (FSDP2 unshards there); calling ``.forward()`` directly does not.
_HOOKED_CALLS = frozenset({"__call__", "_call_impl", "_wrapped_call_impl"})
# Attributes that expose a module's registry: touching them reaches everything below it.
_REFLECTION_ATTRS = frozenset({"__dict__", "_modules", "_parameters", "_buffers"})
# transformers' ``module.dtype`` / ``.device`` look at the first parameter's dtype or device only.
_MODULE_METADATA = frozenset({"dtype", "device"})
# nn.Module methods that hand out submodules (modelled as iteration over them) or register a hook (followed).
_MODULE_ITERATORS = frozenset({"modules", "named_modules", "children", "named_children"})
_HOOK_REGISTRATION = frozenset(
    {
        "register_forward_pre_hook", "register_forward_hook", "register_full_backward_hook",
        "register_full_backward_pre_hook", "register_backward_hook",
    }
)
# nn.Module methods that hand out Parameters (modelled as iteration over them, with their real names).
_PARAM_ITERATORS = frozenset({"parameters", "named_parameters"})
# nn.Module methods that look a submodule or Parameter up by a dotted name with getattr (a constant name resolves).
_NAME_LOOKUPS = frozenset({"get_submodule", "get_parameter"})
# Registries whose constant-key subscripts are modelled (``self._modules["emb"]``); other uses reflect.
_REGISTRIES = frozenset({"_modules", "_parameters", "_buffers"})
_MAX_CONSTS = 8  # a name that may hold more constant strings than this is treated as computed
_MAX_STEPS = 6  # longer chains (``x = x.inner`` in a loop) become "any descendant"
_SCAN_DEPTH = 4  # how deep plain Python objects are searched for references to modules
_SCALARS = (int, float, complex, str, bytes, bool, type(None), torch.dtype, torch.device, torch.Size)

# A step of a reference chain: str attribute | ("()", getter) | ("[]", key or None or ("sel", predicate)) |
# ("?",) computed attribute | ("**",) any below | ("isa", types) kept only if an instance | ("via", method) a
# name lookup by nn.Module's own ``method`` (escapes when the class overrides it).
Step = Any


@dataclass(frozen=True)
class RawRead:
    """One piece of evidence: ``reader``'s code touches ``owner`` outside ``owner``'s own forward window.

    kind: ``"raw-read"`` (a parameter used directly, or reachable from a reference that escapes the analysis),
    ``"call"`` (``owner``'s forward called from ``reader``, which matters when it skips levels of the tree), or
    ``"opaque"`` (``reader``'s source could not be read). ``after_forward_of``: modules called before this read on
    every path through the reader's code.
    """

    reader: str
    owner: str
    param: str | None
    kind: str
    location: str
    after_forward_of: frozenset[str] = field(default=frozenset(), compare=False)

    def describe(self) -> str:
        reader = self.reader or "<root>"
        if self.kind == "opaque":
            return f"{reader}: forward source unreadable ({self.location}); assumed to read anything below it"
        if self.kind == "call":
            return f"{reader} calls {self.owner}.forward directly ({self.location})"
        return f"{self.param} read raw by {reader} ({self.location})"

    def __str__(self) -> str:
        return self.describe()


# ---------------------------------------------------------------------------------------------------------------
# Per-function facts (cached per code object): what each expression that may hold a module reference does


@dataclass(frozen=True)
class _Ref:
    """A value reachable from ``root`` (a name of the function, or ``#n``: what call node n returned)."""

    root: str
    steps: tuple[Step, ...]

    def plus(self, step: Step) -> _Ref:
        if self.steps and self.steps[-1] == ("**",) and step == ("[]", None):
            return self
        steps = (*self.steps, step)
        if len(steps) > _MAX_STEPS:
            steps = (*self.steps[: _MAX_STEPS - 1], ("**",))
        return _Ref(self.root, steps)


Refs = frozenset[_Ref]
_NONE: Refs = frozenset()


@dataclass(frozen=True)
class _Arg:
    refs: Refs
    kind: str  # "pos" | "star" | "kw" | "dstar"
    name: str | None = None


@dataclass(frozen=True)
class _Use:
    """One expression whose value may be a module, a Parameter or a callable, and what is done with it.

    how: ``call`` (it is called with ``args``), ``value`` (any unmodelled use: a read / an escape), ``test``
    (truth test), ``inert`` (identity test, ``isinstance``...), ``iter`` (iterated), ``store`` (an attribute
    ``attr`` of it is assigned), ``return`` (returned), ``discard`` (evaluated and dropped).
    """

    index: int
    refs: Refs
    how: str
    lineno: int
    before: frozenset[int]
    args: tuple[_Arg, ...] = ()
    node: int = -1
    attr: str = ""
    bases: tuple[str, ...] = ()  # the variables the expression (and a call's arguments) start from
    bound: frozenset[int] | None = None  # when some are locals: calls that ran before every binding of them


@dataclass(frozen=True)
class _FunctionFacts:
    positional: tuple[str, ...]
    kwonly: tuple[str, ...]
    vararg: str | None
    kwarg: str | None
    uses: tuple[_Use, ...]
    filename: str
    qualname: str
    lineno_offset: int
    exit_before: frozenset[int] = frozenset()


class _Opaque(Exception):
    pass


def _source_function(func: Any) -> types.FunctionType:
    try:
        return _source_function_cached(func)
    except TypeError:  # unhashable callable
        return _source_function_uncached(func)


@functools.lru_cache(maxsize=8192)
def _source_function_cached(func: Any) -> types.FunctionType:
    return _source_function_uncached(func)


def _source_function_uncached(func: Any) -> types.FunctionType:
    func = inspect.unwrap(func)
    if isinstance(func, (staticmethod, classmethod)):
        func = func.__func__
    if not isinstance(func, types.FunctionType):
        raise _Opaque(f"{func!r} is not a Python function")
    return func


@functools.lru_cache(maxsize=8192)
def _facts_for_code(code: types.CodeType, func: types.FunctionType) -> _FunctionFacts:
    try:
        source = textwrap.dedent(inspect.getsource(func))
        module_ast = ast.parse(source)
    except (OSError, TypeError, SyntaxError, IndentationError) as exc:
        raise _Opaque(f"source of {func.__qualname__} unavailable: {exc}") from None
    node: ast.AST | None = None
    if func.__name__ == "<lambda>":
        lambdas = [n for n in ast.walk(module_ast) if isinstance(n, ast.Lambda)]
        if len(lambdas) != 1:
            raise _Opaque(f"cannot tell which lambda on line {code.co_firstlineno} is {func.__qualname__}")
        node = lambdas[0]
    else:
        node = next(
            (n for n in module_ast.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))), None
        )
    if node is None:
        raise _Opaque(f"{func.__qualname__} is not defined by a def statement")
    args = node.args  # type: ignore[attr-defined]
    positional = tuple(a.arg for a in (*args.posonlyargs, *args.args))
    if len(positional) + len(args.kwonlyargs) != code.co_argcount + code.co_kwonlyargcount:
        raise _Opaque(f"the source found for {func.__qualname__} does not match its code")
    collector = _Collector(node, func.__globals__, code.co_freevars)
    offset = code.co_firstlineno - 1
    uses = tuple(_replace_line(u, u.lineno + offset) for u in collector.uses)
    return _FunctionFacts(
        positional=positional,
        kwonly=tuple(a.arg for a in args.kwonlyargs),
        vararg=args.vararg.arg if args.vararg else None,
        kwarg=args.kwarg.arg if args.kwarg else None,
        uses=uses,
        filename=code.co_filename,
        qualname=func.__qualname__,
        lineno_offset=offset,
        exit_before=collector.exit_before,
    )


def _replace_line(use: _Use, lineno: int) -> _Use:
    return dataclasses.replace(use, lineno=lineno)


def function_facts(func: Any) -> _FunctionFacts:
    """Parsed, cached facts about one function (raises _Opaque when its source cannot be read)."""
    func = _source_function(func)
    return _facts_for_code(func.__code__, func)


def _is_getter(node: ast.Call) -> bool:
    func = node.func
    return isinstance(func, ast.Attribute) and func.attr in MODULE_GETTERS and not node.args and not node.keywords


def _is_builtin(func: ast.AST, names: str | frozenset[str], stored: set[str]) -> bool:
    """``func`` is a plain name of one of these builtins, not shadowed by a local of the function."""
    wanted = {names} if isinstance(names, str) else names
    return isinstance(func, ast.Name) and func.id in wanted and func.id not in stored


_MISSING = object()


def _stores(tree: ast.AST | list[Any], skip: ast.AST | None = None, declarations: bool = True) -> dict[str, int]:
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
    if a is None or b is None or len(a) * len(b) > _MAX_CONSTS:
        return None
    return frozenset(x + y for x in a for y in b)


def _strs(value: Any) -> frozenset[str] | None:
    """A constant string, or a constant collection of strings, as a set (None otherwise)."""
    if isinstance(value, str):
        return frozenset({value})
    if isinstance(value, (tuple, list, set, frozenset)) and value and all(isinstance(v, str) for v in value):
        return frozenset(value) if len(value) <= _MAX_CONSTS else None
    return None


class _Collector:
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
        self.stores = _stores(fn, skip=fn)  # every binding of each name, nested scopes included
        self.stored: set[str] = set(_stores(fn, skip=fn, declarations=False))
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
        self.aliases: dict[str, set[_Ref]] = {}
        self._bind_aliases(fn)
        self.uses: list[_Use] = []
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
                return _MISSING
            if node.id in self.globals:
                return self.globals[node.id]
            return getattr(builtins, node.id, _MISSING)
        if isinstance(node, ast.Attribute):
            base = self._static(node.value)
            if isinstance(base, types.ModuleType):
                return base.__dict__.get(node.attr, _MISSING)
            if isinstance(base, type):
                value = inspect.getattr_static(base, node.attr, _MISSING)
                return value if isinstance(value, (type, str, tuple)) else _MISSING
        return _MISSING

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
            return None if a is None or b is None or len(a | b) > _MAX_CONSTS else a | b
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
            return out if len(out) <= _MAX_CONSTS else None
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
        if len(out) > _MAX_CONSTS:
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
            if _is_builtin(test.func, "isinstance", self.stored) and isinstance(subject, ast.Name):
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
        rebound = _stores(region)
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
                        r = _Ref(r.root, (*r.steps[:-2], ("[]", ("sel", c[1])), ("[]", 1)))
                    narrowed.add(r)
                out = narrowed
        return frozenset(out)

    # -- chain-extending calls: getattr, vars, getters, get_submodule/get_parameter, attrgetter ---------------

    def _chain(self, node: ast.Call) -> tuple[ast.AST, list[tuple[Step, ...]]] | None:
        """(the expression a call extends, the step sequences it may add) when a call only looks something up."""
        func = node.func
        if _is_getter(node):
            return func.value, [(("()", func.attr),)]  # type: ignore[attr-defined]
        plain = not node.keywords and not any(isinstance(a, ast.Starred) for a in node.args)
        if _is_builtin(func, "getattr", self.stored) and len(node.args) >= 2 and plain:
            strs = self._const_strs(node.args[1])
            return node.args[0], [(s,) for s in sorted(strs)] if strs else [(("?",),)]
        if not plain or len(node.args) != 1:
            return None
        if _is_builtin(func, "vars", self.stored):
            return node.args[0], [("__dict__",)]
        if isinstance(func, ast.Attribute) and func.attr in _NAME_LOOKUPS:
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
                found.add(_Ref(node.id, ()))
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
                return frozenset({_Ref("super", ())})
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
                return frozenset({_Ref(f"#{self.call_no[id(node)]}", ())})
            return _NONE
        if isinstance(node, ast.IfExp):
            return self.refs(node.body) | self.refs(node.orelse)
        if isinstance(node, ast.BoolOp):
            return frozenset().union(*(self.refs(v) for v in node.values))
        if isinstance(node, (ast.NamedExpr, ast.Starred)):
            return self.refs(node.value)
        return _NONE

    @staticmethod
    def _each(refs: Refs) -> Refs:
        return frozenset(r.plus(("[]", None)) for r in refs)

    def _iter_targets(self, target: ast.AST, iterable: ast.AST) -> list[tuple[ast.AST, Refs]]:
        """(target, what it may hold) for ``for target in iterable``."""
        if isinstance(iterable, ast.Call) and _is_builtin(iterable.func, _ITER_WRAPPERS, self.stored):
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
            return all(_Collector._is_name_target(e.value if isinstance(e, ast.Starred) else e) for e in t.elts)
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
            and iterable.func.id in _ITER_WRAPPERS
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

    def _emit(self, refs: Refs, how: str, node: ast.AST, *, args: tuple[_Arg, ...] = (), call: int = -1,
              attr: str = "", cond: bool = False) -> None:
        index = len(self.uses)
        if isinstance(node, ast.Call) and how == "call":
            parts = [node.func, *node.args, *(k.value for k in node.keywords)]
        else:
            parts = [node]
        bases = tuple(sorted({b for b in map(self._base, parts) if b}))
        self.uses.append(_Use(index, refs, how, getattr(node, "lineno", 0), self.cur, args, call, attr, bases))
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
        if isinstance(node, ast.Call) and (self._chain(node) is not None or _is_builtin(node.func, "super",
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
        args: list[_Arg] = []
        for arg in node.args:
            if isinstance(arg, ast.Starred):
                args.append(_Arg(self._arg(arg.value, cond), "star"))
            else:
                args.append(_Arg(self._arg(arg, cond), "pos"))
        for kw in node.keywords:
            refs = self._arg(kw.value, cond)
            args.append(_Arg(refs, "kw", kw.arg) if kw.arg else _Arg(refs, "dstar"))
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
        return _NONE


# ---------------------------------------------------------------------------------------------------------------
# Resolution of references against real objects


@dataclass(frozen=True)
class _Resolved:
    kind: str  # "module" | "param" | "method" | "property" | "object" | "escape" | "static"
    obj: Any
    owner: nn.Module | None = None  # for params: the module whose _parameters held it
    attr: str = ""  # for params: attribute name; for methods/properties: the name


@functools.lru_cache(maxsize=65536)
def _class_attr(cls: type, name: str) -> Any:
    """A class attribute without running descriptors (cached: the same classes repeat in every layer)."""
    return inspect.getattr_static(cls, name, None)


@functools.lru_cache(maxsize=4096)
def _custom_getattr(cls: type) -> bool:
    """True when ``cls`` answers unknown attributes itself (peft's wrappers forward them to an inner module)."""
    return inspect.getattr_static(cls, "__getattr__", None) is not nn.Module.__getattr__


@functools.lru_cache(maxsize=4096)
def _defined_by_nn_module(cls: type, name: str) -> bool:
    for klass in cls.__mro__:
        if name in klass.__dict__:
            return klass is nn.Module
    return False


def _children(module: nn.Module) -> list[nn.Module]:
    return [m for m in module._modules.values() if m is not None]


def _descendants(module: nn.Module) -> list[nn.Module]:
    return list(module.modules())


class _Resolver:
    def __init__(self, tree: ModuleTree) -> None:
        self.tree = tree

    def resolve(self, obj: Any, steps: tuple[Step, ...], owner: nn.Module | None = None,
                attr: str = "") -> list[_Resolved]:
        """What a chain of steps reaches when started at ``obj`` (a list: computed keys fan out)."""
        if steps and isinstance(steps[0], tuple) and steps[0][0] == "isa":  # inside ``if isinstance(obj, T):``
            return self.resolve(obj, steps[1:], owner, attr) if isinstance(obj, steps[0][1]) else []
        if isinstance(obj, nn.Parameter):
            if id(obj) not in self.tree.params:
                return []
            if steps and isinstance(steps[0], str) and steps[0] in METADATA_ATTRS:
                return []
            return [_Resolved("param", obj, owner, attr)]
        if isinstance(obj, (torch.Tensor, *_SCALARS)):
            return []
        if isinstance(obj, nn.Module):
            return self._module(obj, steps)
        if not steps:
            if isinstance(obj, (types.ModuleType, type)):
                return [_Resolved("static", obj)]
            return [_Resolved("object", obj)]
        step, rest = steps[0], steps[1:]
        if isinstance(obj, types.ModuleType) and isinstance(step, str):
            value = obj.__dict__.get(step)
            return [] if value is None else self.resolve(value, rest)
        if isinstance(obj, type) and isinstance(step, str):
            value = inspect.getattr_static(obj, step, None)
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__ if isinstance(value, staticmethod) else types.MethodType(value.__func__, obj)
            return [] if value is None else self.resolve(value, rest)
        if isinstance(step, tuple) and step[0] == "[]" and (isinstance(obj, _Seq) or type(obj) in (list, tuple)):
            if isinstance(step[1], int) and -len(obj) <= step[1] < len(obj):
                return self.resolve(obj[step[1]], rest)
            items = list(obj)
            if isinstance(step[1], tuple):  # ("sel", test): the items whose name passes the test
                items = [i for i in items if not (isinstance(i, tuple) and i and isinstance(i[0], str))
                         or _name_passes(i[0], step[1][1])]
            return [r for item in items for r in self.resolve(item, rest)]
        if isinstance(step, tuple) and step[0] == "[]" and type(obj) is dict:
            key = step[1]
            if key is None or isinstance(key, tuple):
                return [r for value in list(obj.values()) for r in self.resolve(value, rest)]
            return self.resolve(obj[key], rest) if key in obj else []  # a missing key raises: nothing read
        if isinstance(step, str):
            value = _plain_attr(obj, step)
            if value is not _MISSING:
                return self.resolve(value, rest)
        return [_Resolved("object", obj)]  # a plain object reached part-way: judged by what it holds

    def _holder(self, value: Any) -> nn.Module | None:
        owners = self.tree.param_owners.get(id(value)) if isinstance(value, nn.Parameter) else None
        return self.tree.modules[owners[0][0]] if owners else None

    def _module(self, obj: nn.Module, steps: tuple[Step, ...]) -> list[_Resolved]:
        if not steps:
            return [_Resolved("module", obj)]
        step, rest = steps[0], steps[1:]
        nexts: list[tuple[Any, str]] = []
        if isinstance(step, str):
            if step in _REFLECTION_ATTRS and rest[:1] == ("keys",):
                return []  # the names only (ModuleDict.keys())
            key = rest[0][1] if rest and isinstance(rest[0], tuple) and rest[0][0] == "[]" else None
            if step in _REGISTRIES and isinstance(key, str) and type(getattr(obj, step, None)) is dict:
                value = getattr(obj, step).get(key)  # ``self._modules["emb"]``: that entry, nothing else
                return [] if value is None else self.resolve(value, rest[1:], owner=obj, attr=key)
            if step == "__dict__" and isinstance(key, str) and type(obj.__dict__) is dict:
                if key in _REGISTRIES:  # ``vars(self)["_modules"]``: the registry itself
                    return self._module(obj, (key, *rest[1:]))
                if key not in obj.__dict__:
                    return []  # submodules and Parameters are not in __dict__: a KeyError, nothing read
                return self.resolve(obj.__dict__[key], rest[1:], owner=obj, attr=key)
            if step in _REFLECTION_ATTRS or step in ("__getattr__", "__getattribute__"):
                return [_Resolved("escape", obj, attr=step)]
            dunder = step.startswith("__") and step.endswith("__") and step not in _HOOKED_CALLS
            if step in _MODULE_METADATA or dunder:
                return []  # __class__, __name__, .dtype: the object's type, never its data
            if step in obj._parameters:
                nexts = [(obj._parameters[step], step)]
            elif step in obj._modules:
                nexts = [(obj._modules[step], step)]
            elif step in obj._buffers:
                return []
            elif step in obj.__dict__:
                value = obj.__dict__[step]
                if isinstance(value, types.MethodType) and value.__self__ is obj:
                    return [_Resolved("method", obj, attr=step)] if not rest else []
                nexts = [(value, step)]
            else:
                static = _class_attr(type(obj), step)
                if isinstance(static, (types.FunctionType, staticmethod, classmethod)):
                    return [_Resolved("method", obj, attr=step)] if not rest else []
                if isinstance(static, (property, functools.cached_property)):
                    return [_Resolved("property", obj, attr=step)]
                if static is None:
                    if not _custom_getattr(type(obj)):
                        return []
                    # A wrapper that answers unknown attributes itself (peft forwards them to an inner module):
                    # ask it, then follow what it hands back by identity.
                    try:
                        value = getattr(obj, step)
                    except AttributeError:
                        return []  # no such attribute: the code raises there, nothing is read
                    except Exception:
                        return [_Resolved("escape", obj, attr=step)]
                    if isinstance(value, (nn.Module, nn.Parameter)) or (
                        isinstance(value, types.MethodType) and isinstance(value.__self__, nn.Module)
                    ):
                        # Which inner module answers depends on the wrapper's state (peft's disable_adapter()
                        # switches to the original module): everything below the wrapper counts as read.
                        return [_Resolved("escape", obj, attr=f"{step} (answered by {type(obj).__name__})")]
                    return self.resolve(value, rest, owner=self._holder(value), attr=step)
                if callable(getattr(static, "__get__", None)) and not isinstance(static, (*_SCALARS, tuple, list,
                                                                                         frozenset, set, dict)):
                    return [_Resolved("escape", obj, attr=step)]  # another descriptor: unknown code
                nexts = [(static, step)]
        elif step[0] == "()":
            try:
                nexts = [(getattr(obj, step[1])(), step[1])]
            except Exception:
                return []
        elif step[0] == "[]":
            key = step[1]
            if key is None or isinstance(key, tuple):  # (a name test only selects among named_* items)
                nexts = [(child, "") for child in _children(obj)]
            else:
                try:
                    nexts = [(obj[key], str(key))]  # type: ignore[index]
                except Exception:
                    return []
        elif step[0] == "?":
            return [_Resolved("escape", obj, attr="<computed attribute>")]
        elif step[0] == "via":  # get_submodule / get_parameter: getattr along the dotted name
            if not _defined_by_nn_module(type(obj), step[1]):
                return [_Resolved("escape", obj, attr=f"{step[1]}() (overridden)")]
            return self._module(obj, rest)
        elif step[0] == "**":
            return [r for module in _descendants(obj) for r in self.resolve(module, rest)]
        results = []
        for value, name in nexts:
            if value is None:
                continue
            results.extend(self.resolve(value, rest, owner=obj, attr=name))
        return results


def _name_passes(name: str, test: tuple[str, Any]) -> bool:
    kind, value = test
    if kind == "eq":
        return name in value
    return name.startswith(value) if kind == "startswith" else name.endswith(value)


_PLAIN_GETATTRIBUTE = (object.__getattribute__, types.SimpleNamespace.__getattribute__)


def _plain_attr(obj: Any, name: str) -> Any:
    """``obj.name`` for a plain Python object (a namespace of helpers...) when it is certain what that returns
    without running code: an instance attribute, or a function, staticmethod or classmethod of its class."""
    cls = type(obj)
    if name.startswith("__") or isinstance(obj, (types.FunctionType, types.MethodType, functools.partial)):
        return _MISSING
    if _class_attr(cls, "__getattribute__") not in _PLAIN_GETATTRIBUTE:
        return _MISSING
    static = _class_attr(cls, name)
    if static is not None and hasattr(type(static), "__set__"):
        return _MISSING  # a data descriptor (property, slot): runs code or is not in __dict__
    inst = obj.__dict__ if type(getattr(obj, "__dict__", None)) is dict else {}
    if name in inst:
        return inst[name]
    if isinstance(static, types.FunctionType):
        return types.MethodType(static, obj)
    if isinstance(static, staticmethod):
        return static.__func__
    if isinstance(static, classmethod):
        return types.MethodType(static.__func__, cls)
    if static is not None and not hasattr(type(static), "__get__"):
        return static  # a plain class-level value
    return _MISSING


def _held(obj: Any, tree: ModuleTree, depth: int = _SCAN_DEPTH, seen: set[int] | None = None) -> list[Any]:
    """Modules and Parameters of ``tree`` that a plain Python object holds (containers, closures, partials...)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth < 0 or isinstance(obj, _SCALARS):
        return []
    seen.add(id(obj))
    if isinstance(obj, nn.Module):
        return [obj] if id(obj) in tree.path_of else []
    if isinstance(obj, nn.Parameter):
        return [obj] if id(obj) in tree.params else []
    if isinstance(obj, (torch.Tensor, types.ModuleType, type)):
        return []
    if isinstance(obj, types.FunctionType):
        parts: list[Any] = [c.cell_contents for c in (obj.__closure__ or ()) if _cell_full(c)]
        parts += list(obj.__defaults__ or ()) + list((obj.__kwdefaults__ or {}).values())
    elif isinstance(obj, types.MethodType):
        parts = [obj.__self__, obj.__func__]
    elif isinstance(obj, functools.partial):
        parts = [obj.func, *obj.args, *obj.keywords.values()]
    elif isinstance(obj, dict):
        parts = list(obj.values())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        parts = list(obj)
    else:
        parts = list(getattr(obj, "__dict__", {}).values())
        parts += [getattr(obj, s, None) for s in getattr(type(obj), "__slots__", ()) if isinstance(s, str)]
    found: list[Any] = []
    for part in parts:
        if not isinstance(part, (*_SCALARS, torch.Tensor)):
            found.extend(_held(part, tree, depth - 1, seen))
    return found


def _cell_full(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:
        return False
    return True


# ---------------------------------------------------------------------------------------------------------------
# The analysis over a whole tree


def _runs_own_code(module: nn.Module) -> bool:
    """False for torch's own building blocks, whose forwards read only their own parameters."""
    forward = module.__dict__.get("forward") or type(module).forward
    func = getattr(forward, "__func__", forward)
    func = inspect.unwrap(func) if callable(func) else func
    module_name = getattr(func, "__module__", "") or ""
    return not module_name.startswith("torch.")


def _torch_code(func: Any) -> bool:
    return (getattr(func, "__module__", "") or "").startswith("torch")


def _forward_function(module: nn.Module) -> Any:
    instance_forward = module.__dict__.get("forward")
    if instance_forward is not None:
        if isinstance(instance_forward, types.MethodType) and instance_forward.__self__ is module:
            return instance_forward.__func__
        raise _Opaque(f"instance-level forward {instance_forward!r} on {type(module).__name__}")
    static = inspect.getattr_static(type(module), "forward", None)
    if isinstance(static, functools.partialmethod):
        raise _Opaque(f"{type(module).__name__}.forward is a functools.partialmethod")
    return type(module).forward


@dataclass
class Analysis:
    """Everything the static pass found: evidence events and the modules it could not read."""

    events: list[RawRead]
    opaque: dict[str, str]


Bindings = dict[str, tuple[Any, ...]]


class _Site:
    """Who runs the code at a use, what ran before it on every path, and where it is (both computed lazily)."""

    __slots__ = ("_before", "_held", "_where", "reader")

    def __init__(self, reader: str, before: Any, where: Any, held: Any = None) -> None:
        self.reader = reader
        self._before = before  # a frozenset, or (entry set, called map, use) to union on demand
        self._where = where  # a string, or (facts, lineno)
        self._held = held  # like _before, for the values the use holds (None: the same as _before)

    @staticmethod
    def _union(spec: Any) -> frozenset[str]:
        if isinstance(spec, frozenset):
            return spec
        entry, called, use = spec
        return entry.union(*(called.get(i, frozenset()) for i in use.before)) if use else entry

    @property
    def before(self) -> frozenset[str]:
        if not isinstance(self._before, frozenset):
            self._before = self._union(self._before)
        return self._before

    @property
    def held_before(self) -> frozenset[str]:
        """What ran before the Parameters this use holds were fetched (a local bound earlier holds the object
        fetched then: after a later call of its module, it is still the sharded one)."""
        if self._held is None:
            return self.before
        if not isinstance(self._held, frozenset):
            self._held = self._union(self._held)
        return self._held

    @property
    def where(self) -> str:
        if not isinstance(self._where, str):
            facts, lineno = self._where
            self._where = f"{facts.filename.rsplit('/', 1)[-1]}:{lineno} in {facts.qualname}"
        return self._where


class _Analyzer:
    def __init__(self, tree: ModuleTree) -> None:
        self.tree = tree
        self.resolver = _Resolver(tree)
        self.events: dict[tuple[Any, ...], RawRead] = {}
        self.opaque: dict[str, str] = {}
        self.visited: dict[tuple[Any, ...], list[Any]] = {}
        self.escaped: set[tuple[str, int]] = set()
        self._subtree_owners: dict[int, list[tuple[str, str]]] = {}
        self._held_memo: dict[int, tuple[Any, list[Any]]] = {}
        self._sigs: dict[int, Any] = {}
        self._capture: list[RawRead] | None = None

    # -- evidence ---------------------------------------------------------------------------------------------

    def _add(self, event: RawRead) -> None:
        if self._capture is not None:
            self._capture.append(event)
        key = (event.reader, event.owner, event.param, event.kind)
        previous = self.events.get(key)
        if previous is not None and event.kind == "raw-read":
            # A read counts as "after forward" only if every occurrence is.
            both = previous.after_forward_of & event.after_forward_of
            self.events[key] = RawRead(
                previous.reader, previous.owner, previous.param, previous.kind, previous.location, both
            )
            return
        self.events.setdefault(key, event)

    def _read(self, param: nn.Parameter, site: _Site, after: bool = True) -> None:
        owners = self.tree.param_owners.get(id(param), ())
        if any(self.tree.is_ancestor_or_self(owner_path, site.reader) for owner_path, _ in owners):
            return  # read inside (a sharer's) own forward: its group is unsharded there
        for owner_path, name in owners:
            qualified = f"{owner_path}.{name}" if owner_path else name
            self._add(RawRead(site.reader, owner_path, qualified, "raw-read", site.where,
                              site.held_before if after else frozenset()))

    def _escape(self, obj: Any, site: _Site, why: str) -> None:
        """``obj`` (a module, Parameter or plain object) leaves what the analysis models: a read of all below it."""
        if isinstance(obj, nn.Parameter):
            self._read(obj, _Site(site.reader, frozenset(), f"{site.where}; {why}"), after=False)
            return
        if not isinstance(obj, nn.Module):
            for held in self._held(obj):
                self._escape(held, site, why)
            return
        path = self.tree.path_of.get(id(obj))
        if path is None or (site.reader, id(obj)) in self.escaped:
            return
        self.escaped.add((site.reader, id(obj)))
        owners = self._subtree_owners.get(id(obj))
        if owners is None:
            by_owner: dict[str, str] = {}
            for _, param in self.tree.subtree_params(path):
                for owner_path, name in self.tree.param_owners.get(id(param), ()):
                    by_owner.setdefault(owner_path, f"{owner_path}.{name}" if owner_path else name)
            owners = sorted(by_owner.items())
            self._subtree_owners[id(obj)] = owners
        where = f"{site.where}; {why}: everything below {path or '<root>'} counts as read there"
        for owner_path, qualified in owners:
            if not self.tree.is_ancestor_or_self(owner_path, site.reader):
                self._add(RawRead(site.reader, owner_path, qualified, "raw-read", where))

    def _opaque(self, module: nn.Module, reader: str, why: str) -> None:
        path = self.tree.path_of.get(id(module), reader)
        self.opaque.setdefault(path, why)
        if path == reader:
            self._add(RawRead(reader, reader, None, "opaque", why))
        else:
            self._escape(module, _Site(reader, frozenset(), why), "unreadable code")

    # -- driving ----------------------------------------------------------------------------------------------

    def run(self) -> Analysis:
        from torch.nn.modules import module as module_mod

        if module_mod._global_forward_hooks or module_mod._global_forward_pre_hooks:
            why = "global forward hooks are registered (they run around every module)"
            self.opaque[""] = why
            self._add(RawRead("", "", None, "opaque", why))
        done: dict[Any, tuple[str, list[RawRead], dict[str, str]]] = {}
        for path, module in self.tree.modules.items():
            # Repeated layers: a module shaped exactly like one analysed before (same classes, names, hooks and
            # attribute holdings, all the way down) yields the same evidence, moved to its own path.
            sig = self._signature(module)
            seen = done.get(sig) if sig is not None else None
            if seen is not None and self._replay(seen, path):
                continue
            self._capture = []
            opaque_before = dict(self.opaque)
            self._module_code(module, path)
            captured, self._capture = self._capture, None
            added = {k: v for k, v in self.opaque.items() if k not in opaque_before}
            if sig is not None and path and sig not in done:
                done[sig] = (path, captured, added)
        return Analysis(list(self.events.values()), self.opaque)

    def _module_code(self, module: nn.Module, path: str) -> None:
        """Everything that runs as ``module``'s code: its hooks, a ``__call__`` override and its forward."""
        self._hooks(module, path)
        call = _class_attr(type(module), "__call__")
        if call is not nn.Module.__call__ and path:
            # Runs before the module's hooks: code of the parent, outside the module's own window.
            parent = self.tree.parent(path) or ""
            site = _Site(parent, frozenset(), f"{type(module).__name__}.__call__")
            if self._callable(call, [(module,)], {}, site) is None:
                self._opaque(module, parent, f"{type(module).__name__}.__call__ cannot be read")
        if not _runs_own_code(module):
            return
        try:
            forward = _forward_function(module)
            self._function(_source_function(forward), {}, (module,), path, frozenset(), forward_of=module)
        except _Opaque as exc:
            self.opaque[path] = str(exc)
            self._add(RawRead(path, path, None, "opaque", str(exc)))

    def _signature(self, module: nn.Module) -> Any:
        """A hashable description of everything the analysis of ``module``'s code can depend on (None: unique)."""
        key = id(module)
        if key in self._sigs:
            return self._sigs[key]
        self._sigs[key] = None  # a module reachable from itself: unique
        if not all(type(d) is dict for d in (module._parameters, module._buffers, module._modules)):
            return None  # e.g. a ScriptModule's registries: not plain dicts
        path = self.tree.path_of.get(key, "")
        holdings = []
        for name, value in module.__dict__.items():
            if name.startswith("_") or isinstance(value, (*_SCALARS, torch.Tensor)):
                continue
            held = self._held(value)
            relative = []
            for obj in held:
                where = self.tree.path_of.get(id(obj)) if isinstance(obj, nn.Module) else None
                if where is None or not self.tree.is_ancestor_or_self(path, where) or not path:
                    return None  # holds something outside its own subtree
                relative.append(where[len(path):])
            holdings.append((name, type(value), tuple(relative)))
        children = []
        for name, child in module._modules.items():
            child_sig = None if child is None else self._signature(child)
            if child is not None and child_sig is None:
                return None
            children.append((name, child_sig))
        if any(p is not None and self._shared(p) for p in module._parameters.values()):
            return None  # a Parameter shared with another module: its evidence depends on where the other is
        params = tuple((n, p is None) for n, p in module._parameters.items())
        hooks = bool(module._forward_hooks or module._forward_pre_hooks)
        sig = (type(module), module.__dict__.get("forward"), hooks, params, tuple(module._buffers), tuple(children),
               tuple(holdings))
        if hooks or "forward" in module.__dict__:
            sig = None
        self._sigs[key] = sig
        return sig

    def _shared(self, param: nn.Parameter) -> bool:
        return len(self.tree.param_owners.get(id(param), ())) > 1

    def _replay(self, seen: tuple[str, list[RawRead], dict[str, str]], path: str) -> bool:
        """Re-add the evidence found for an identically shaped module at ``seen[0]``, moved to ``path``."""
        old, events, opaque = seen
        old_parent, new_parent = self.tree.parent(old) or "", self.tree.parent(path) or ""

        def move(p: str) -> str | None:
            if p == old or p.startswith(old + "."):
                return path + p[len(old):]
            return new_parent if p == old_parent else None

        moved: list[RawRead] = []
        for e in events:
            reader, owner = move(e.reader), move(e.owner)
            after = [move(a) for a in e.after_forward_of]
            if reader is None or owner is None or any(a is None for a in after):
                return False
            param = None if e.param is None else move(e.param)
            if e.param is not None and param is None:
                return False
            location = e.location.replace(f"below {old} ", f"below {path} ")
            moved.append(RawRead(reader, owner, param, e.kind, location, frozenset(a for a in after if a)))
        moved_opaque = {}
        for p, why in opaque.items():
            target = move(p)
            if target is None:
                return False
            moved_opaque[target] = why
        for event in moved:
            self._add(event)
        for p, why in moved_opaque.items():
            self.opaque.setdefault(p, why)
        return True

    def _hooks(self, module: nn.Module, path: str) -> None:
        hooks = [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]
        for hook in hooks:
            if getattr(hook, "__fsdp_compat_guard__", False):
                continue  # fsdp-compat's own run-time guard: reads no parameter
            # Hooks registered before fully_shard run inside the module's window (FSDP2 prepends its pre-hook and
            # appends its post-hook), so the module's own parameters are unsharded there.
            site = _Site(path, frozenset(), f"forward hook {getattr(hook, '__qualname__', repr(hook))}")
            if self._callable(hook, [(module,)], {}, site, torch_ok=True) is None:
                self._escape(module, site, "a hook the analysis cannot read")

    # -- calls ------------------------------------------------------------------------------------------------

    def _function(self, func: types.FunctionType, kwargs: dict[str, tuple[Any, ...]], args: tuple[Any, ...],
                  reader: str, before: frozenset[str], *, forward_of: nn.Module | None = None,
                  where: str = "") -> list[Any]:
        """Analyse one function run by ``reader`` with ``args`` (each a tuple of possible objects) bound."""
        facts = function_facts(func)
        positional = [a if isinstance(a, tuple) else (a,) for a in args]
        bindings: Bindings = {}
        for name, value in zip(facts.positional, positional, strict=False):
            bindings[name] = value
        for name, value in kwargs.items():
            if name in facts.positional or name in facts.kwonly:
                bindings[name] = value
        key = (
            func.__code__, reader, before,
            tuple(sorted((k, tuple(id(o) for o in v)) for k, v in bindings.items())),
        )
        if key in self.visited:
            return self.visited[key]
        self.visited[key] = _Outcome()
        extra = positional[len(facts.positional):]
        extra_kw = {k: v for k, v in kwargs.items() if k not in bindings}
        leftovers = [o for v in (*extra, *extra_kw.values()) for o in v]
        if leftovers and not (facts.vararg or facts.kwarg):
            leftovers = []  # a call that would raise TypeError: nothing runs
        closure = dict(zip(func.__code__.co_freevars, func.__closure__ or (), strict=False))
        returned: dict[int, list[Any]] = {}
        called: dict[int, frozenset[str]] = {}
        results = _Outcome()
        site_of = functools.partial(self._site, facts, reader, before, called)
        for obj in leftovers:
            self._escape(obj, site_of(facts.uses[0] if facts.uses else None), "passed through *args/**kwargs")
        # Arguments that hold values (a Parameter, a container) rather than modules: fetched by the caller.
        values = {n for n, objs in bindings.items() if any(not isinstance(o, (nn.Module, _Bound)) for o in objs)}
        for use in facts.uses:
            site = site_of(use)
            if use.bound is not None or values.intersection(use.bases):
                held = frozenset() if values.intersection(use.bases) else use.bound
                site._held = (before, called, dataclasses.replace(use, before=use.before & held))
            targets = self._targets(use.refs, bindings, closure, func, returned, site)
            if use.how == "call":
                out = self._do_call(use, targets, bindings, closure, func, returned, site, called)
                returned[use.node] = out
            else:
                for res in targets:
                    self._do_use(use, res, site, forward_of, results, reader)
        results.called = before.union(*(called.get(i, frozenset()) for i in facts.exit_before))
        self.visited[key] = results
        return results

    def _site(self, facts: _FunctionFacts, reader: str, before: frozenset[str], called: dict[int, frozenset[str]],
              use: _Use | None) -> _Site:
        lineno = use.lineno if use is not None else facts.lineno_offset + 1
        return _Site(reader, (before, called, use), (facts, lineno))

    def _targets(self, refs: Refs, bindings: Bindings, closure: dict[str, Any], func: types.FunctionType,
                 returned: dict[int, list[Any]], site: _Site) -> list[_Resolved]:
        out: list[_Resolved] = []
        for ref in refs:
            for root in self._roots(ref.root, bindings, closure, func, returned, site):
                if ref.root == "super":
                    out.extend(self._super(func, root, ref.steps))
                else:
                    out.extend(self.resolver.resolve(root, ref.steps))
        return out

    def _roots(self, name: str, bindings: Bindings, closure: dict[str, Any], func: types.FunctionType,
               returned: dict[int, list[Any]], site: _Site) -> tuple[Any, ...]:
        if name in bindings:
            return bindings[name]
        if name.startswith("#"):
            return tuple(returned.get(int(name[1:]), ()))
        if name == "super":
            first = next(iter(bindings.values()), ())
            return first
        if name in closure:
            return (closure[name].cell_contents,) if _cell_full(closure[name]) else ()
        if name in func.__globals__:
            return (func.__globals__[name],)
        value = getattr(builtins, name, None)
        return () if value is None else (value,)

    def _super(self, func: types.FunctionType, self_obj: Any, steps: tuple[Step, ...]) -> list[_Resolved]:
        if not steps or not isinstance(steps[0], str) or not isinstance(self_obj, nn.Module):
            return []
        name = steps[0]
        owner_name = func.__qualname__.rsplit(".", 1)[0]
        mro = type(self_obj).__mro__
        for index, cls in enumerate(mro):
            if cls.__qualname__ == owner_name and func.__name__ in cls.__dict__:
                for later in mro[index + 1:]:
                    if name in later.__dict__:
                        if name in _HOOKED_CALLS and later is nn.Module:
                            return [_Resolved("method", self_obj, attr="__call__")]
                        if later is nn.Module:
                            return [_Resolved("escape", self_obj, attr=f"super().{name}")]
                        return [_Resolved("function", later.__dict__[name], owner=self_obj, attr=name)]
                return []
        return [_Resolved("escape", self_obj, attr="super()")]

    def _arg_objects(
        self, use: _Use, bindings: Bindings, closure: dict[str, Any], func: types.FunctionType,
        returned: dict[int, list[Any]], site: _Site,
    ) -> tuple[list[tuple[Any, ...]], dict[str, tuple[Any, ...]], list[Any]]:
        """Positional and keyword arguments resolved to objects; what goes through ``*``/``**`` is returned apart."""
        positional: list[tuple[Any, ...]] = []
        keywords: dict[str, tuple[Any, ...]] = {}
        starred: list[Any] = []
        for arg in use.args:
            objs = tuple(self._objects(arg.refs, bindings, closure, func, returned, site))
            if arg.kind == "pos":
                positional.append(objs)
            elif arg.kind == "kw" and arg.name:
                keywords[arg.name] = objs
            else:
                starred.extend(objs)
        return positional, keywords, starred

    def _objects(self, refs: Refs, bindings: Bindings, closure: dict[str, Any], func: types.FunctionType,
                 returned: dict[int, list[Any]], site: _Site) -> list[Any]:
        """What ``refs`` may evaluate to, as objects worth tracking (modules, Parameters, holders of them)."""
        out: list[Any] = []
        for res in self._targets(refs, bindings, closure, func, returned, site):
            if res.kind in ("module", "param", "object"):
                out.append(res.obj)
            elif res.kind in ("method", "property", "escape"):
                out.append(_Bound(res))
        return out

    def _do_call(self, use: _Use, targets: list[_Resolved], bindings: Bindings, closure: dict[str, Any],
                 func: types.FunctionType, returned: dict[int, list[Any]], site: _Site,
                 called: dict[int, frozenset[str]]) -> list[Any]:
        positional, keywords, starred = self._arg_objects(use, bindings, closure, func, returned, site)
        tracked = [o for objs in (*positional, *keywords.values()) for o in objs]
        for obj in starred:
            self._escape_any(obj, site, "passed through *args/**kwargs")
        results: list[Any] = []
        must: frozenset[str] | None = None  # modules called by this call whichever target it is
        followed_all = bool(targets)
        for res in targets:
            calls: set[str] = set()
            out = self._call_target(res, positional, keywords, site, calls)
            if out is None:
                followed_all = False
            else:
                results.extend(out)
                calls |= getattr(out, "called", frozenset())
            must = frozenset(calls) if must is None else must & calls
        if not followed_all:
            for obj in tracked:
                self._escape_any(obj, site, "handed to code the analysis does not follow")
        if must:
            called[use.index] = must
        return results

    def _escape_any(self, obj: Any, site: _Site, why: str) -> None:
        if isinstance(obj, _Bound):
            res = obj.res
            if res.kind == "method" and res.attr in _HOOKED_CALLS:
                return  # a module's __call__ handed on: whoever calls it runs the module's hooks
            self._escape(res.obj, site, why)
        else:
            self._escape(obj, site, why)

    def _call_target(self, res: _Resolved, positional: list[tuple[Any, ...]], keywords: dict[str, tuple[Any, ...]],
                     site: _Site, calls: set[str]) -> list[Any] | None:
        """Follow one possible callee; None when it is not followed (its tracked arguments then escape)."""
        if res.kind == "module" or (res.kind == "method" and res.attr in _HOOKED_CALLS):
            module = res.obj
            path = self.tree.path_of.get(id(module))
            if path is None:
                return None
            calls.add(path)
            if path != site.reader:
                self._add(RawRead(site.reader, path, None, "call", site.where))
            if self._carries(positional, keywords):
                try:
                    forward = _source_function(_forward_function(module))
                except _Opaque:
                    return None
                self._function(forward, keywords, ((module,), *positional), path, site.held_before | {path},
                               forward_of=module)
            return []
        if res.kind == "param":
            self._read(res.obj, site)
            return []
        if res.kind == "escape":
            self._escape(res.obj, site, f"reached through {res.attr}")
            return []
        if res.kind == "method":
            module = res.obj
            if _defined_by_nn_module(type(module), res.attr):
                return self._nn_module_method(module, res.attr, positional, keywords, site)
            method = inspect.getattr_static(module, res.attr, None)
            if res.attr in module.__dict__:
                method = module.__dict__[res.attr].__func__
            try:
                source = _source_function(method)
            except _Opaque as exc:
                self._opaque_method(module, site, str(exc))
                return []
            args: tuple[Any, ...] = ((module,), *positional)
            if isinstance(method, staticmethod):
                args = tuple(positional)
            return self._function(source, keywords, args, site.reader, site.held_before, where=site.where)
        if res.kind == "property":
            return self._property(res, site)
        if res.kind == "function":  # super().name
            try:
                source = _source_function(res.obj)
            except _Opaque as exc:
                self._opaque_method(res.owner, site, str(exc))
                return []
            return self._function(source, keywords, ((res.owner,), *positional), site.reader, site.held_before,
                                  where=site.where)
        if res.kind == "static":
            if isinstance(res.obj, type):
                return None  # constructing an object from modules or Parameters: they escape into it
            return []
        target = res.obj
        if target is getattr or target is setattr or target is vars:
            return None
        if isinstance(target, types.BuiltinFunctionType) or ((
            isinstance(target, type) or _torch_code(target)
        ) and not isinstance(target, (types.MethodType, functools.partial))):
            return None
        if not self._carries(positional, keywords) and not self._held(target):
            return []  # nothing of the model goes in: whatever it does, it cannot touch a Parameter
        if isinstance(target, (types.FunctionType, types.MethodType, functools.partial)):
            return self._callable(target, positional, keywords, site)
        for held in self._held(target):  # a callable object: whatever it holds escapes
            self._escape(held, site, "held by a callable the analysis does not follow")
        return None

    def _nn_module_method(self, module: nn.Module, name: str, positional: list[tuple[Any, ...]],
                          keywords: dict[str, tuple[Any, ...]], site: _Site) -> list[Any]:
        """nn.Module's own methods: module iterators and hook registration are modelled, the rest reflects."""
        if name in _MODULE_ITERATORS or name in _PARAM_ITERATORS:
            # Every item the call can yield, with its real name when called without arguments (with arguments -
            # a prefix, recurse=False... - the same or fewer objects, names unknown: a name test keeps them all).
            if name in _PARAM_ITERATORS:
                items = list(module.named_parameters())
            elif name.endswith("modules"):
                items = list(module.named_modules())
            else:
                items = [(n, m) for n, m in module._modules.items() if m is not None]
            plain = not positional and not keywords
            if name.startswith("named_"):
                return [_Seq(_Seq((n if plain else None, m)) for n, m in items)]
            return [_Seq(m for _, m in items)]
        if name in _HOOK_REGISTRATION:
            hooks = [*(positional[0] if positional else ()), *keywords.get("hook", ())]
            path = self.tree.path_of.get(id(module), site.reader)
            for hook in hooks:
                inner = _Site(path, frozenset(), f"{site.where}; hook registered there")
                if isinstance(hook, _Bound) or self._callable(hook, [(module,)], {}, inner, torch_ok=True) is None:
                    self._escape(module, site, "a hook registered in forward that the analysis cannot read")
            return []
        self._escape(module, site, f"nn.Module.{name}() reflects on it")
        return []

    def _callable(self, target: Any, positional: list[tuple[Any, ...]], keywords: dict[str, tuple[Any, ...]],
                  site: _Site, *, torch_ok: bool = False) -> list[Any] | None:
        """Follow a call of a plain function, bound method or partial; None when it cannot be followed."""
        prefix: list[tuple[Any, ...]] = []
        func = target
        kw = dict(keywords)
        while isinstance(func, functools.partial):
            prefix = [(a,) for a in func.args] + prefix
            kw = {**{k: (v,) for k, v in func.keywords.items()}, **kw}
            func = func.func
        if isinstance(func, types.MethodType):
            prefix = [(func.__self__,), *prefix]
            func = func.__func__
        if isinstance(func, nn.Module):
            return None
        try:
            source = _source_function(func)
        except _Opaque:
            return None
        if _torch_code(source) and not torch_ok:
            return None  # torch's functional code: a Parameter handed to it is simply read
        return self._function(source, kw, (*prefix, *positional), site.reader, site.held_before, where=site.where)

    def _property(self, res: _Resolved, site: _Site) -> list[Any]:
        static = _class_attr(type(res.obj), res.attr)
        getter = static.fget if isinstance(static, property) else getattr(static, "func", None)
        try:
            source = _source_function(getter)
        except _Opaque as exc:
            self._opaque_method(res.obj, site, str(exc))
            return []
        return self._function(source, {}, ((res.obj,),), site.reader, site.held_before, where=site.where)

    def _opaque_method(self, module: Any, site: _Site, why: str) -> None:
        if isinstance(module, nn.Module):
            path = self.tree.path_of.get(id(module), site.reader)
            self.opaque.setdefault(path, why)
            self._escape(module, site, f"unreadable code ({why})")

    def _held(self, obj: Any) -> list[Any]:
        key = id(obj)
        if key not in self._held_memo:
            self._held_memo[key] = (obj, _held(obj, self.tree))
        return self._held_memo[key][1]

    def _carries(self, positional: list[tuple[Any, ...]], keywords: dict[str, tuple[Any, ...]]) -> bool:
        """True when an argument is (or holds) a module, a Parameter or a method of the model."""
        return any(
            isinstance(o, _Bound) or self._held(o) for objs in (*positional, *keywords.values()) for o in objs
        )

    def _returned_site(self, module: nn.Module, site: _Site) -> _Site:
        """A forward that returns a module or Parameter hands it to its caller: charged to the parent."""
        path = self.tree.path_of.get(id(module), "")
        parent = self.tree.parent(path) if path else None
        return _Site(parent if parent is not None else path, frozenset(), site.where)

    def _do_use(self, use: _Use, res: _Resolved, site: _Site, forward_of: nn.Module | None, results: list[Any],
                reader: str) -> None:
        how = use.how
        kind = res.kind
        if kind == "param":
            if how in ("inert", "discard", "bind"):
                return
            if how == "return" and forward_of is None:
                results.append(res.obj)  # handed back to the caller, which decides
                return
            if how == "return":
                self._escape(res.obj, self._returned_site(forward_of, site), "returned from a forward")
                return
            self._read(res.obj, site)
            return
        if kind == "module":
            if how in ("inert", "discard", "bind", "test", "iter"):
                return
            if how == "return":
                if forward_of is None:
                    results.append(res.obj)
                else:
                    self._escape(res.obj, self._returned_site(forward_of, site), "returned from a forward")
                return
            if how == "store":
                if use.attr in res.obj._parameters or use.attr in res.obj._modules:
                    self._escape(res.obj, site, f"its {use.attr} is replaced")
                return
            self._escape(res.obj, site, "used as a value")
            return
        if kind == "escape":
            if how in ("inert",):
                return
            self._escape(res.obj, site, f"reached through {res.attr}")
            return
        if kind == "property":
            if how in ("inert", "store"):
                return
            out = self._property(res, site)
            for obj in out:
                fake = _Use(use.index, use.refs, how, use.lineno, use.before)
                for sub in self.resolver.resolve(obj, ()):
                    self._do_use(fake, sub, site, forward_of, results, reader)
            return
        if kind == "method":
            if how in ("inert", "discard", "bind", "test"):
                return
            if res.attr in _HOOKED_CALLS:
                path = self.tree.path_of.get(id(res.obj))
                if path is not None and path != reader:
                    self._add(RawRead(reader, path, None, "call", site.where))
                return
            self._escape(res.obj, site, f"its method {res.attr} is handed on")
            return
        if kind == "object":
            if how in ("inert", "discard", "bind", "test", "iter"):
                return
            if how == "return" and forward_of is None:
                results.append(res.obj)
                return
            for held in self._held(res.obj):
                self._escape(held, site, "held by an object the analysis does not model")


class _Outcome(list):  # type: ignore[type-arg]
    """What a followed function returned (objects of the model), and the modules it called on every path."""

    called: frozenset[str] = frozenset()


class _Seq(tuple):  # type: ignore[type-arg]
    """What a module iterator (``named_modules()``...) returns: iterating or indexing it gives its items."""


@dataclass(frozen=True)
class _Bound:
    """A method, property or reflective access handed around as a value."""

    res: _Resolved




def find_raw_reads(model: nn.Module, tree: ModuleTree | None = None) -> Analysis:
    """Static evidence for ``model``: raw reads, skip-level forward calls and unreadable (opaque) modules."""
    return _Analyzer(tree or ModuleTree.build(model)).run()
