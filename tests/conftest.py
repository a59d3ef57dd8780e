"""Shared test settings: which device the distributed tests use, and failing (not skipping) when it is missing.

``FSDP_COMPAT_TEST_DEVICE=cuda`` (set by the tox ``-gpu`` factor) runs the distributed tests with NCCL on every
visible GPU; without CUDA that is a failure, never a skip.
"""

from __future__ import annotations

import os

import pytest
import torch

DEVICE = os.environ.get("FSDP_COMPAT_TEST_DEVICE", "cpu")
# One NCCL rank per visible GPU (NCCL refuses two ranks on one GPU); 2 gloo ranks on CPU.
WORLD_SIZE = max(1, torch.cuda.device_count()) if DEVICE == "cuda" else 2


def pytest_sessionstart(session: pytest.Session) -> None:
    if DEVICE == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError(
            "FSDP_COMPAT_TEST_DEVICE=cuda but torch.cuda.is_available() is False: the GPU factor needs a CUDA "
            "build of torch and a visible GPU"
        )
    if DEVICE not in ("cpu", "cuda"):
        raise pytest.UsageError(f"FSDP_COMPAT_TEST_DEVICE must be cpu or cuda, got {DEVICE!r}")


def pytest_report_header(config: pytest.Config) -> str:
    return f"fsdp-compat: distributed tests on {DEVICE} with {WORLD_SIZE} ranks"
