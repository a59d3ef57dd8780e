"""SkyRL, real wheels: its own model loading and FSDP2 init (not only ``apply_fsdp2``), on gloo ranks, crash first.

SkyRL's policy worker (``init_model``) runs ``FSDPStrategy.setup_distributed`` -> ``HFModelWrapper`` (meta
weights on ranks other than 0) -> ``FSDPStrategy.prepare`` -> ``_fsdp_init_model``. That strategy hard-codes
CUDA: ``setup_distributed`` builds an ``init_device_mesh("cuda")`` mesh, which ``fully_shard`` cannot use
without CUDA, and ``fsdp2_load_full_state_dict`` stages tensors through ``.cuda()``. The CPU tests here assert
exactly those two blockers on the real strategy, and train through a **reproduction of**
``FSDPStrategy._fsdp_init_model`` / ``_fsdp_init_train_model`` (``lab.stacks.skyrl_engine_ranks``): skyrl 0.4.0
``skyrl/backends/skyrl_train/distributed/fsdp_strategy.py`` lines 202-285 (mixed-precision policy,
``fsdp_kwargs``, ``state_dict()``, ``module.to("meta")`` with the rank-0 snapshot of non-persistent buffers,
``apply_fsdp2(module, fsdp_kwargs, self.fsdp_config)``, ``fsdp2_load_full_state_dict``, AdamW and scheduler);
skyrl-train 0.3.1 ``skyrl_train/distributed/fsdp_strategy.py`` lines 254-300 (its ``fsdp2`` branch, no meta
move). SkyRL's own code runs wherever it can on CPU: the meta-init choice, ``HFModelWrapper`` loading the saved
model and its forward (images as ``TensorList``), ``PrecisionType``, ``fsdp_strategy.MixedPrecisionPolicy`` and
``fsdp_strategy.apply_fsdp2`` (the name SkyRL calls, patched by the installed ``.pth``), the "regular" PPO loss
from ``PolicyLossRegistry``, ``FSDPStrategy.backward`` and ``optimizer_step`` (``max_grad_norm=0``: the clip
moves the norm to ``torch.cuda.current_device()``). Only the CUDA lines are replaced: a "cpu" mesh of the same
shape, and ``fsdp2_load_full_state_dict`` as torch's ``set_model_state_dict`` with SkyRL's options plus the
non-persistent buffer broadcast on CPU.

Data-parallel: each rank trains on its own micro-batch and the reference is one process training on all the ranks'
micro-batches with the mean loss (gradients and post-AdamW parameters asserted ``== 0.0``). Where the release loads
a VLM, a mixed case (rank 0 images, rank 1 text only) shows gloo's collective mismatch with fsdp-compat's mixed-batch
alignment off, then the same exact parity with it on.

Which model: GLM4V where the release's policy builder can load it (skyrl >= 0.2: ``AutoModelForImageTextToText``);
elsewhere ``AutoModelForCausalLM`` rejects ``Glm4vConfig`` (asserted), so those releases train the zoo's Qwen2,
whose unpatched crash there is the set-indexing ``TypeError`` of SkyRL's own ``apply_fsdp2``.

``FSDP_COMPAT_TEST_DEVICE=cuda`` (the ``-gpu`` tox factor) adds the real ``FSDPStrategy.prepare`` on one GPU,
crash first; without CUDA that setting fails the session (``tests/conftest.py``). Ranks are fresh interpreters
that never import an fsdp_compat adapter (the ``.pth`` hook patches SkyRL; ``FSDP_COMPAT=off`` turns it off).
"""

from __future__ import annotations

import os
import sys
from importlib import metadata
from typing import Any

import pytest

from fsdp_compat.testing.crashes import GLOO_MISMATCH

DEVICE = os.environ.get("FSDP_COMPAT_TEST_DEVICE", "cpu")

from lab.stack_families import STACKS  # noqa: E402
from lab.support import BREADTH, STUBS, rank_pythonpath, require_framework  # noqa: E402

from fsdp_compat.testing.skyrl_smoke import installed_skyrl  # noqa: E402

FOUND = require_framework("skyrl or skyrl-train", installed_skyrl)

import torch  # noqa: E402

from fsdp_compat.testing.launch import RunResult, current_wording, run_ranks  # noqa: E402
from fsdp_compat.testing.parity import PARITY_TOL  # noqa: E402
from fsdp_compat.testing.skyrl_smoke import (  # noqa: E402
    ENV_CONFIG,
    GLM4V_CRITIC_ERROR,
    GLM4V_LOAD_ERROR,
    GRID_SAMPLER_CRASH,
    SET_INDEX_CRASH,
    loads_glm4v,
)

DISTRIBUTION, VERSION = FOUND
RELEASE = f"{DISTRIBUTION} {VERSION}"
MODEL = "glm4v" if loads_glm4v(DISTRIBUTION, VERSION) else "qwen2"
UNPATCHED_CRASH = GRID_SAMPLER_CRASH if MODEL == "glm4v" else SET_INDEX_CRASH
NO_CUDA = "AssertionError: Torch not compiled with CUDA enabled"
#: VLMs this release's HFModelWrapper loads (AutoModelForImageTextToText, skyrl >= 0.2) for the mixed-batch cases:
#: GLM4V and a Qwen2.5-VL (its forward passes pixel_values / image_grid_thw only when the micro-batch has them).
MIXED_MODELS = ("glm4v", "qwen2.5-vl") if MODEL == "glm4v" else ()
STEPS = 2
#: Every rank: .pth patching off or on, and skyrl-train 0.3.1's missing re-export repaired test-side so that
#: its fsdp_strategy imports without the adapter (``tests/lab/stacks/skyrl_ranks.py``).
BASE_ENV = {"FSDP_COMPAT_TEST_REPAIR_MPP": "1"}


def _pth_installed() -> bool:
    try:
        files = metadata.distribution("fsdp-compat").files or []
    except metadata.PackageNotFoundError:
        return False
    return any(f.name == "fsdp_compat.pth" for f in files)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The zoo's GLM4V and Qwen2, written with ``save_pretrained`` as a user's checkpoint folder."""
    from fsdp_compat.testing.zoo import build_model

    if not _pth_installed():
        pytest.fail("fsdp-compat is not installed as a wheel with its .pth (pip install .)", pytrace=False)
    root = tmp_path_factory.mktemp("skyrl_engine_models")
    paths = {}
    for name in ("glm4v", "qwen2", *MIXED_MODELS):
        if not (root / name).exists():
            build_model(name).save_pretrained(root / name)
        paths[name] = str(root / name)
    return paths


def _rank_path() -> str:
    """The rank modules first, then the caller's PYTHONPATH (no empty entry: that would put the working
    directory, a source checkout, ahead of the installed wheel)."""
    return rank_pythonpath(STUBS)


def _run(body: str, cfg: dict[str, Any], *, world_size: int = 2, timeout_s: float = 240, **env: str) -> RunResult:
    full_env = {**BASE_ENV, "PYTHONPATH": _rank_path(), **env}
    routine = f"lab.stacks.skyrl_engine_ranks:{body}"
    result = run_ranks(routine, cfg, world_size=world_size, timeout_s=timeout_s, env=full_env)
    outcome = "ok" if result.ok else result.exception
    print(f"{RELEASE} {body} {cfg.get('model', '')} {env or ''}: {outcome} ({result.seconds:.1f}s)")
    return result


def _assert_crash(result: RunResult, text: str) -> None:
    assert not result.ok, f"expected the upstream crash ({text}), but it ran"
    assert text in (result.exception or ""), result.error


# -------------------------------------------------------------------------------------------------- loading


@pytest.mark.timeout(300)
def test_which_skyrl_model_builders_load_glm4v(saved: dict[str, str]) -> None:
    """policy/ref load GLM4V only where the release has the VLM branch; language_model_only and critic never."""
    result = _run("loading_paths", {"path": saved["glm4v"]}, world_size=1)
    result.raise_for_error()
    seen = result.ranks[0].extra
    assert seen["release"] == RELEASE
    if loads_glm4v(DISTRIBUTION, VERSION):
        assert seen["policy"] == {"loaded": "Glm4vForConditionalGeneration"}, seen
        assert seen["language_model_only"] == {"error": GLM4V_LOAD_ERROR}, seen
    else:
        assert seen["policy"] == {"error": GLM4V_LOAD_ERROR}, seen
    assert seen["critic"] == {"error": GLM4V_CRITIC_ERROR}, seen
    # doctor states the same fact for the installed release (its one home is fsdp_compat.known_limits)
    from fsdp_compat.doctor import report

    doctor_line = "the policy and ref models load it" if "loaded" in seen["policy"] else "this release cannot load it"
    assert f"GLM4V: {doctor_line}" in report()


# ---------------------------------------------------------------------------- _fsdp_init_model reproduction


def _train_cfg(saved: dict[str, str]) -> dict[str, Any]:
    return {"path": saved[MODEL], "model": MODEL, "seed": 0, "steps": STEPS}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fsdp_init_model_unpatched_crashes(saved: dict[str, str]) -> None:
    """FSDP_COMPAT=off: SkyRL's own wrap crashes the first step (GLM4V's grid_sampler, or the set indexing)."""
    result = _run("init_and_train", _train_cfg(saved), FSDP_COMPAT="off")
    _assert_crash(result, UNPATCHED_CRASH)
    for rank in result.failing_ranks:
        assert rank.extra["strategy_apply_fsdp2_patched"] is False, rank.extra


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fsdp_init_model_trains_with_exact_parity(saved: dict[str, str]) -> None:
    """Patched by the .pth hook, each rank its own micro-batch: gradients after each backward and parameters after
    each AdamW step equal an unsharded single-process HFModelWrapper of the same checkpoint trained on both ranks'
    micro-batches with the mean loss, asserted ``== 0.0``; each rank's loss is the reference's loss of its own
    micro-batch, every step, and the loss moves."""
    result = _run("init_and_train", _train_cfg(saved))
    result.raise_for_error()
    assert result.max_abs_grad_diff == 0.0 and result.max_abs_param_diff == 0.0, (
        result.max_abs_grad_diff,
        result.max_abs_param_diff,
    )
    losses = [rank.losses for rank in result.ranks]
    for rank in result.ranks:
        assert rank.losses == rank.extra["reference_losses"], (rank.rank, rank.losses, rank.extra["reference_losses"])
    assert losses[0] != losses[1], losses  # different data on every rank
    assert len(losses[0]) == STEPS and losses[0][0] != losses[0][-1], losses
    assert [rank.extra["meta_init"] for rank in result.ranks] == [False, True]  # SkyRL's meta init on rank 1
    assert result.ranks[0].extra["fsdp_groups"] == result.ranks[1].extra["fsdp_groups"]  # same plan on meta
    for rank in result.ranks:
        extra = rank.extra
        assert extra["release"] == RELEASE and extra["adapter_imported_before_skyrl"] is False, extra
        assert extra["strategy_apply_fsdp2_patched"] and extra["probe"]["activated_by"] == "pth-hook", extra
        assert extra["max_param_update"] > 0.0, extra
        assert "" in extra["fsdp_groups"], extra
        assert "model.visual.embeddings.position_embedding" not in extra["fsdp_groups"], extra
    print(f"{RELEASE} {MODEL} losses {losses[0]} Δgrad=0.0 Δparam=0.0 ({result.seconds:.1f}s)")


# --------------------------------------------------------------- mixed micro-batches: images on one rank only

def _image_text_crashes_then_trains_exactly(cfg: dict[str, Any]) -> None:
    """Rank 0 images, rank 1 text only, through ``init_and_train``: with the alignment off gloo aborts; with it, rank
    1 runs one dummy tower call per forward, every forward exchanges the counts, and both ranks equal one process
    (losses, gradients and post-AdamW parameters ``== 0.0``), SkyRL's ``apply_fsdp2`` patched by the .pth hook."""
    off = _run("init_and_train", cfg, timeout_s=90, FSDP_COMPAT_MIXED_BATCHES="off")
    assert not off.ok, "expected the collective mismatch, but it ran"
    text = "\n".join((r.error or "") + str(r.extra.get("log_tail", "")) for r in off.ranks)
    assert GLOO_MISMATCH in current_wording(text), text[-3000:]
    result = _run("init_and_train", cfg)
    result.raise_for_error()
    assert result.max_abs_grad_diff == 0.0 and result.max_abs_param_diff == 0.0, (
        result.max_abs_grad_diff,
        result.ranks[0].extra.get("worst_grad_param"),
        result.max_abs_param_diff,
    )
    for rank in result.ranks:
        assert rank.losses == rank.extra["reference_losses"], (rank.rank, rank.losses, rank.extra)
        assert rank.extra["strategy_apply_fsdp2_patched"] and rank.extra["probe"]["activated_by"] == "pth-hook"
    assert [r.extra["mixed_batches"]["dummy_calls"] for r in result.ranks] == [0, STEPS], result.ranks[1].extra
    assert [r.extra["mixed_batches"]["exchanges"] for r in result.ranks] == [STEPS, STEPS]
    model = cfg["model"]
    print(f"{RELEASE} {model} image|text: off -> {GLOO_MISMATCH}; on Δgrad=0.0 Δparam=0.0 ({result.seconds:.1f}s)")


if MIXED_MODELS:

    @pytest.mark.slow
    @pytest.mark.timeout(300)
    @pytest.mark.parametrize("model", MIXED_MODELS)
    def test_fsdp_init_model_rank_without_images_crashes_then_trains_exactly(saved: dict[str, str], model: str) -> None:
        """Rank 0 an image micro-batch, rank 1 text only, through HFModelWrapper's own forward (it passes no vision
        input for a text batch, so rank 1 never calls the tower). With fsdp-compat's plan but its mixed-batch
        alignment off (``FSDP_COMPAT_MIXED_BATCHES=off``) gloo aborts; with it (installed by the SkyRL adapter's
        ``apply_fsdp2``) rank 1 runs one zero dummy tower call per forward and both ranks equal one process trained
        on both micro-batches with the mean loss: gradients and post-AdamW parameters asserted ``== 0.0``."""
        cfg = {"path": saved[model], "model": model, "seed": 0, "steps": STEPS, "variants": ["image", "text"]}
        _image_text_crashes_then_trains_exactly(cfg)


#: One family of every other tower kind whose images SkyRL's experience carries (``pixel_values``, with
#: ``image_grid_thw`` where the kind has one) and transformers 5.16.1 has (lab.stack_families), the patch grid being
#: GLM4V's and Qwen2.5-VL's above.
KIND_FAMILIES = STACKS["skyrl"] if MIXED_MODELS else {}

if KIND_FAMILIES:

    @pytest.mark.slow
    @pytest.mark.timeout(300)
    @pytest.mark.parametrize("model", [pytest.param(m, id=kind, marks=BREADTH) for kind, m in KIND_FAMILIES.items()])
    def test_every_tower_kind_rank_without_images_crashes_then_trains_exactly(
        tmp_path: Any, model: str
    ) -> None:
        """As the GLM4V case, for one family of each tower kind, loaded by HFModelWrapper from a saved checkpoint and
        sharded by SkyRL's ``apply_fsdp2`` (its own wrap rule, the family's vision blocks among the groups):
        unaligned, gloo aborts; aligned, rank 1 runs one dummy tower call per forward and both ranks are exact."""
        from fsdp_compat.testing.zoo import build_model

        path = tmp_path / "model"
        build_model(model).save_pretrained(path)
        cfg = {"path": str(path), "model": model, "seed": 0, "steps": STEPS, "variants": ["image", "text"]}
        _image_text_crashes_then_trains_exactly(cfg)


# ---------------------------------------------------------------------------------- the real FSDPStrategy

if DEVICE == "cpu" and not torch.cuda.is_available():

    @pytest.mark.timeout(300)
    def test_real_fsdp_strategy_needs_cuda(saved: dict[str, str]) -> None:
        """The blockers a CPU user meets in SkyRL's own strategy, in order, with fsdp-compat active."""
        result = _run("real_strategy", {"path": saved[MODEL], "model": MODEL, "seed": 0, "device": "cpu"}, world_size=1)
        if torch.version.cuda is not None:  # a CUDA build without a GPU (the torch 2.8 env): the mesh itself fails
            error = result.error or ""
            assert not result.ok and "ZeroDivisionError: integer modulo by zero" in (result.exception or ""), error
            assert 'init_device_mesh("cuda"' in error, error
            return
        result.raise_for_error()
        seen = result.ranks[0].extra
        assert seen["patched"] is True and seen["mesh_device_type"] == "cuda", seen
        first, second = seen["prepare_cuda_mesh"], seen["prepare_cpu_mesh"]
        # 1. setup_distributed's init_device_mesh("cuda"): the first fully_shard asks CUDA for its device.
        assert first["exception"] == NO_CUDA, first
        assert first["skyrl_frame"].endswith("fsdp_strategy.py:_fsdp_init_model"), first
        assert first["skyrl_line"].startswith("apply_fsdp2(") and "self.fsdp_config)" in first["skyrl_line"], first
        assert first["fsdp_groups"] == [], first
        # 2. given a CPU mesh, apply_fsdp2 shards the model and fsdp2_load_full_state_dict calls .cuda().
        assert second["exception"] == NO_CUDA, second
        assert "/distributed/fsdp_utils.py:" in second["skyrl_frame"] and ".cuda()" in second["skyrl_line"], second
        assert "" in second["fsdp_groups"] and len(second["fsdp_groups"]) > 1, second


if DEVICE == "cuda":

    @pytest.mark.slow
    @pytest.mark.timeout(600)
    def test_real_fsdp_strategy_prepare_on_one_gpu(saved: dict[str, str]) -> None:
        """setup_distributed, HFModelWrapper, prepare and PPO steps through SkyRL's own FSDPStrategy, crash first."""
        if not torch.cuda.is_available():
            pytest.fail("FSDP_COMPAT_TEST_DEVICE=cuda but CUDA is not available", pytrace=False)
        cfg = {"path": saved[MODEL], "model": MODEL, "seed": 0, "steps": STEPS, "device": "cuda"}
        _assert_crash(_run("real_strategy", cfg, world_size=1, FSDP_COMPAT="off"), UNPATCHED_CRASH)
        result = _run("real_strategy", cfg, world_size=1)
        result.raise_for_error()
        seen = result.ranks[0].extra
        assert seen["patched"] and seen["probe"]["activated_by"] == "pth-hook", seen
        assert "model.visual.embeddings.position_embedding" not in seen["fsdp_groups"], seen
        losses, reference = result.ranks[0].losses, seen["reference_step1_loss"]
        assert abs(losses[0] - reference) <= PARITY_TOL * max(1.0, abs(reference)), (losses, reference)
        assert len(losses) == STEPS and losses[0] != losses[-1], losses
        print(f"{RELEASE} real FSDPStrategy on CUDA: losses {losses}, unsharded step-1 loss {reference}")


# ------------------------------------------------------------------------------------------------------- Ray


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_ray_actors_crash_unpatched_then_train_patched(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two Ray actors form a gloo group and call SkyRL's apply_fsdp2 on GLM4V: with FSDP_COMPAT=off in their
    runtime_env they crash in grid_sampler; two fresh actors without it train at exact parity (.pth hook)."""
    import lab.stacks.skyrl_ranks as skyrl_ranks
    import ray

    from fsdp_compat.testing.launch import _free_port

    monkeypatch.setenv("PYTHONPATH", _rank_path())
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    monkeypatch.delenv("FSDP_COMPAT", raising=False)
    common = {"FSDP_COMPAT_TEST_REPAIR_MPP": "1", ENV_CONFIG: "explicit"}
    outcomes = {}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        for case, env in (("off", {**common, "FSDP_COMPAT": "off"}), ("patched", common)):
            actor = ray.remote(num_cpus=1, runtime_env={"env_vars": env})(skyrl_ranks.RayRank)
            ranks = [actor.remote() for _ in range(2)]
            port = _free_port()
            outcomes[case] = ray.get([a.run.remote(i, 2, port, STEPS, 120.0) for i, a in enumerate(ranks)], timeout=300)
            for a in ranks:
                ray.kill(a)
    finally:
        ray.shutdown()
    for r in outcomes["off"]:
        # torch 2.8 (skyrl-train 0.3.1's pin) words it "aten.op.default: got mixed" (with a colon)
        assert not r["ok"] and GRID_SAMPLER_CRASH in r["error"].replace(".default: got mixed", ".default got mixed"), r
        assert r["extra"]["strategy_apply_fsdp2_patched_on_import"] is False
    errors = [r["error"] for r in outcomes["patched"] if not r["ok"]]
    assert not errors, "\n".join(errors)
    assert len({r["extra"]["pid"] for r in outcomes["patched"]}) == 2
    for r in outcomes["patched"]:
        assert r["extra"]["probe"]["activated_by"] == "pth-hook", r["extra"]
        assert r["max_abs_grad_diff"] == 0.0 and r["max_abs_param_diff"] == 0.0, r
    print(f"{RELEASE} ray: off -> {GRID_SAMPLER_CRASH}; patched Δgrad=0.0 Δparam=0.0", file=sys.stderr)
