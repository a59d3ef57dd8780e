"""SkyRL, real wheels: GLM4V through ``fsdp_strategy.apply_fsdp2`` on 2 gloo ranks, unpatched and patched.

Needs an installed ``skyrl`` or ``skyrl-train`` (tox envs ``skyrl040``, ``skyrltrain031``, label ``skyrl-all``) and
fsdp-compat installed as a wheel (its ``.pth``); collected only by those envs, so a missing piece fails.

Rank code lives in ``tests/lab/stacks/skyrl_ranks.py`` and imports no fsdp_compat adapter; ``tests/lab/stubs`` holds a
test-only ``flash_attn.bert_padding`` stand-in (flash-attn needs CUDA; SkyRL imports it at module level).
``FSDP_COMPAT_TEST_DEVICE=cuda`` runs the distributed cases on CUDA/NCCL (one rank per GPU, at most 2).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from importlib import metadata
from typing import Any

import pytest
from lab.support import STUBS, rank_pythonpath, require_framework

from fsdp_compat.testing.launch import RunResult
from fsdp_compat.testing.parity import run_training
from fsdp_compat.testing.skyrl_smoke import (
    ENV_CONFIG,
    GRID_SAMPLER_CRASH,
    SET_INDEX_CRASH,
    SET_INDEX_RELEASES,
    installed_skyrl,
)

RANK_PATH = rank_pythonpath(STUBS)
DISTRIBUTION, VERSION = require_framework("skyrl or skyrl-train", installed_skyrl)
RELEASE = f"{DISTRIBUTION} {VERSION}"
PACKAGE = {"skyrl": "skyrl.backends.skyrl_train.distributed", "skyrl-train": "skyrl_train.distributed"}[DISTRIBUTION]
DEVICE = os.environ.get("FSDP_COMPAT_TEST_DEVICE", "cpu")
STEPS = 3


def _missing(reason: str) -> None:
    pytest.fail(f"{reason} (tests/stacks/skyrl runs only where SkyRL is installed)", pytrace=False)


def _world_size() -> int:
    if DEVICE == "cpu":
        return 2
    import torch

    if not torch.cuda.is_available():
        pytest.fail(f"FSDP_COMPAT_TEST_DEVICE={DEVICE} but CUDA is not available", pytrace=False)
    return min(2, torch.cuda.device_count())


def _pth_installed() -> bool:
    try:
        files = metadata.distribution("fsdp-compat").files or []
    except metadata.PackageNotFoundError:
        return False
    return any(f.name == "fsdp_compat.pth" for f in files)


def _need_pth() -> None:
    if not _pth_installed():
        _missing("fsdp-compat is not installed as a wheel with its .pth (pip install .)")


def _run(wrap: str, **env: str) -> RunResult:
    result = run_training(
        "glm4v",
        f"lab.stacks.skyrl_ranks:{wrap}",
        world_size=_world_size(),
        steps=STEPS,
        device=DEVICE,
        timeout_s=240,
        env={"PYTHONPATH": RANK_PATH, **env},
        probe="lab.stacks.skyrl_ranks:probe",
    )
    figures = f"Δgrad={result.max_rel_grad_diff} Δparam={result.max_rel_param_diff}" if result.ok else ""
    print(f"{RELEASE} {wrap} {env}: ok={result.ok} {figures} {result.exception or ''} ({result.seconds:.1f}s)")
    return result


def _assert_crash(result: RunResult, text: str) -> None:
    assert not result.ok, f"expected the upstream crash ({text}), but training succeeded"
    # torch 2.8 (skyrl-train 0.3.1's pin) words DTensor's error "aten.op.default: got mixed ..." (FACTS.md 12)
    assert text in (result.exception or "").replace(".default: got mixed", ".default got mixed"), result.error


def _assert_parity(result: RunResult, *, activated_by: str) -> list[dict[str, Any]]:
    result.raise_for_error()
    assert result.max_abs_grad_diff == 0.0 and result.max_abs_param_diff == 0.0, (
        result.max_abs_grad_diff,
        result.max_abs_param_diff,
    )
    infos = []
    for rank in result.ranks:
        info, probe = rank.extra["wrap"], rank.extra["probe"]
        assert info["release"] == RELEASE
        assert info["strategy_apply_fsdp2_patched"] and info["utils_apply_fsdp2_patched"], info
        assert probe["patched"] and probe["activated_by"] == activated_by, probe
        groups = rank.extra["fsdp_groups"]
        assert "model.visual.embeddings.position_embedding" not in groups, groups
        assert "" in groups and "model.language_model.layers.0" in groups, groups
        assert len(rank.losses) == STEPS
        infos.append(info)
    return infos


# ------------------------------------------------------------------------------------------------- unpatched


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fsdp_compat_off_default_config_crashes() -> None:
    """SkyRL's shipped config (no wrap policy): the set-indexing TypeError where the release has it, else GLM4V's."""
    result = _run("wrap_strategy", FSDP_COMPAT="off", FSDP_COMPAT_TEST_REPAIR_MPP="1", **{ENV_CONFIG: "default"})
    expected = SET_INDEX_CRASH if VERSION in SET_INDEX_RELEASES[DISTRIBUTION] else GRID_SAMPLER_CRASH
    _assert_crash(result, expected)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fsdp_compat_off_explicit_wrap_policy_crashes_in_grid_sampler() -> None:
    result = _run("wrap_strategy", FSDP_COMPAT="off", FSDP_COMPAT_TEST_REPAIR_MPP="1", **{ENV_CONFIG: "explicit"})
    _assert_crash(result, GRID_SAMPLER_CRASH)


# --------------------------------------------------------------------------------------------------- patched


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pth_hook_trains_with_exact_parity() -> None:
    """No fsdp_compat adapter import anywhere in rank code: the installed .pth patches SkyRL on import."""
    _need_pth()
    result = _run("wrap_strategy", **{ENV_CONFIG: "default"})
    for info in _assert_parity(result, activated_by="pth-hook"):
        assert info["adapter_imported_before_skyrl"] is False


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_guard_turns_skyrls_own_rule_into_parity() -> None:
    """FSDP_COMPAT_POLICY=legacy-skyrl: the patched apply_fsdp2 applies SkyRL's own rule (the position table gets a
    group). With FSDP_COMPAT_GUARD=off that is the grid_sampler crash; with the run-time guard (on by default)
    the same groups train with exact parity."""
    _need_pth()
    env = {ENV_CONFIG: "explicit", "FSDP_COMPAT_POLICY": "legacy-skyrl"}
    _assert_crash(_run("wrap_strategy", FSDP_COMPAT_GUARD="off", **env), GRID_SAMPLER_CRASH)
    result = _run("wrap_strategy", **env)
    result.raise_for_error()
    assert result.max_abs_grad_diff == 0.0 and result.max_abs_param_diff == 0.0
    for rank in result.ranks:
        assert "model.visual.embeddings.position_embedding" in rank.extra["fsdp_groups"], rank.extra["fsdp_groups"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pth_hook_honours_the_configured_wrap_policy() -> None:
    """``wrap_policy.transformer_layer_cls_to_wrap`` naming only the text layer: no vision block gets a group."""
    _need_pth()
    case = "dictconfig-text-only" if DISTRIBUTION == "skyrl" else "text-only"
    result = _run("wrap_strategy", **{ENV_CONFIG: case})
    infos = _assert_parity(result, activated_by="pth-hook")
    assert infos[0]["config"] == "DictConfig"
    for rank in result.ranks:
        assert not any(g.startswith("model.visual.blocks") for g in rank.extra["fsdp_groups"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_explicit_import_before_skyrl_trains_with_exact_parity() -> None:
    result = _run("wrap_explicit", FSDP_COMPAT_AUTOLOAD="0", **{ENV_CONFIG: "explicit"})
    for info in _assert_parity(result, activated_by="import"):
        assert info["adapter_imported_before_skyrl"] is True


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_explicit_import_after_fsdp_strategy_rebinds_it() -> None:
    """fsdp_strategy bound the original by name first; importing the adapter afterwards must still reach it."""
    result = _run(
        "wrap_explicit_late", FSDP_COMPAT_AUTOLOAD="0", FSDP_COMPAT_TEST_REPAIR_MPP="1", **{ENV_CONFIG: "default"}
    )
    for info in _assert_parity(result, activated_by="import"):
        assert info["strategy_patched_before_adapter_import"] is False


# ------------------------------------------------------------------------------------------ patch / unpatch


def _python(code: str, **env: str) -> dict[str, Any]:
    """Run ``code`` in a fresh interpreter of this environment; it prints one JSON line last."""
    full_env = {**os.environ, "PYTHONPATH": RANK_PATH, **env}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


_UNPATCH_SCRIPT = """
    import importlib, json
    import lab.stacks.skyrl_ranks as skyrl_ranks  # interpreter workarounds only
    P = {package!r}
    order = {order!r}
    utils = importlib.import_module(P + ".fsdp_utils")
    original = utils.apply_fsdp2
    out = {{"original_is_upstream": not hasattr(original, "__fsdp_compat__")}}
    if order == "strategy-first":
        if not hasattr(utils, "MixedPrecisionPolicy"):  # skyrl-train 0.3.1, no adapter yet (test-side repair)
            from torch.distributed.fsdp import MixedPrecisionPolicy
            utils.MixedPrecisionPolicy = MixedPrecisionPolicy
        strategy = importlib.import_module(P + ".fsdp_strategy")
    import fsdp_compat.adapters.skyrl as adapter
    adapter.patch()
    if order == "adapter-first":
        strategy = importlib.import_module(P + ".fsdp_strategy")
    out["patched_utils"] = utils.apply_fsdp2 is not original and utils.apply_fsdp2.__wrapped__ is original
    out["patched_strategy"] = strategy.apply_fsdp2 is utils.apply_fsdp2
    out["describe"] = adapter.ADAPTER.describe()
    adapter.unpatch()
    out["restored_utils"] = utils.apply_fsdp2 is original
    out["restored_strategy"] = strategy.apply_fsdp2 is original
    out["is_patched_after"] = adapter.is_patched()
    adapter.patch()
    out["repatched_strategy"] = getattr(strategy.apply_fsdp2, "__fsdp_compat__", False)
    adapter.unpatch()
    out["restored_again"] = utils.apply_fsdp2 is original and strategy.apply_fsdp2 is original
    print(json.dumps(out))
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("order", ["strategy-first", "adapter-first"])
def test_unpatch_restores_the_originals_in_both_modules(order: str) -> None:
    out = _python(_UNPATCH_SCRIPT.format(package=PACKAGE, order=order), FSDP_COMPAT_AUTOLOAD="0")
    assert out["original_is_upstream"], out
    assert out["patched_utils"] and out["patched_strategy"], out
    assert out["restored_utils"] and out["restored_strategy"] and not out["is_patched_after"], out
    assert out["repatched_strategy"] and out["restored_again"], out


@pytest.mark.timeout(300)
def test_fsdp_compat_off_leaves_skyrl_untouched() -> None:
    _need_pth()
    code = f"""
        import importlib, json, sys
        import lab.stacks.skyrl_ranks as skyrl_ranks
        utils = importlib.import_module({PACKAGE!r} + ".fsdp_utils")
        print(json.dumps({{"patched": hasattr(utils.apply_fsdp2, "__fsdp_compat__"),
                           "adapter_loaded": "fsdp_compat.adapters.skyrl" in sys.modules}}))
    """
    assert _python(code, FSDP_COMPAT="off") == {"patched": False, "adapter_loaded": False}
    assert _python(code) == {"patched": True, "adapter_loaded": True}


# ------------------------------------------------------------------------------------------------------- Ray


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_ray_actors_are_patched_by_the_pth_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two Ray actors form the gloo group and call SkyRL's apply_fsdp2; no fsdp_compat import in actor code."""
    _need_pth()
    import lab.stacks.skyrl_ranks as skyrl_ranks
    import ray

    # No empty entry: "" would put the working directory (a source checkout) ahead of the installed wheel.
    monkeypatch.setenv("PYTHONPATH", RANK_PATH)
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    monkeypatch.delenv("FSDP_COMPAT", raising=False)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        actor = ray.remote(num_cpus=1)(skyrl_ranks.RayRank)
        ranks = [actor.remote() for _ in range(2)]
        port = _free_port()
        results = ray.get([a.run.remote(i, 2, port, STEPS, 240.0) for i, a in enumerate(ranks)], timeout=360)
    finally:
        ray.shutdown()
    errors = [r["error"] for r in results if not r["ok"]]
    assert not errors, "\n".join(errors)
    assert len({r["extra"]["pid"] for r in results}) == 2
    for r in results:
        extra = r["extra"]
        assert extra["adapter_imported_before_skyrl"] is False
        assert extra["strategy_apply_fsdp2_patched_on_import"] is True
        assert extra["probe"]["patched"] and extra["probe"]["activated_by"] == "pth-hook"
        assert r["max_abs_grad_diff"] == 0.0 and r["max_abs_param_diff"] == 0.0
    print(
        f"{RELEASE} ray: Δgrad={max(r['max_rel_grad_diff'] for r in results)} "
        f"Δparam={max(r['max_rel_param_diff'] for r in results)}"
    )


# ----------------------------------------------------------------------------------------------------- smoke


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_smoke_table_passes() -> None:
    """``fsdp-compat smoke --framework skyrl`` in miniature: every row as expected (ranks via the test module)."""
    _need_pth()
    from fsdp_compat.testing.skyrl_smoke import run
    from fsdp_compat.testing.smoke import format_smoke_table

    rows = run(
        world_size=_world_size(),
        steps=STEPS,
        device=DEVICE,
        rank_module="lab.stacks.skyrl_ranks",
        env={"PYTHONPATH": RANK_PATH, "FSDP_COMPAT_TEST_REPAIR_MPP": "1"},
    )
    table = format_smoke_table(rows)
    print(table)
    assert rows and all(r.passed for r in rows), table
