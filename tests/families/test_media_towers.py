"""Video paths of their own, and ranks that differ in every medium, under mixed micro-batches (transformers 5.24,
tiny, fp32, 2 gloo ranks, fsdp-compat's plan).

Video-LLaVA encodes videos with a second tower (``video_tower``); Nemotron-H Omni encodes them with its vision tower
but through a video patch projection that images never reach: a rank with videos runs collectives (or gives
parameters gradients) that a rank without videos does not, whatever the image dummy does. Their rows carry a
:class:`~fsdp_compat.runtime.vlm_families.VideoTower`, a column of its own in the exchange. Shown first, unaligned
(videos against text: a gloo abort); then, aligned, ranks that differ in images, videos and audio in any mix train
at exact parity (0.0 gradients and parameters after 2 AdamW steps, equal losses), with one dummy per step for each
medium another rank has and this one lacks. A rank with all three media against a text rank: dots3 (its videos run
through its image path, so they count as vision tower calls). Nemotron-H Omni cannot take images and videos in one
micro-batch at all (its forward's own placeholder check), shown here too.
"""

from __future__ import annotations

import pytest
import torch
from lab.support import DEVICE
from lab.vlms import tiny_models

from fsdp_compat.runtime.vlm_families import FAMILIES
from fsdp_compat.testing.crashes import GLOO_MISMATCH
from fsdp_compat.testing.launch import RunResult, current_wording
from fsdp_compat.testing.parity import run_training

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

AUTO = "fsdp_compat.testing.wraps:core_auto"
STEPS = 2
#: Tiny model -> its row's name.
ROWS = {"video_llava": "video-llava", "nemotron_h_omni": "nemotron-h-omni", "dots3_note": "dots3-note"}
#: Pairs of ranks per family: every medium the family's batches carry, against text, against each other, and
#: several on one rank against fewer on the other.
PAIRS = {
    "video_llava": [("video", "text"), ("image", "video"), ("image+video", "text"), ("image+video", "image"),
                    ("image+video", "video")],
    "nemotron_h_omni": [("video", "text"), ("image", "video"), ("video+audio", "text"), ("video+audio", "image"),
                        ("image+audio", "video"), ("audio", "video")],
    "dots3_note": [("image+video+audio", "text"), ("image+video+audio", "video"), ("video", "audio"),
                   ("image+video", "audio")],
}  # fmt: skip
CASES = [(name, pair) for name, pairs in PAIRS.items() for pair in pairs]


def _row(name: str) -> object:
    return next(f for f in FAMILIES if f.name == ROWS[name])


def _run(name: str, variants: tuple[str, str], mode: str) -> RunResult:
    return run_training(f"lab.vlms:{name}", AUTO, world_size=2, steps=STEPS, device=DEVICE, timeout_s=90.0,
                        variants=list(variants), env={"FSDP_COMPAT_MIXED_BATCHES": mode})  # fmt: skip


def _vision_dummies(name: str, media: list[set[str]], own: set[str]) -> int:
    """Vision tower dummies per step on the rank with ``own``: one per image or video call another rank makes
    beyond this one's; a family whose videos have a column of their own tops each medium up by itself, one whose
    videos run through the image path (dots3) tops up the count of calls."""
    if _row(name).video is not None:
        return len({"image", "video"} & (set().union(*media) - own))
    return max(len(m & {"image", "video"}) for m in media) - len(own & {"image", "video"})


def test_the_families_with_a_video_path_of_their_own_have_a_video_row() -> None:
    assert sorted(f.name for f in FAMILIES if getattr(f, "video", None) is not None) == [
        "nemotron-h-omni", "video-llava",
    ]  # fmt: skip
    for name in ROWS:
        assert "video" in tiny_models()[name].media(), name


@pytest.mark.parametrize("name", ["video_llava", "nemotron_h_omni"])
def test_videos_on_one_rank_fall_out_of_step_unaligned(name: str) -> None:
    run = _run(name, ("video", "text"), "off")
    assert not run.ok
    text = "\n".join((r.error or "") + str(r.extra.get("log_tail", "")) for r in run.ranks)
    assert (GLOO_MISMATCH in current_wording(text)) if DEVICE == "cpu" else ("timed out" in text), text[-3000:]


@pytest.mark.parametrize(("name", "variants"), CASES, ids=[f"{n}-{'|'.join(p)}" for n, p in CASES])
def test_ranks_that_differ_in_any_medium_train_exactly(name: str, variants: tuple[str, str]) -> None:
    run = _run(name, variants, "sync")
    run.raise_for_error()
    assert run.max_abs_grad_diff == 0.0, run.ranks[0].extra.get("worst_grad_param")
    assert run.max_abs_param_diff == 0.0, run.ranks[0].extra.get("worst_param")
    media = [set(v.split("+")) for v in variants]
    for r, own in zip(run.ranks, media, strict=True):
        counters = r.extra["mixed_batches"]
        others = set().union(*media)
        assert counters["audio_dummy_calls"] == (STEPS if "audio" in others - own else 0), (r.rank, counters)
        assert counters["dummy_calls"] == STEPS * _vision_dummies(name, media, own), (r.rank, counters)
        assert r.losses == r.extra["reference_losses"]


def test_nemotron_h_omni_cannot_take_images_and_videos_in_one_micro_batch() -> None:
    """Its forward fills image and video features from the image token alike (video_token_id is not read), so a
    micro-batch with both fails the forward's own placeholder check, on one process: no rank can have both."""
    tiny = tiny_models()["nemotron_h_omni"]
    model = tiny.build().float()
    batch = tiny.batch(torch.Generator().manual_seed(0), "image+video")
    with pytest.raises(ValueError, match=r"feature vectors for .* placeholder tokens"):
        model(**batch)
