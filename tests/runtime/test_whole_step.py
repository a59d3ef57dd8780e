"""The whole training step through the direct API (``fsdp_compat.apply_fsdp2``, policy auto) with ranks that differ
in kind: one with images, one without. Tiny GLM4V and Qwen2.5-VL, 2 gloo ranks, fp32 unless said, 2 AdamW steps.

Every case first fails without the mixed micro-batch alignment (``FSDP_COMPAT_MIXED_BATCHES=off``: gloo's "Received
data size doesn't match expected size"), then trains with it, each rank on its own batches:

- gradient accumulation: rank 0 runs an image micro-batch then a text one, rank 1 the reverse, new batches every
  step. With FSDP2's no-sync (``set_requires_gradient_sync(False)`` on all but the last micro-batch) and with a sync
  after every micro-batch, gradients and post-AdamW parameters equal one process training on all four micro-batches
  with the mean loss, 0.0, when that process sums the micro-batches' gradients in FSDP2's order
  (:func:`~fsdp_compat.testing.parity.accumulated_reference_backward`). The order is asserted to matter: the same
  sums in the other mode's order, or one backward after another, differ (by ~1e-8 here). Every rank's loss of every
  micro-batch equals the reference's.
- activation checkpointing, ``torch.utils.checkpoint`` reentrant and not (transformers'
  ``gradient_checkpointing_enable`` before sharding; the first text layer's and vision block's computation asserted
  to run twice a step, forward and recomputation, on the text rank through the dummy, counted on the submodules
  each block calls, which holds wherever transformers puts the checkpoint): 0.0 against one process without
  checkpointing, and equal losses.
- bf16 ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``: compared with plain per-layer FSDP2 under the
  same policy, not with one process (see :func:`test_bf16_equals_plain_per_layer_fsdp2_bit_for_bit`): 0.0.
- a control: a one-ulp change and a NaN injected into one gradient shard of the accumulation run are reported by
  the comparator.

The ranks always run on CPU with gloo whatever ``FSDP_COMPAT_TEST_DEVICE`` says: the exact figures rest on two
ranks (every sum of two terms is commutative), and the GPU factor has one NCCL rank per GPU.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from lab.support import BREADTH, rank_pythonpath

from fsdp_compat.testing.crashes import GLOO_MISMATCH
from fsdp_compat.testing.launch import RunResult, current_wording, run_ranks

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

ROUTINE = "lab.whole_step:whole_step_rank"
MODELS = ["glm4v", pytest.param("qwen2.5-vl", marks=BREADTH)]
STEPS = 2
VARIANTS = ["image", "text"]  # one batch a rank, for the cases without accumulation
IMAGE_THEN_TEXT = [["image", "text"], ["text", "image"]]  # [rank][micro-batch], for accumulation


def _run(model: str, cases: list[dict[str, Any]], *, mode: str = "sync", timeout_s: float = 300.0) -> RunResult:
    cfg = {"model": model, "seed": 0, "steps": STEPS, "variants": VARIANTS, "cases": cases}
    env = {"PYTHONPATH": rank_pythonpath(), "FSDP_COMPAT_MIXED_BATCHES": mode}
    run = run_ranks(ROUTINE, cfg, world_size=2, timeout_s=timeout_s, env=env)
    print(f"{model} {mode} {cases}: {'ok' if run.ok else run.exception} ({run.seconds:.1f}s)")
    return run


def _assert_mismatch(model: str, case: dict[str, Any]) -> None:
    run = _run(model, [case], mode="off", timeout_s=120.0)
    assert not run.ok
    text = "\n".join((r.error or "") + str(r.extra.get("log_tail", "")) for r in run.ranks)
    assert GLOO_MISMATCH in current_wording(text), text[-3000:]


def _cases(run: RunResult) -> list[list[dict[str, Any]]]:
    """``[rank][case]``: each case's figures on each rank."""
    run.raise_for_error()
    return [r.extra["cases"] for r in run.ranks]


def _assert_exact(figures: dict[str, Any]) -> None:
    assert figures["grads"] == 0.0, (figures["case"], figures["worst_grad"], figures["grads"])  # NaN fails too
    assert figures["params"] == 0.0, (figures["case"], figures["worst_param"], figures["params"])


# ---------------------------------------------------------------------------------------------- accumulation


@pytest.mark.parametrize("model", MODELS)
def test_accumulation_image_then_text_crashes_then_sums_like_one_process(model: str) -> None:
    cases = [{"kind": "accumulate", "sync": sync, "kinds": IMAGE_THEN_TEXT} for sync in ("last", "every")]
    _assert_mismatch(model, cases[0])
    for rank, figures in enumerate(_cases(_run(model, cases))):
        for case in figures:
            _assert_exact(case)
            assert case["losses"] == case["reference_losses"]  # every micro-batch, every step
            # the order of the sums is what makes 0.0: the other order, or backward after backward, rounds otherwise
            assert 0.0 < case["other_order"] < 1e-6 and 0.0 < case["one_backward"] < 1e-6, case
            print(f"rank {rank} sync={case['case']['sync']}: other order {case['other_order']:.2g}, "
                  f"backward after backward {case['one_backward']:.2g}")  # fmt: skip
            # each rank has one text micro-batch a step: one dummy there; one exchange per micro-batch
            expected = {"installed": 1, "dummy_calls": STEPS, "audio_dummy_calls": 0, "exchanges": 2 * STEPS,
                        "rounds": 0}  # fmt: skip (the table's path: no generic stops)
            assert case["mixed_batches"] == expected, rank


def test_accumulation_comparator_reports_one_ulp_and_nan() -> None:
    """The control: rank 0 moves one element of its ``lm_head.weight`` gradient shard to the next float (the
    smallest change there is) or to NaN, after both backwards and before the comparison. The gradient comparator
    reports the ulp where it is and the NaN (NaN-sticky to the end, parameters included: AdamW spreads it). AdamW's
    first update is ``lr * sign(g)``-like, so one ulp need not reach the parameters: the gradients carry that proof."""
    base = {"kind": "accumulate", "sync": "last", "kinds": IMAGE_THEN_TEXT}
    run = _run("glm4v", [{**base, "perturb": "ulp"}, {**base, "perturb": "nan"}])
    for ulp, nan in _cases(run):
        assert 0.0 < ulp["grads"] < 1e-6, ulp
        assert ulp["worst_grad"] == "lm_head.weight", ulp
        assert math.isnan(nan["grads"]) and math.isnan(nan["params"]), nan
    assert math.isnan(run.max_abs_grad_diff) and math.isnan(run.max_abs_param_diff)


# ------------------------------------------------------------------------------------- activation checkpointing


@pytest.mark.parametrize("model", MODELS)
def test_activation_checkpointing_crashes_then_trains_exactly(model: str) -> None:
    cases = [{"kind": "checkpoint", "reentrant": reentrant} for reentrant in (True, False)]
    for case in cases:
        _assert_mismatch(model, case)
    for rank, figures in enumerate(_cases(_run(model, cases))):
        for case in figures:
            _assert_exact(case)
            assert case["losses"] == case["reference_losses"]
            # checkpointed: each block's computation runs in forward and again in backward (every submodule it calls
            # runs twice); on the text rank the dummy runs the tower
            runs = case["runs_per_step"]
            assert sorted(runs) == ["text_layer", "vision_block"] and all(runs.values()), case
            assert {n for seen in runs.values() for n in seen.values()} == {2.0}, case
            assert case["mixed_batches"]["dummy_calls"] == (0 if rank == 0 else STEPS)


# ------------------------------------------------------------------------------------------------------- bf16


@pytest.mark.parametrize("model", MODELS)
def test_bf16_equals_plain_per_layer_fsdp2_bit_for_bit(model: str) -> None:
    """bf16 parameters, fp32 reduction, image|text ranks: ``auto`` equals plain per-layer FSDP2 (every
    ``_no_split_modules`` block a group, the vision tower's other parts and every embedding in the root: nothing is
    ever read while sharded) under the same policy, 0.0 in gradients and post-AdamW parameters, and equal losses.

    Why a sharded reference and why 0.0: FSDP2's ``MixedPrecisionPolicy`` casts each group's forward inputs to bf16
    at that group's boundary, so the numbers depend on the grouping and one process is no reference; the control
    here, root-only FSDP2 against the same per-layer twin, differs (measured: first-step gradients 1.5e-5 GLM4V /
    4.9e-4 Qwen2.5-VL, parameters after two steps 1.5e-3 / 3.5e-3). ``auto``'s plan is per-layer plus two groups,
    ``embed_tokens`` and ``lm_head``, and the test asserts what they receive before the cast: integer token ids and
    the final norm's bf16 output, which the cast leaves as they are. So both plans run the same ops on the same values
    in the same dtypes, and reduce in fp32 over two ranks (commutative): bit-identical. Both plans need the mixed
    micro-batch alignment (a vision block group is skipped by the text rank), so the twin gets it too."""
    case = {"kind": "bf16"}
    _assert_mismatch(model, case)
    for ranks in _cases(_run(model, [case])):
        for figures in ranks:
            _assert_exact(figures)
            for per_layer, auto, _ in figures["losses"]:
                assert auto == per_layer
            groups = figures["groups"]
            extra = sorted(set(groups["auto"]) - set(groups["per_layer"]))
            assert extra == ["lm_head", "model.language_model.embed_tokens"], groups
            assert set(groups["per_layer"]) <= set(groups["auto"])
            assert figures["input_dtypes"] == {
                "lm_head": ["torch.bfloat16"],
                "model.language_model.embed_tokens": ["torch.int64"],
            }
            root_only = figures["root_only"]
            assert figures["root_only_first_grads"] > 0.0 and root_only["params"] > 1e-4, root_only
            print(f"{model}: root-only vs per-layer, first gradients {figures['root_only_first_grads']:.2g}, "
                  f"parameters after {STEPS} steps {root_only['params']:.2g}")  # fmt: skip
