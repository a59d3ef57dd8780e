"""The timm tower kinds (``timm_inputs``: FastVLM, Gemma3n; ``timm_tile_inputs``: PerceptionLM) through three
training frameworks' own FSDP2 paths, where test_timm_towers_through_stacks.py runs them through transformers' native
FSDP2 and accelerate:

- NeMo Automodel 0.7.0: ``parallelize_model(model, MeshContext.build(FSDP2Config(...)))`` (its
  ``apply_fsdp2_sharding_recursively``: every ``nn.ModuleList`` child one group, then the embeddings and the root;
  rank routine ``lab.stacks.nemo_automodel_ranks:nemo_rank``, as tests/stacks/nemo_automodel);
- verl 0.9.1's engine: ``TrainingWorker`` and ``train_batch``, fp32, no remove padding (rank routine
  ``lab.stacks.verl_families_ranks:families_ranks``, as tests/stacks/verl_sp/test_verl_engine_families.py);
- SkyRL 0.4.0: ``HFModelWrapper`` (which hands the model ``pixel_values`` only, all these families need) and the
  reproduction of ``FSDPStrategy._fsdp_init_model`` around SkyRL's own ``apply_fsdp2`` (rank routine
  ``lab.stacks.skyrl_engine_ranks:init_and_train``, as tests/stacks/skyrl/test_skyrl_engine.py).

Rank 0 trains an image micro-batch, rank 1 a text-only one, fp32, 2 gloo ranks, 2 AdamW steps. With
``FSDP_COMPAT=off`` (the framework as it is) rank 0's collectives for the tower meet rank 1's for a text group and
gloo aborts ("Received data size doesn't match expected size"): through NeMo the FastViT tower has no
``nn.ModuleList`` child and stays in the root, whose reduce-scatter then differs in size; the others shard the tower
(or its blocks) apart. With fsdp-compat (the ``.pth`` hook) rank 1 runs one zero dummy tower call per forward and both
ranks equal one process training on both micro-batches with the mean loss: gradients after each backward and
parameters after each step ``== 0.0``, each rank's loss the reference's on its own batch.

timm imports torchvision, which imports beside torch 2.14.1 only, so these run in the ``families524-timm`` tox env
(transformers 5.24.0) with the three frameworks installed ``--no-deps`` (their FSDP2 paths import and train on 5.24,
above their own pins: NeMo 5.18.0, verl's envs 5.10.4, SkyRL's <=5.16.1; each framework's cases pass the same on its
own pin too, measured once with that transformers swapped in). A missing framework fails collection, never skips.
Figures: torch 2.14.1 (CPU), 2 gloo ranks on 2 cores, about 2.5 minutes for this module.
"""

from __future__ import annotations

import importlib
from importlib import metadata
from typing import Any

import pytest
from lab.stacks.verl_engine_ranks import assert_reference_steps_exact
from lab.support import OFF, ON, STUBS, rank_output, rank_pythonpath, require_framework
from packaging.version import Version

from fsdp_compat.testing.crashes import GLOO_MISMATCH

require_framework("timm", lambda: importlib.import_module("timm"))
NEMO = require_framework(
    "nemo_automodel", lambda: importlib.import_module("nemo_automodel.components.distributed.parallelizer")
)
VERL = require_framework("verl", lambda: Version(metadata.version("verl")))
SKYRL = require_framework("skyrl", lambda: Version(metadata.version("skyrl")))

from fsdp_compat.testing.launch import RunResult, current_wording, run_ranks  # noqa: E402

pytestmark = pytest.mark.timeout(400)

#: timm tower kind -> its families' tiny models (as test_timm_towers_through_stacks.TIMM_KINDS)
TIMM_KINDS: dict[str, tuple[str, ...]] = {
    "timm_inputs": ("lab.vlms:fast_vlm", "lab.vlms:gemma3n"),
    "timm_tile_inputs": ("lab.vlms:perception_lm",),
}
CASES = [pytest.param(m, id=f"{kind}-{m.rpartition(':')[2]}") for kind, models in TIMM_KINDS.items() for m in models]
TOWER = "model.vision_tower"
STEPS = 2


def _off_aborted(result: RunResult, timeout_s: float) -> None:
    """The unaligned launch failed by gloo's collective mismatch, an abort (not a hang until the timeout)."""
    assert not result.ok, "expected the collective mismatch, but it trained"
    assert result.seconds < timeout_s, result.seconds
    text = current_wording(rank_output(result))
    assert GLOO_MISMATCH in text, text[-4000:]


def _seconds(stack: str, name: str, off: RunResult, on: RunResult) -> None:
    """Each launch's wall time, and the gloo line of the unaligned one (the aborting rank's, not its peer's echo)."""
    line = next(x for x in current_wording(rank_output(off)).splitlines() if GLOO_MISMATCH in x)
    print(f"{stack} {name}: off {off.seconds:.1f}s ({line.strip()[-120:]}), on {on.seconds:.1f}s, 0.0")


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A tiny family's checkpoint (``save_pretrained``), written once per module: verl and SkyRL load it."""
    from fsdp_compat.testing.zoo import build_model

    dirs: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in dirs:
            path = tmp_path_factory.mktemp(name.rpartition(":")[2])
            build_model(name).save_pretrained(path)
            dirs[name] = str(path)
        return dirs[name]

    return get


# -------------------------------------------------------------------------------------------- NeMo Automodel 0.7.0

#: NeMo 0.7.0's groups for each family (every ``nn.ModuleList`` child, the untied embeddings, the root): FastViT's
#: stages are no ModuleList, so its tower stays in the root; MobileNetV5 and the PE ViT give their two blocks a group
#: each, Gemma3n's audio conformer and AltUp projections their own too.
_TEXT = [["model.language_model.embed_tokens"], ["model.language_model.layers.0"], ["model.language_model.layers.1"]]
_BLOCKS = [[f"{TOWER}.timm_model.blocks.0"], [f"{TOWER}.timm_model.blocks.1"]]
NEMO_GROUPS = {
    "lab.vlms:fast_vlm": [[""], *_TEXT, ["lm_head"]],
    "lab.vlms:gemma3n": [
        [""],
        *_BLOCKS,
        *_TEXT,
        ["model.language_model.altup_projections.0"],
        ["model.language_model.altup_unembed_projections.0"],
        ["model.audio_tower.conformer.0"],
        ["model.audio_tower.conformer.1"],
        ["lm_head"],
    ],
    "lab.vlms:perception_lm": [[""], *_BLOCKS, *_TEXT, ["lm_head"]],
}


def _nemo(name: str, env: dict[str, str | None]) -> RunResult:
    return run_ranks(
        "lab.stacks.nemo_automodel_ranks:nemo_rank",
        {"model": name, "steps": STEPS, "variants": ["image", "text"]},
        world_size=2,
        timeout_s=240,
        env={"PYTHONPATH": rank_pythonpath(), **env},
    )


@pytest.mark.parametrize("name", CASES)
def test_timm_tower_rank_without_images_crashes_then_trains_exactly_through_nemo(name: str) -> None:
    """NeMo's own groups (:data:`NEMO_GROUPS`). Unpatched: gloo aborts. Patched by the ``.pth`` hook: the same
    groups, rank 1 runs one dummy tower call per forward, both ranks exact (0.0), and not against a control
    reference that ignores rank 1's batch."""
    off = _nemo(name, OFF)
    _off_aborted(off, 240)
    assert all(r.extra["patched"] is False for r in off.ranks if "patched" in r.extra)

    on = _nemo(name, ON)
    on.raise_for_error()
    for rank in on.ranks:
        extra = rank.extra
        assert extra["patched"] is True
        assert extra["groups"] == NEMO_GROUPS[name], extra["groups"]  # NeMo's selection, kept
        assert extra["grad_diff"] == 0.0, extra["worst_grad_param"]  # NaN fails too
        assert extra["param_diff"] == 0.0, extra["worst_param"]
        assert extra["control_grad_diff"] > 1e-3, extra["control_grad_diff"]
        assert extra["losses"] == extra["reference_losses"], (extra["losses"], extra["reference_losses"])
    assert [r.extra["mixed_batches"]["dummy_calls"] for r in on.ranks] == [0, STEPS]  # one per forward
    assert [r.extra["mixed_batches"]["exchanges"] for r in on.ranks] == [STEPS, STEPS]
    assert on.ranks[0].extra["losses"] != on.ranks[1].extra["losses"]  # each rank its own batch
    _seconds("nemo-automodel 0.7.0", name, off, on)


# --------------------------------------------------------------------------------------------- verl 0.9.1's engine

VERL_TIMEOUT_S = 180.0
FP32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
#: no remove padding, fp32, the clip made a no-op: the comparison can be exact
VERL_CASE = {"name": "family", "kinds": ["image", "text"], "engine": {"mixed_precision": FP32},
             "optimizer": {"clip_grad": 1e9}}  # fmt: skip


def _verl(path: str, name: str, env: dict[str, str]) -> RunResult:
    clean = {k: "" for k in ("FSDP_COMPAT", "FSDP_COMPAT_POLICY", "FSDP_COMPAT_MIXED_BATCHES",
                             "VERL_USE_EXTERNAL_MODULES")}  # fmt: skip
    clean["USE_HUB_KERNELS"] = "0"  # transformers' kernelize on verl's meta-device ranks (no-op on 5.24)
    return run_ranks(
        "lab.stacks.verl_families_ranks:families_ranks",
        {"model_dir": path, "model": name, "device": "cpu", "cases": [VERL_CASE]},
        world_size=2,
        timeout_s=VERL_TIMEOUT_S,
        env={**clean, "PYTHONPATH": rank_pythonpath(), **env},
    )


@pytest.mark.parametrize("name", CASES)
def test_timm_tower_rank_without_images_crashes_then_trains_exactly_through_verl(saved: Any, name: str) -> None:
    """verl's engine (transformers' forward: verl has no forward of its own for these families). Unpatched (verl's
    selector, no alignment): gloo aborts. The default (fsdp-compat's selector, the whole tower one group, and the
    alignment): one dummy tower call per step on rank 1, and each step's losses, gradients and post-AdamW parameters
    equal one process on both micro-batches (0.0); the reference's tower gets a gradient."""
    path = saved(name)
    off = _verl(path, name, {"FSDP_COMPAT": "off"})
    _off_aborted(off, VERL_TIMEOUT_S)

    on = _verl(path, name, {})
    on.raise_for_error()
    image, text = (r.extra["cases"]["family"] for r in on.ranks)
    for rank in on.ranks:
        assert rank.extra["state"]["patched"], rank.extra["state"]
    assert image["groups"] == text["groups"] and TOWER in image["groups"], (image["groups"], text["groups"])
    assert [len(s["vision_calls"]) for s in image["steps"]] == [1] * STEPS, image["steps"]
    assert [len(s["vision_calls"]) for s in text["steps"]] == [1] * STEPS, text["steps"]  # the dummy
    assert [s["alignment_dummies"] for s in image["steps"]] == [0] * STEPS, image["steps"]
    assert [s["alignment_dummies"] for s in text["steps"]] == [1] * STEPS, text["steps"]
    assert all("pixel_values" in s["model_inputs"][0] for s in image["steps"]), image["steps"]
    assert not any("pixel_values" in s["model_inputs"][0] for s in text["steps"]), text["steps"]
    reference = image["reference"]
    assert_reference_steps_exact(reference, STEPS, name)
    assert all(ref["grad_norm_vision"] > 0.0 for ref in reference["steps"]), reference["steps"]
    _seconds(f"verl {VERL}", name, off, on)


# ------------------------------------------------------------------------------------------------------ SkyRL 0.4.0

SKYRL_TIMEOUT_S = 120.0


def _skyrl(path: str, name: str, env: dict[str, str | None]) -> RunResult:
    cfg = {"path": path, "model": name, "seed": 0, "steps": STEPS, "variants": ["image", "text"]}
    return run_ranks(
        "lab.stacks.skyrl_engine_ranks:init_and_train",
        cfg,
        world_size=2,
        timeout_s=SKYRL_TIMEOUT_S,
        # skyrl's Python 3.11 TypedDict repair (lab.stacks.skyrl_ranks) and the stubs first, as test_skyrl_engine
        env={"FSDP_COMPAT_TEST_REPAIR_MPP": "1", "PYTHONPATH": rank_pythonpath(STUBS), **env},
    )


@pytest.mark.parametrize("name", CASES)
def test_timm_tower_rank_without_images_crashes_then_trains_exactly_through_skyrl(saved: Any, name: str) -> None:
    """``HFModelWrapper`` loads the checkpoint (``AutoModelForImageTextToText``, meta weights on rank 1) and SkyRL's
    ``apply_fsdp2`` shards it. Unpatched: gloo aborts. Patched by the ``.pth`` hook: the tower one group, rank 1 runs
    one dummy tower call per forward, and both ranks equal one process (PPO loss, gradients, post-AdamW parameters:
    0.0)."""
    path = saved(name)
    off = _skyrl(path, name, OFF)
    _off_aborted(off, SKYRL_TIMEOUT_S)
    assert all(r.extra["strategy_apply_fsdp2_patched"] is False for r in off.ranks if "release" in r.extra)

    on = _skyrl(path, name, ON)
    on.raise_for_error()
    assert on.max_abs_grad_diff == 0.0, (on.max_abs_grad_diff, on.ranks[0].extra.get("worst_grad_param"))
    assert on.max_abs_param_diff == 0.0, on.max_abs_param_diff
    for rank in on.ranks:
        assert rank.losses == rank.extra["reference_losses"], (rank.rank, rank.losses, rank.extra["reference_losses"])
        assert rank.extra["release"] == f"skyrl {SKYRL}", rank.extra["release"]
        assert rank.extra["strategy_apply_fsdp2_patched"] and rank.extra["probe"]["activated_by"] == "pth-hook"
        assert TOWER in rank.extra["fsdp_groups"], rank.extra["fsdp_groups"]
        assert rank.extra["max_param_update"] > 0.0
    assert [r.extra["meta_init"] for r in on.ranks] == [False, True]  # SkyRL's meta init on rank 1
    assert on.ranks[0].extra["fsdp_groups"] == on.ranks[1].extra["fsdp_groups"]
    assert [r.extra["mixed_batches"]["dummy_calls"] for r in on.ranks] == [0, STEPS]
    assert [r.extra["mixed_batches"]["exchanges"] for r in on.ranks] == [STEPS, STEPS]
    assert on.ranks[0].losses[-1] != on.ranks[1].losses[-1]  # each rank its own batch (step 1: PPO ratio 1)
    _seconds(f"skyrl {SKYRL}", name, off, on)


def test_frameworks_are_the_releases_run_here() -> None:
    """The releases these figures were measured on (a newer one fails here first, to be measured again)."""
    assert (metadata.version("nemo-automodel"), VERL, SKYRL) == ("0.7.0", Version("0.9.1"), Version("0.4.0"))
    assert NEMO.__name__ == "nemo_automodel.components.distributed.parallelizer"
