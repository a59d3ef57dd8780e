"""Wrap policies: which modules are *candidates* for their own FSDP2 group, and how unsafe ones are handled.

``legacy`` and ``legacy-skyrl`` reproduce the upstream selections exactly (to demonstrate the crash and to compare
against); ``input-only`` is the fix proposed upstream; ``layers-only`` shards only the layer classes; ``auto`` (the
default) makes every candidate its own group when that is safe and otherwise lifts or keeps it in the root, using the
evidence of :mod:`fsdp_compat.analysis`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fsdp_compat.errors import FsdpCompatError

MIB = 2**20


@dataclass(frozen=True)
class Policy:
    """Base of all policies; ``name`` is what ``policy=`` strings and ``FSDP_COMPAT_POLICY`` use."""

    name: ClassVar[str] = ""
    #: True when the policy trusts only evidence-checked plans (auto); False for reproductions of upstream rules.
    analyzed: ClassVar[bool] = False


@dataclass(frozen=True)
class Legacy(Policy):
    """verl >= 0.7.1 (and main): layer classes, plus every ``nn.Embedding`` and every leaf named ``embed_tokens`` or
    ``lm_head`` with a ``weight`` when the top-level ``config.tie_word_embeddings`` is false.

    ``output_embeddings=False`` gives the SkyRL / verl 0.4-0.7.0 rule (embeddings only), policy ``legacy-skyrl``.
    """

    name: ClassVar[str] = "legacy"
    output_embeddings: bool = True


@dataclass(frozen=True)
class LegacySkyrl(Legacy):
    """SkyRL (every release) and verl 0.4.0-0.7.0: layer classes plus every ``nn.Embedding`` when untied."""

    name: ClassVar[str] = "legacy-skyrl"
    output_embeddings: bool = False


@dataclass(frozen=True)
class InputOnly(Policy):
    """The fix proposed upstream: layer classes plus ``get_input_embeddings()`` when untied."""

    name: ClassVar[str] = "input-only"


@dataclass(frozen=True)
class LayersOnly(Policy):
    """Only the layer classes get groups; everything else stays in the root."""

    name: ClassVar[str] = "layers-only"


@dataclass(frozen=True)
class Auto(Policy):
    """Shard everything that can safely stay sharded, as far as the static analysis can see.

    The analysis is conservative (what it cannot follow counts as a read), and the run-time guard that
    ``apply_fsdp2`` and the adapters install covers reads no static analysis can see.

    Candidates are the layer classes, every ``nn.Embedding`` and the output embedding. A candidate whose
    parameters are only used inside its own forward owns a group (as upstream does, so text models see no change).
    A candidate read raw by an ancestor cannot: it is lifted into a new group at the reading module when its
    parameters weigh at least ``lift_min_bytes`` (large tables stay sharded), and otherwise left in the enclosing
    group (a small table costs no extra all-gather). A candidate read only *after* its own forward keeps its group
    with ``reshard_after_forward=False`` when ``allow_no_reshard``. Modules that hold the same Parameter object share
    one group. What is left in the root group (unsharded for the whole forward) is split further: a top-most module
    there weighing at least ``split_root_min_bytes`` (None: never) gets a group of its own when no read outside its
    own forward touches its parameters.
    """

    name: ClassVar[str] = "auto"
    analyzed: ClassVar[bool] = True
    lift_min_bytes: int = 32 * MIB
    allow_no_reshard: bool = True
    allow_shared_groups: bool = True
    wrap_output_embeddings: bool = True
    split_root_min_bytes: int | None = 32 * MIB


POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (Auto, Legacy, LegacySkyrl, InputOnly, LayersOnly)
}
POLICY_NAMES: tuple[str, ...] = tuple(POLICIES)
#: every policy, ``auto`` last: the order of the CLI's and the benchmarks' side-by-side tables
POLICY_ORDER: tuple[str, ...] = tuple(sorted(POLICY_NAMES, key=lambda name: name == "auto"))


def resolve_policy(policy: str | Policy) -> Policy:
    """A policy object from a name or an object; unknown names raise an error that lists the valid ones."""
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, str):
        key = policy.strip().lower().replace("_", "-")
        if key in POLICIES:
            return POLICIES[key]()
    raise FsdpCompatError(
        f"unknown wrap policy {policy!r}; use one of {', '.join(POLICY_NAMES)} "
        "(or a policy object such as fsdp_compat.Auto(lift_min_bytes=0))"
    )
