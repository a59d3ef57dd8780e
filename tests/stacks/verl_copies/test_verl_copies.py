"""Trainers with their own copy of verl's old ``apply_fsdp2`` (adapters/verl_copies.py), each through its own function
as its trainer calls it, on 2 gloo ranks in fresh interpreters: crash first with fsdp-compat off
(``FSDP_COMPAT=off``), then exact parity with the ``.pth`` hook patching the copy, image|text ranks too, and a text
model keeps exactly the copy's groups.

The tox env names the copy under test (``FSDP_COMPAT_TEST_COPY``: a distribution of ``COPIES``; envs
``lmmsengine014``, ``siirl020``, ``trinityrft060``, label ``verl-copies``); a missing trainer fails the collection.
Rank code is ``tests/lab/stacks/verl_copies_ranks.py``.
"""

from __future__ import annotations

import importlib
import os

import pytest
from lab.support import rank_pythonpath, require_framework

from fsdp_compat.testing.crashes import GLOO_MISMATCH

#: distribution -> (the module defining apply_fsdp2, the rank wrap fn that calls it)
COPIES = {
    "lmms-engine": ("lmms_engine.utils.fsdp2_utils", "lab.stacks.verl_copies_ranks:wrap_lmms_engine"),
    "siirl": ("siirl.utils.model_utils.fsdp_utils", "lab.stacks.verl_copies_ranks:wrap_siirl"),
    "trinity-rft": ("trinity.trainer.verl_legacy.utils", "lab.stacks.verl_copies_ranks:wrap_trinity_rft"),
}
DISTRIBUTION = os.environ.get("FSDP_COMPAT_TEST_COPY", "")
MODULE, WRAP = COPIES.get(DISTRIBUTION, ("", ""))

require_framework(
    f"the verl copy {DISTRIBUTION or '(FSDP_COMPAT_TEST_COPY unset)'}",
    lambda: importlib.import_module(MODULE) if MODULE else None,
)

from fsdp_compat.testing.launch import current_wording  # noqa: E402
from fsdp_compat.testing.parity import run_training  # noqa: E402

pytestmark = pytest.mark.timeout(400)

GRID_SAMPLER = "aten.grid_sampler_2d.default got mixed torch.Tensor and DTensor"
ON = {"FSDP_COMPAT": None, "FSDP_COMPAT_POLICY": None, "FSDP_COMPAT_MIXED_BATCHES": None}


def run(model: str, variants: list[str] | None = None, timeout_s: float = 240, **env: str | None):
    return run_training(
        model, WRAP, steps=2, timeout_s=timeout_s, variants=variants, env={"PYTHONPATH": rank_pythonpath(), **env}
    )


def assert_exact(result) -> None:
    """Difference 0.0: gradients after each backward and parameters after each AdamW step equal one process training
    on both ranks' micro-batches with the mean loss; each rank's loss is the reference's loss of its own batch."""
    result.raise_for_error()
    assert result.max_abs_grad_diff == 0.0, result.ranks[0].extra.get("worst_grad_param")
    assert result.max_abs_param_diff == 0.0, result.ranks[0].extra.get("worst_param")
    for rank in result.ranks:
        assert rank.losses == rank.extra["reference_losses"], (rank.rank, rank.losses, rank.extra["reference_losses"])
        assert rank.extra["wrap"] is True  # the copy's apply_fsdp2 imported by name was fsdp-compat's


def test_glm4v_crashes_through_the_copy_without_fsdp_compat():
    result = run("glm4v", ["image", "image"], FSDP_COMPAT="off")
    assert not result.ok
    assert result.ranks[0].extra["wrap"] is False
    assert GRID_SAMPLER in (result.exception or ""), result.error


def test_glm4v_each_rank_its_own_image_batch_exact():
    result = run("glm4v", ["image", "image"], **ON)
    assert_exact(result)
    assert result.ranks[0].losses != result.ranks[1].losses  # different data on every rank
    groups = result.ranks[0].extra["fsdp_groups"]
    assert "model.visual.embeddings.position_embedding" not in groups  # the raw-read table stays in the root
    assert {"model.language_model.embed_tokens", "model.visual.blocks.0", "model.language_model.layers.0"} <= set(
        groups
    )


def test_glm4v_rank_without_images_crashes_unaligned_then_trains_exactly():
    """Rank 0 an image micro-batch, rank 1 text only: the vision blocks have their own groups, the forward runs the
    tower only with pixel_values. Alignment off: gloo aborts with the collective mismatch; on (installed by the
    replacement): rank 1 runs one zero dummy tower call per forward and both ranks match one process exactly."""
    variants = ["image", "text"]
    off = run("glm4v", variants, timeout_s=60, FSDP_COMPAT=None, FSDP_COMPAT_MIXED_BATCHES="off")
    assert not off.ok, "expected the collective mismatch, but it ran"
    text = "\n".join((r.error or "") + str(r.extra.get("log_tail", "")) for r in off.ranks)
    assert GLOO_MISMATCH in current_wording(text), text[-3000:]
    result = run("glm4v", variants, **ON)
    assert_exact(result)
    print(f"{DISTRIBUTION} image|text: Δgrad {result.max_abs_grad_diff:.3g} Δparam {result.max_abs_param_diff:.3g}")
    assert [r.extra["mixed_batches"]["dummy_calls"] for r in result.ranks] == [0, 2]  # one per forward, 2 steps


def test_text_model_keeps_the_copys_groups():
    off, on = run("qwen2", FSDP_COMPAT="off"), run("qwen2", **ON)
    off.raise_for_error()
    assert on.ranks[0].extra["wrap"] is True and off.ranks[0].extra["wrap"] is False
    assert on.ranks[0].extra["fsdp_group_sets"] == off.ranks[0].extra["fsdp_group_sets"]
    assert_exact(on)
