"""A read-only index of a module tree: paths, ancestry, parameter ownership and sharing.

The planner asks tree questions constantly (who is whose ancestor, which modules hold this very Parameter object);
answering them from one index keeps each question O(depth) and the planner free of ``named_modules()`` loops.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from fsdp_compat.paths import within


def repeated_block_classes(model: Any) -> list[str]:
    """Classes that repeat inside a ``ModuleList`` (the decoder / vision blocks), plus ``_no_split_modules``: the
    layer classes a model that declares none is planned with, and what an outdated wrap-list warning suggests."""
    counts: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            for child in module:
                counts[type(child).__name__] = counts.get(type(child).__name__, 0) + 1
    repeated = {name for name, n in counts.items() if n >= 2}
    declared = getattr(model, "_no_split_modules", None) or ()
    repeated |= {n for n in declared if isinstance(n, str)}
    return sorted(repeated)


@dataclass
class ModuleTree:
    """Index of ``model``'s module tree. Paths are ``named_modules()`` names; the root is ``""``."""

    model: nn.Module
    modules: dict[str, nn.Module] = field(default_factory=dict)
    path_of: dict[int, str] = field(default_factory=dict)
    post_order: dict[str, int] = field(default_factory=dict)
    # id(Parameter) -> every (module path, attribute name) that registers that very object.
    param_owners: dict[int, list[tuple[str, str]]] = field(default_factory=dict)
    params: dict[int, nn.Parameter] = field(default_factory=dict)

    @classmethod
    def build(cls, model: nn.Module) -> ModuleTree:
        tree = cls(model)
        for path, module in model.named_modules():
            tree.modules[path] = module
            tree.path_of[id(module)] = path
            for name, param in module._parameters.items():
                if param is None:
                    continue
                tree.param_owners.setdefault(id(param), []).append((path, name))
                tree.params[id(param)] = param
        for index, path in enumerate(tree._post_order_paths("")):
            tree.post_order[path] = index
        return tree

    def _post_order_paths(self, root: str) -> Iterator[str]:
        stack: list[tuple[str, bool]] = [(root, False)]
        while stack:
            path, expanded = stack.pop()
            if expanded:
                yield path
                continue
            stack.append((path, True))
            module = self.modules[path]
            children = [
                self.path_of[id(child)]
                for child in module._modules.values()
                if child is not None and id(child) in self.path_of
            ]
            # Only children whose canonical path is directly below this one (a module registered twice is
            # visited once, under its first name).
            children = [c for c in children if self.parent(c) == path]
            stack.extend((child, False) for child in reversed(children))

    @staticmethod
    def parent(path: str) -> str | None:
        if path == "":
            return None
        return path.rsplit(".", 1)[0] if "." in path else ""

    def ancestors(self, path: str) -> Iterator[str]:
        """Strict ancestors of ``path``, nearest first, ending with the root ``""``."""
        current = self.parent(path)
        while current is not None:
            yield current
            current = self.parent(current)

    @staticmethod
    def is_ancestor_or_self(ancestor: str, path: str) -> bool:
        return within(path, ancestor)

    def lca(self, a: str, b: str) -> str:
        """Lowest common ancestor of two module paths."""
        parts_a, parts_b = a.split(".") if a else [], b.split(".") if b else []
        common: list[str] = []
        for x, y in zip(parts_a, parts_b, strict=False):
            if x != y:
                break
            common.append(x)
        return ".".join(common)

    def path_between(self, low: str, high: str, *, include_low: bool) -> list[str]:
        """Modules from ``low`` up to ``high`` (``high`` excluded); ``high`` must be an ancestor of ``low``."""
        nodes = [low] if include_low and low != high else []
        for ancestor in self.ancestors(low):
            if ancestor == high:
                break
            nodes.append(ancestor)
        return nodes

    def below_common_ancestor(self, paths: Sequence[str]) -> list[str]:
        """Every module from each of ``paths`` up to their lowest common ancestor (excluded): the modules that may not
        own a group while the modules at ``paths`` (sharers of one Parameter) sit together in an enclosing one."""
        top = functools.reduce(self.lca, paths)
        return [node for p in paths if p != top for node in [p, *self.path_between(p, top, include_low=False)]]

    def depth(self, path: str) -> int:
        return 0 if path == "" else path.count(".") + 1

    def subtree_params(self, path: str) -> Iterator[tuple[str, nn.Parameter]]:
        """(qualified name, Parameter) of every parameter registered in ``path``'s subtree, each object once."""
        seen: set[int] = set()
        prefix = f"{path}." if path else ""
        for name, param in self.modules[path].named_parameters(remove_duplicate=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            yield prefix + name, param

    def direct_param_count(self, path: str) -> int:
        return sum(p.numel() for p in self.modules[path]._parameters.values() if p is not None)
