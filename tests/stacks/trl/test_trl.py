"""TRL (``trl`` 1.16.0 from PyPI): tiny GLM4V trained by TRL's own ``SFTTrainer`` with ``fsdp_config={"version":
2}`` on 2 gloo ranks (rank 0 an image batch, rank 1 a text-only one): the HF Trainer's ``Accelerator.prepare`` ->
accelerate's ``fsdp2_prepare_model``, the path fsdp-compat's accelerate adapter patches. Rank code and how the
Trainer takes accelerate's FSDP2 path on CPU: ``lab.stacks.trl_ranks``. Runs in the ``trl116`` tox env (the only one
that collects this folder: a missing TRL fails).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest
from lab.support import OFF, ON, rank_output, rank_pythonpath, require_framework

from fsdp_compat.testing.crashes import GLOO_MISMATCH

require_framework("TRL's SFTTrainer", lambda: importlib.import_module("trl.trainer.sft_trainer"))

from fsdp_compat.testing.launch import RunResult, run_ranks  # noqa: E402

pytestmark = pytest.mark.timeout(400)



def run(variants: list[str], env: dict[str, str | None], tmp_path: Path, **cfg: Any) -> RunResult:
    return run_ranks(
        "lab.stacks.trl_ranks:sft_rank",
        {"model": "glm4v", "steps": 2, "variants": variants, "out": str(tmp_path), **cfg},
        world_size=2,
        timeout_s=300,
        env={"PYTHONPATH": rank_pythonpath(), **env},
    )


def test_sft_trainer_rank_without_images_crashes_then_trains_exactly(tmp_path: Path) -> None:
    """Unpatched, the text-only rank falls out of step in the vision blocks' all-gathers and gloo aborts. With
    fsdp-compat installed, 2 SFTTrainer steps equal one process on both batches with the mean loss: gradients and
    post-AdamW parameters 0.0 (transformers' loss on the model's logits via ``compute_loss_func``; TRL's default fused
    LM head is the next test)."""
    off = run(["image", "text"], OFF, tmp_path, plain_loss=True)
    assert not off.ok, "expected the collective mismatch, but it ran"
    assert GLOO_MISMATCH in rank_output(off), rank_output(off)[-4000:]

    on = run(["image", "text"], ON, tmp_path, plain_loss=True)
    on.raise_for_error()
    for rank in on.ranks:
        extra = rank.extra
        print(f"rank {rank.rank}: Δgrad {extra['grad_diff']} Δparam {extra['param_diff']} losses {extra['losses']}")
        assert extra["is_fsdp2"] and extra["log"][0].startswith("fsdp-compat: patched accelerate"), extra["log"]
        assert ["model.visual.blocks.0"] in extra["groups"] and ["lm_head"] in extra["groups"]
        assert extra["grad_diff"] == 0.0, extra["worst_grad_param"]
        assert extra["param_diff"] == 0.0, extra["worst_param"]
    # one per forward: SFTTrainer runs the loss forward and, with compute_loss_func, a no_grad one for its metrics
    assert [r.extra["dummy_calls"] for r in on.ranks] == [0, 4]


def test_trls_fused_lm_head_gradient_is_not_averaged_across_ranks_with_or_without_fsdp_compat(tmp_path: Path) -> None:
    """Upstream, recorded (TRL 1.16.0, not fsdp-compat's): SFTTrainer's default fused LM head reads
    ``lm_head.weight`` and calls ``full_tensor()`` on it itself; under FSDP2 with a different batch on each rank the
    head's gradient then differs from the one-process mean (every other gradient of the first step agrees to
    rounding), identically with and without fsdp-compat; with the same batch on both ranks it agrees. Both ranks
    have images here, so the unpatched run does not abort."""
    off = run(["image", "image"], OFF, tmp_path)
    on = run(["image", "image"], ON, tmp_path)
    same = run(["image", "image"], ON, tmp_path, same_batch=True)
    for result in (off, on, same):
        result.raise_for_error()
    first = [r.ranks[0].extra["step_grad_diff"][0] for r in (off, on, same)]
    print(f"first-step worst gradient differences (off, on, same batch): {first}")
    assert first[0] == first[1] and first[0][1] == "lm_head.weight" and first[0][0] > 1e-3
    assert off.ranks[0].extra["lm_head_grad_ratio"] == on.ranks[0].extra["lm_head_grad_ratio"]
    assert abs(on.ranks[0].extra["lm_head_grad_ratio"][0] - 1.0) > 0.05
    assert first[2][0] < 1e-6 and abs(same.ranks[0].extra["lm_head_grad_ratio"][0] - 1.0) < 1e-6
