"""torchtitan 0.3.0 (``torchtitan`` from PyPI): its own Qwen3.5 (``torchtitan.models.qwen3_5.Qwen35Model``, a tiny
config from its own config builders) sharded by its own FSDP2 apply functions, on 2 gloo ranks in fresh
interpreters, fp32, each rank its own batch: rank 0 one image, rank 1 text only.

torchtitan's ``parallelize_qwen3_5`` (what its ``Trainer`` calls as ``model_spec.parallelize_fn``) gives the vision
encoder one group (``apply_fsdp_to_vision_encoder``), then the token embedding, each layer, ``[norm, lm_head]`` and
the root (``apply_fsdp_to_decoder``); ``Qwen35Model._prepare_multimodal_embeds`` runs the encoder only where a batch
has pixels. So with ``FSDP_COMPAT=off`` the image rank all-gathers the encoder's group while the text rank
all-gathers layer 0's, and gloo aborts. torchtitan's model classes are in no family table of fsdp-compat: with
fsdp-compat merely installed (the ``.pth`` hook; the generic layer on the root torchtitan made), the alignment by
mechanism (``fsdp_compat/runtime/replay.py``) has the text rank replay the image rank's encoder call on zeros of the
recorded shape, once per forward.

How deep it runs (``lab.stacks.torchtitan_ranks`` says it line by line): ``Trainer.__init__``'s model path from
``ParallelDims.from_config`` to ``config.optimizer.build`` and the trainer's own ``post_dataloading_process``; the
``Trainer`` object itself cannot be constructed on CPU (its first lines set a CUDA device). Four CPU limits shape the
run: the meshes' ``device_type`` set to ``cpu`` (torchtitan falls back to ``cuda``), the ``partial_dtensor`` spmd
backend (torch 2.13.0's ``fully_shard`` takes DTensors only under the default ``spmd_types``), every layer full
attention (Gated DeltaNet is FLA's Triton kernels) and no-grad forwards. torch's ``flex_attention`` raises
``NotImplementedError: FlexAttention does not support backward on CPU`` as soon as an input requires grad, in the
forward (``torch/nn/attention/flex_attention.py`` ``_validate_device``, from torchtitan's
``FlexAttention.compiled_flex_attn``): no backward and no AdamW step runs here, so training parity needs a GPU and is
not asserted. What is asserted: two training-step forwards (hidden states and torchtitan's chunked loss) and two
eval-mode log-prob passes per rank equal one process running the same weights unsharded on both batches (0.0), and
a grad-mode forward stops at that ``NotImplementedError`` on both ranks (on the text rank inside the replay), not in
a hang. Runs in the ``torchtitan030`` tox env (``tox -m torchtitan``).
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

import pytest
from lab.support import OFF, ON, rank_output, rank_pythonpath, require_framework

from fsdp_compat.testing.crashes import GLOO_MISMATCH
from fsdp_compat.testing.launch import RunResult, current_wording, run_ranks

TORCHTITAN = require_framework("torchtitan", lambda: metadata.version("torchtitan"))

pytestmark = pytest.mark.timeout(600)

BODY = "lab.stacks.torchtitan_ranks:torchtitan_rank"
#: ``parallelize_qwen3_5``'s groups for the tiny Qwen3.5 (``fully_shard([norm, lm_head])`` is one group).
GROUPS = [[""], ["tok_embeddings"], ["layers.0"], ["layers.1"], ["norm", "lm_head"], ["vision_encoder"]]
INSTALLED = (
    "fsdp-compat: generic layer on FSDP2 root Qwen35Model (5 groups below it): mixed micro-batch alignment installed"
)
NO_CPU_BACKWARD = "NotImplementedError: FlexAttention does not support backward on CPU"
#: Where a grad-mode forward stops on CPU: the vision encoder's first attention, torchtitan's compiled FlexAttention.
ENCODER_ATTENTION = [
    "models/common/vision_encoder.py:forward",
    "models/common/attention.py:forward",
    "models/common/attention.py:compiled_flex_attn",
]
FORWARDS = 2  # each a training-step forward and a log-prob pass: 4 root forwards a rank


def _run(env: dict[str, str | None], **cfg: Any) -> RunResult:
    return run_ranks(
        BODY,
        {"variants": ["image", "text"], **cfg},
        world_size=2,  # the case is one image rank and one text rank
        timeout_s=420,
        env={**env, "FSDP_COMPAT_GENERIC": None, "PYTHONPATH": rank_pythonpath()},
    )


def test_image_and_text_ranks_abort_under_torchtitans_own_fsdp2_without_fsdp_compat() -> None:
    result = _run(OFF, reference=False, collective_timeout_s=30)
    assert not result.ok, rank_output(result)
    text = current_wording(rank_output(result))
    assert GLOO_MISMATCH in text or "Timed out waiting" in text, text
    for r in result.ranks:  # the rank that reported first: torchtitan's own groups
        if "groups" in r.extra:
            assert r.extra["groups"] == GROUPS, r.extra["groups"]


def test_image_and_text_ranks_forward_exactly_with_fsdp_compat_installed() -> None:
    result = _run(ON, forwards=FORWARDS, grad_forward=True)
    result.raise_for_error()
    ranks = result.ranks
    for r in ranks:
        assert r.extra["groups"] == GROUPS  # torchtitan's groups, untouched
        assert INSTALLED in r.extra["log"], r.extra["log"]
        assert r.extra["optimizer"] == "AdamW"
        assert len(r.extra["diffs"]) == FORWARDS
        for diff in r.extra["diffs"]:
            assert diff == {"hidden": 0.0, "loss": 0.0, "logprobs": 0.0}, (r.rank, r.extra["diffs"])
        assert r.extra["control_diff"] > 0.1, r.extra  # the other rank's reference differs: the comparison bites
    # the text rank replays the image rank's vision encoder call once per root forward; the image rank never does
    assert [r.extra["mixed_batches"]["dummy_calls"] for r in ranks] == [0, 2 * FORWARDS]
    assert [r.extra["mixed_batches"]["exchanges"] for r in ranks] == [2 * FORWARDS] * 2
    # with grad on, the forward stops at the first FlexAttention on both ranks: the image rank's encoder, and the
    # text rank's replay of it (both call it in step: no hang)
    stops = [r.extra["grad_stop"] for r in ranks]
    for stop in stops:
        assert stop is not None and stop["error"].startswith(NO_CPU_BACKWARD), stops
        assert stop["torchtitan_frames"] == ENCODER_ATTENTION, stops
        assert stop["last_frame"] == "torch/nn/attention/flex_attention.py:_validate_device", stops
    assert [s["in_replay"] for s in stops] == [False, True], stops
