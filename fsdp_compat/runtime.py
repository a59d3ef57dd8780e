"""What every plan applier installs on the root model it shards, in one call: the run-time guard (a read the plan
did not foresee unshards its group instead of crashing) and mixed micro-batch alignment (a rank without images
still issues the vision tower's collectives; a vision-tower call outside the model's forward, as in ``generate``,
is unsharded and counted; ``generate`` keeps the ranks in step). A user of plain FSDP2 calls it too, after
``fully_shard``: the outside-forward tower crash and the mixed-batch mismatch are FSDP2's, under every plan."""

from __future__ import annotations

from torch import nn

__all__ = ["install_runtime"]


def install_runtime(model: nn.Module) -> None:
    """Install both on ``model`` (idempotent; each has its own switch: ``FSDP_COMPAT_GUARD``,
    ``FSDP_COMPAT_MIXED_BATCHES``). It may run before ``fully_shard``: both find the FSDP2 groups at the first
    forward."""
    from fsdp_compat.guard import install_guard
    from fsdp_compat.mixed_batches import install_mixed_batches

    install_guard(model)
    install_mixed_batches(model)
