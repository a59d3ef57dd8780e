"""The alignment's arithmetic on exchange tables alone (``fsdp_compat.runtime.alignment``: no process group, no
model): every rank reaches the most calls any rank makes, per medium, and a per-image family's dummies pack as many
images as the calls they pair with."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fsdp_compat.runtime.alignment import Targets, call_images, owed, targets


def test_an_image_rank_and_a_text_rank() -> None:
    rows = {0: (1,), 1: (0,)}
    assert targets(rows) == Targets(1)
    assert [owed(row[0], targets(rows).vision) for row in rows.values()] == [0, 1]


def test_no_rank_with_images_runs_no_tower() -> None:
    assert targets({0: (0, 0), 1: (0, 0)}, media=1) == Targets(0, (0,))


def test_each_medium_has_its_own_target() -> None:
    rows = {0: (2, 0, 1), 1: (0, 1, 0), 2: (1, 0, 0)}  # vision calls, audio calls, video-path calls
    assert targets(rows, media=2) == Targets(2, (1, 1))


def test_per_image_calls_pair_with_the_longest_sequence() -> None:
    rows = {0: (2, 3, 1), 1: (1, 3, 0), 2: (0, 0, 0)}  # vision calls, then images per call (two call columns)
    planned = targets(rows, image_columns=2)
    assert planned == Targets(2, (), (3, 1), True)


def test_per_image_calls_that_cannot_pair_are_flagged() -> None:
    rows = {0: (1, 3, 0), 1: (1, 2, 0)}  # both call once, with 3 and 2 images
    assert call_images(rows, 1, 3) == ((3,), False)
    assert targets(rows, image_columns=2).consistent is False


def test_an_empty_exchange_is_refused() -> None:
    with pytest.raises(ValueError):
        targets({})


@given(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 4)), min_size=1, max_size=32))
def test_every_rank_reaches_the_same_count(rows: list[tuple[int, int]]) -> None:
    table = dict(enumerate(rows))
    planned = targets(table, media=1)
    for vision, audio in rows:
        assert vision + owed(vision, planned.vision) == planned.vision
        assert audio + owed(audio, planned.media[0]) == planned.media[0]
    assert planned.vision in {v for v, _ in rows} and planned.media[0] in {a for _, a in rows}
