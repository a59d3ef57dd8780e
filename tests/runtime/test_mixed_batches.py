"""Mixed micro-batches through the direct API (``fsdp_compat.apply_fsdp2``, policy auto): some ranks have images,
others none, and every rank's FSDP2 collectives stay in step.

Each case first shows the failure without fsdp-compat's alignment (``FSDP_COMPAT_MIXED_BATCHES=off``: gloo aborts
with "Received data size doesn't match expected size"), then trains with it and equals one process training on all
the ranks' micro-batches with the mean of their losses: gradients after each backward and parameters after each
AdamW step, asserted ``== 0.0`` (2 ranks: the reference's per-micro-batch ``loss / 2`` backward sums gradients the
way FSDP2's reduce-scatter does). The stacks' own paths (SkyRL, transformers' native FSDP2, AReaL, verl's engine)
are tested in their own files.
"""

from __future__ import annotations

import pytest
from lab.support import BREADTH, DEVICE, WORLD_SIZE

from fsdp_compat.errors import FsdpCompatError
from fsdp_compat.runtime.mixed_batches import FAMILIES, install_mixed_batches, mixed_batches_mode
from fsdp_compat.testing.crashes import GLOO_MISMATCH
from fsdp_compat.testing.launch import RunResult, current_wording
from fsdp_compat.testing.parity import run_training

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

AUTO = "fsdp_compat.testing.wraps:core_auto"
# One rank with images, the others none (on GPU: one NCCL rank per GPU, rank 0 the image rank).
IMAGE_AND_TEXT = ["image"] + ["text"] * (max(WORLD_SIZE, 2) - 1)
WORLD = len(IMAGE_AND_TEXT)
FAMILY_MODELS = [
    "glm4v",
    pytest.param("glm4v-moe", marks=BREADTH),
    pytest.param("qwen2-vl", marks=BREADTH),
    "qwen2.5-vl",
    pytest.param("qwen3-vl", marks=BREADTH),
    "llava",  # a fixed-resolution tower (CLIP): pixel_values only
    pytest.param("mistral3", marks=BREADTH),  # Pixtral: pixel_values + image_sizes
    pytest.param("idefics3", marks=BREADTH),  # tiles, the text model as text_model
]


def _run(model: str, variants: list[str], mode: str = "sync", timeout_s: float = 90.0, wrap: str = AUTO) -> RunResult:
    return run_training(
        model,
        wrap,
        world_size=len(variants),
        steps=2,
        device=DEVICE,
        timeout_s=timeout_s,
        variants=variants,
        env={"FSDP_COMPAT_MIXED_BATCHES": mode},
    )


def _assert_exact(run: RunResult) -> None:
    run.raise_for_error()
    assert run.max_abs_grad_diff == 0.0, run.ranks[0].extra.get("worst_grad_param")
    assert run.max_abs_param_diff == 0.0, run.ranks[0].extra.get("worst_param")
    for r in run.ranks:  # every rank's loss is the one-process loss of its own micro-batch, every step
        assert r.losses == r.extra["reference_losses"]


def _assert_mismatch(run: RunResult) -> None:
    assert not run.ok
    text = "\n".join((r.error or "") + str(r.extra.get("log_tail", "")) for r in run.ranks)
    if DEVICE == "cpu":
        assert GLOO_MISMATCH in current_wording(text), text[-3000:]
    else:  # NCCL: a hang, ended by the harness deadline
        assert "timed out" in text, text[-3000:]


def _dummy_calls(run: RunResult) -> list[int]:
    return [r.extra["mixed_batches"]["dummy_calls"] for r in run.ranks]


@pytest.mark.parametrize("model", FAMILY_MODELS)
def test_rank_without_images_crashes_then_trains_exactly(model: str) -> None:
    _assert_mismatch(_run(model, IMAGE_AND_TEXT, mode="off", timeout_s=60.0))
    run = _run(model, IMAGE_AND_TEXT)
    _assert_exact(run)
    # rank 0 never needed a dummy; every text rank ran one per forward (2 steps)
    assert _dummy_calls(run) == [0] + [2] * (WORLD - 1)
    assert all(r.extra["mixed_batches"]["exchanges"] == 2 for r in run.ranks)


def test_tower_without_groups_of_its_own_still_falls_out_of_step() -> None:
    """The whole vision tower in the root group: no vision all-gather to skip, but the root reduce-scatters only the
    parameters that got a gradient, so the image-less rank's reduce-scatter is smaller. Aligned, it is exact."""
    wrap = "lab.wraps:auto_text_layers"
    off = _run("glm4v", IMAGE_AND_TEXT, mode="off", timeout_s=60.0, wrap=wrap)
    _assert_mismatch(off)
    assert "reduce_scatter" in "\n".join(r.error or "" for r in off.ranks)
    run = _run("glm4v", IMAGE_AND_TEXT, wrap=wrap)
    _assert_exact(run)
    assert not any(path.startswith("model.visual") for path in run.ranks[0].extra["fsdp_groups"])
    assert _dummy_calls(run) == [0] + [2] * (WORLD - 1)


def test_no_rank_has_images_runs_no_tower() -> None:
    """No rank has vision input: no rank runs the tower, the tower gets no (zero) gradient, and AdamW leaves it
    alone exactly as one process would."""
    run = _run("qwen2-vl", ["text"] * WORLD)
    _assert_exact(run)
    assert _dummy_calls(run) == [0] * WORLD


def test_images_on_every_rank_different_counts() -> None:
    run = _run("qwen2-vl", ["image", "three-images"] + ["text"] * (WORLD - 2))
    _assert_exact(run)
    assert _dummy_calls(run)[:2] == [0, 0]


def test_images_and_videos_on_one_rank_only() -> None:
    """Rank 0 calls the tower twice (images, then videos); the others top up to two calls."""
    run = _run("qwen2-vl", ["image+video"] + ["image"] * (WORLD - 1))
    _assert_exact(run)
    assert _dummy_calls(run) == [0] + [2] * (WORLD - 1)  # one dummy per forward, 2 steps
    run = _run("qwen2.5-vl", ["image+video"] + ["text"] * (WORLD - 1))
    _assert_exact(run)
    assert _dummy_calls(run) == [0] + [4] * (WORLD - 1)


def test_always_mode_skips_the_exchange_but_cannot_count_videos() -> None:
    """``always`` (verl's way: a dummy wherever input is missing, no exchange) trains an image/text mix exactly, but
    a rank with images and videos calls the tower twice and the others once: the collectives fall out of step."""
    run = _run("glm4v", IMAGE_AND_TEXT, mode="always")
    _assert_exact(run)
    assert all(r.extra["mixed_batches"]["exchanges"] == 0 for r in run.ranks)
    _assert_mismatch(_run("qwen2-vl", ["image+video"] + ["text"] * (WORLD - 1), mode="always", timeout_s=60.0))


def test_always_mode_gives_the_tower_zero_gradients_on_all_text_steps() -> None:
    """Why ``sync`` is the default: with no image anywhere, ``always`` still runs the tower, so its parameters get
    zero gradients (not none) and AdamW's weight decay moves them where one process would not touch them."""
    # the tower has gradients here and none in the one process: compared with zeros (by default that fails)
    run = run_training("glm4v", AUTO, world_size=WORLD, steps=2, device=DEVICE, timeout_s=90.0,
                       variants=["text"] * WORLD, env={"FSDP_COMPAT_MIXED_BATCHES": "always"}, absent_is_zero=True)
    run.raise_for_error()
    assert run.max_abs_grad_diff == 0.0  # the zero gradients equal the reference's missing ones
    assert run.max_abs_param_diff > 0.0
    assert run.ranks[0].extra["worst_param"].startswith("model.visual.")


def test_vlm_outside_the_table_trains_exactly_by_mechanism() -> None:
    """VipLLaVA with its row taken out of the table in the rank processes (``lab.wraps:auto_outside_the_table``: a
    transformers family the table does not know): without alignment the collectives fall out of step; with it the
    generic mechanism replays the image rank's vision-tower call on the text rank, and the step equals one process.
    VipLLaVA reads several of the tower's hidden states and not its last layer's output, so the replay's gradients
    reach only the layers the image rank's do. FSDP2 alone is not exact on VipLLaVA (it reorders sums: the all-image
    run, no replay, is ~1e-8 off in gradients), so the image|text run is held to that run's distance, measured here
    (the family table's rule, :data:`lab.families.MEASURED_FACTOR`)."""
    import math

    from lab.families import MEASURED_FACTOR

    outside = "lab.wraps:auto_outside_the_table"
    _assert_mismatch(_run("vipllava", IMAGE_AND_TEXT, mode="off", timeout_s=60.0, wrap=outside))
    alone = _run("vipllava", ["image"] * len(IMAGE_AND_TEXT), wrap=outside)
    alone.raise_for_error()
    run = _run("vipllava", IMAGE_AND_TEXT, wrap=outside)
    run.raise_for_error()
    bound = (alone.max_rel_grad_diff, alone.max_rel_param_diff)
    got = (run.max_rel_grad_diff, run.max_rel_param_diff)
    assert all(math.isfinite(v) for v in (*bound, *got)), (bound, got)  # NaN fails
    assert got[0] <= MEASURED_FACTOR * bound[0] and got[1] <= MEASURED_FACTOR * bound[1], (got, bound)
    assert [r.extra["mixed_batches"]["dummy_calls"] for r in alone.ranks] == [0] * len(IMAGE_AND_TEXT)
    assert [r.extra["mixed_batches"]["dummy_calls"] for r in run.ranks] == [0] + [2] * (WORLD - 1)
    assert all(r.extra["mixed_batches"]["rounds"] > 0 for r in run.ranks)  # the mechanism's path, not a row's


def test_family_table_rows_and_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    names = [f.name for f in FAMILIES]
    assert len(names) == len(set(names))
    for model in ("glm4v", "glm4v-moe", "qwen2-vl", "qwen2.5-vl", "qwen3-vl", "llava", "gemma3", "mistral3"):
        assert any(model == f.name for f in FAMILIES)
    monkeypatch.setenv("FSDP_COMPAT_MIXED_BATCHES", "sometimes")
    with pytest.raises(FsdpCompatError, match="sync, always, off"):
        mixed_batches_mode()
    monkeypatch.setenv("FSDP_COMPAT_MIXED_BATCHES", "off")
    from fsdp_compat.testing.zoo import build_model

    assert install_mixed_batches(build_model("glm4v")) == []
    monkeypatch.setenv("FSDP_COMPAT_MIXED_BATCHES", "sync")
    assert install_mixed_batches(build_model("qwen2")) == []  # a text model: nothing installed
    model = build_model("glm4v")
    first = install_mixed_batches(model)
    assert len(first) == 1 and install_mixed_batches(model) == first  # idempotent


def test_a_family_built_without_its_tower_gets_no_alignment() -> None:
    """A text-only configuration of a family with a row (transformers 5.24's Gemma4 without a vision config sets
    ``vision_tower = None``): nothing to align, and installing must not fail (it raised AttributeError in
    ``get_submodule`` once, breaking transformers' native FSDP2 for text-only Gemma4)."""
    from fsdp_compat.testing.zoo import build_model

    model = build_model("glm4v")
    model.model.visual = None
    assert install_mixed_batches(model, "sync") == []


def test_off_keeps_outside_tower_calls_working_but_reports_no_alignment(monkeypatch: pytest.MonkeyPatch) -> None:
    """``off`` returns no alignment hooks (nothing to count), yet ``generate`` is still wrapped (``synced_gpus``) and
    a later install with another mode replaces the off hooks instead of returning them."""
    from fsdp_compat.testing.zoo import build_model

    model = build_model("glm4v")
    assert install_mixed_batches(model, "off") == []
    assert "generate" in vars(model)  # the wrapped generate
    (hooks,) = install_mixed_batches(model, "sync")
    assert hooks.mode == "sync" and install_mixed_batches(model, "sync") == [hooks]


def test_unsharded_model_is_untouched() -> None:
    """Without FSDP2 groups in the tower (one process, no fully_shard) the hooks never exchange or add a dummy."""
    import torch

    from fsdp_compat.testing.zoo import build_model, make_batch

    model = build_model("glm4v")
    reference = build_model("glm4v")
    (hooks,) = install_mixed_batches(model)
    batch = make_batch("glm4v", variant="text")
    assert torch.equal(model(**batch).logits, reference(**batch).logits)
    assert hooks.dummy_calls == 0 and hooks.exchanges == 0
    assert hooks._active is None  # not sharded yet: decided again at the next forward (a later fully_shard)
    with torch.no_grad():  # generate on an unsharded model: the wrapper changes nothing
        prompt = {k: v for k, v in batch.items() if k != "labels"}
        got = model.generate(**prompt, max_new_tokens=2, do_sample=False, pad_token_id=0)
        assert torch.equal(got, reference.generate(**prompt, max_new_tokens=2, do_sample=False, pad_token_id=0))
    assert hooks.exchanges == 0 and hooks.decode_steps == 0
