"""Plain FSDP2's contract, kept by fsdp-compat's run-time layer in every job it touches.

fsdp-compat puts its run-time layer on every FSDP2 root (the generic layer; ``apply_fsdp2`` and the adapters install
it themselves). Each case runs on 2 gloo ranks, fp32, each rank on its own micro-batch, and first shows what the same
job does without fsdp-compat (``FSDP_COMPAT=off``: plain FSDP2), then what it does with the package merely installed:

- a forward method registered with FSDP2 (``generate``, a rollout) as the root's first call, then AdamW steps: the
  guard's per-op check opens and closes with FSDP2's own root pre/post-forward, so nothing stays entered and training
  equals one process (0.0); plain FSDP2 crashes on this grouping at the table's raw read;
- a dropped model is freed (weakref), whoever installed the layer (``apply_fsdp2``, ``install_runtime``, the
  generic layer);
- the mixed micro-batch error that exists to prevent a hang reaches every rank at the first forward through the
  generic layer (Chameleon, a family the alignment refuses by name, image|text): plain FSDP2 aborts in a collective
  mismatch instead;
- after ``unshard()`` with ``reshard_after_forward=False``, a ``no_grad`` sample on rank 0 alone finishes as in
  plain FSDP2 (no exchange where FSDP2 issues no collective);
- ``fully_shard(model)`` alone, image|text ranks: plain FSDP2 aborts (the root's reduce-scatter covers only the
  parameters that got a gradient); aligned, 0.0;
- an optimizer built after a ``no_grad`` first forward: plain FSDP2 trains tensors it then discards (the root group
  is left unsharded), fsdp-compat reshards once after that pass: 0.0.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
from lab.support import BREADTH, OFF, ON, WORLD_SIZE, assert_ranks_exact, rank_output

from fsdp_compat.testing.crashes import GLOO_MISMATCH
from fsdp_compat.testing.launch import RunResult, current_wording, run_ranks

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
# The envs that rerun tests/runtime on each torch a framework pins deselect the BREADTH cases (torch-independent
# bookkeeping, or a mechanism another case proves there); core runs every case on torch 2.13.

BODY = "lab.contract:contract_rank"


def _run(case: str, env: dict[str, str | None], *, variants: tuple[str, ...] = ("image",), **cfg: Any) -> RunResult:
    kinds = [variants[r % len(variants)] for r in range(WORLD_SIZE)]
    return run_ranks(
        BODY, {"case": case, "model": "glm4v", "variants": kinds, **cfg}, world_size=WORLD_SIZE, timeout_s=200,
        env={**ON, "FSDP_COMPAT_GENERIC": None, **env},
    )  # fmt: skip


def _errors(result: RunResult) -> str:
    """Every rank's traceback and output tail, in the current torch's wording of the same failures."""
    return current_wording(rank_output(result))


def test_generate_registered_with_fsdp2_as_the_first_call_then_training() -> None:
    off = _run("generate_first", OFF, shard="own")
    assert not off.ok and "aten.grid_sampler_2d.default got mixed" in _errors(off), rank_output(off)
    result = _run("generate_first", {}, shard="own", variants=("image", "text"))
    assert_ranks_exact(result)
    for r in result.ranks:
        assert r.extra["modes_after_generate"] == 0, r.extra  # the guard's mode closed with FSDP2's post-forward
        assert r.extra["guard_unshards"] >= 2, r.extra  # armed: the trainer's rule gives the table its own group


@BREADTH
def test_a_dropped_model_is_freed_whoever_installed_the_runtime() -> None:
    result = _run("drop", {}, ways=["apply", "install", "own"], variants=("image", "text"))
    result.raise_for_error()
    for r in result.ranks:
        assert r.extra["alive"] == {way: [False, False] for way in ("apply", "install", "own")}, r.extra
        # the per-op check only where the plan or the group check cannot rule a sharded read out: fsdp-compat's own
        # plan never needs it; the trainer's rule (the table's own group) does, by hand or through the generic layer
        assert r.extra["armed"] == {"apply": False, "install": True, "own": True}, r.extra


@BREADTH
@pytest.mark.soak
def test_a_soak_that_rebuilds_the_model_keeps_memory_flat() -> None:
    """200 steps, the model rebuilt every 20 (an RL worker reloading its policy, a sweep): no model outlives its
    rebuild, and resident memory after the later rebuilds stays within 64 MiB of the third (allocator warm-up)."""
    result = _run("soak", {}, shard="own", variants=("image", "text"), rebuilds=10, steps=20)
    result.raise_for_error()
    for r in result.ranks:
        assert r.extra["alive"] == [0] * 10, r.extra
        rss = r.extra["rss_mib"]
        assert max(rss[3:]) - rss[2] < 64, rss


@BREADTH  # the generic layer's error path is fsdp-compat's own code, the same on every torch
def test_the_error_that_prevents_a_hang_reaches_every_rank_through_the_generic_layer() -> None:
    cfg = {"model": "lab.vlms:chameleon", "steps": 1, "variants": ["image", "text"][:WORLD_SIZE] * (WORLD_SIZE // 2)}
    env = {**ON, "FSDP_COMPAT_GENERIC": None}
    off = run_ranks("lab.every_root:own_trainer_rank", cfg, world_size=WORLD_SIZE, timeout_s=200, env={**env, **OFF})
    assert not off.ok and "FsdpCompatError" not in _errors(off), rank_output(off)
    result = run_ranks("lab.every_root:own_trainer_rank", cfg, world_size=WORLD_SIZE, timeout_s=200, env=env)
    assert not result.ok
    for r in result.ranks:
        assert "FsdpCompatError: fsdp-compat: mixed micro-batches" in (r.error or ""), rank_output(result)
        assert GLOO_MISMATCH not in current_wording(r.error or ""), rank_output(result)


@pytest.mark.parametrize("env", [pytest.param(OFF, marks=BREADTH), {}], ids=["plain-fsdp2", "fsdp-compat"])
def test_a_forward_on_one_rank_with_every_group_unsharded_finishes(env: dict[str, str | None]) -> None:
    result = _run("one_rank_forward", env, shard="root", collective_timeout_s=30)
    result.raise_for_error()
    assert result.ranks[0].extra["sample_loss"] > 0
    if env:
        assert result.ranks[0].extra["mixed_batches"]["installed"] == 0  # plain FSDP2: nothing of fsdp-compat
    else:
        assert result.ranks[0].extra["mixed_batches"]["exchanges"] == 1  # the training step's, not the sample's


def test_one_group_for_the_whole_model_is_aligned() -> None:
    off = _run("train", OFF, shard="root", variants=("image", "text"), collective_timeout_s=60)
    assert not off.ok and GLOO_MISMATCH in _errors(off), rank_output(off)
    result = _run("train", {}, shard="root", variants=("image", "text"))
    assert_ranks_exact(result)
    assert [r.extra["mixed_batches"]["dummy_calls"] for r in result.ranks][:2] == [0, 2]


@BREADTH
@pytest.mark.skipif(
    importlib.util.find_spec("torch.distributed._composable.replicate_with_fsdp") is None,
    reason="this torch has no replicate() built on FSDP2's state (torch.distributed._composable.replicate_with_fsdp)",
)
def test_replicate_roots_are_aligned_and_survive_a_restart() -> None:
    """``replicate()`` (torch.distributed._composable.replicate_with_fsdp): its state subclasses FSDP2's, so the
    generic layer reaches its roots too. Image|text ranks: plain replicate aborts (the gradient all-reduce covers only
    the parameters that got a gradient); with fsdp-compat, 0.0; then the process group is destroyed and a new one
    made (rank 1 a fresh interpreter) and a fresh replicated model trains exactly again."""
    off = _run("train", OFF, shard="replicate", variants=("image", "text"), collective_timeout_s=60)
    assert not off.ok and GLOO_MISMATCH in _errors(off), rank_output(off)
    from lab.restart import assert_both_phases_exact, free_port

    cfg = {"model": "glm4v", "steps": 2, "variants": ["image", "text"], "second_port": free_port(), "rule": "replicate"}
    assert_both_phases_exact(run_ranks("lab.restart:restart_rank", cfg, world_size=2, timeout_s=240, env={**ON}))


def test_an_optimizer_built_after_a_no_grad_first_forward_trains_like_one_process() -> None:
    off = _run("train_after_no_grad_first", OFF, shard="own", model="qwen2")
    off.raise_for_error()
    assert all(r.extra["param_diff"] > 1e-4 for r in off.ranks), [r.extra["param_diff"] for r in off.ranks]
    result = _run("train_after_no_grad_first", {}, shard="own", model="qwen2")
    assert_ranks_exact(result)
    assert all(r.extra["plain_params_after_eval"] == 0 for r in result.ranks)


@BREADTH  # the table's door is fsdp-compat's own code, the same on every torch
@pytest.mark.parametrize("kinds", [("image",), ("image", "text")], ids=["image|image", "image|text"])
def test_a_vlm_class_of_the_users_own_trains_exactly_once_its_row_is_registered(kinds: tuple[str, ...]) -> None:
    """``fsdp_compat.register_family`` (the family table's public door): a patch encoder and a decoder of
    the user's own, no transformers class. With its row, 0.0 against one process (the text rank runs one dummy
    encoder call a step, the row's, not the generic mechanism's replay: no stop at the groups).

    Without fsdp-compat, image|text ranks fall out of step (tests/runtime/test_mechanism.py: unregistered, the
    generic mechanism aligns the same class)."""
    cfg = {"model": "lab.own_vlm:TINY", "variants": list(kinds), "shard": "own"}
    if len(kinds) > 1:
        # the encoder's and the decoder's blocks are the same size: the ranks' all-gathers pair up wrongly (unrelated
        # buffers mixed) and the run ends at the collective timeout, or gloo sees the sizes differ
        off = _run("own_vlm", OFF, register=True, collective_timeout_s=15, **cfg)
        text = _errors(off)
        assert not off.ok and (GLOO_MISMATCH in text or "Timed out waiting" in text), text
    result = _run("own_vlm", {}, register=True, **cfg)
    assert_ranks_exact(result)
    expected = [2 if kinds[r % len(kinds)] == "text" else 0 for r in range(WORLD_SIZE)]
    assert [r.extra["mixed_batches"]["dummy_calls"] for r in result.ranks] == expected
    # the row's path: no generic stops
    assert [r.extra["mixed_batches"]["rounds"] for r in result.ranks] == [0] * WORLD_SIZE
