"""The mixed micro-batch alignment's arithmetic, without a process group: every rank's counts in, what each rank
owes out.

One exchange gives, per rank, a row of counts: the vision tower's calls in this forward, then one count per other
aligned medium (audio, a video path of its own), then, where the family runs modules once per image of a tower call,
the images of each of its calls (0 where the call is not made). From those rows every rank computes the same
targets (the most calls any rank makes, per medium) and owes dummies up to them. Nothing here touches torch or a
process group: :mod:`.mixed_batches` binds it to a model's hooks, and tests/runtime/test_alignment.py checks it on
tables alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["Targets", "call_images", "owed", "targets"]

Rows = Mapping[int, tuple[int, ...]]  # rank -> its exchanged counts


@dataclass(frozen=True)
class Targets:
    """What every rank makes in this forward: ``vision`` tower calls, each other medium's calls (``media``, in the
    row's order) and, for a family with per-image modules, the images of each call of the longest call sequence
    (``images``; empty otherwise). ``consistent``: every rank's real calls are a prefix of that sequence (so a
    dummy packing as many images as the call it pairs with lines the per-image modules up)."""

    vision: int
    media: tuple[int, ...] = ()
    images: tuple[int, ...] = ()
    consistent: bool = True


def targets(rows: Rows, media: int = 0, image_columns: int = 0) -> Targets:
    """The targets of one exchange: ``media`` columns after the vision column, then ``image_columns`` columns of
    images per call (0: the family has no per-image modules)."""
    if not rows:
        raise ValueError("an exchange has at least one rank's row")
    vision = max(row[0] for row in rows.values())
    others = tuple(max(row[i] for row in rows.values()) for i in range(1, 1 + media))
    if not image_columns:
        return Targets(vision, others)
    images, consistent = call_images(rows, 1 + media, 1 + media + image_columns)
    return Targets(vision, others, images, consistent)


def call_images(rows: Rows, first: int, last: int) -> tuple[tuple[int, ...], bool]:
    """The images of each call of the longest call sequence any rank makes (columns ``first:last``, zeros left out),
    and whether every rank's sequence is the start of it."""
    calls = {rank: tuple(n for n in row[first:last] if n > 0) for rank, row in rows.items()}
    longest = max(calls.values(), key=len)
    return longest, all(seq == longest[: len(seq)] for seq in calls.values())


def owed(own: int, target: int) -> int:
    """Dummy calls a rank that made ``own`` calls owes to reach ``target`` (never negative)."""
    return max(0, target - own)
