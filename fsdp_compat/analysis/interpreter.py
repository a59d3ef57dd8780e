"""The interpreter: runs each module's facts against the real model and turns uses into evidence.

Drives the analysis over the whole tree (hooks, ``__call__`` overrides, forwards; repeated layers replayed),
binds each function's arguments to real objects, follows the calls it can and charges every read or escape to the
module whose code runs, with what ran before it on every path.
"""

from __future__ import annotations

import builtins
import dataclasses
import functools
import inspect
import types
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fsdp_compat.analysis.evidence import Analysis, RawRead
from fsdp_compat.analysis.facts import forward_function, function_facts, runs_own_code, source_function, torch_code
from fsdp_compat.analysis.names import (
    CALLS_FIRST_ARGUMENT,
    CHECKPOINT_KEYWORDS,
    DICT_VIEWS,
    HOOK_REGISTRATION,
    HOOKED_CALLS,
    MODULE_ITERATORS,
    PARAM_ITERATORS,
    RUNTIME_HOOK_MARK,
    SCALARS,
    Step,
)
from fsdp_compat.analysis.refs import FunctionFacts, Opaque, Refs, Use
from fsdp_compat.analysis.resolver import (
    Resolved,
    Resolver,
    Seq,
    cell_full,
    class_attr,
    defined_by_nn_module,
    held_values,
)
from fsdp_compat.tree import ModuleTree

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
        self.resolver = Resolver(tree)
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
        call = class_attr(type(module), "__call__")
        if call is not nn.Module.__call__ and path:
            # Runs before the module's hooks: code of the parent, outside the module's own window.
            parent = self.tree.parent(path) or ""
            site = _Site(parent, frozenset(), f"{type(module).__name__}.__call__")
            if self._callable(call, [(module,)], {}, site) is None:
                self._opaque(module, parent, f"{type(module).__name__}.__call__ cannot be read")
        if not runs_own_code(module):
            return
        try:
            forward = forward_function(module)
            self._function(source_function(forward), {}, (module,), path, frozenset(), forward_of=module)
        except Opaque as exc:
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
            if name.startswith("_") or isinstance(value, (*SCALARS, torch.Tensor)):
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
            if getattr(hook, RUNTIME_HOOK_MARK, False) or _is_fsdp2_hook(hook):
                continue  # fsdp-compat's own run-time layer, or FSDP2's own hooks (a sharded model's window)
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
        # What lands in *args / **kwargs escapes, unless the function never mentions that name (a counter or
        # profiler hook ``def hook(*args): calls.append(1)``): a value nothing can reach is read by nobody.
        leftovers = [o for v in (extra_kw.values() if _mentions(facts, facts.kwarg) else ()) for o in v]
        if facts.vararg and extra:
            if all(len(v) == 1 for v in extra):  # ``args`` is the tuple it is at run time: its uses are followed
                bindings[facts.vararg] = (tuple(v[0] for v in extra),)
            else:  # several possible values per position: no one tuple to follow
                leftovers += [o for v in extra for o in v]
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

    def _site(self, facts: FunctionFacts, reader: str, before: frozenset[str], called: dict[int, frozenset[str]],
              use: Use | None) -> _Site:
        lineno = use.lineno if use is not None else facts.lineno_offset + 1
        return _Site(reader, (before, called, use), (facts, lineno))

    def _targets(self, refs: Refs, bindings: Bindings, closure: dict[str, Any], func: types.FunctionType,
                 returned: dict[int, list[Any]], site: _Site) -> list[Resolved]:
        out: list[Resolved] = []
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
            return (closure[name].cell_contents,) if cell_full(closure[name]) else ()
        if name in func.__globals__:
            return (func.__globals__[name],)
        value = getattr(builtins, name, None)
        return () if value is None else (value,)

    def _super(self, func: types.FunctionType, self_obj: Any, steps: tuple[Step, ...]) -> list[Resolved]:
        if not steps or not isinstance(steps[0], str) or not isinstance(self_obj, nn.Module):
            return []
        name = steps[0]
        owner_name = func.__qualname__.rsplit(".", 1)[0]
        mro = type(self_obj).__mro__
        for index, cls in enumerate(mro):
            if cls.__qualname__ == owner_name and func.__name__ in cls.__dict__:
                for later in mro[index + 1:]:
                    if name in later.__dict__:
                        if name in HOOKED_CALLS and later is nn.Module:
                            return [Resolved("method", self_obj, attr="__call__")]
                        if later is nn.Module:
                            return [Resolved("escape", self_obj, attr=f"super().{name}")]
                        return [Resolved("function", later.__dict__[name], owner=self_obj, attr=name)]
                return []
        return [Resolved("escape", self_obj, attr="super()")]

    def _arg_objects(
        self, use: Use, bindings: Bindings, closure: dict[str, Any], func: types.FunctionType,
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

    def _do_call(self, use: Use, targets: list[Resolved], bindings: Bindings, closure: dict[str, Any],
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
            if res.kind == "method" and res.attr in HOOKED_CALLS:
                return  # a module's __call__ handed on: whoever calls it runs the module's hooks
            self._escape(res.obj, site, why)
        else:
            self._escape(obj, site, why)

    def _call_target(self, res: Resolved, positional: list[tuple[Any, ...]], keywords: dict[str, tuple[Any, ...]],
                     site: _Site, calls: set[str]) -> list[Any] | None:
        """Follow one possible callee; None when it is not followed (its tracked arguments then escape)."""
        if res.kind == "module" or (res.kind == "method" and res.attr in HOOKED_CALLS):
            module = res.obj
            path = self.tree.path_of.get(id(module))
            if path is None:
                return None
            calls.add(path)
            if path != site.reader:
                self._add(RawRead(site.reader, path, None, "call", site.where))
            if self._carries(positional, keywords):
                try:
                    forward = source_function(forward_function(module))
                except Opaque:
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
            if isinstance(module, (nn.ModuleDict, nn.ParameterDict)) and res.attr in DICT_VIEWS:
                return _dict_view(module, res.attr)
            if defined_by_nn_module(type(module), res.attr):
                return self._nn_module_method(module, res.attr, positional, keywords, site)
            method = inspect.getattr_static(module, res.attr, None)
            if res.attr in module.__dict__:
                method = module.__dict__[res.attr].__func__
            try:
                source = source_function(method)
            except Opaque as exc:
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
                source = source_function(res.obj)
            except Opaque as exc:
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
        if _qualified(target) in CALLS_FIRST_ARGUMENT:
            return self._call_first_argument(positional, keywords, site, calls)
        if isinstance(target, types.BuiltinFunctionType) or ((
            isinstance(target, type) or torch_code(target)
        ) and not isinstance(target, (types.MethodType, functools.partial))):
            return None
        if not self._carries(positional, keywords) and not self._held(target):
            return []  # nothing of the model goes in: whatever it does, it cannot touch a Parameter
        if isinstance(target, (types.FunctionType, types.MethodType, functools.partial)):
            return self._callable(target, positional, keywords, site)
        for held in self._held(target):  # a callable object: whatever it holds escapes
            self._escape(held, site, "held by a callable the analysis does not follow")
        return None

    def _call_first_argument(self, positional: list[tuple[Any, ...]], keywords: dict[str, tuple[Any, ...]],
                             site: _Site, calls: set[str]) -> list[Any] | None:
        """``torch.utils.checkpoint.checkpoint(function, *args, **kwargs)``: followed as ``function(*args,
        **kwargs)`` (a module called through its hooks, a method of the model read as any call of it); not followed
        where the function is anything else (a closure, a lambda: what it reaches is unknown here)."""
        if not positional or not positional[0]:
            return None
        rest = {name: objs for name, objs in keywords.items() if name not in CHECKPOINT_KEYWORDS}
        results: list[Any] = []
        for function in positional[0]:
            if isinstance(function, _Bound):
                res = function.res
            elif isinstance(function, nn.Module):
                res = Resolved("module", function)
            else:
                return None
            out = self._call_target(res, positional[1:], rest, site, calls)
            if out is None:
                return None
            results.extend(out)
        return results

    def _nn_module_method(self, module: nn.Module, name: str, positional: list[tuple[Any, ...]],
                          keywords: dict[str, tuple[Any, ...]], site: _Site) -> list[Any]:
        """nn.Module's own methods: module iterators and hook registration are modelled, the rest reflects."""
        if name in MODULE_ITERATORS or name in PARAM_ITERATORS:
            # Every item the call can yield, with its real name when called without arguments (with arguments -
            # a prefix, recurse=False... - the same or fewer objects, names unknown: a name test keeps them all).
            if name in PARAM_ITERATORS:
                items = list(module.named_parameters())
            elif name.endswith("modules"):
                items = list(module.named_modules())
            else:
                items = [(n, m) for n, m in module._modules.items() if m is not None]
            plain = not positional and not keywords
            if name.startswith("named_"):
                return [Seq(Seq((n if plain else None, m)) for n, m in items)]
            return [Seq(m for _, m in items)]
        if name in HOOK_REGISTRATION:
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
            source = source_function(func)
        except Opaque:
            return None
        if torch_code(source) and not torch_ok:
            return None  # torch's functional code: a Parameter handed to it is simply read
        return self._function(source, kw, (*prefix, *positional), site.reader, site.held_before, where=site.where)

    def _property(self, res: Resolved, site: _Site) -> list[Any]:
        static = class_attr(type(res.obj), res.attr)
        getter = static.fget if isinstance(static, property) else getattr(static, "func", None)
        try:
            source = source_function(getter)
        except Opaque as exc:
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
            self._held_memo[key] = (obj, held_values(obj, self.tree))
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

    def _do_use(self, use: Use, res: Resolved, site: _Site, forward_of: nn.Module | None, results: list[Any],
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
                fake = Use(use.index, use.refs, how, use.lineno, use.before)
                for sub in self.resolver.resolve(obj, ()):
                    self._do_use(fake, sub, site, forward_of, results, reader)
            return
        if kind == "method":
            if how in ("inert", "discard", "bind", "test"):
                return
            if res.attr in HOOKED_CALLS:
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


def _qualified(func: Any) -> str:
    """``module.qualname`` of a function (empty for anything without both)."""
    return f"{getattr(func, '__module__', '')}.{getattr(func, '__qualname__', '')}"


@dataclass(frozen=True)
class _Bound:
    """A method, property or reflective access handed around as a value."""

    res: Resolved


def find_raw_reads(model: nn.Module, tree: ModuleTree | None = None) -> Analysis:
    """Static evidence for ``model``: raw reads, skip-level forward calls and unreadable (opaque) modules."""
    return _Analyzer(tree or ModuleTree.build(model)).run()


def _is_fsdp2_hook(hook: Any) -> bool:
    """A hook ``fully_shard`` registered (its window's unshard and reshard): on a model analysed after sharding,
    FSDP2's own hooks are the window itself, not a read of the parameters."""
    func = getattr(hook, "__func__", hook)
    return str(getattr(func, "__module__", "") or "").startswith("torch.distributed.fsdp.")


def _mentions(facts: FunctionFacts, name: str | None) -> bool:
    """Whether the function's body reaches the variable ``name`` at all (False for None: no such parameter)."""
    if name is None:
        return False
    for use in facts.uses:
        if name in use.bases or any(ref.root == name for ref in use.refs):
            return True
        if any(ref.root == name for arg in use.args for ref in arg.refs):
            return True
    return False


def _dict_view(container: nn.ModuleDict | nn.ParameterDict, name: str) -> list[Any]:
    """``ModuleDict.values()`` / ``.items()`` / ``.keys()`` (and ParameterDict's): its own entries, with their names,
    as iterating ``children()`` is (``for layer in self.layers.values()``, torchtitan's decoder loop); its
    implementation reads ``self._modules``, which would otherwise count as reflecting on everything below it."""
    entries = list(container.items())
    if name == "keys":
        return []
    if name == "items":
        return [Seq(Seq((key, value)) for key, value in entries)]
    return [Seq(value for _, value in entries)]
