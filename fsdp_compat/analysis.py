"""Static analysis: find parameter reads that happen outside the owning module's forward.

FSDP2 unshards a group only inside its module's forward (and backward). A module may therefore own a group only if
every read of its parameters happens there. This module reads the code that actually runs - each module's current
``forward`` (so a framework's monkey-patched forward counts), the helper methods it calls on itself and on its
children, and ``super()`` chains - and reports every expression that reaches a Parameter through an attribute chain
(``self.a.b.weight``, local aliases, ``get_input_embeddings()``, ``for layer in self.layers``) from another module's
code, plus forward calls that skip levels of the tree. Source it cannot read makes the module *opaque*: the planner
then assumes it may read anything below it.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fsdp_compat.tree import ModuleTree

# Reading these off a Parameter never touches its data, and they are correct on a sharded DTensor too.
METADATA_ATTRS = frozenset(
    {
        "shape", "dtype", "device", "ndim", "size", "dim", "numel", "nelement", "requires_grad", "is_cuda",
        "is_meta", "layout", "element_size", "is_floating_point", "is_complex", "names", "data_ptr",
        "is_contiguous", "stride", "__class__", "type",
    }
)
# Getters that return submodules; calling them during analysis is safe and resolves the chain.
MODULE_GETTERS = frozenset({"get_input_embeddings", "get_output_embeddings", "get_decoder", "get_encoder"})
# Builtins whose arguments are inspected, never called or read.
INERT_CALLS = frozenset(
    {"isinstance", "issubclass", "hasattr", "getattr", "type", "id", "len", "print", "repr", "str", "callable"}
)
# Calling a module through these runs its hooks (FSDP2 unshards there); calling ``.forward()`` directly does not.
_HOOKED_CALLS = frozenset({"__call__", "_call_impl", "_wrapped_call_impl"})

Step = Any  # str attribute | ("()", getter) | ("[]", key or None) | ("*",)


@dataclass(frozen=True)
class RawRead:
    """One piece of evidence: ``reader``'s code touches ``owner`` outside ``owner``'s own forward window.

    kind: ``"raw-read"`` (a parameter used directly), ``"call"`` (``owner``'s forward called from ``reader``,
    which matters when it skips levels of the tree), or ``"opaque"`` (``reader``'s source could not be read).
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


@dataclass(frozen=True)
class _Use:
    steps: tuple[Step, ...]
    how: str  # "call" (the chain is called), "arg" (passed to a non-builtin call), "value"
    lineno: int


@dataclass(frozen=True)
class _FunctionFacts:
    uses: tuple[_Use, ...]
    super_calls: tuple[tuple[str, int], ...]
    # Calls that hand ``self`` to another function: (callee name as written, parameter position or keyword, line).
    self_passing: tuple[tuple[str, int | str, int], ...]
    filename: str
    qualname: str


class _Opaque(Exception):
    pass


def _source_function(func: Any) -> types.FunctionType:
    func = inspect.unwrap(func)
    if isinstance(func, (staticmethod, classmethod)):
        func = func.__func__
    if not isinstance(func, types.FunctionType):
        raise _Opaque(f"{func!r} is not a Python function")
    return func


@functools.lru_cache(maxsize=4096)
def _facts_for_code(code: types.CodeType, func: types.FunctionType, self_param: int | str = 0) -> _FunctionFacts:
    try:
        source = textwrap.dedent(inspect.getsource(func))
        module_ast = ast.parse(source)
    except (OSError, TypeError, SyntaxError, IndentationError) as exc:
        raise _Opaque(f"source of {func.__qualname__} unavailable: {exc}") from None
    node = next(
        (n for n in module_ast.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))), None
    )
    if node is None:
        raise _Opaque(f"{func.__qualname__} is not defined by a def statement")
    offset = code.co_firstlineno - 1
    positional = [a.arg for a in (*node.args.posonlyargs, *node.args.args)]
    if isinstance(self_param, int):
        self_name = positional[self_param] if self_param < len(positional) else None
    else:
        named = {*positional, *(a.arg for a in node.args.kwonlyargs)}
        self_name = self_param if self_param in named else None
    if self_name is None:
        # e.g. a decorator's ``wrapper(*args, **kwargs)`` without functools.wraps: the real code is elsewhere.
        raise _Opaque(f"{func.__qualname__} takes the module only through *args/**kwargs")
    uses, supers, passing = _collect_uses(node, self_name)
    return _FunctionFacts(
        uses=tuple(_Use(u.steps, u.how, u.lineno + offset) for u in uses),
        super_calls=tuple((name, line + offset) for name, line in supers),
        self_passing=tuple((name, where, line + offset) for name, where, line in passing),
        filename=code.co_filename,
        qualname=func.__qualname__,
    )


def function_facts(func: Any, self_param: int | str = 0) -> _FunctionFacts:
    """Parsed, cached facts about one function: the attribute chains it uses and how (raises _Opaque).

    ``self_param`` says which parameter holds the module: the first positional one for methods, another position
    or a keyword for a plain function the module passes itself to (``eager_attention_forward(self, ...)``).
    """
    func = _source_function(func)
    return _facts_for_code(func.__code__, func, self_param)


def _collect_uses(
    fn: ast.AST, self_name: str | None
) -> tuple[list[_Use], list[tuple[str, int]], list[tuple[str, int | str, int]]]:
    aliases: dict[str, tuple[Step, ...]] = {}
    if self_name:
        aliases[self_name] = ()
    parents: dict[int, ast.AST] = {}
    for parent in ast.walk(fn):
        for child in ast.iter_child_nodes(parent):
            parents[id(child)] = parent

    def chain(node: ast.AST) -> tuple[Step, ...] | None:
        if isinstance(node, ast.Name):
            return aliases.get(node.id)
        if isinstance(node, ast.Attribute):
            base = chain(node.value)
            return None if base is None else (*base, node.attr)
        if isinstance(node, ast.Subscript):
            base = chain(node.value)
            if base is None:
                return None
            key = node.slice
            if isinstance(key, ast.Slice):
                return base  # a slice of a ModuleList/Sequential is a container of the same children
            if isinstance(key, ast.Constant) and isinstance(key.value, (int, str)):
                return (*base, ("[]", key.value))
            return (*base, ("[]", None))
        if isinstance(node, ast.Call) and not node.args and not node.keywords:
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in MODULE_GETTERS:
                base = chain(func.value)
                return None if base is None else (*base, ("()", func.attr))
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "getattr"
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            base = chain(node.args[0])
            return None if base is None else (*base, node.args[1].value)
        return None

    def iter_chain(node: ast.AST) -> tuple[Step, ...] | None:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "enumerate":
            node = node.args[0] if node.args else node
        base = chain(node)
        return None if base is None else (*base, ("*",))

    def bind(target: ast.AST, value: tuple[Step, ...] | None, enumerate_pair: bool = False) -> None:
        if value is None:
            return
        if isinstance(target, ast.Name):
            aliases.setdefault(target.id, value)
        elif enumerate_pair and isinstance(target, ast.Tuple) and len(target.elts) == 2:
            bind(target.elts[1], value)

    # Aliases are collected flow-insensitively, twice so that aliases of aliases resolve.
    for _ in range(2):
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                bind(node.targets[0], chain(node.value))
            elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
                bind(node.target, chain(node.value))
            elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
                is_enum = isinstance(node.iter, ast.Call) and getattr(node.iter.func, "id", "") == "enumerate"
                bind(node.target, iter_chain(node.iter), enumerate_pair=is_enum)

    uses: list[_Use] = []
    supers: list[tuple[str, int]] = []
    passing: list[tuple[str, int | str, int]] = []
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id not in INERT_CALLS:
            for index, arg in enumerate(node.args):
                if isinstance(arg, ast.Name) and aliases.get(arg.id) == () and not isinstance(arg, ast.Starred):
                    passing.append((node.func.id, index, node.lineno))
            for keyword in node.keywords:
                value = keyword.value
                if keyword.arg and isinstance(value, ast.Name) and aliases.get(value.id) == ():
                    passing.append((node.func.id, keyword.arg, node.lineno))
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Call)
            and isinstance(node.func.value.func, ast.Name)
            and node.func.value.func.id == "super"
        ):
            supers.append((node.func.attr, node.lineno))
            continue
        if not isinstance(node, (ast.Name, ast.Attribute, ast.Subscript, ast.Call)):
            continue
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            continue
        if isinstance(node, (ast.Attribute, ast.Subscript)) and not isinstance(node.ctx, ast.Load):
            continue
        steps = chain(node)
        if steps is None or steps == ():
            continue
        parent = parents.get(id(node))
        if _extends_chain(parent, node, chain):
            continue
        how = "value"
        if isinstance(parent, ast.Call):
            if parent.func is node:
                how = "call"
            elif isinstance(parent.func, ast.Name) and parent.func.id in INERT_CALLS:
                continue  # isinstance(self.w, ...), hasattr(...): looks at the object, never at its data
            else:
                how = "arg"
        elif isinstance(parent, ast.keyword):
            grand = parents.get(id(parent))
            if isinstance(grand, ast.Call) and not (
                isinstance(grand.func, ast.Name) and grand.func.id in INERT_CALLS
            ):
                how = "arg"
        uses.append(_Use(steps, how, getattr(node, "lineno", 0)))
    return uses, supers, passing


def _extends_chain(parent: ast.AST | None, node: ast.AST, chain: Any) -> bool:
    """True when ``parent`` is a longer chain built on ``node`` (then only the longest chain is a use)."""
    if parent is None:
        return False
    if isinstance(parent, (ast.Attribute, ast.Subscript)) and parent.value is node:
        return chain(parent) is not None
    if isinstance(parent, ast.Call) and isinstance(node, ast.Attribute) and parent.func is node:
        return node.attr in MODULE_GETTERS and not parent.args and chain(parent) is not None
    if isinstance(parent, ast.Call) and isinstance(parent.func, ast.Name) and parent.func.id == "getattr":
        return chain(parent) is not None
    return False


# ---------------------------------------------------------------------------------------------------------------
# Resolution of chains against real module instances


@dataclass(frozen=True)
class _Resolved:
    kind: str  # "module" | "param" | "method"
    obj: Any
    owner: nn.Module | None = None  # for params: the module whose _parameters held it
    attr: str = ""  # for params: attribute name; for methods: method name


@functools.lru_cache(maxsize=65536)
def _class_attr(cls: type, name: str) -> Any:
    """A class attribute without running descriptors (cached: the same classes repeat in every layer)."""
    return inspect.getattr_static(cls, name, None)


def _children(module: nn.Module) -> list[nn.Module]:
    return [m for m in module._modules.values() if m is not None]


def resolve(obj: Any, steps: tuple[Step, ...], owner: nn.Module | None = None, attr: str = "") -> list[_Resolved]:
    """What a chain of steps reaches when started at ``obj`` (a list: ``*`` fans out over children)."""
    if isinstance(obj, nn.Parameter):
        if steps and isinstance(steps[0], str) and steps[0] in METADATA_ATTRS:
            return []
        return [_Resolved("param", obj, owner, attr)]
    if isinstance(obj, torch.Tensor) or not isinstance(obj, nn.Module):
        return []
    if not steps:
        return [_Resolved("module", obj)]
    step, rest = steps[0], steps[1:]
    nexts: list[tuple[Any, str]] = []
    if isinstance(step, str):
        if step in obj._parameters:
            nexts = [(obj._parameters[step], step)]
        elif step in obj._modules:
            nexts = [(obj._modules[step], step)]
        elif step in obj._buffers:
            return []
        else:
            static = _class_attr(type(obj), step)
            if isinstance(static, (types.FunctionType, staticmethod, classmethod)) or (
                step in obj.__dict__ and isinstance(obj.__dict__[step], types.MethodType)
            ):
                return [_Resolved("method", obj, attr=step)] if not rest else []
            if step in obj.__dict__:
                nexts = [(obj.__dict__[step], step)]
            else:
                return []
    elif step[0] == "()":
        try:
            nexts = [(getattr(obj, step[1])(), step[1])]
        except Exception:
            return []
    elif step[0] == "[]":
        key = step[1]
        if key is None:
            nexts = [(child, "") for child in _children(obj)]
        else:
            try:
                nexts = [(obj[key], str(key))]  # type: ignore[index]
            except Exception:
                return []
    elif step[0] == "*":
        nexts = [(child, "") for child in _children(obj)]
    results: list[_Resolved] = []
    for value, name in nexts:
        if value is None:
            continue
        results.extend(resolve(value, rest, owner=obj, attr=name))
    return results


# ---------------------------------------------------------------------------------------------------------------
# The analysis over a whole tree


def _runs_own_code(module: nn.Module) -> bool:
    """False for torch's own building blocks, whose forwards read only their own parameters."""
    forward = module.__dict__.get("forward") or type(module).forward
    func = getattr(forward, "__func__", forward)
    func = inspect.unwrap(func) if callable(func) else func
    module_name = getattr(func, "__module__", "") or ""
    return not module_name.startswith("torch.")


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


class _Analyzer:
    def __init__(self, tree: ModuleTree) -> None:
        self.tree = tree
        self.events: dict[tuple[Any, ...], RawRead] = {}
        self.opaque: dict[str, str] = {}

    def run(self) -> Analysis:
        for path, module in self.tree.modules.items():
            if not _runs_own_code(module):
                continue
            try:
                forward = _forward_function(module)
                self._function(forward, module, path, set())
            except _Opaque as exc:
                self.opaque[path] = str(exc)
                self._add(RawRead(path, path, None, "opaque", str(exc)))
        return Analysis(list(self.events.values()), self.opaque)

    def _add(self, event: RawRead) -> None:
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

    def _function(
        self, func: Any, self_obj: nn.Module, reader: str, visited: set[Any], self_param: int | str = 0
    ) -> None:
        if isinstance(func, staticmethod):
            return  # reached as self.helper(...): it never receives the module (self-passing calls are followed)
        func = _source_function(func)
        key = (func.__code__, id(self_obj), self_param)
        if key in visited:
            return
        visited.add(key)
        facts = function_facts(func, self_param)
        for callee_name, where, lineno in facts.self_passing:
            callee = func.__globals__.get(callee_name, getattr(__builtins__, callee_name, None))
            closure = dict(zip(func.__code__.co_freevars, func.__closure__ or (), strict=False))
            if callee_name in closure:
                try:
                    callee = closure[callee_name].cell_contents
                except ValueError:
                    callee = None
            if isinstance(callee, type) or (callee is not None and getattr(callee, "__module__", "") == "builtins"):
                continue  # a class or builtin given the module (e.g. super-style helpers, id(), vars())
            if not isinstance(inspect.unwrap(callee) if callable(callee) else callee, types.FunctionType):
                raise _Opaque(
                    f"{facts.qualname} passes the module to {callee_name}() at line {lineno}, which cannot be read"
                )
            self._function(callee, self_obj, reader, visited, where)
        called_before: list[tuple[int, str]] = []
        deferred: list[tuple[_Use, _Resolved]] = []
        for use in facts.uses:
            for res in resolve(self_obj, use.steps):
                if res.kind == "module" and use.how in ("call", "arg"):
                    callee = self.tree.path_of.get(id(res.obj))
                    if callee is None or (res.obj is self_obj and use.how == "arg"):
                        continue
                    called_before.append((use.lineno, callee))
                    if callee != reader:
                        self._add(RawRead(reader, callee, None, "call", self._where(facts, use.lineno)))
                elif res.kind == "method" and use.how in ("call", "arg"):
                    target = res.obj
                    if res.attr in _HOOKED_CALLS:
                        callee = self.tree.path_of.get(id(target))
                        if callee is not None and callee != reader:
                            called_before.append((use.lineno, callee))
                            self._add(RawRead(reader, callee, None, "call", self._where(facts, use.lineno)))
                        continue
                    method = inspect.getattr_static(target, res.attr, None)
                    if method is None and res.attr in target.__dict__:
                        method = target.__dict__[res.attr].__func__
                    try:
                        self._function(method, target, reader, visited)
                    except _Opaque as exc:
                        target_path = self.tree.path_of.get(id(target), reader)
                        self.opaque.setdefault(target_path, str(exc))
                        self._add(RawRead(reader, target_path, None, "opaque", str(exc)))
                elif res.kind == "param":
                    deferred.append((use, res))
        for use, res in deferred:
            owner_path = self.tree.path_of.get(id(res.owner))
            if owner_path is None or owner_path == reader:
                continue
            after = frozenset(path for line, path in called_before if line < use.lineno)
            name = f"{owner_path}.{res.attr}" if owner_path else res.attr
            self._add(RawRead(reader, owner_path, name, "raw-read", self._where(facts, use.lineno), after))
        for name, _line in facts.super_calls:
            for method in self._super_methods(func, self_obj, name):
                try:
                    self._function(method, self_obj, reader, visited)
                except _Opaque as exc:
                    self.opaque.setdefault(reader, str(exc))
                    self._add(RawRead(reader, reader, None, "opaque", str(exc)))

    @staticmethod
    def _super_methods(func: types.FunctionType, self_obj: nn.Module, name: str) -> Iterator[Any]:
        owner_name = func.__qualname__.rsplit(".", 1)[0]
        mro = type(self_obj).__mro__
        for index, cls in enumerate(mro):
            if cls.__qualname__ == owner_name and cls.__dict__.get(func.__name__) is not None:
                for later in mro[index + 1 :]:
                    if name in later.__dict__:
                        method = later.__dict__[name]
                        if getattr(method, "__module__", "").startswith("torch.") or later is nn.Module:
                            return
                        yield method
                        return
                return

    @staticmethod
    def _where(facts: _FunctionFacts, lineno: int) -> str:
        filename = facts.filename.rsplit("/", 1)[-1]
        return f"{filename}:{lineno} in {facts.qualname}"


def find_raw_reads(model: nn.Module, tree: ModuleTree | None = None) -> Analysis:
    """Static evidence for ``model``: raw reads, skip-level forward calls and unreadable (opaque) modules."""
    return _Analyzer(tree or ModuleTree.build(model)).run()
