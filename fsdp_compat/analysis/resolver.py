"""Resolution: what a reference chain reaches when started at a real object.

Walks attribute, index and getter steps through a live module tree (registered children and Parameters, plain
attributes, containers, namespaces) without running unknown code; anything it cannot be sure of comes back as an
escape. Also finds the modules and Parameters a plain Python object holds (``held_values``).
"""

from __future__ import annotations

import functools
import inspect
import types
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fsdp_compat.analysis.names import (
    HOOKED_CALLS,
    METADATA_ATTRS,
    MISSING,
    MODULE_METADATA,
    REFLECTION_ATTRS,
    REGISTRIES,
    SCALARS,
    SCAN_DEPTH,
    Step,
)
from fsdp_compat.tree import ModuleTree


@dataclass(frozen=True)
class Resolved:
    kind: str  # "module" | "param" | "method" | "property" | "object" | "escape" | "static"
    obj: Any
    owner: nn.Module | None = None  # for params: the module whose _parameters held it
    attr: str = ""  # for params: attribute name; for methods/properties: the name


@functools.lru_cache(maxsize=65536)
def class_attr(cls: type, name: str) -> Any:
    """A class attribute without running descriptors (cached: the same classes repeat in every layer)."""
    return inspect.getattr_static(cls, name, None)


@functools.lru_cache(maxsize=4096)
def _custom_getattr(cls: type) -> bool:
    """True when ``cls`` answers unknown attributes itself (peft's wrappers forward them to an inner module)."""
    return inspect.getattr_static(cls, "__getattr__", None) is not nn.Module.__getattr__


@functools.lru_cache(maxsize=4096)
def defined_by_nn_module(cls: type, name: str) -> bool:
    for klass in cls.__mro__:
        if name in klass.__dict__:
            return klass is nn.Module
    return False


def _children(module: nn.Module) -> list[nn.Module]:
    return [m for m in module._modules.values() if m is not None]


def _descendants(module: nn.Module) -> list[nn.Module]:
    return list(module.modules())


class Resolver:
    def __init__(self, tree: ModuleTree) -> None:
        self.tree = tree

    def resolve(self, obj: Any, steps: tuple[Step, ...], owner: nn.Module | None = None,
                attr: str = "") -> list[Resolved]:
        """What a chain of steps reaches when started at ``obj`` (a list: computed keys fan out)."""
        if steps and isinstance(steps[0], tuple) and steps[0][0] == "isa":  # inside ``if isinstance(obj, T):``
            return self.resolve(obj, steps[1:], owner, attr) if isinstance(obj, steps[0][1]) else []
        if isinstance(obj, nn.Parameter):
            if id(obj) not in self.tree.params:
                return []
            if steps and isinstance(steps[0], str) and steps[0] in METADATA_ATTRS:
                return []
            return [Resolved("param", obj, owner, attr)]
        if isinstance(obj, (torch.Tensor, *SCALARS)):
            return []
        if isinstance(obj, nn.Module):
            return self._module(obj, steps)
        if not steps:
            if isinstance(obj, (types.ModuleType, type)):
                return [Resolved("static", obj)]
            return [Resolved("object", obj)]
        step, rest = steps[0], steps[1:]
        if isinstance(obj, types.ModuleType) and isinstance(step, str):
            value = obj.__dict__.get(step)
            return [] if value is None else self.resolve(value, rest)
        if isinstance(obj, type) and isinstance(step, str):
            value = inspect.getattr_static(obj, step, None)
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__ if isinstance(value, staticmethod) else types.MethodType(value.__func__, obj)
            return [] if value is None else self.resolve(value, rest)
        if isinstance(step, tuple) and step[0] == "[]" and (isinstance(obj, Seq) or type(obj) in (list, tuple)):
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
            if value is not MISSING:
                return self.resolve(value, rest)
        return [Resolved("object", obj)]  # a plain object reached part-way: judged by what it holds

    def _holder(self, value: Any) -> nn.Module | None:
        owners = self.tree.param_owners.get(id(value)) if isinstance(value, nn.Parameter) else None
        return self.tree.modules[owners[0][0]] if owners else None

    def _module(self, obj: nn.Module, steps: tuple[Step, ...]) -> list[Resolved]:
        if not steps:
            return [Resolved("module", obj)]
        step, rest = steps[0], steps[1:]
        nexts: list[tuple[Any, str]] = []
        if isinstance(step, str):
            if step in REFLECTION_ATTRS and rest[:1] == ("keys",):
                return []  # the names only (ModuleDict.keys())
            key = rest[0][1] if rest and isinstance(rest[0], tuple) and rest[0][0] == "[]" else None
            if step in REGISTRIES and isinstance(key, str) and type(getattr(obj, step, None)) is dict:
                value = getattr(obj, step).get(key)  # ``self._modules["emb"]``: that entry, nothing else
                return [] if value is None else self.resolve(value, rest[1:], owner=obj, attr=key)
            if step == "__dict__" and isinstance(key, str) and type(obj.__dict__) is dict:
                if key in REGISTRIES:  # ``vars(self)["_modules"]``: the registry itself
                    return self._module(obj, (key, *rest[1:]))
                if key not in obj.__dict__:
                    return []  # submodules and Parameters are not in __dict__: a KeyError, nothing read
                return self.resolve(obj.__dict__[key], rest[1:], owner=obj, attr=key)
            if step in REFLECTION_ATTRS or step in ("__getattr__", "__getattribute__"):
                return [Resolved("escape", obj, attr=step)]
            dunder = step.startswith("__") and step.endswith("__") and step not in HOOKED_CALLS
            if step in MODULE_METADATA or dunder:
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
                    return [Resolved("method", obj, attr=step)] if not rest else []
                nexts = [(value, step)]
            else:
                static = class_attr(type(obj), step)
                if isinstance(static, (types.FunctionType, staticmethod, classmethod)):
                    return [Resolved("method", obj, attr=step)] if not rest else []
                if isinstance(static, (property, functools.cached_property)):
                    return [Resolved("property", obj, attr=step)]
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
                        return [Resolved("escape", obj, attr=step)]
                    if isinstance(value, (nn.Module, nn.Parameter)) or (
                        isinstance(value, types.MethodType) and isinstance(value.__self__, nn.Module)
                    ):
                        # Which inner module answers depends on the wrapper's state (peft's disable_adapter()
                        # switches to the original module): everything below the wrapper counts as read.
                        return [Resolved("escape", obj, attr=f"{step} (answered by {type(obj).__name__})")]
                    return self.resolve(value, rest, owner=self._holder(value), attr=step)
                if callable(getattr(static, "__get__", None)) and not isinstance(static, (*SCALARS, tuple, list,
                                                                                         frozenset, set, dict)):
                    return [Resolved("escape", obj, attr=step)]  # another descriptor: unknown code
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
            return [Resolved("escape", obj, attr="<computed attribute>")]
        elif step[0] == "via":  # get_submodule / get_parameter: getattr along the dotted name
            if not defined_by_nn_module(type(obj), step[1]):
                return [Resolved("escape", obj, attr=f"{step[1]}() (overridden)")]
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
        return MISSING
    if class_attr(cls, "__getattribute__") not in _PLAIN_GETATTRIBUTE:
        return MISSING
    static = class_attr(cls, name)
    if static is not None and hasattr(type(static), "__set__"):
        return MISSING  # a data descriptor (property, slot): runs code or is not in __dict__
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
    return MISSING


def held_values(obj: Any, tree: ModuleTree, depth: int = SCAN_DEPTH, seen: set[int] | None = None) -> list[Any]:
    """Modules and Parameters of ``tree`` that a plain Python object holds (containers, closures, partials...)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth < 0 or isinstance(obj, SCALARS):
        return []
    seen.add(id(obj))
    if isinstance(obj, nn.Module):
        return [obj] if id(obj) in tree.path_of else []
    if isinstance(obj, nn.Parameter):
        return [obj] if id(obj) in tree.params else []
    if isinstance(obj, (torch.Tensor, types.ModuleType, type)):
        return []
    if isinstance(obj, types.FunctionType):
        parts: list[Any] = [c.cell_contents for c in (obj.__closure__ or ()) if cell_full(c)]
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
        if not isinstance(part, (*SCALARS, torch.Tensor)):
            found.extend(held_values(part, tree, depth - 1, seen))
    return found


def cell_full(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:
        return False
    return True


class Seq(tuple):  # type: ignore[type-arg]
    """What a module iterator (``named_modules()``...) returns: iterating or indexing it gives its items."""
