"""VeOmni (``veomni`` 0.1.12 from PyPI, ``--no-deps`` on transformers 5.9.0, the release its repository pins): tiny
VLMs built, sharded and stepped through VeOmni's own trainer code on 2 gloo ranks in fresh interpreters, fp32, each
rank its own micro-batch, 2 steps of VeOmni's own optimizer; ``lab.stacks.veomni_ranks`` says what runs.

Where it stops, and why: VeOmni's ``VLMTrainer.__init__`` is followed step by step through ``_setup`` (VeOmni's
parallel state and mesh), ``_build_model`` (``build_foundation_model`` on the meta device from a local checkpoint),
``_freeze_model_module``, ``_build_parallelized_model`` (``build_parallelize_model`` -> ``parallelize_model_fsdp2``:
a group per ``_no_split_modules`` class, children first, then the root; each rank loads its shards from the
checkpoint), ``_build_training_context`` and ``_build_optimizer``, then per step ``forward_backward_step`` (VeOmni's
``mean_global_loss`` weighting) and ``optimizer.step()``. Not run: the data pipeline (``_build_model_assets`` and
after need the model's processor and tokenizer files, hub downloads this machine cannot make, and a dataset: the ranks
get zoo micro-batches with the masks VeOmni's Qwen-VL collator adds), ``train_step``'s callbacks, clipping and LR
scheduler, and VeOmni's own ``dist.init_process_group`` (it asks for an accelerator's backend and raises on CPU: the
ranks join gloo first, which ``_setup`` then keeps). Kernels are eager (the defaults are Liger / flash-attention,
GPU only) and parameters fp32 (the default is bf16). fsdp-compat has no VeOmni adapter: what acts here is its generic
layer on every FSDP2 root, installed by the ``.pth`` start-up hook.

(a) transformers' own GLM4V and Qwen2.5-VL (``MODELING_BACKEND=hf``, VeOmni's switch to transformers' classes;
GLM4V has no VeOmni modeling at all). VeOmni gives the vision blocks and text layers groups and keeps GLM4V's
position table in the root, so no raw read crashes. Rank 0 images, rank 1 text: with ``FSDP_COMPAT=off`` rank 1's
first text-layer all-gather meets rank 0's first vision-block all-gather and gloo aborts; with fsdp-compat rank 1
runs one dummy tower call per forward and both ranks equal one process training on both micro-batches (``== 0.0``).

(b) VeOmni's own Qwen2.5-VL (its generated modeling): its forward runs ``visual.dummy_forward()`` for each medium a
micro-batch lacks, so an image rank calls the tower twice per forward (its images, a video dummy) and a text rank
twice (two dummies): the ranks stay in step without fsdp-compat, and there is no crash to show. fsdp-compat must add
nothing: its alignment stands aside for a forward that is not transformers' own (no exchange, no dummy), the tower
calls stay two per rank per forward, and the run is bit-identical to ``FSDP_COMPAT=off`` and exact (``0.0``).

Runs in the ``veomni0112`` tox env (``tox -m veomni``; the only one that collects this folder: a missing VeOmni fails).
"""

from __future__ import annotations

import importlib
import math
import re
from pathlib import Path
from typing import Any

import pytest
from lab.support import OFF, ON, assert_ranks_exact, rank_output, rank_pythonpath, require_framework

from fsdp_compat.testing.crashes import GLOO_MISMATCH

require_framework("veomni", lambda: importlib.import_module("veomni.distributed.torch_parallelize"))

from fsdp_compat.testing.launch import RunResult, run_ranks  # noqa: E402

pytestmark = pytest.mark.timeout(400)

#: VeOmni's selection on both models (``_no_split_modules``: the vision blocks and the text decoder layers; no
#: ``nn.Embedding`` rule), children first, then the root
GROUPS = [
    [""],
    ["model.visual.blocks.0"],
    ["model.visual.blocks.1"],
    ["model.language_model.layers.0"],
    ["model.language_model.layers.1"],
]
GENERIC = "fsdp-compat: generic layer on FSDP2 root {} (4 groups below it)"
VEOMNI_QWEN = "veomni-qwen2.5-vl"


def run(model: str, variants: list[str], switches: dict[str, str | None], workdir: Path) -> RunResult:
    """``model`` through VeOmni on 2 ranks, rank r on ``variants[r]``; each rank's checkpoint under ``workdir``."""
    env = {"PYTHONPATH": rank_pythonpath(), **switches}
    if model != VEOMNI_QWEN:
        env["MODELING_BACKEND"] = "hf"  # VeOmni's switch to transformers' own classes (GLM4V has no VeOmni modeling)
    return run_ranks(
        "lab.stacks.veomni_ranks:veomni_rank",
        {"model": model, "steps": 2, "variants": variants, "workdir": str(workdir)},
        world_size=2,
        timeout_s=240,
        env=env,
    )


def _exact(result: RunResult, model_module: str) -> None:
    """Ran on every rank through VeOmni's path: VeOmni's groups and class, the checkpoint loaded into the shards
    exactly, and every rank exact against one process (gradients, parameters, losses)."""
    assert_ranks_exact(result)
    for rank in result.ranks:
        extra = rank.extra
        print(
            f"rank {rank.rank}: Δgrad {extra['grad_diff']} Δparam {extra['param_diff']} tower calls "
            f"{extra['tower_calls']} mixed batches {extra['mixed_batches']} ({result.seconds:.1f}s)"
        )
        assert extra["groups"] == GROUPS
        assert extra["model_module"] == model_module
        assert extra["load_diff"] == 0.0, extra["worst_loaded"]
        assert extra["guard_unshards"] in (0, None)  # VeOmni's grouping keeps GLM4V's raw read in the root
    assert result.ranks[0].extra["losses"] != result.ranks[1].extra["losses"]  # each rank its own micro-batch


def _shard_bytes(module: Any, world: int = 2) -> int:
    """The bytes one rank contributes to an fp32 FSDP2 all-gather of ``module``'s group (dim 0 split, padded)."""
    return sum(4 * math.ceil(p.shape[0] / world) * (p.numel() // p.shape[0]) for p in module.parameters())


#: the transformers classes VeOmni loads with ``MODELING_BACKEND=hf``: zoo name -> the module of their modeling
HF_MODELS = {
    "glm4v": "transformers.models.glm4v.modeling_glm4v",
    "qwen2.5-vl": "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl",
}


@pytest.mark.parametrize("model", list(HF_MODELS))
def test_rank_without_images_aborts_unpatched_then_trains_exactly(model: str, tmp_path: Path) -> None:
    """Rank 0 images, rank 1 text. Unpatched: gloo aborts, rank 1's text-layer shard arriving where rank 0 expects a
    vision block's (the sizes in gloo's message in the ratio of the two groups' shards, computed from the model).
    Patched: rank 1 calls the tower on a dummy once per
    forward (rank 0 on its images), both ranks exact."""
    from fsdp_compat.testing.zoo import build_model

    off = run(model, ["image", "text"], OFF, tmp_path)
    assert not off.ok, "expected the collective mismatch, but it ran"
    output = rank_output(off)
    found = re.search(r"(\d+) vs (\d+)\. " + re.escape(GLOO_MISMATCH), output)
    assert found, output[-4000:]
    tiny = build_model(model)
    layer, block = _shard_bytes(tiny.model.language_model.layers[0]), _shard_bytes(tiny.model.visual.blocks[0])
    sent, expected = int(found[1]), int(found[2])
    print(f"unpatched: {found[0]} (shards: text layer {layer} bytes, vision block {block} bytes)")
    assert sent * block == expected * layer  # gloo's pieces of the two groups' shards: the same fraction of each
    assert all(r.extra["log"] == [] for r in off.ranks if "log" in r.extra)

    on = run(model, ["image", "text"], ON, tmp_path)
    _exact(on, HF_MODELS[model])
    assert [r.extra["tower_calls"] for r in on.ranks] == [[1, 1], [1, 1]]  # one tower call per rank per forward
    assert [r.extra["mixed_batches"]["dummy_calls"] for r in on.ranks] == [0, 2]  # rank 1's: one per forward
    assert [r.extra["mixed_batches"]["exchanges"] for r in on.ranks] == [2, 2]
    for rank in on.ranks:
        assert any(line.startswith(GENERIC.format(type(tiny).__name__)) for line in rank.extra["log"])


def test_glm4v_image_ranks_train_exactly_with_and_without_fsdp_compat(tmp_path: Path) -> None:
    """Both ranks with images (distinct micro-batches): exact without fsdp-compat, and with it (no dummy), the
    same losses."""
    off = run("glm4v", ["image", "image"], OFF, tmp_path)
    _exact(off, "transformers.models.glm4v.modeling_glm4v")
    on = run("glm4v", ["image", "image"], ON, tmp_path)
    _exact(on, "transformers.models.glm4v.modeling_glm4v")
    assert [r.extra["mixed_batches"]["dummy_calls"] for r in on.ranks] == [0, 0]
    assert [r.extra["tower_calls"] for r in on.ranks] == [[1, 1], [1, 1]]
    assert [r.extra["losses"] for r in on.ranks] == [r.extra["losses"] for r in off.ranks]


def test_veomnis_own_qwen25_vl_keeps_its_own_dummy_and_fsdp_compat_adds_none(tmp_path: Path) -> None:
    """VeOmni's Qwen2.5-VL, rank 0 images, rank 1 text. Without fsdp-compat VeOmni's ``dummy_forward`` keeps the
    ranks in step (two tower calls per rank per forward: rank 0 its images and a video dummy, rank 1 two dummies)
    and the run is exact. With fsdp-compat: the same tower calls (no dummy of fsdp-compat's, no exchange), exact,
    and the same losses bit for bit."""
    off = run(VEOMNI_QWEN, ["image", "text"], OFF, tmp_path)
    on = run(VEOMNI_QWEN, ["image", "text"], ON, tmp_path)
    module = "veomni.models.transformers.qwen2_5vl.generated.patched_modeling_qwen2_5_vl_gpu"
    for result in (off, on):
        _exact(result, module)
        assert [r.extra["tower_calls"] for r in result.ranks] == [[2, 2], [2, 2]]
    for rank in on.ranks:  # installed on the root, and standing aside: no exchange, no dummy
        counters = rank.extra["mixed_batches"]
        assert (counters["installed"], counters["dummy_calls"], counters["exchanges"]) == (1, 0, 0), counters
    assert [r.extra["losses"] for r in on.ranks] == [r.extra["losses"] for r in off.ranks]
    for rank in on.ranks:
        assert any(line.startswith(GENERIC.format("Qwen2_5_VLForConditionalGeneration")) for line in rank.extra["log"])
    assert all(r.extra["log"] == [] for r in off.ranks)
