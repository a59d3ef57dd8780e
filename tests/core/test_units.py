"""The helpers written once: byte sizes (``fsdp_compat.units.fmt_bytes``) and module-path containment
(``fsdp_compat.paths.within``). The expected strings are the ones the docs quote (docs/api.md's plan and policy table,
the guard's message in docs/guarantees.md, the benchmark tables), computed by hand from the byte counts."""

from __future__ import annotations

import pytest

from fsdp_compat.paths import within
from fsdp_compat.tree import ModuleTree
from fsdp_compat.units import fmt_bytes

KiB, MiB, GiB, TiB = 2**10, 2**20, 2**30, 2**40


@pytest.mark.parametrize(
    ("n", "decimals", "text"),
    [
        (0, 1, "0 B"),
        (1023, 1, "1023 B"),
        (1024, 1, "1.0 KiB"),
        (8 * KiB, 1, "8.0 KiB"),  # GLM4V's vision position table in the zoo: 2,048 fp32 parameters
        (32 * MiB, 1, "32.0 MiB"),  # Auto.lift_min_bytes
        (706 * MiB, 1, "706.0 MiB"),  # GLM-4.1V's merger, split from the root
        (141_536 * 4 // 8, 2, "69.11 KiB"),  # GLM4V's 141,536 fp32 parameters over 8 ranks
        (481_264, 2, "469.98 KiB"),
        (141_536 * 4 // 8, None, "69.1 KiB"),  # three significant figures
        (481_264, None, "470 KiB"),
        (-481_264, None, "-470 KiB"),  # a benchmark's difference of two sizes
        (3 * TiB, 1, "3.0 TiB"),
    ],
)
def test_fmt_bytes(n: int, decimals: int | None, text: str) -> None:
    assert fmt_bytes(n, decimals=decimals) == text


@pytest.mark.parametrize(
    ("path", "ancestor", "inside"),
    [
        ("a.b", "", True),  # everything is within the root
        ("", "", True),
        ("a", "a", True),
        ("a.b.c", "a.b", True),
        ("a.bc", "a.b", False),  # a name prefix is not a parent
        ("a", "a.b", False),
        ("", "a", False),
    ],
)
def test_within(path: str, ancestor: str, inside: bool) -> None:
    assert within(path, ancestor) is inside
    assert ModuleTree.is_ancestor_or_self(ancestor, path) is inside
