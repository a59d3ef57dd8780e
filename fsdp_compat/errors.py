"""Errors that name the problem and the fix."""

from __future__ import annotations


class FsdpCompatError(ValueError):
    """Bad input to fsdp-compat: the message says what is wrong and how to fix it."""
