"""After a ``no_grad`` first pass of a root, its groups are sharded again: an optimizer built then holds the real
parameters.

FSDP2 leaves the root's own group unsharded after the root's forward (a backward is expected to reshard it). After a
``no_grad`` forward as the root's first call (an evaluation or a log-prob pass before the optimizer is built),
``model.parameters()`` returns that group's unsharded plain tensors, an optimizer built then updates tensors FSDP2
discards at the next reshard, and training silently departs from one process. Plain FSDP2 leaves this to the user
(``model.reshard()``); fsdp-compat sits on that window and closes it: at the end of the root's first pass, if it ran
without grad, the groups that pass unsharded are resharded (a local free, no collective). Groups that were
unsharded before the pass by the user's own ``unshard()`` are left as they are; groups fsdp-compat unsharded before
it (a vision tower called outside the forward, on some ranks only: :func:`note_unshard`) count as sharded, so every
rank reshards the same groups. Only the first pass: a loop of ``no_grad`` forwards (decode, log-prob passes) gains
no all-gather per step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fsdp_compat.runtime.window import subscribe, tree_groups, window_of

__all__ = ["FirstPass", "note_unshard"]

_ATTR = "_fsdp_compat_first_pass"


class FirstPass:
    """The rule above, subscribed to ``model``'s forward window. ``resharded``: the groups it resharded (0 or more)."""

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._done = False
        self._grad = True
        self._sharded: list[Any] = []
        self._ours: set[int] = set()  # ids of groups fsdp-compat itself unsharded before the first pass
        self.resharded = 0
        self._unsubscribe = subscribe(model, self)
        model.__dict__[_ATTR] = self

    def on_open(self) -> None:
        if self._done:
            return
        self._grad = torch.is_grad_enabled()
        window = window_of(self._model)
        state = window.state if window is not None else None
        if self._grad or state is None:
            return
        try:
            self._sharded = [g for g in tree_groups(state) if not g.is_unsharded or id(g) in self._ours]
        except (AttributeError, TypeError):  # another torch's FSDP2 internals: FSDP2's own behaviour
            self._sharded = []
        self._ours = set()

    def on_close(self, raised: bool) -> None:
        if self._done:
            return
        self._done = True
        sharded, self._sharded = self._sharded, []
        if self._grad or raised:
            return
        for group in sharded:
            if group.is_unsharded:
                group.reshard()
                self.resharded += 1

    def remove(self) -> None:
        self._unsubscribe()
        if self._model.__dict__.get(_ATTR) is self:
            del self._model.__dict__[_ATTR]


def note_unshard(root: nn.Module, module: nn.Module) -> None:
    """fsdp-compat unshards ``module``'s FSDP2 groups outside a pass (below ``root``): before the first pass, they
    count as sharded for :class:`FirstPass`, whose reshard must be the same on every rank."""
    first = root.__dict__.get(_ATTR)
    if first is None or first._done:
        return
    from fsdp_compat.runtime.window import param_groups

    first._ours.update(id(g) for g in param_groups(module._get_fsdp_state()))
