"""GLM4V's sibling GLM4V-MoE through verl's REAL engine, image|text ranks (issue 30 item 4's lower-priority part).

verl 0.9.1 has its own forward for ``glm4v`` (it runs the vision tower on a dummy for a text-only micro-batch), but not
for ``glm4v_moe``: ``apply_monkey_patch`` leaves transformers' forward, which calls the tower only with pixel values,
and has no Ulysses input slicing for it (so this runs without sequence parallelism). 2 gloo ranks, verl's
``TrainingWorker`` and ``train_batch``, fp32 policy, no remove padding (eager attention), rank 0 image rows, rank 1
text-only rows, 2 steps. Rank routines: ``tests/lab/stacks/verl_ulysses_ranks.py`` (family ``glm4v-moe``, sp 1).

Order: ``FSDP_COMPAT=off`` (rank 0 crashes, rank 1 hangs), ``FSDP_COMPAT_MIXED_BATCHES=off`` (gloo aborts on the
collective mismatch), the default (fsdp-compat's alignment runs its own dummy on rank 1; 0.0 against one process
training on both micro-batches with the mean loss). Each launch is bounded by ``run_ranks(timeout_s=TIMEOUT_S)``.

Figures were measured with torch 2.13.0+cpu, transformers 5.10.4, verl 0.9.1, 2 gloo ranks.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

import pytest
from lab.stacks.verl_engine_ranks import assert_reference_steps_exact
from lab.support import rank_pythonpath, require_framework
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from fsdp_compat.testing.crashes import GLOO_MISMATCH

VERL = require_framework("verl", lambda: Version(metadata.version("verl")))

from fsdp_compat.testing.launch import RunResult, current_wording, run_ranks  # noqa: E402
from fsdp_compat.testing.verl_smoke import GRID_SAMPLER_CRASH  # noqa: E402

WORLD = 2
TIMEOUT_S = 180.0
#: the launch that hangs: gloo's collective timeout, and how long the crashed rank stays alive (as a Ray actor's
#: process does after its method raised) so that the other waits as it would on a cluster
COLLECTIVE_TIMEOUT_S, HOLD_S = 20.0, 25.0  # 20 s: slack for a rank slowed by a busy host
FP32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
#: sp 1, no remove padding, fp32, the clip made a no-op: the comparison can be exact
MOE = {
    "name": "moe", "family": "glm4v-moe", "kinds": ["image", "text"], "sp": 1, "remove_padding": False,
    "engine": {"mixed_precision": FP32}, "optimizer": {"clip_grad": 1e9}, "references": [1],
}  # fmt: skip
IMAGE = [48, 96]  #: rank 0's tower input per step: 48 patches of 3 * 2 * 4 * 4
DUMMY = [16, 96]  #: fsdp-compat's grid dummy for the GLM4V kind: grid [[1, 4, 4]] (spatial merge 2)

#: verl 0.9.1: the engine on CPU (platform registry, 0.9.0+); test_verl_engine.py covers where older releases stop
pytestmark = pytest.mark.skipif(
    not SpecifierSet(">=0.9.1").contains(VERL, prereleases=True),
    reason=f"verl {VERL}: this runs verl 0.9.1's engine (test_verl_engine.py asserts where older releases stop)",
)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from fsdp_compat.testing.zoo import build_model

    path = tmp_path_factory.mktemp("glm4v-moe")
    build_model("glm4v-moe").save_pretrained(path)
    return str(path)


def _run(moe_dir: str, case: dict[str, Any], env: dict[str, str], **cfg: Any) -> RunResult:
    clean = {k: "" for k in ("FSDP_COMPAT", "FSDP_COMPAT_POLICY", "FSDP_COMPAT_MIXED_BATCHES",
                             "VERL_USE_EXTERNAL_MODULES")}  # fmt: skip
    result = run_ranks(
        "lab.stacks.verl_ulysses_ranks:ulysses_ranks",
        {"model_dir": moe_dir, "moe_dir": moe_dir, "device": "cpu", "cases": [case], **cfg},
        world_size=WORLD,
        timeout_s=TIMEOUT_S,
        env={**clean, "PYTHONPATH": rank_pythonpath(), **env},
    )
    print(f"verl {VERL} GLM4V-MoE launch {env or 'default'}: {result.seconds:.1f}s, ok {result.ok}")
    return result


def test_off_switch_image_rank_crashes_text_rank_hangs(moe_dir: str) -> None:
    """FSDP_COMPAT=off: verl's selector gives the position table a group; rank 0 (images) stops in the tower with
    the grid_sampler crash; rank 1 (text only: transformers' forward skips the tower) waits in FSDP2's all-gather
    of the next group, which rank 0 never makes, for as long as rank 0's process lives (then gloo's timeout)."""
    result = _run(moe_dir, {**MOE, "expect_failure": True, "hold_s": HOLD_S}, {"FSDP_COMPAT": "off"},
                  collective_timeout_s=COLLECTIVE_TIMEOUT_S)  # fmt: skip
    result.raise_for_error()
    image, text = (r.extra["cases"]["moe"] for r in result.ranks)
    for rank in result.ranks:
        assert not rank.extra["state"]["patched"], rank.extra["state"]
    assert GRID_SAMPLER_CRASH in image["error"], image
    assert "model.visual.embeddings.position_embedding" in image["groups"], image["groups"]
    assert "Timed out waiting" in text["error"] and "foreach_all_gather" in text["traceback"], text
    assert text["vision_calls"] == [] and text["steps"] == [], text
    assert text["case_s"] > image["case_s"], (text["case_s"], image["case_s"])  # blocked while rank 0 lived
    print(f"verl {VERL} GLM4V-MoE off: rank 0 {image['error'][:60]}...; rank 1 {text['error'][-70:]} "
          f"({text['case_s']:.1f}s vs rank 0 {image['case_s']:.1f}s)")


def test_alignment_off_aborts_on_the_collective_mismatch(moe_dir: str) -> None:
    """FSDP_COMPAT_MIXED_BATCHES=off (fsdp-compat's wrap rule, no alignment): rank 1 skips the vision blocks'
    all-gathers; its next all-gather meets rank 0's vision-block all-gather: gloo aborts the process."""
    result = _run(moe_dir, MOE, {"FSDP_COMPAT_MIXED_BATCHES": "off"})
    assert not result.ok, "expected the collective mismatch, but it trained"
    assert result.seconds < TIMEOUT_S, result.seconds  # an abort, not a hang
    text = "\n".join((r.error or "") + str(r.extra.get("log_tail", "")) for r in result.ranks)
    assert GLOO_MISMATCH in current_wording(text), text[-3000:]


def test_image_and_text_ranks_train_exactly(moe_dir: str) -> None:
    """The default: fsdp-compat's alignment runs the tower once per step on its zero dummy on rank 1; both ranks
    train 2 steps and each step's losses, gradients and post-AdamW parameters equal one process training on both
    micro-batches with the mean loss (fp32): 0.0."""
    result = _run(moe_dir, MOE, {})
    result.raise_for_error()
    image, text = (r.extra["cases"]["moe"] for r in result.ranks)
    assert [s["vision_calls"] for s in image["steps"]] == [[IMAGE]] * 2, image["steps"]
    assert [s["vision_calls"] for s in text["steps"]] == [[DUMMY]] * 2, text["steps"]
    assert [s["alignment_dummies"] for s in image["steps"]] == [0, 0], image["steps"]
    assert [s["alignment_dummies"] for s in text["steps"]] == [1, 1], text["steps"]
    assert "model.visual.embeddings.position_embedding" not in image["groups"], image["groups"]
    reference = image["reference_sp1"]
    assert not reference["mixed_precision"], reference
    assert_reference_steps_exact(reference, 2)
    for ref in reference["steps"]:
        assert ref["vision_calls"] == [IMAGE] and ref["grad_norm_vision"] > 0.0, ref  # one process: no dummy
    assert image["steps"][0]["loss"] != image["steps"][1]["loss"], image["steps"]
    print(f"verl {VERL} GLM4V-MoE image|text: losses {[r['losses'] for r in reference['steps']]}, 0.0 vs one process")
