"""Module paths as ``named_modules()`` writes them (the root is ``""``): the one containment test.

Imports nothing, so the adapters use it at load time without importing torch.
"""

from __future__ import annotations

__all__ = ["within"]


def within(path: str, ancestor: str) -> bool:
    """``path`` is ``ancestor`` or a module below it; every path is within the root ``""``."""
    return ancestor == "" or path == ancestor or path.startswith(ancestor + ".")
