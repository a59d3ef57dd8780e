"""The generic layer's declaration: every FSDP2 root gets fsdp-compat's run-time layer at its first forward.

=============  ======================================================================================================
torch          replaced in ``torch.distributed.fsdp._fully_shard._fsdp_state``
=============  ======================================================================================================
2.8 - 2.15     ``FSDPState._root_pre_forward`` (looked up on the class at every call: reaches every root, however
               ``fully_shard`` was bound) becomes :func:`fsdp_compat.runtime.every_root.make_root_pre_forward`
=============  ======================================================================================================

What happens at a new root, and why this hook point: :mod:`fsdp_compat.runtime.every_root`. FSDP2's own behaviour is
unchanged; where an adapter's applier installed the run-time layer already, nothing more is installed.
``FSDP_COMPAT_GENERIC=off`` turns the layer off at run time; ``FSDP_COMPAT=off`` leaves torch unpatched.
Activation: the installed ``.pth`` hook when torch's FSDP2 state module is imported (``import transformers``'s
modeling code and every ``from torch.distributed.fsdp import fully_shard`` import it), or
``import fsdp_compat.adapters.fsdp2``.
"""

from __future__ import annotations

from fsdp_compat.activation import Release, Replacement, declare
from fsdp_compat.runtime.every_root import ROOT_PRE_FORWARD, make_root_pre_forward

from . import trigger

__all__ = ["ADAPTER", "RELEASES", "is_patched", "patch", "unpatch"]

FSDP_STATE = trigger("torch")

RELEASES: tuple[Release, ...] = (
    Release(">=2.8", (Replacement(FSDP_STATE, ROOT_PRE_FORWARD, make_root_pre_forward),)),
)

ADAPTER = declare("fsdp2", RELEASES)
patch, unpatch, is_patched = ADAPTER.patch, ADAPTER.unpatch, ADAPTER.is_patched
