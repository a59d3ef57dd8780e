"""What the test modules share: where the distributed tests run, the ranks' ``PYTHONPATH``, and the framework a stack
folder needs.

Importable as ``lab.support`` from every test module: pytest (``prepend`` import mode, the default) puts the folder of
``tests/conftest.py``, which has no ``__init__.py``, on ``sys.path`` before it collects anything; tests/conftest.py
puts ``tests/`` on ``PYTHONPATH`` for every process a test starts. Test modules import settings from here, never from
``conftest`` (pytest's own module, which it may import under another name).

``FSDP_COMPAT_TEST_DEVICE=cuda`` (set by the tox ``-gpu`` factor) runs the distributed tests with NCCL on every
visible GPU; tests/conftest.py makes a missing CUDA a usage error, never a skip.

Each ``tests/stacks/<framework>/`` folder is collected only by the tox envs that install that framework (tox.ini names
the folder), so a missing framework there is a broken environment: the module fails at collection, never skips.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

T = TypeVar("T")

#: ``tests/``: every rank routine, fake and stub the tests use lives under ``tests/lab`` and imports as ``lab.*``.
TESTS = Path(__file__).resolve().parents[1]
#: Stand-ins for modules a framework imports at module level but a CPU machine lacks (``flash_attn`` for SkyRL).
STUBS = TESTS / "lab" / "stubs"


def rank_pythonpath(*first: Path | str) -> str:
    """The rank processes' ``PYTHONPATH``: ``first`` (e.g. :data:`STUBS`), ``tests/``, then the caller's own entries
    (never an empty entry: that would put the working directory first)."""
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    ordered = [str(p) for p in (*first, TESTS)] + inherited
    return os.pathsep.join(dict.fromkeys(ordered))


#: The device of the distributed tests: ``cpu`` (gloo) or ``cuda`` (NCCL).
DEVICE = os.environ.get("FSDP_COMPAT_TEST_DEVICE", "cpu")
#: One NCCL rank per visible GPU (NCCL refuses two ranks on one GPU); 2 gloo ranks on CPU.
WORLD_SIZE = max(1, torch.cuda.device_count()) if DEVICE == "cuda" else 2
#: A case that repeats a mechanism another case of the same test already proves, on another model family, world size
#: or plan. The core env (torch 2.13) runs every case; the envs that rerun these tests on each torch a framework pins
#: deselect these (``-m "not breadth"``), so each test still runs there with at least one case.
BREADTH = pytest.mark.breadth


def require_framework(name: str, probe: Callable[[], T | None]) -> T:
    """``probe()``'s result (e.g. the installed version); a probe that raises ``ImportError`` (which includes
    ``importlib.metadata.PackageNotFoundError``) or returns None fails the calling test module's collection."""
    try:
        found = probe()
    except ImportError as exc:
        found, why = None, f"{type(exc).__name__}: {exc}"
    else:
        why = "not installed"
    if found is None:
        pytest.fail(
            f"{name} is missing ({why}): this folder runs only in the tox envs that install {name} (see tox.ini)",
            pytrace=False,
        )
    return found


#: The ranks' fsdp-compat switches all unset: the defaults a user gets (a test's own environment cannot leak in).
ON: dict[str, str | None] = {
    "FSDP_COMPAT": None,
    "FSDP_COMPAT_POLICY": None,
    "FSDP_COMPAT_MIXED_BATCHES": None,
    "FSDP_COMPAT_GUARD": None,
}
#: The same with fsdp-compat off: the framework as it is, for the crash shown first.
OFF: dict[str, str | None] = {**ON, "FSDP_COMPAT": "off"}
#: fsdp-compat on but its mixed micro-batch alignment off: the collective mismatch of image|text ranks shown first.
MIXED_OFF: dict[str, str | None] = {**ON, "FSDP_COMPAT_MIXED_BATCHES": "off"}


def assert_ranks_exact(result: Any) -> None:
    """Every rank of a ``run_ranks`` result that trained against one process (``lab.every_root``,
    ``lab.contract``): 0.0 in gradients and parameters, and its losses equal to the reference's."""
    result.raise_for_error()
    for r in result.ranks:
        assert r.extra["grad_diff"] == 0.0, (r.rank, r.extra["worst_grad_param"], r.extra["grad_diff"])
        assert r.extra["param_diff"] == 0.0, (r.rank, r.extra["worst_param"], r.extra["param_diff"])
        assert r.extra["losses"] == r.extra["reference_losses"], r.extra


def rank_output(result: Any) -> str:
    """Every rank's traceback and output tail of a ``RunResult`` (a rank that gloo aborts reports only its
    output)."""
    return "\n".join(f"--- rank {r.rank} ---\n{r.error}\n{r.extra.get('log_tail', '')}" for r in result.ranks)
