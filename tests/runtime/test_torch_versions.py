"""``fsdp_compat.runtime.torch_versions``: which torch the run-time guard runs on, read from version strings (doctor
reads the installed metadata without importing torch)."""

from __future__ import annotations

from importlib import metadata

import pytest
import torch

from fsdp_compat.runtime.torch_versions import GUARD_MIN_TORCH, guard_supports, installed_torch, release


@pytest.mark.parametrize(
    ("version", "expected"),
    [
        ("2.11.0+cu130", (2, 11)),
        ("2.16.0.dev20270101", (2, 16)),
        ("2.8.0", (2, 8)),
        ("10.0", (10, 0)),
        ("2", None),
        ("garbage", None),
        ("", None),
    ],
)
def test_release_reads_major_and_minor(version: str, expected: tuple[int, int] | None) -> None:
    assert release(version) == expected


def test_the_guard_supports_its_minimum_and_newer_and_nothing_older_or_unreadable() -> None:
    assert GUARD_MIN_TORCH == (2, 8)
    assert all(guard_supports(v) for v in ("2.8.0", "2.13.0+cpu", "2.16.0.dev20270101", "3.0.0"))
    assert not any(guard_supports(v) for v in ("2.7.1", "1.13.1", "garbage", ""))


def test_the_installed_torch_is_read_from_its_metadata() -> None:
    assert installed_torch() == metadata.version("torch")
    assert release(torch.__version__) == release(installed_torch() or "")
