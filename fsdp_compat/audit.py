"""Dynamic audit: run the unsharded model once and record every parameter used outside its owner's forward.

This is the ground truth the static analysis is tested against: a ``TorchFunctionMode`` sees every op and its
arguments, forward hooks keep the stack of modules that are executing, and a parameter that reaches an op while
its owning module is not on that stack is exactly the read that FSDP2 would serve a sharded DTensor.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from fsdp_compat.analysis import METADATA_ATTRS, RawRead
from fsdp_compat.tree import ModuleTree

_TORCH_DIR = os.path.dirname(torch.__file__)
_THIS_FILE = os.path.abspath(__file__)


@dataclass
class _State:
    tree: ModuleTree
    owners: dict[int, tuple[str, str]]
    stack: list[str]
    found: dict[tuple[str, str, str], RawRead]
    phase: str = "forward"


def _func_name(func: Callable[..., Any]) -> str:
    descriptor = getattr(func, "__self__", None)
    if getattr(func, "__name__", "") == "__get__" and descriptor is not None:
        return getattr(descriptor, "__name__", "")
    return getattr(func, "__name__", "")


def _is_metadata(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """An op that looks only at metadata: ``Tensor.type()`` names the type, ``Tensor.type(dtype)`` casts (a read)."""
    if name == "type":
        return len(args) <= 1 and kwargs.get("dtype") is None
    return name in METADATA_ATTRS


def _caller_location() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        filename = os.path.abspath(frame.f_code.co_filename)
        if not filename.startswith(_TORCH_DIR) and filename != _THIS_FILE:
            return f"{os.path.basename(filename)}:{frame.f_lineno} in {frame.f_code.co_qualname}"
        frame = frame.f_back  # type: ignore[assignment]
    return "<unknown>"


class _ReadRecorder(TorchFunctionMode):
    def __init__(self, state: _State) -> None:
        super().__init__()
        self.state = state

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if not _is_metadata(_func_name(func), args, kwargs):
            executing = set(self.state.stack)
            leaves, _ = tree_flatten((args, kwargs))
            for leaf in leaves:
                owner = self.state.owners.get(id(leaf)) if isinstance(leaf, nn.Parameter) else None
                if owner is None or owner[0] in executing:
                    continue
                reader = self.state.stack[-1] if self.state.stack else "<outside any module>"
                name = f"{owner[0]}.{owner[1]}" if owner[0] else owner[1]
                key = (reader, name, self.state.phase)
                if key not in self.state.found:
                    location = _caller_location()
                    if self.state.phase != "forward":
                        location = f"{location} (during {self.state.phase})"
                    self.state.found[key] = RawRead(reader, owner[0], name, "raw-read", location)
        return func(*args, **kwargs)


def audit_raw_reads(model: nn.Module, *args: Any, **kwargs: Any) -> list[RawRead]:
    """Run one real forward (and backward when the output has a ``loss``) of the unsharded ``model``.

    Returns every parameter used while its owning module was not executing, with the reading module (the innermost
    module executing at the time) and the source location. Shared Parameters count as owned by every module that
    registers them.
    """
    tree = ModuleTree.build(model)
    owners: dict[int, tuple[str, str]] = {}
    for pid, registered in tree.param_owners.items():
        owners[pid] = registered[0]
    state = _State(tree, owners, [], {})
    sharers = {pid: {path for path, _ in regs} for pid, regs in tree.param_owners.items()}

    def pre_hook(module: nn.Module, _args: Any) -> None:
        state.stack.append(tree.path_of[id(module)])

    def post_hook(module: nn.Module, _args: Any, _out: Any) -> None:
        path = tree.path_of[id(module)]
        if path in state.stack:
            del state.stack[len(state.stack) - 1 - state.stack[::-1].index(path) :]

    handles = []
    for module in tree.modules.values():
        handles.append(module.register_forward_pre_hook(pre_hook))
        handles.append(module.register_forward_hook(post_hook, always_call=True))
    try:
        with _ReadRecorder(state):
            output = model(*args, **kwargs)
            loss = getattr(output, "loss", None)
            if loss is None and isinstance(output, dict):
                loss = output.get("loss")
            if isinstance(loss, torch.Tensor) and loss.requires_grad:
                state.phase = "backward"
                state.stack.clear()
                loss.backward()
    finally:
        for handle in handles:
            handle.remove()
    reads = []
    for (reader, name, _phase), read in state.found.items():
        pid = next((pid for pid, (p, a) in owners.items() if (f"{p}.{a}" if p else a) == name), None)
        if pid is not None and reader in sharers.get(pid, set()):
            continue  # a sharer using its own (shared) parameter inside its own forward
        reads.append(read)
    return reads
