"""GLM4V and Qwen2.5-VL through verl's REAL engine with Ulysses sequence parallelism, image|text data-parallel groups.

verl 0.9.1's ``TrainingWorker`` with ``ulysses_sequence_parallel_size=2`` on 4 gloo ranks: verl's ``(dp, sp)`` mesh
[[0, 1], [2, 3]], i.e. 2 data-parallel groups of 2 sequence-parallel ranks; ``use_remove_padding=True`` (verl refuses
Ulysses without it), verl's default bf16 policy and gradient checkpointing, 2 rows per micro-batch, 2 steps. The two
SP ranks of a data-parallel group share its micro-batch (verl packs its rows into one row, pads it to a multiple of 2
and, for a VLM, cuts it in two after the embedding); data-parallel group 0 has image rows, group 1 text-only rows
(verl issue #3315: mixed image/text runs hang with Ulysses). Rank routines: ``tests/lab/stacks/verl_ulysses_ranks.py``
(verl's own engine, ``train_batch``, SFT collator and Ulysses collectives on gloo; on CPU the test-side platform of
``lab.stacks.verl_cpu_platform`` and the pure-torch stand-in for flash-attn's varlen kernel, as in
test_verl_engine.py). Each launch is bounded by ``run_ranks(timeout_s=TIMEOUT_S)``; the launch that hangs also by
gloo's collective timeout.

Order: ``FSDP_COMPAT=off`` (GLM4V: a crash on every rank; Qwen2.5-VL: a crash on the text ranks, a hang on the image
ranks), ``FSDP_COMPAT_MIXED_BATCHES=off`` (trains), the default (trains), each compared with one process. "One
process" comes in two forms (``verl_ulysses_ranks.ulysses_reference``):

* ``reference_sp1``: verl's forward through the engine's ``forward_step`` with SP off, every data-parallel group's
  micro-batch, ``(loss_g / 2).backward()``, FSDP2's bf16 policy by hand, the engine's AdamW. The losses are equal
  (0.0), the gradients are not: an SP rank sums each weight's (and bias') gradient over its half of the tokens only,
  in bf16, and FSDP2 adds the halves in fp32; one process sums all tokens in one bf16 reduction. That is Ulysses'
  arithmetic, with images on every rank as well (the all-image case), not the mixed batches'.
* ``reference_sp2``: the same one process with the SP split emulated: two copies of the weights, each embedding the
  whole packed row and running the vision tower (or verl's dummy) as an SP rank does; in the text model every module
  with parameters runs token half s with copy s (attention over the whole row, as Ulysses' all-to-all gives it), the
  padding as verl's ``ulysses_pad``; the copies' bf16 gradients cast to fp32 and summed over the 4 (group, half)
  terms. Four fp32 terms can round differently per summation order, and the reduce-scatter's order is gloo's: per
  element, the engine's value must be the sum in one of the orders (a handful of elements per step depend on it),
  and the reference steps with it. Held to 0.0: losses, gradients, post-AdamW parameters, both steps.

Figures were measured with torch 2.13.0+cpu, transformers 5.10.4, verl 0.9.1, 4 gloo ranks.
"""

from __future__ import annotations

import math
from importlib import metadata
from typing import Any

import pytest
from lab.stacks.verl_engine_ranks import assert_reference_steps_exact
from lab.support import rank_pythonpath, require_framework
from packaging.specifiers import SpecifierSet
from packaging.version import Version

VERL = require_framework("verl", lambda: Version(metadata.version("verl")))

from fsdp_compat.testing.launch import RunResult, run_ranks  # noqa: E402
from fsdp_compat.testing.verl_smoke import GRID_SAMPLER_CRASH  # noqa: E402

WORLD, SP = 4, 2
TIMEOUT_S = 300.0  #: per launch; a hang ends here (measured: each launch takes 15-60 s on 2 shared cores)
#: the launch that hangs: the ranks that failed stay alive HOLD_S (as a Ray actor's process does after its method
#: raised), so that the others wait as they would on a cluster instead of seeing their peers' connections close;
#: gloo's collective timeout (the process group's) is COLLECTIVE_TIMEOUT_S. Measured: the waiting ranks stay in
#: their all-gather as long as the failed ranks live and raise gloo's timeout after those have exited
COLLECTIVE_TIMEOUT_S, HOLD_S = 20.0, 25.0  # 20 s: slack for a rank slowed by a busy host
MESH = [[0, 1], [2, 3]]  #: verl's (dp, sp) mesh: ranks 0, 1 are data-parallel group 0
#: the vision tower's input per micro-batch kind: patches x patch dim (GLM4V: patch 14, 1176 = 3 * 2 * 14 * 14;
#: the zoo's Qwen2.5-VL: patch 4, 96); "text" is verl's own text-only dummy, 16 patches, grid [[1, 4, 4]]
PATCHES = {
    "glm4v": {"image": [48, 1176], "image2": [96, 1176], "text": [16, 1176]},
    "qwen2.5-vl": {"image": [48, 96], "image2": [96, 96], "text": [16, 96]},
}
#: the clip made a no-op (clip_grad 1e9) so that the comparison can be exact, the flash-attn stand-in where
#: flash-attn is not installed; GLM4V is test_verl_engine.py's patch-14 model (verl's dummy fits it)
CASE = {"flash_stand_in": True, "optimizer": {"clip_grad": 1e9}}
MIXED = {"name": "mixed", "family": "glm4v", "kinds": ["image", "text"], **CASE}
ALL_IMAGE = {"name": "all_image", "family": "glm4v", "kinds": ["image", "image2"], **CASE}
QWEN_MIXED = {"name": "qwen_mixed", "family": "qwen2.5-vl", "kinds": ["image", "text"], **CASE}
#: verl 0.9.1's Qwen2-VL forward, text-only micro-batch, transformers 5, without fsdp-compat's repair
QWEN_MEAN_CRASH = "AttributeError: 'BaseModelOutputWithPooling' object has no attribute 'mean'"

#: verl 0.9.1: the engine on CPU (platform registry, 0.9.0+) and a remove-padding GLM4V attention that runs on
#: transformers 5 (0.9.0's imports a function transformers 5 no longer has: test_verl_engine.py asserts that stop)
needs_ulysses_engine = pytest.mark.skipif(
    not SpecifierSet(">=0.9.1").contains(VERL, prereleases=True),
    reason=f"verl {VERL}: Ulysses needs remove padding, whose GLM4V attention runs on transformers 5 from 0.9.1 "
    "(test_verl_engine.py asserts where 0.9.0 stops; older releases cannot run the engine on CPU)",
)
pytestmark = needs_ulysses_engine


@pytest.fixture(scope="module")
def p14_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    import lab.stacks.verl_engine_ranks as verl_engine_ranks

    path = tmp_path_factory.mktemp("glm4v-p14-ulysses")
    verl_engine_ranks.build_glm4v_p14().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    import lab.stacks.verl_ulysses_ranks as verl_ulysses_ranks

    path = tmp_path_factory.mktemp("qwen25vl-ulysses")
    verl_ulysses_ranks.build_qwen25_vl().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def dirs(p14_dir: str, qwen_dir: str) -> dict[str, str]:
    return {"model_dir": p14_dir, "p14_dir": p14_dir, "qwen_dir": qwen_dir}


def _launch(
    dirs: dict[str, str], cases: list[dict[str, Any]], env: dict[str, str], **cfg: Any
) -> tuple[list[dict[str, Any]], float]:
    clean = {k: "" for k in ("FSDP_COMPAT", "FSDP_COMPAT_POLICY", "FSDP_COMPAT_MIXED_BATCHES",
                             "VERL_USE_EXTERNAL_MODULES")}  # fmt: skip
    result: RunResult = run_ranks(
        "lab.stacks.verl_ulysses_ranks:ulysses_ranks",
        {**dirs, "device": "cpu", "cases": cases, **cfg},
        world_size=WORLD,
        timeout_s=TIMEOUT_S,
        env={**clean, "PYTHONPATH": rank_pythonpath(), **env},
    )
    result.raise_for_error()
    first = result.ranks[0].extra["cases"]
    timing = ", ".join(f"{c['name']} {first[c['name']]['case_s']:.1f}s" for c in cases if c["name"] in first)
    print(f"verl {VERL} Ulysses launch {env or 'default'}: {result.seconds:.1f}s (rank 0, per case: {timing})")
    return [rank.extra for rank in result.ranks], result.seconds


@pytest.fixture(scope="module")
def all_off(dirs: dict[str, str]) -> tuple[list[dict[str, Any]], float]:
    # GLM4V: every rank stops in the vision tower's position embedding, after the same collectives: the launch goes
    # on (a barrier); then Qwen2.5-VL, where the ranks stop at different points: the launch ends there
    cases = [
        {**MIXED, "expect_failure": True, "same_stop": True},
        {**QWEN_MIXED, "expect_failure": True, "hold_s": HOLD_S},
    ]
    return _launch(dirs, cases, {"FSDP_COMPAT": "off"}, collective_timeout_s=COLLECTIVE_TIMEOUT_S)


@pytest.fixture(scope="module")
def off(all_off: tuple[list[dict[str, Any]], float]) -> tuple[list[dict[str, Any]], float]:
    return all_off


@pytest.fixture(scope="module")
def qwen_off(all_off: tuple[list[dict[str, Any]], float]) -> tuple[list[dict[str, Any]], float]:
    return all_off


@pytest.fixture(scope="module")
def alignment_off(dirs: dict[str, str]) -> tuple[list[dict[str, Any]], float]:
    return _launch(dirs, [MIXED, QWEN_MIXED], {"FSDP_COMPAT_MIXED_BATCHES": "off"})


@pytest.fixture(scope="module")
def on(dirs: dict[str, str]) -> tuple[list[dict[str, Any]], float]:
    return _launch(dirs, [MIXED, ALL_IMAGE, QWEN_MIXED], {})


def _case(ranks: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [rank["cases"][name] for rank in ranks]


def _kind(case: dict[str, Any], rank: int) -> str:
    return case["kinds"][rank // SP]


def _patches(case: dict[str, Any], kind: str) -> list[int]:
    return PATCHES[case["family"]][kind]


def _assert_ulysses_layout(ranks: list[dict[str, Any]], case: dict[str, Any]) -> None:
    """verl built the (dp, sp) mesh; each SP rank ran the vision tower once per step on its group's whole
    micro-batch (a text-only group on verl's own dummy: no second dummy of ours), and its text model got half of the
    packed (and padded) row; the two SP ranks of a group trained with the same loss."""
    per_rank = _case(ranks, case["name"])
    for rank, state in enumerate(per_rank):
        assert state["mesh"] == MESH and state["sp_size"] == SP, state
        assert state["dp_size"] == WORLD // SP and state["dp_rank"] == rank // SP, state
        assert state["compute_dtype"] == "torch.bfloat16" and state["gradient_checkpointing"], state
        assert state["flash_stand_in"] != state["flash_attn"], state
        assert "model.visual.embeddings.position_embedding" not in state["groups"], state["groups"]
        assert state["sp_group_at_step"] == [SP] * len(state["steps"]), state["sp_group_at_step"]
        for step in state["steps"]:
            assert step["vision_calls"] == [_patches(case, _kind(case, rank))], (rank, step["vision_calls"])
            (inputs,) = step["model_inputs"]  # the whole packed row, padded to a multiple of SP
            total = inputs["input_ids"][1]
            assert inputs["input_ids"] == [1, total] and total % SP == 0, inputs
            assert inputs["position_ids"] == [4, 1, total] and inputs["attention_mask"] is None, inputs
            assert (inputs["pixel_values"] is None) == (_kind(case, rank) == "text"), inputs
            # every text layer (checkpointed: forward and recompute) saw this rank's half of the row
            half = [1, total // SP, state["hidden_size"]]
            assert step["text_inputs"] and all(s == half for s in step["text_inputs"]), step
            assert step["attention_calls"], step  # flash-attn's varlen kernel (or its stand-in) ran
            assert math.isfinite(step["loss"]), step
    for group in range(WORLD // SP):
        losses = [[s["loss"] for s in per_rank[r]["steps"]] for r in range(group * SP, (group + 1) * SP)]
        assert all(x == losses[0] for x in losses), (group, losses)


def _assert_exact(ranks: list[dict[str, Any]], case: dict[str, Any]) -> dict[str, Any]:
    """One process with the SP split emulated (reference_sp2): every step's losses (one per data-parallel group),
    full gradients and post-AdamW parameters 0.0; the loss moved; the groups saw different data."""
    rank0 = _case(ranks, case["name"])[0]
    reference = rank0["reference_sp2"]
    assert reference["virtual_sp"] == SP and reference["mixed_precision"], reference
    assert_reference_steps_exact(reference, 2, case["name"])
    for ref in reference["steps"]:
        assert ref["vision_calls"] == [_patches(case, k) for k in case["kinds"]], ref["vision_calls"]
        assert ref["grad_norm_vision"] > 0.0, ref
    first, second = (s["loss"] for s in rank0["steps"])
    assert first != second, f"{case['name']}: the loss did not move"
    naive = rank0["reference_sp1"]  # SP off: the same losses, gradients summed over all tokens at once
    for ref in naive["steps"]:
        assert ref["loss_diff"] == 0.0, ref
    print(
        f"verl {VERL} Ulysses {case['name']}: losses per step "
        f"{[s['losses'] for s in reference['steps']]}; vs one process with the SP split emulated: 0.0; vs one "
        f"process with SP off: grad {[s['grad_diff'] for s in naive['steps']]} "
        f"(at {[s['grad_at'] for s in naive['steps']]}), param {[s['param_diff'] for s in naive['steps']]}; "
        f"summed in one fixed order instead of the collective's: grad "
        f"{[s['grad_diff_one_order'] for s in reference['steps']]} "
        f"({[s['order_dependent_elements'] for s in reference['steps']]} order-dependent elements of "
        f"{reference['steps'][0]['terms']} terms)"
    )
    return reference


# ------------------------------------------------------------------------------------------ crash and hang first


def test_off_switch_crashes_on_every_rank(off: tuple[list[dict[str, Any]], float]) -> None:
    """FSDP_COMPAT=off: verl's own selector gives the vision tower's position embedding a group of its own; all four
    ranks stop at the first forward with the grid_sampler crash (rank 2 and 3 on verl's text-only dummy), after the
    same collectives: a crash, no hang (the launch ends well inside its TIMEOUT_S)."""
    ranks, seconds = off
    assert seconds < TIMEOUT_S, seconds
    for rank, state in enumerate(ranks):
        assert not state["state"]["patched"], state["state"]
        case = state["cases"]["mixed"]
        assert GRID_SAMPLER_CRASH in case["error"], case
        assert "model.visual.embeddings.position_embedding" in case["groups"], case["groups"]
        assert case["mesh"] == MESH and case["sp_size"] == SP, case
        assert case["vision_calls"] == [_patches(MIXED, _kind(MIXED, rank))], (rank, case["vision_calls"])


def test_qwen_off_switch_text_group_crashes_image_group_hangs(qwen_off: tuple[list[dict[str, Any]], float]) -> None:
    """Qwen2.5-VL, FSDP_COMPAT=off (verl's own selector and forward): verl's text-only dummy runs the vision tower,
    then calls ``.mean()`` on its transformers-5 model output: ranks 2 and 3 (the text group) raise the
    AttributeError in verl's code at the first forward. Ranks 0 and 1 (the image group) go on into FSDP2's next
    all-gather, which ranks 2 and 3 never make: they wait until gloo's collective timeout (COLLECTIVE_TIMEOUT_S; on
    NCCL until the watchdog): the hang of verl #3315, on the image ranks. They stay blocked for as long as the failed
    ranks' processes live (measured: HOLD_S, then gloo's timeout after those exited)."""
    ranks, seconds = qwen_off
    assert seconds < TIMEOUT_S, seconds
    for rank, state in enumerate(ranks):
        assert not state["state"]["patched"] and not state["state"]["qwen2_vl_repaired"], state["state"]
        case = state["cases"]["qwen_mixed"]
        assert case["mesh"] == MESH and case["sp_size"] == SP, case
        assert case["vision_calls"] == [_patches(QWEN_MIXED, _kind(QWEN_MIXED, rank))], (rank, case["vision_calls"])
        if _kind(QWEN_MIXED, rank) == "text":
            assert case["error"] == QWEN_MEAN_CRASH, case
            assert case["where"].startswith("verl/models/transformers/qwen2_vl.py:"), case["where"]
            assert "in _get_input_embeds" in case["traceback"], case["traceback"]
        else:
            assert "Timed out waiting" in case["error"], case
            assert "foreach_all_gather" in case["traceback"], case["traceback"]  # FSDP2's unshard
            assert case["steps"] == [], case["steps"]  # not one step finished
            # blocked for as long as the failed text ranks lived (they hold HOLD_S after their error)
            assert case["case_s"] > max(ranks[r]["cases"]["qwen_mixed"]["case_s"] for r in (2, 3)), case["case_s"]
    print(f"verl {VERL} Qwen2.5-VL Ulysses, FSDP_COMPAT=off: text ranks {ranks[2]['cases']['qwen_mixed']['error']}; "
          f"image ranks {ranks[0]['cases']['qwen_mixed']['error'][-80:]}; per rank case seconds "
          f"{[round(r['cases']['qwen_mixed']['case_s'], 1) for r in ranks]}")


def test_alignment_off_trains_exactly(
    alignment_off: tuple[list[dict[str, Any]], float], on: tuple[list[dict[str, Any]], float]
) -> None:
    """FSDP_COMPAT_MIXED_BATCHES=off (fsdp-compat's wrap rule and its repairs of verl's forwards, no alignment): no
    crash, no hang, GLM4V and Qwen2.5-VL. verl's forwards run the vision tower on their own dummy for a text-only
    micro-batch, on both SP ranks of the text group, so FSDP2's collectives pair up across all four ranks; the
    alignment leaves verl's forwards alone, so the run is bit for bit the default one (digests of every step's full
    gradients and parameters, every rank) and exact against one process."""
    ranks, _ = alignment_off
    assert all(r["state"]["patched"] for r in ranks), [r["state"] for r in ranks]
    default, _ = on
    for case in (MIXED, QWEN_MIXED):
        _assert_ulysses_layout(ranks, case)
        _assert_exact(ranks, case)
        pairs = zip(_case(ranks, case["name"]), _case(default, case["name"]), strict=True)
        for rank, (a, b) in enumerate(pairs):
            assert [s["digest"] for s in a["steps"]] == [s["digest"] for s in b["steps"]], (case["name"], rank)
            assert [s["loss"] for s in a["steps"]] == [s["loss"] for s in b["steps"]], (case["name"], rank)


# ---------------------------------------------------------------------------------------------------- exact


def test_image_and_text_groups_train_exactly(on: tuple[list[dict[str, Any]], float]) -> None:
    """Data-parallel group 0 with image rows, group 1 text only, each group 2 SP ranks: 2 steps, 0.0 against one
    process with the SP split emulated (losses, gradients, post-AdamW parameters)."""
    ranks, _ = on
    for state in ranks:
        assert state["state"]["patched"] and state["state"]["glm4v_repaired"], state["state"]
    _assert_ulysses_layout(ranks, MIXED)
    _assert_exact(ranks, MIXED)


def test_all_image_groups_train_exactly(on: tuple[list[dict[str, Any]], float]) -> None:
    """Both data-parallel groups with images (other sizes, other token counts): the same exactness. Against one
    process with SP off this run, too, differs in the gradients (printed): Ulysses' own split of the token sums."""
    ranks, _ = on
    _assert_ulysses_layout(ranks, ALL_IMAGE)
    _assert_exact(ranks, ALL_IMAGE)


def test_qwen_image_and_text_groups_train_exactly(on: tuple[list[dict[str, Any]], float]) -> None:
    """Qwen2.5-VL (windowed vision blocks), the same layout: with fsdp-compat's repair of verl's Qwen2-VL
    ``_get_input_embeds`` (the tower's features, not its model output, on transformers 5) the text group runs verl's
    dummy and both groups train 2 steps, 0.0 against one process with the SP split emulated."""
    ranks, _ = on
    for state in ranks:
        assert state["state"]["patched"] and state["state"]["qwen2_vl_repaired"], state["state"]
    _assert_ulysses_layout(ranks, QWEN_MIXED)
    _assert_exact(ranks, QWEN_MIXED)
