"""What a stack folder needs before its tests mean anything: the framework it tests, installed.

Each ``tests/stacks/<framework>/`` folder is collected only by the tox envs that install that framework (tox.ini names
the folder), so a missing framework there is a broken environment: the module fails at collection, never skips.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import pytest

T = TypeVar("T")


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
