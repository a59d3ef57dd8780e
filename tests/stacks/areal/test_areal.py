"""AReaL (``areal`` 1.0.4 from PyPI, installed ``--no-deps`` plus what its FSDP engine imports): GLM4V through
AReaL's own ``parallelize_model`` (the call its FSDPEngine makes), on 2 gloo ranks in fresh interpreters.

Crash first with fsdp-compat off (``FSDP_COMPAT=off``), then exact parity with the ``.pth`` hook patching
``areal.engine.fsdp_utils.apply_fsdp2``; a text model keeps exactly AReaL's groups. Rank code is
``tests/lab/stacks/areal_ranks.py``. Runs in the ``areal104`` tox envs (the only ones that collect this folder:
missing AReaL fails).
"""

from __future__ import annotations

import importlib

import pytest
from lab.support import rank_pythonpath, require_framework

from fsdp_compat.testing.crashes import GLOO_MISMATCH

require_framework("AReaL's FSDP engine", lambda: importlib.import_module("areal.engine.fsdp_utils.parallel"))

from fsdp_compat.testing.launch import current_wording  # noqa: E402
from fsdp_compat.testing.parity import forget_image_positions, run_training  # noqa: E402

pytestmark = pytest.mark.timeout(400)

WRAP = "lab.stacks.areal_ranks:wrap_parallelize_model"


def run(model: str, **env: str | None):
    return run_training(model, WRAP, steps=2, timeout_s=240, env={"PYTHONPATH": rank_pythonpath(), **env})


def test_glm4v_crashes_through_areal_without_fsdp_compat():
    result = run("glm4v", FSDP_COMPAT="off")
    assert not result.ok
    assert "aten.grid_sampler_2d.default got mixed torch.Tensor and DTensor" in (result.exception or ""), result.error


def test_glm4v_exact_through_areal_with_fsdp_compat():
    result = run("glm4v", FSDP_COMPAT=None, FSDP_COMPAT_POLICY=None)
    result.raise_for_error()
    extra = result.ranks[0].extra
    assert extra["wrap"] is True  # parallelize_model called fsdp-compat's apply_fsdp2 (rebound by name)
    assert "model.visual.embeddings.position_embedding" not in extra["fsdp_groups"]
    assert {"model.language_model.embed_tokens", "model.visual.blocks.0"} <= set(extra["fsdp_groups"])
    assert result.max_abs_grad_diff == 0.0 and result.max_abs_param_diff == 0.0  # a batch per rank; NaN fails


def test_text_model_keeps_areals_groups():
    off, on = run("qwen2", FSDP_COMPAT="off"), run("qwen2", FSDP_COMPAT=None, FSDP_COMPAT_POLICY=None)
    off.raise_for_error()
    on.raise_for_error()
    assert on.ranks[0].extra["wrap"] is True and off.ranks[0].extra["wrap"] is False
    assert sorted(on.ranks[0].extra["fsdp_groups"]) == sorted(off.ranks[0].extra["fsdp_groups"])
    assert on.max_abs_grad_diff == 0.0 and on.max_abs_param_diff == 0.0


# ------------------------------------------------------------------ different data per rank, mixed micro-batches



def _run_variants(model: str, variants: list[str], timeout_s: float = 240, **env: str | None):
    return run_training(
        model, WRAP, steps=2, timeout_s=timeout_s, variants=variants, env={"PYTHONPATH": rank_pythonpath(), **env}
    )


def _assert_exact(result) -> None:
    """Difference 0.0: gradients after each backward and parameters after each AdamW step equal one process training
    on both ranks' micro-batches with the mean loss; each rank's loss is the reference's loss of its own batch."""
    result.raise_for_error()
    assert result.max_abs_grad_diff == 0.0, result.ranks[0].extra.get("worst_grad_param")
    assert result.max_abs_param_diff == 0.0, result.ranks[0].extra.get("worst_param")
    for rank in result.ranks:
        assert rank.losses == rank.extra["reference_losses"], (rank.rank, rank.losses, rank.extra["reference_losses"])
        assert rank.extra["wrap"] is True  # parallelize_model called fsdp-compat's apply_fsdp2


def test_glm4v_each_rank_its_own_batch_exact_through_areal():
    """Two different image micro-batches (seeds 0 and 1) through AReaL's parallelize_model: exact (0.0)."""
    result = _run_variants("glm4v", ["image", "image"], FSDP_COMPAT=None, FSDP_COMPAT_POLICY=None)
    _assert_exact(result)
    assert result.ranks[0].losses != result.ranks[1].losses  # different data on every rank
    assert [r.extra["mixed_batches"]["dummy_calls"] for r in result.ranks] == [0, 0]


@pytest.mark.parametrize("model", ["glm4v", "qwen2.5-vl"])
def test_rank_without_images_crashes_then_trains_exactly_through_areal(model):
    """Rank 0 an image micro-batch, rank 1 text only, sharded by AReaL's parallelize_model (the vision blocks get
    groups of their own) and run through transformers' forward (the tower only with pixel_values). fsdp-compat's
    mixed-batch alignment off (``FSDP_COMPAT_MIXED_BATCHES=off``): gloo aborts with the collective mismatch; on
    (installed by the AReaL adapter's apply_fsdp2): rank 1 runs one zero dummy tower call per forward and both ranks
    match one process on both micro-batches with the mean loss, exactly (0.0, both steps' losses). On transformers
    5.3.0 (AReaL's pin) this needs the reference to start each micro-batch without the previous image batch's cached
    ``rope_deltas`` (``parity.forget_image_positions``): without it the reference's text batch was rotated at shifted
    positions and gradients differed by ~7e-8."""
    variants = ["image", "text"]
    off = _run_variants(model, variants, timeout_s=60, FSDP_COMPAT=None, FSDP_COMPAT_MIXED_BATCHES="off")
    assert not off.ok, "expected the collective mismatch, but it ran"
    text = "\n".join((r.error or "") + str(r.extra.get("log_tail", "")) for r in off.ranks)
    assert GLOO_MISMATCH in current_wording(text), text[-3000:]
    result = _run_variants(model, variants, FSDP_COMPAT=None, FSDP_COMPAT_POLICY=None, FSDP_COMPAT_MIXED_BATCHES=None)
    _assert_exact(result)
    print(f"AReaL {model} image|text: Δgrad {result.max_abs_grad_diff:.3g} Δparam {result.max_abs_param_diff:.3g} abs")
    assert any(group.startswith("model.visual.blocks.") for group in result.ranks[0].extra["fsdp_groups"])
    assert [r.extra["mixed_batches"]["dummy_calls"] for r in result.ranks] == [0, 2]  # one per forward, 2 steps
    assert [r.extra["mixed_batches"]["exchanges"] for r in result.ranks] == [2, 2]


@pytest.mark.parametrize("model", ["glm4v", "qwen2.5-vl"])
def test_transformers_here_carries_image_positions_into_the_next_text_batch(model):
    """Why the reference forgets cached image positions (one process, no FSDP): on this env's transformers (5.3.0,
    AReaL's pin) a text micro-batch run after an image micro-batch on the same model gets other gradients than on a
    fresh model (the image batch's ``rope_deltas`` shift its positions); with ``forget_image_positions`` in between
    they are identical. transformers 5.6 and later skip the cached value in training forwards."""
    import torch

    from fsdp_compat.testing.zoo import build_model, make_batch

    def text_grads(after_image: bool, forget: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        net = build_model(model).float().train()
        if after_image:
            net(**make_batch(model, seed=0, variant="image"))  # a forward only: it caches rope_deltas
            assert any(getattr(m, "rope_deltas", None) is not None for m in net.modules())
        if forget:
            forget_image_positions(net)
        net(**make_batch(model, seed=1, variant="text")).loss.backward()
        return {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}

    fresh = text_grads(after_image=False, forget=False)
    stale = text_grads(after_image=True, forget=False)
    reset = text_grads(after_image=True, forget=True)
    assert any(not torch.equal(fresh[n], stale[n]) for n in fresh), "the cached positions changed nothing here"
    assert all(torch.equal(fresh[n], reset[n]) for n in fresh)
