"""One forward window per FSDP2 root: it opens where FSDP2's root pre-forward starts a pass and closes where FSDP2's
root post-forward ends it, for ``forward`` and for every method registered with ``register_fsdp_forward_method``.

Why FSDP2's own pair: a registered forward method (``generate`` for a rollout, say) runs FSDP2's
``FSDPState._pre_forward`` / ``_post_forward`` around the method, but no module hook of the root. A layer that opened
its state in a module pre-hook and closed it in a module post-hook (a ``TorchFunctionMode``, a depth counter) would
stay open after such a call and break the next optimizer step. The window is what FSDP2 itself treats as one pass:
``_root_pre_forward`` makes a state ``_state_ctx.iter_forward_root`` (the transition from None is the start of a
pass), and ``_post_forward`` of that state clears it (the end).

Where it hooks, all idempotent (whichever runs first opens or closes; the others find it done):

* ``FSDPState._root_pre_forward`` on the class (the generic layer's replacement, :mod:`.every_root`) calls
  :func:`root_pre_forward_done`;
* the same two methods on the root's own state instance (``state.__dict__``: FSDP2 looks both up on the state at
  every call from a registered method, and ``_root_pre_forward`` at every pass), set by :meth:`ForwardWindow.attach`
  once the root's state exists; :meth:`ForwardWindow.remove` deletes them;
* a forward pre-hook on the root (FSDP2's own is prepended, so it always runs first) and a forward hook registered
  at the first pass (after FSDP2's, so it closes after FSDP2's post-forward; ``always_call``: a forward that raised
  closes it too).

Subscribers (the guard, the runtime's own first-pass rule) get ``on_open()`` and ``on_close(raised)``. Nothing here
keeps a model alive beyond the module's own reference cycles (the window is stored on the module).
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from fsdp_compat.runtime import marked

__all__ = [
    "ATTR", "ForwardWindow", "Subscriber", "from_module_call", "param_groups", "root_pre_forward_done", "subscribe",
    "tree_groups", "window_of",
]

#: Where a root keeps its window (``module.__dict__``): the module owns it, so it dies with the module.
ATTR = "_fsdp_compat_window"

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_MODULE_FILE = os.path.join(_TORCH_DIR, "nn", "modules", "module.py")
_SKIPPED_DIRS = (
    os.path.join(_TORCH_DIR, "distributed") + os.sep,
    os.path.join(_TORCH_DIR, "_dynamo") + os.sep,
    os.path.join(_TORCH_DIR, "_compile.py"),
    os.path.dirname(__file__) + os.sep,  # fsdp-compat's run-time layer (the generic layer's hook)
)


class Subscriber(Protocol):
    def on_open(self) -> None: ...

    def on_close(self, raised: bool) -> None: ...


class ForwardWindow:
    """The window of one root module (see the module docstring). ``passes``: passes opened so far; ``grad``: whether
    the open pass runs with grad; ``from_call``: whether it was entered through the module's ``__call__`` (False:
    a registered forward method)."""

    def __init__(self, root: nn.Module) -> None:
        self.is_open = False
        self.passes = 0
        self.grad = True
        self.from_call = True
        self.subscribers: list[Subscriber] = []
        self.broken: BaseException | None = None  # the internals error that keeps the window shut
        self._state: Any = None  # the root's FSDP2 state, once attached
        self._post_handle: Any = None
        self._pre_handle = root.register_forward_pre_hook(marked(self._module_pre_forward))
        self._root = root

    # ------------------------------------------------------------------------------------------ open and close

    def open(self) -> None:
        if self.is_open:
            return
        self.is_open = True
        self.passes += 1
        self.grad = torch.is_grad_enabled()
        if self._post_handle is None:  # after FSDP2's post-forward hook, which exists by now
            self._post_handle = self._root.register_forward_hook(marked(self._module_post_forward), always_call=True)
        opened: list[Subscriber] = []
        try:
            for subscriber in self.subscribers:
                subscriber.on_open()
                opened.append(subscriber)
        except BaseException:
            self.is_open = False
            for subscriber in reversed(opened):
                subscriber.on_close(True)
            raise

    def close(self, raised: bool = False) -> None:
        if not self.is_open:
            return
        self.is_open = False
        for subscriber in reversed(self.subscribers):
            subscriber.on_close(raised)

    # ------------------------------------------------------------------------------------------------ hooks

    def attach(self, state: Any) -> None:
        """Put the window on the root's FSDP2 state (its ``_root_pre_forward`` and ``_post_forward``, looked up on
        the instance at every call)."""
        if self._state is state:
            return
        self._detach()
        self._state = state
        cls = type(state)

        def _root_pre_forward(module: nn.Module, args: Any, kwargs: Any) -> Any:
            before = self._pass_root(state)
            result = cls._root_pre_forward(state, module, args, kwargs)
            if before is None and self._pass_root(state) is state:
                self.from_call = from_module_call()
                self.open()
            return result

        def _post_forward(module: nn.Module, inputs: Any, output: Any) -> Any:
            ends = self._pass_root(state) is state
            output = cls._post_forward(state, module, inputs, output)
            if ends:
                self.close()
            return output

        state.__dict__["_root_pre_forward"] = _root_pre_forward
        state.__dict__["_post_forward"] = _post_forward

    @property
    def state(self) -> Any:
        """The root's FSDP2 state once the window is attached to it (None before)."""
        return self._state

    def _detach(self) -> None:
        state, self._state = self._state, None
        if state is not None:
            state.__dict__.pop("_root_pre_forward", None)
            state.__dict__.pop("_post_forward", None)

    def _module_pre_forward(self, module: nn.Module, args: Any) -> None:
        state = _root_state(module)
        if state is None:
            return
        self.attach(state)
        if not self.is_open and self._pass_root(state) is state:
            self.from_call = True
            self.open()

    def _pass_root(self, state: Any) -> Any:
        """FSDP2's ``iter_forward_root`` of ``state``'s tree (None between passes). Where this torch's FSDP2 has no
        such field, the window never opens again, and every subscriber that relies on FSDP2 internals is told to
        stand aside (the guard warns once): FSDP2 runs as without them."""
        if self.broken is not None:
            return _NEVER
        try:
            return state._state_ctx.iter_forward_root
        except (AttributeError, TypeError) as exc:  # another torch release's FSDP2 internals
            self.broken = exc
            for subscriber in self.subscribers:
                stand_aside = getattr(subscriber, "stand_aside", None)
                if callable(stand_aside):
                    stand_aside(exc)
            return _NEVER

    def _module_post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        self.close(raised=output is None)

    def remove(self) -> None:
        self.close(raised=False)
        for handle in (self._pre_handle, self._post_handle):
            if handle is not None:
                handle.remove()
        self._pre_handle = self._post_handle = None
        self._detach()
        self.subscribers = []
        self._root.__dict__.pop(ATTR, None)


_NEVER = object()  # a pass root no state is


def window_of(root: nn.Module, *, create: bool = False) -> ForwardWindow | None:
    """The window stored on ``root`` (made there with ``create``; attached to its FSDP2 state when it has one)."""
    window = root.__dict__.get(ATTR)
    if window is None and create:
        window = ForwardWindow(root)
        root.__dict__[ATTR] = window
        state = _root_state(root)
        if state is not None:
            window.attach(state)
    return window


def root_pre_forward_done(state: Any, module: nn.Module) -> None:
    """FSDP2's class-level ``_root_pre_forward`` just made ``state`` the pass's root (the generic layer's hook):
    open the window of the root's module, if it has one."""
    window = module.__dict__.get(ATTR)
    if window is not None and not window.is_open and window.broken is None:
        window.attach(state)
        window.from_call = from_module_call()
        window.open()


def param_groups(state: Any) -> list[Any]:
    """The FSDP2 parameter groups of one state (torch < 2.10: one group per state, or none)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = state._fsdp_param_group
        groups = [group] if group is not None else []
    return list(groups)


def tree_groups(state: Any) -> list[Any]:
    """Every FSDP2 parameter group of the root ``state``'s tree (after its lazy init), root first."""
    return [group for other in state._state_ctx.all_states for group in param_groups(other)]


def _root_state(module: nn.Module) -> Any:
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, FSDPModule):
        return None
    state = module._get_fsdp_state()
    return state if len(getattr(state, "_modules", ())) == 1 else None


def from_module_call() -> bool:
    """Whether the running FSDP2 pre-forward was entered through ``nn.Module.__call__`` (its hooks), not through a
    method registered with ``register_fsdp_forward_method``: the first frame outside torch.distributed, Dynamo's
    wrappers and fsdp-compat's own is ``torch/nn/modules/module.py``."""
    frame: Any = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(_SKIPPED_DIRS):
            return filename == _MODULE_FILE
        frame = frame.f_back
    return False


def subscribe(root: nn.Module, subscriber: Subscriber) -> Callable[[], None]:
    """Add ``subscriber`` to ``root``'s window (made if needed); returns the call that takes it off again."""
    window = window_of(root, create=True)
    assert window is not None
    window.subscribers.append(subscriber)
    return functools.partial(_unsubscribe, root, subscriber)


def _unsubscribe(root: nn.Module, subscriber: Subscriber) -> None:
    window = window_of(root)
    if window is None or subscriber not in window.subscribers:
        return
    if window.is_open:
        subscriber.on_close(False)
    window.subscribers.remove(subscriber)
    if not window.subscribers:
        window.remove()
