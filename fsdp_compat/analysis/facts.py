"""From a callable, or a module's forward, to the cached facts of its source.

The interpreter asks here for "what does this function do"; the answer is parsed once per code object
(``lru_cache``) and raises ``Opaque`` when the source cannot be read.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
import types
from typing import Any

from torch import nn

from fsdp_compat.analysis.collector import Collector
from fsdp_compat.analysis.refs import FunctionFacts, Opaque, Use


def source_function(func: Any) -> types.FunctionType:
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
        raise Opaque(f"{func!r} is not a Python function")
    return func


@functools.lru_cache(maxsize=8192)
def _facts_for_code(code: types.CodeType, func: types.FunctionType) -> FunctionFacts:
    try:
        source = textwrap.dedent(inspect.getsource(func))
        module_ast = ast.parse(source)
    except (OSError, TypeError, SyntaxError, IndentationError) as exc:
        raise Opaque(f"source of {func.__qualname__} unavailable: {exc}") from None
    node: ast.AST | None = None
    if func.__name__ == "<lambda>":
        lambdas = [n for n in ast.walk(module_ast) if isinstance(n, ast.Lambda)]
        if len(lambdas) != 1:
            raise Opaque(f"cannot tell which lambda on line {code.co_firstlineno} is {func.__qualname__}")
        node = lambdas[0]
    else:
        node = next(
            (n for n in module_ast.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))), None
        )
    if node is None:
        raise Opaque(f"{func.__qualname__} is not defined by a def statement")
    args = node.args  # type: ignore[attr-defined]
    positional = tuple(a.arg for a in (*args.posonlyargs, *args.args))
    if len(positional) + len(args.kwonlyargs) != code.co_argcount + code.co_kwonlyargcount:
        raise Opaque(f"the source found for {func.__qualname__} does not match its code")
    collector = Collector(node, func.__globals__, code.co_freevars)
    offset = code.co_firstlineno - 1
    uses = tuple(_replace_line(u, u.lineno + offset) for u in collector.uses)
    return FunctionFacts(
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


def _replace_line(use: Use, lineno: int) -> Use:
    return dataclasses.replace(use, lineno=lineno)


def function_facts(func: Any) -> FunctionFacts:
    """Parsed, cached facts about one function (raises Opaque when its source cannot be read)."""
    func = source_function(func)
    return _facts_for_code(func.__code__, func)


def runs_own_code(module: nn.Module) -> bool:
    """False for torch's own building blocks, whose forwards read only their own parameters."""
    forward = module.__dict__.get("forward") or type(module).forward
    func = getattr(forward, "__func__", forward)
    func = inspect.unwrap(func) if callable(func) else func
    module_name = getattr(func, "__module__", "") or ""
    return not module_name.startswith("torch.")


def torch_code(func: Any) -> bool:
    return (getattr(func, "__module__", "") or "").startswith("torch")


def forward_function(module: nn.Module) -> Any:
    instance_forward = module.__dict__.get("forward")
    if instance_forward is not None:
        if isinstance(instance_forward, types.MethodType) and instance_forward.__self__ is module:
            return instance_forward.__func__
        raise Opaque(f"instance-level forward {instance_forward!r} on {type(module).__name__}")
    static = inspect.getattr_static(type(module), "forward", None)
    if isinstance(static, functools.partialmethod):
        raise Opaque(f"{type(module).__name__}.forward is a functools.partialmethod")
    return type(module).forward
