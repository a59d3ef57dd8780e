"""Mllama's cross-attention join point (``CrossAttention`` in its row) beyond the training step the families test
runs: ``generate`` and log-prob passes with an image prompt on rank 0 and a text prompt on rank 1.

A text rank's first forward hands its cross-attention layers zero states (its dummy tower call's 0.0 term) and an
all-zero row mask; with a cache, those zero states are cached as real ones would be, so every decode step runs the
cross-attention layers on every rank (the image rank from its cached image states), and the text rank's decode
steps get the zero row mask again. Each rank compares with an unsharded copy of the model on its own prompt (the one
process): tokens and every step's scores ``torch.equal``, log-probs ``== 0.0``. Unaligned
(``FSDP_COMPAT_MIXED_BATCHES=off``) the text rank skips the tower and those layers: gloo's size mismatch. The rank
routines are tests/runtime/test_generation.py's (``lab.generation``); the tiny model's tanh gates are open, so a
cross-attention layer that added anything would show in the scores.
"""

from __future__ import annotations

from typing import Any

import pytest
from lab.support import DEVICE, rank_pythonpath

from fsdp_compat.testing.crashes import GLOO_MISMATCH
from fsdp_compat.testing.launch import RunResult, current_wording, run_ranks

pytestmark = [pytest.mark.timeout(300)]

MODEL = "lab.vlms:mllama"


def _launch(cases: list[str], mode: str) -> RunResult:
    return run_ranks(
        "lab.generation:generation_ranks",
        {"model": MODEL, "plan": "auto", "variants": ["image", "text"], "cases": cases, "device": DEVICE},
        world_size=2,
        timeout_s=150.0,
        env={"PYTHONPATH": rank_pythonpath(), "FSDP_COMPAT_MIXED_BATCHES": mode},
    )


def _case(run: RunResult, name: str) -> list[dict[str, Any]]:
    """Per rank, the result of the case called ``name``."""
    run.raise_for_error()
    return [next(v for k, v in r.extra.items() if k.partition(":")[2] == name) for r in run.ranks]


def test_mllama_generation_and_log_probs_with_image_and_text_ranks_equal_one_process() -> None:
    run = _launch(["generate", "logprobs", "sample"], "sync")
    print(f"mllama: generate, logprobs, sample on image|text ranks in {run.seconds:.1f}s")
    for rank, out in enumerate(_case(run, "generate")):
        assert out["tokens"] == out["ref_tokens"] and out["scores_equal"], (rank, out["max_score_diff"])
        c = out["counters"]
        assert c["decode_steps"] == out["new_tokens"] - 1 == 2 and c["exchanges"] == 1, (rank, c)
        assert c["dummy_calls"] == rank, (rank, c)  # the text rank, once per generate (its prefill)
    for rank, out in enumerate(_case(run, "sample")):  # the ranks stop at different lengths (synced_gpus)
        assert out["tokens"] == out["ref_tokens"] and out["scores_equal"], (rank, out["max_score_diff"])
        assert out["new_tokens"] == 2 + 2 * rank and out["counters"]["decode_steps"] == 3, (rank, out)
    for rank, out in enumerate(_case(run, "logprobs")):
        assert out["no_grad"] == 0.0 and out["eval"] == 0.0, (rank, out)
        assert out["counters"]["dummy_calls"] == 2 * rank, (rank, out)  # one per forward on the text rank


def test_mllama_image_and_text_generation_falls_out_of_step_without_the_alignment() -> None:
    run = _launch(["generate"], "off")
    assert not run.ok
    text = "\n".join((r.error or "") + str(r.extra.get("log_tail", "")) for r in run.ranks)
    assert (GLOO_MISMATCH in current_wording(text)) if DEVICE == "cpu" else ("timed out" in text), text[-3000:]
