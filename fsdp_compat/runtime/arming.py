"""Whether the guard's per-op check must run on a root: only where fsdp-compat's check of the FSDP2 groups cannot
rule a read of a sharded group out.

The check (:mod:`fsdp_compat.group_check`) reads the model's code (the static evidence) and the groups as they are.
A safe grouping, which fsdp-compat's own plan always is, costs no per-op check; an unsafe group, an analysis that
could not run, or a policy that skips the analysis (``legacy`` and the like) arms it. One rule for every path:
``apply_fsdp2``, each adapter and the generic layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fsdp_compat.policies import Policy

__all__ = ["Arming", "decide"]


@dataclass(frozen=True)
class Arming:
    """The verdict on one root: ``armed`` (the per-op check runs), ``unsafe`` ((group, why) per group the check
    found readable while sharded; empty where it found none or could not run), ``checked`` (the check ran)."""

    armed: bool
    unsafe: list[tuple[str, str]] = field(default_factory=list)
    checked: bool = False

    @property
    def unsafe_names(self) -> list[str]:
        return [group for group, _ in self.unsafe]


def decide(root: Any, policy: Policy | None = None) -> Arming:
    """The verdict for ``root`` (an FSDP2 root after its groups exist); ``policy`` defaults to
    ``FSDP_COMPAT_POLICY``."""
    from fsdp_compat.group_check import evidence, unsafe_groups

    if policy is None:
        from fsdp_compat import switches
        from fsdp_compat.policies import POLICY_NAMES, resolve_policy

        name = switches.choice(switches.POLICY, POLICY_NAMES, "auto", what="a policy name", strict=True)
        policy = resolve_policy(name)
    if not policy.analyzed:
        return Arming(True)  # legacy & co: no analysis, so nothing is ruled out
    unsafe = unsafe_groups("fully_shard", root, evidence("fully_shard", root))
    if unsafe is None:
        return Arming(True)
    return Arming(bool(unsafe), list(unsafe), checked=True)
