"""pytest hooks: the distributed tests' device checked at start (its setting lives in ``lab.support``), and failing (not
skipping) when it is missing.

``FSDP_COMPAT_TEST_DEVICE=cuda`` (set by the tox ``-gpu`` factor) runs the distributed tests with NCCL on every
visible GPU; without CUDA that is a failure, never a skip.

A test whose ``skipif`` condition holds at collection (it needs another framework release, e.g. verl's
``_select_fsdp2_wrap_targets`` on verl 0.7.0) does not apply to this environment: it is deselected, not skipped,
and the summary lists each one with its reason, so a skip in a report always means something went wrong.

This folder goes first on ``PYTHONPATH`` in ``os.environ`` as soon as pytest imports this file, so every process a
test starts (rank processes of ``fsdp_compat.testing.launch.run_ranks`` included) can import the test lab
(``lab.*``, tests/lab/) and ``lab.support``; a test that sets the ranks' ``PYTHONPATH`` itself keeps the inherited
entries after its own.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from lab.support import DEVICE, WORLD_SIZE

TESTS = str(Path(__file__).resolve().parent)
_inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != TESTS]
os.environ["PYTHONPATH"] = os.pathsep.join([TESTS, *_inherited])

__all__ = ["DEVICE", "WORLD_SIZE"]  # still importable from here for now; test modules import them from lab.support


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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    keep, not_applicable = [], []
    for item in items:
        reasons = [
            mark.kwargs.get("reason", "")
            for mark in item.iter_markers("skipif")
            if mark.args and isinstance(mark.args[0], bool) and mark.args[0]
        ]
        (not_applicable if reasons else keep).append((item, reasons[0] if reasons else ""))
    if not_applicable:
        config.hook.pytest_deselected(items=[item for item, _ in not_applicable])
        items[:] = [item for item, _ in keep]
        config.stash[_NOT_APPLICABLE] = [(item.nodeid, reason) for item, reason in not_applicable]


_NOT_APPLICABLE = pytest.StashKey[list]()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    rows = config.stash.get(_NOT_APPLICABLE, [])
    if rows:
        terminalreporter.section(f"not applicable to this environment: {len(rows)} deselected")
        for nodeid, reason in rows:
            terminalreporter.write_line(f"{nodeid}: {reason}")
