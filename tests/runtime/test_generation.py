"""Every forward that is not a training forward, on a sharded vision-language model, with image and text prompts on
different ranks: ``model.generate`` (greedy; sampling and an early end-of-sequence, so the ranks stop at different
lengths), log-prob passes under ``torch.no_grad()`` and ``model.eval()``, and the vision tower called outside the
model's forward (``get_image_features``, as transformers >= 5.2x's generate does, or ``model.visual(...)``).

Each rank compares with an unsharded copy of the model on its own prompt (the one process): tokens and every step's
scores equal (``torch.equal``), log-probs and features ``== 0.0``; a training step after them equals one process
training on all the ranks' micro-batches (0.0). Each failure is shown first: FSDP2 alone crashes on the tower call
outside the forward (``got mixed torch.Tensor and DTensor``), ``FSDP_COMPAT_MIXED_BATCHES=off`` falls out of step
on image|text ranks, and ``synced_gpus=False`` falls out of step when the ranks stop at different lengths. The rank
routines are in ``tests/lab/generation.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
from lab.support import BREADTH, DEVICE, WORLD_SIZE, rank_pythonpath

from fsdp_compat.testing.crashes import GLOO_MISMATCH
from fsdp_compat.testing.launch import RunResult, current_wording, run_ranks

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]

MIXED = "got mixed torch.Tensor and DTensor"
WORLD = max(WORLD_SIZE, 2)
IMAGE_AND_TEXT = ["image"] + ["text"] * (WORLD - 1)
IMAGES = ["image"] * WORLD
# greedy before any forward, log-probs, greedy again after them, sampling and an early EOS, tower calls outside
# the forward, and a training step at the end
ALL_CASES = ["generate", "logprobs", "generate", "sample", "eos", "visual", "features", "train"]


def _launch(model: str, plan: str, variants: list[str], cases: list[str], *, mode: str = "sync",
            timeout_s: float = 240.0, **cfg: Any) -> RunResult:  # fmt: skip
    # "-bare" plans are plain FSDP2 without fsdp-compat: its automatic activation (the generic layer too) is off
    bare = {"FSDP_COMPAT": "off"} if plan.endswith("-bare") else {}
    return run_ranks(
        "lab.generation:generation_ranks",
        {"model": model, "plan": plan, "variants": variants, "cases": cases, "device": DEVICE, **cfg},
        world_size=len(variants),
        timeout_s=timeout_s,
        env={"PYTHONPATH": rank_pythonpath(), "FSDP_COMPAT_MIXED_BATCHES": mode, **bare},
    )


def _cases(run: RunResult, name: str) -> list[list[dict[str, Any]]]:
    """Per rank, the results of every case called ``name``, in order."""
    run.raise_for_error()
    return [[v for k, v in r.extra.items() if k.partition(":")[2] == name] for r in run.ranks]


def _text(run: RunResult) -> str:
    return "\n".join((r.error or "") + str(r.extra.get("log_tail", "")) for r in run.ranks)


def _assert_out_of_step(run: RunResult) -> None:
    assert not run.ok
    text = _text(run)
    if DEVICE == "cpu":
        assert GLOO_MISMATCH in current_wording(text), text[-3000:]
    else:  # NCCL: a hang, ended by the launcher's deadline
        assert "timed out" in text, text[-3000:]


def _assert_generation_exact(out: dict[str, Any]) -> None:
    assert out["tokens"] == out["ref_tokens"]
    assert out["scores_equal"], out["max_score_diff"]


@pytest.mark.parametrize("model", ["glm4v", pytest.param("qwen2.5-vl", marks=BREADTH)])
def test_generation_and_log_probs_with_image_and_text_ranks_equal_one_process(model: str) -> None:
    """Image and text prompts on different ranks, fsdp-compat's plan: every case equals the one process; the
    text ranks run the tower on a dummy where the image rank runs it, and decode steps make no exchange."""
    run = _launch(model, "auto", IMAGE_AND_TEXT, ALL_CASES)
    print(f"{model}: {len(ALL_CASES)} cases on {WORLD} ranks in {run.seconds:.1f}s")
    generations = _cases(run, "generate")
    for rank, results in enumerate(generations):
        assert len(results) == 2  # before and after a no-grad forward
        for index, out in enumerate(results):
            _assert_generation_exact(out)
            c = out["counters"]
            # transformers >= 5.2x encodes the images before the first forward (a tower call outside it); older
            # releases inside it. Either way: one exchange at the prefill, one more per outside call, and none in
            # the decode steps, which decode from the cache on every rank
            outside = generations[0][index]["counters"]["outside_calls"]
            assert c["decode_steps"] == out["new_tokens"] - 1 == 2, c
            assert c["exchanges"] == 1 + outside, (rank, c)
            assert c["dummy_calls"] == (0 if rank == 0 else 1), (rank, c)  # the text ranks, once per generate
    lengths = []
    for rank, (out,) in enumerate(_cases(run, "sample")):
        _assert_generation_exact(out)
        assert out["new_tokens"] == 2 + 2 * (rank % 2)
        lengths.append(out["new_tokens"])
        assert out["counters"]["decode_steps"] == 3  # every rank runs the longest rank's forwards (synced_gpus)
    assert len(set(lengths)) > 1
    eos = [out for (out,) in _cases(run, "eos")]
    for out in eos:
        _assert_generation_exact(out)
    assert eos[0]["new_tokens"] == 2 and all(out["new_tokens"] > 2 for out in eos[1:]), eos
    for rank, (out,) in enumerate(_cases(run, "logprobs")):
        assert out["no_grad"] == 0.0 and out["eval"] == 0.0, out
        assert out["counters"]["dummy_calls"] == (0 if rank == 0 else 2)  # one per forward on the text ranks
    for name in ("visual", "features"):
        for rank, (out,) in enumerate(_cases(run, name)):
            assert out["called"] == (rank == 0) and out["logprobs"] == 0.0, out
            if rank == 0:
                assert out["max_feature_diff"] == 0.0 and out["counters"]["outside_calls"] == 1
            else:  # the image rank's outside call and its forward: a dummy for each
                assert out["counters"]["dummy_calls"] == 2 and out["counters"]["exchanges"] == 2, out
    for (out,) in _cases(run, "train"):
        assert out["grad_diff"] == 0.0 and out["param_diff"] == 0.0, out


def test_image_and_text_generation_falls_out_of_step_without_the_alignment() -> None:
    _assert_out_of_step(_launch("glm4v", "auto", IMAGE_AND_TEXT, ["generate"], mode="off", timeout_s=90.0))


def test_image_and_text_log_prob_pass_falls_out_of_step_without_the_alignment() -> None:
    _assert_out_of_step(_launch("glm4v", "auto", IMAGE_AND_TEXT, ["logprobs"], mode="off", timeout_s=90.0))


def test_ranks_that_stop_at_different_lengths_need_synced_gpus() -> None:
    """``synced_gpus=False``: the rank that stops first leaves generate while the others still all-gather their
    decode step's layers. The default (the case above) keeps them in step."""
    # the rank still decoding waits in an all-gather nobody joins: gloo gives up after 20 s (the run's deadline
    # stays 90 s, for starting and generating on a loaded machine)
    run = _launch("glm4v", "auto", IMAGES, ["sample"], synced_gpus=False, timeout_s=90.0, collective_timeout_s=20.0)
    assert not run.ok
    for r in run.ranks:  # the ranks were stopped inside the case, not while starting
        text = (r.error or "") + str(r.extra.get("log_tail", ""))
        assert f"rank {r.rank}: case 0:sample started" in text, text[-3000:]
        # the waiting rank's collective times out (or mismatches); the rank it waited for then loses its peer
        seen = current_wording(text).lower()
        signs = (GLOO_MISMATCH, "timed out", "closed by peer", "reset by peer")
        assert any(sign.lower() in seen for sign in signs), text
        # the rank with the fewest new tokens left generate; a rank with more was still decoding
        assert (f"rank {r.rank}: case 0:sample finished" in text) == (r.rank % 2 == 0), text[-3000:]


@pytest.mark.parametrize("plan", ["root", pytest.param("blocks", marks=BREADTH)])
def test_tower_call_outside_the_forward_crashes_plain_fsdp2_then_works_with_the_runtime(plan: str) -> None:
    """Plain FSDP2, one group on the root (``root``) or a framework's wrap of every vision block and text layer
    (``blocks``), no fsdp-compat: ``get_image_features`` before any forward meets the sharded patch embedding.
    With ``fsdp_compat.runtime.install_runtime(model)`` it equals the one process, and so does generation with
    image|text ranks and a training step after it."""
    bare = _launch("glm4v", f"{plan}-bare", IMAGES, ["features"], timeout_s=90.0)
    assert not bare.ok
    assert MIXED in _text(bare), _text(bare)[-3000:]
    run = _launch("glm4v", plan, IMAGE_AND_TEXT, ["features", "generate", "train"])
    for rank, (out,) in enumerate(_cases(run, "features")):
        assert out["logprobs"] == 0.0 and out["called"] == (rank == 0)
        if rank == 0:
            assert out["max_feature_diff"] == 0.0
    for (out,) in _cases(run, "generate"):
        _assert_generation_exact(out)
    for (out,) in _cases(run, "train"):
        assert out["grad_diff"] == 0.0 and out["param_diff"] == 0.0, out


def test_a_forward_before_fully_shard_does_not_switch_the_alignment_off() -> None:
    """A framework that runs the model once before sharding it (a warm-up, a dtype probe): the alignment is decided
    again at the next forward, so image|text ranks still train, and generate, exactly."""
    run = _launch("glm4v", "auto", IMAGE_AND_TEXT, ["train", "generate"], forward_before_shard=True)
    for r in run.ranks:
        assert r.extra["hooks_before_shard"]["exchanges"] == 0, r.extra  # one process' worth: nothing exchanged
    for rank, (out,) in enumerate(_cases(run, "train")):
        assert out["grad_diff"] == 0.0 and out["param_diff"] == 0.0, out
        assert out["counters"]["dummy_calls"] == (0 if rank == 0 else 1)
    for (out,) in _cases(run, "generate"):
        _assert_generation_exact(out)


def test_the_exchange_touches_no_device_tensor_on_a_non_cpu_mesh() -> None:
    """Every exchange sees a mesh that says its device is ``meta`` (a stand-in for a GPU mesh: the exchange used to
    put its vector there and read it back with ``.tolist()``, a device-to-host sync per forward on NCCL), and runs
    with ``meta`` as the default device, under a dispatch spy. The spy sees a meta tensor in the old way's vector
    (the control); in the exchange it sees only CPU tensors, and the all-reduce runs on a gloo group of its own,
    not on the mesh's. Generation, log-probs, an outside tower call and a training step stay exact."""
    run = _launch("glm4v", "auto", IMAGE_AND_TEXT, ["features", "generate", "logprobs", "train"], meta_mesh=True)
    run.raise_for_error()
    for r in run.ranks:
        assert r.extra["control_devices"] == ["meta"], r.extra["control_devices"]
        spy = r.extra["exchange_spy"]
        assert spy["exchanges"] >= 5 and spy["ops"] > 0, spy
        assert spy["devices"] == ["cpu"], spy
        assert set(spy["backends"]) == {"gloo"} and r.extra["mesh_group"] not in spy["groups"], spy
    for (out,) in _cases(run, "generate"):
        _assert_generation_exact(out)
    for (out,) in _cases(run, "train"):
        assert out["grad_diff"] == 0.0 and out["param_diff"] == 0.0, out
