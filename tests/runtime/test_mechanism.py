"""Alignment by mechanism: a vision-language class fsdp-compat has never seen (no transformers class, no row in any
table, nothing registered) keeps its ranks in step when their micro-batches differ in images.

Each case runs on 2 gloo ranks, fp32, each rank on its own micro-batch (images on rank 0, text only on rank 1 unless
the case says otherwise), 2 AdamW steps, then a ``no_grad`` log-prob pass, against one process training on both
micro-batches with the mean loss, the model sharded by a trainer's own ``fully_shard`` calls (fsdp-compat only
through the installed ``.pth``: the generic layer). Without fsdp-compat (``FSDP_COMPAT=off``) the image|text runs
fall out of step first.
"""

from __future__ import annotations

from typing import Any

import pytest
from lab.support import BREADTH, OFF, ON, WORLD_SIZE, assert_ranks_exact, rank_output

from fsdp_compat.testing.crashes import GLOO_MISMATCH
from fsdp_compat.testing.launch import RunResult, current_wording, run_ranks

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

BODY = "lab.mechanism:mechanism_rank"
OWN = "lab.own_vlm:TINY"


def _run(model: str, shard: str, variants: tuple[str, ...], env: dict[str, str | None], **cfg: Any) -> RunResult:
    kinds = [variants[r % len(variants)] for r in range(WORLD_SIZE)]
    return run_ranks(
        BODY, {"model": model, "shard": shard, "variants": kinds, **cfg}, world_size=WORLD_SIZE, timeout_s=200,
        env={**ON, "FSDP_COMPAT_GENERIC": None, **env},
    )  # fmt: skip


def _errors(result: RunResult) -> str:
    return current_wording(rank_output(result))


def _falls_out_of_step(result: RunResult) -> bool:
    text = _errors(result)
    return not result.ok and (GLOO_MISMATCH in text or "Timed out waiting" in text or "Connection closed" in text)


# the torch-pinned envs run the blocks case, the gate and one named error (the mechanism's FSDP2 hook points); the
# other placements, the model's own dummy and the second error are the same code on every torch: core runs them
@pytest.mark.parametrize(
    "shard", ["blocks", *(pytest.param(s, marks=BREADTH) for s in ("embed", "decoder", "root"))]
)
def test_a_vlm_class_never_seen_trains_image_and_text_ranks_exactly(shard: str) -> None:
    """The text rank replays the image rank's encoder call (recorded there, zeros of its shape) once per forward,
    wherever the trainer's rule puts the encoder: its blocks in groups of their own (``blocks``), after an embedding
    group (``embed``), in the root's group (``decoder``: a call without a group of its own, so its parameters'
    gradients still reach the root's reduce-scatter), or one group for the whole model (``root``)."""
    off = _run(OWN, shard, ("image", "text"), OFF, collective_timeout_s=15)
    assert _falls_out_of_step(off), rank_output(off)
    result = _run(OWN, shard, ("image", "text"), {})
    assert_ranks_exact(result)
    assert [r.extra["mixed_batches"]["dummy_calls"] for r in result.ranks] == [0, 2]  # one per training step
    assert [r.extra["mixed_batches"]["exchanges"] for r in result.ranks] == [2, 2]  # one per forward
    # the log-prob pass (no_grad) after training: each rank's log-probabilities equal one process's, bit for bit
    assert [r.extra["log_prob_diff"] for r in result.ranks] == [0.0, 0.0]
    # one replay where the pass all-gathers; one group for the whole model stays unsharded after the last backward, so
    # the pass issues no collective at all (as in plain FSDP2) and nothing is exchanged or replayed
    assert [r.extra["log_prob_replays"] for r in result.ranks] == ([0, 0] if shard == "root" else [0, 1])


def test_a_tower_output_the_forward_does_not_read_gets_no_gradient_on_the_replaying_rank() -> None:
    """The encoder returns its first and its last block's states, the forward reads the first (an inner layer's
    features): on the image rank the last block gets no gradient, so its group's reduce-scatter is smaller there
    unless the replay leaves it without one too (the caller's used outputs, shared at the forward's end)."""
    off = _run("lab.mechanism:PARTIAL", "blocks", ("image", "text"), OFF, collective_timeout_s=15)
    assert _falls_out_of_step(off), rank_output(off)
    result = _run("lab.mechanism:PARTIAL", "blocks", ("image", "text"), {})
    assert_ranks_exact(result)
    assert [r.extra["mixed_batches"]["dummy_calls"] for r in result.ranks] == [0, 2]


def test_an_encoder_that_is_one_group_and_called_directly_is_replayed() -> None:
    """The encoder one FSDP2 group and called as a module (no features method), as torchtitan shards and calls its
    vision encoder: the call is recorded before the stop at its own all-gather reports."""
    off = _run("lab.mechanism:DIRECT", "unit", ("image", "text"), OFF, collective_timeout_s=15)
    assert _falls_out_of_step(off), rank_output(off)
    result = _run("lab.mechanism:DIRECT", "unit", ("image", "text"), {})
    assert_ranks_exact(result)
    assert [r.extra["mixed_batches"]["dummy_calls"] for r in result.ranks] == [0, 2]


@BREADTH
def test_image_ranks_make_no_replay_and_no_stop() -> None:
    """image|image: the same media on every rank (equal digests), so the forward-start exchange is all there is."""
    result = _run(OWN, "blocks", ("image",), {})
    assert_ranks_exact(result)
    for r in result.ranks:
        assert r.extra["mixed_batches"]["dummy_calls"] == 0 and r.extra["mixed_batches"]["rounds"] == 0, r.extra


@BREADTH
def test_a_model_that_runs_its_own_dummy_gets_no_second_call() -> None:
    """A forward that runs the encoder on a zero image itself when it has none (verl's and VeOmni's VLM forwards
    do): the text rank's own call stands where the image rank's does, so nothing is replayed."""
    result = _run("lab.mechanism:SELF_DUMMY", "blocks", ("image", "text"), {})
    assert_ranks_exact(result)
    assert [r.extra["mixed_batches"]["dummy_calls"] for r in result.ranks] == [0, 0]
    assert [r.extra["log_prob_diff"] for r in result.ranks] == [0.0, 0.0]


@pytest.mark.parametrize(
    ("model", "why"),
    [
        (
            "lab.mechanism:LOOPED",
            "different FSDP2 groups (rank 0: encoder.blocks.0 (1 media call(s) started); rank 1: decoder.blocks.0)",
        ),
        pytest.param(
            "lab.mechanism:TAGGED",
            "call tagged cannot be replayed on rank(s) 1, which lack it: it takes an argument of type "
            "lab.mechanism.Tag",
            marks=BREADTH,
        ),
    ],
    ids=["blocks-in-its-own-forward", "an-object-of-its-own"],
)
def test_a_medium_that_cannot_be_replayed_is_a_named_error_on_every_rank(model: str, why: str) -> None:
    off = _run(model, "blocks", ("image", "text"), OFF, collective_timeout_s=15)
    assert _falls_out_of_step(off), rank_output(off)
    result = _run(model, "blocks", ("image", "text"), {}, collective_timeout_s=60)
    assert not result.ok
    for rank in result.ranks:
        text = rank.error or ""
        assert "FsdpCompatError" in text and why in text, rank_output(result)
        assert "register_family" in text and f"in this forward of {type_name(model)}" in text, text
        assert "media inputs (pixel_values)" in text, text


def type_name(model: str) -> str:
    return {"lab.mechanism:LOOPED": "LoopedVlm", "lab.mechanism:TAGGED": "TaggedVlm"}[model]
