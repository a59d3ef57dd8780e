"""Wrap policies (``fsdp_compat.policies``): names resolve to the documented policies (docs/api.md), a policy object
passes through as it is, and a bad name is refused with a message that names every valid one."""

from __future__ import annotations

import pytest

from fsdp_compat.errors import FsdpCompatError
from fsdp_compat.policies import POLICY_ORDER, Auto, InputOnly, LayersOnly, Legacy, LegacySkyrl, resolve_policy

#: the names docs/api.md documents for ``policy=`` and ``FSDP_COMPAT_POLICY``
DOCUMENTED = {"auto", "legacy", "legacy-skyrl", "input-only", "layers-only"}


def test_a_bad_name_is_refused_with_every_valid_name() -> None:
    with pytest.raises(FsdpCompatError, match="unknown wrap policy 'legacy-verl'") as raised:
        resolve_policy("legacy-verl")
    listed = str(raised.value).split("use one of ", 1)[1].split(" (", 1)[0]
    assert set(listed.split(", ")) == DOCUMENTED


def test_names_are_read_case_and_separator_blind() -> None:
    assert type(resolve_policy(" Input_Only ")) is InputOnly
    assert type(resolve_policy("LAYERS-ONLY")) is LayersOnly
    assert type(resolve_policy("legacy_skyrl")) is LegacySkyrl
    assert type(resolve_policy("legacy")) is Legacy
    assert resolve_policy("auto") == Auto()


def test_a_policy_object_passes_through_and_other_types_are_refused() -> None:
    mine = Auto(lift_min_bytes=0)
    assert resolve_policy(mine) is mine
    with pytest.raises(FsdpCompatError, match="unknown wrap policy 3"):
        resolve_policy(3)  # type: ignore[arg-type]


def test_legacy_variants_differ_only_in_the_output_embedding_rule() -> None:
    """verl >= 0.7.1 adds ``lm_head``; SkyRL and verl 0.4-0.7.0 take embeddings only (policies docstrings,
    docs/stacks.md)."""
    assert Legacy().output_embeddings is True and LegacySkyrl().output_embeddings is False
    assert isinstance(LegacySkyrl(), Legacy)
    assert Auto.analyzed and not any(cls.analyzed for cls in (Legacy, LegacySkyrl, InputOnly, LayersOnly))


def test_side_by_side_order_lists_every_policy_once_with_auto_last() -> None:
    assert set(POLICY_ORDER) == DOCUMENTED and len(POLICY_ORDER) == len(DOCUMENTED)
    assert POLICY_ORDER[-1] == "auto"
