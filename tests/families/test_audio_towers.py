"""The omni families' audio towers under mixed micro-batches (transformers 5.24's Qwen2.5-Omni and Qwen3-Omni-MoE
thinkers, dots3, Muse Spark, Nemotron-H Omni, Gemma4, Gemma3n (its timm tower: families524-timm) and Inkling, tiny,
fp32, 2 gloo ranks, fsdp-compat's plan).

A rank with audio runs the audio encoder's all-gathers (and its parameters get gradients that the root group
reduce-scatters); a rank without audio skips them, so the ranks fall out of step as they do on image|text ranks.
Shown first, unaligned, audio against text; then, aligned, every pair of ranks that differ in audio, in images or in
both trains at exact parity (0.0, equal losses): a dummy clip runs on the rank without audio where the forward runs
its audio, once per step: before the vision tower call in the Qwen thinkers, after it in the others (a rank with
audio but no image there runs its vision dummy before its audio call). The whole step too, for the Qwen thinkers:
``generate``, a log-prob pass and a training step with audio and images on one rank and neither on the other equal
one process (the rank routines of tests/runtime/test_generation.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from lab.support import BREADTH, DEVICE
from lab.vlms import tiny_models
from lab.vlms.grid import OmniVlm

from fsdp_compat.testing.crashes import GLOO_MISMATCH
from fsdp_compat.testing.launch import RunResult, current_wording, run_ranks
from fsdp_compat.testing.parity import run_training

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

AUTO = "fsdp_compat.testing.wraps:core_auto"
STEPS = 2
CORE = Path(__file__).resolve().parents[1] / "runtime"  # the generation rank routines
OMNI = sorted({t.name for t in tiny_models().values() if isinstance(t, OmniVlm) and "audio" in t.media()})
# Ranks that differ in audio (and in images): audio on one rank only, each rank one medium, and both media on one
# rank against none on the other (the audio and vision dummies then run in the forward's order).
PAIRS = [("audio", "image"), ("image+audio", "text"), ("audio", "text"), ("image+audio", "image")]
# One family per order of the forward (audio before the vision tower, after it) runs in the default list's hf524;
# the others repeat a mechanism: breadth.
DEFAULT = ("qwen2_5_omni_thinker", "dots3_note")
# The families whose generate the whole-step rank routines drive (Qwen's thinkers: mrope, audio before images).
GENERATING = ["qwen2_5_omni_thinker", "qwen3_omni_moe_thinker"]


def _params(names: list[str] = OMNI) -> list[object]:
    """The families as cases: those of ``DEFAULT`` plain, the others breadth; one whose tiny model needs a package
    this env lacks (Gemma3n's timm tower) is not applicable here (deselected by tests/conftest.py) and runs in the
    env its tiny model names, as in test_vlm_families.py."""
    import importlib.util

    cases = []
    for name in names:
        tiny = tiny_models()[name]
        missing = [m for m in getattr(tiny, "requires", ()) if importlib.util.find_spec(m) is None]
        marks = [pytest.mark.skipif(bool(missing), reason=f"{name} needs {', '.join(missing)}: tox -e "
                                    f"{getattr(tiny, 'env', '')}")]  # fmt: skip
        cases.append(pytest.param(name, marks=marks if name in DEFAULT else [BREADTH, *marks]))
    return cases


def _run(name: str, variants: tuple[str, str], mode: str) -> RunResult:
    return run_training(f"lab.vlms:{name}", AUTO, world_size=2, steps=STEPS, device=DEVICE, timeout_s=90.0,
                        variants=list(variants), env={"FSDP_COMPAT_MIXED_BATCHES": mode})  # fmt: skip


def test_the_omni_families_are_the_ones_with_an_audio_row() -> None:
    """The tiny models with audio batches are the families whose row aligns an audio tower."""
    from fsdp_compat.runtime.vlm_families import FAMILIES

    assert OMNI == ["dots3_note", "gemma3n", "gemma4", "inkling_mm_model", "muse_spark", "nemotron_h_omni",
                    "qwen2_5_omni_thinker", "qwen3_omni_moe_thinker"]  # fmt: skip
    assert sorted(f.name for f in FAMILIES if f.audio is not None) == [
        "dots3-note", "gemma3n", "gemma4", "inkling", "muse-spark", "nemotron-h-omni", "qwen2.5-omni-thinker",
        "qwen3-omni-moe-thinker",
    ]  # fmt: skip
    # the two orders a forward runs its audio in: before its vision tower (Qwen), after it (the others)
    assert sorted(f.name for f in FAMILIES if f.audio is not None and not f.audio.after_vision) == [
        "qwen2.5-omni-thinker", "qwen3-omni-moe-thinker",
    ]  # fmt: skip


@pytest.mark.parametrize("name", _params())
def test_audio_on_one_rank_falls_out_of_step_unaligned(name: str) -> None:
    run = _run(name, ("audio", "text"), "off")
    assert not run.ok
    text = "\n".join((r.error or "") + str(r.extra.get("log_tail", "")) for r in run.ranks)
    assert (GLOO_MISMATCH in current_wording(text)) if DEVICE == "cpu" else ("timed out" in text), text[-3000:]


@pytest.mark.parametrize("variants", PAIRS, ids="|".join)
@pytest.mark.parametrize("name", _params())
def test_ranks_that_differ_in_audio_train_exactly(name: str, variants: tuple[str, str]) -> None:
    run = _run(name, variants, "sync")
    run.raise_for_error()
    assert run.max_abs_grad_diff == 0.0, run.ranks[0].extra.get("worst_grad_param")
    assert run.max_abs_param_diff == 0.0, run.ranks[0].extra.get("worst_param")
    media = [set(v.split("+")) for v in variants]
    for r, own in zip(run.ranks, media, strict=True):
        counters = r.extra["mixed_batches"]
        others = set().union(*media)
        # one dummy per step for each medium another rank has and this one lacks
        assert counters["audio_dummy_calls"] == (STEPS if "audio" in others - own else 0), (r.rank, counters)
        assert counters["dummy_calls"] == (STEPS if "image" in others - own else 0), (r.rank, counters)
        assert r.losses == r.extra["reference_losses"]


def _whole_step(name: str, variants: tuple[str, str], cases: list[str], mode: str) -> RunResult:
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return run_ranks(
        "lab.generation:generation_ranks",
        {"model": f"lab.vlms:{name}", "plan": "auto", "variants": list(variants), "cases": cases, "device": DEVICE},
        world_size=2,
        timeout_s=240.0,
        env={"PYTHONPATH": os.pathsep.join([str(CORE), *inherited]), "FSDP_COMPAT_MIXED_BATCHES": mode},
    )


@pytest.mark.parametrize("name", _params(GENERATING))
def test_generation_log_probs_and_a_step_with_audio_on_one_rank_equal_one_process(name: str) -> None:
    """Rank 0 has images and audio, rank 1 neither. Unaligned, ``generate`` falls out of step; aligned, its tokens
    and every step's scores equal the unsharded model's (``torch.equal``), so do the log-probs (0.0, under no_grad
    and in eval), and a training step after them equals one process (0.0). Rank 1 runs one dummy clip per forward
    that is not a decode step: generate's prefill, the two log-prob forwards, the training forward."""
    unaligned = _whole_step(name, ("image+audio", "text"), ["generate"], "off")
    assert not unaligned.ok
    text = "\n".join((r.error or "") + str(r.extra.get("log_tail", "")) for r in unaligned.ranks)
    assert (GLOO_MISMATCH in current_wording(text)) if DEVICE == "cpu" else ("timed out" in text), text[-3000:]
    run = _whole_step(name, ("image+audio", "text"), ["generate", "logprobs", "train"], "sync")
    run.raise_for_error()
    for r in run.ranks:
        generated, logprobs, train = r.extra["0:generate"], r.extra["1:logprobs"], r.extra["2:train"]
        assert generated["tokens"] == generated["ref_tokens"] and generated["scores_equal"], generated
        assert generated["counters"]["decode_steps"] == generated["new_tokens"] - 1 > 0
        assert logprobs["no_grad"] == 0.0 and logprobs["eval"] == 0.0, logprobs
        assert train["grad_diff"] == 0.0 and train["param_diff"] == 0.0, train
        dummies = [c["counters"]["audio_dummy_calls"] for c in (generated, logprobs, train)]
        assert dummies == ([0, 0, 0] if r.rank == 0 else [1, 2, 1]), (r.rank, dummies)
