"""skyrl-train and skyrl installed side by side (an upgraded environment): both get patched, each logged.

Needs both distributions (tox env ``skyrlboth``: skyrl-train 0.3.1 and skyrl 0.4.0, ``--no-deps``). Each
distribution is its own transaction, activated when its ``fsdp_utils`` is imported, whatever was imported first
and whether the adapter came before or after. Crash first: with ``FSDP_COMPAT=off`` tiny GLM4V crashes with the
grid_sampler error through either distribution's ``fsdp_strategy.apply_fsdp2``. Also here: SkyRL with an outdated
``wrap_policy.transformer_layer_cls_to_wrap`` trains (SkyRL does too, sharding only embeddings) with one warning.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from importlib import metadata
from typing import Any

import pytest
from lab.support import STUBS, rank_pythonpath, require_framework

VERSIONS = require_framework(
    "skyrl-train and skyrl side by side",
    lambda: {d: metadata.version(d) for d in ("skyrl-train", "skyrl")},  # PackageNotFoundError: one is missing
)

from fsdp_compat.testing.launch import RunResult  # noqa: E402
from fsdp_compat.testing.parity import run_training  # noqa: E402
from fsdp_compat.testing.skyrl_smoke import GRID_SAMPLER_CRASH  # noqa: E402

#: this folder (the rank module) and the SkyRL tests' flash_attn stand-in
RANK_PATH = rank_pythonpath(STUBS)
#: test-side oracle, written independently of the adapter's registry on purpose (FACTS.md section 5)
UTILS = {
    "skyrl-train": "skyrl_train.distributed.fsdp_utils",
    "skyrl": "skyrl.backends.skyrl_train.distributed.fsdp_utils",
}


#: GLM4V's layer classes named in the config, as in SkyRL's GLM4V recipes (skyrl-train < 0.4 crash earlier on
#: transformers 5's set-valued _no_split_modules without it: "'set' object is not subscriptable")
LAYERS = "Glm4vTextDecoderLayer,Glm4vVisionBlock"


def _run(**env: str) -> RunResult:
    env = {"FSDP_COMPAT_TEST_LAYERS": LAYERS, **env}
    result = run_training(
        "glm4v",
        "lab.stacks.skyrl_side_by_side_ranks:skyrl_side_by_side",
        world_size=2,
        steps=2,
        timeout_s=240,
        env={"PYTHONPATH": RANK_PATH, **env},
    )
    print(f"{env}: ok={result.ok} {result.exception or ''} ({result.seconds:.1f}s)")
    return result


# ----------------------------------------------------------------------------------------- trained on 2 ranks


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("via", ["skyrl-train", "skyrl"])
def test_unpatched_crashes_through_either_distribution(via: str) -> None:
    result = _run(FSDP_COMPAT="off", FSDP_COMPAT_TEST_VIA=via, FSDP_COMPAT_TEST_IMPORT_ORDER="skyrl-train,skyrl")
    assert not result.ok and GRID_SAMPLER_CRASH in (result.exception or ""), result.error


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("order", "via"), [("skyrl-train,skyrl", "skyrl"), ("skyrl,skyrl-train", "skyrl-train")])
def test_pth_hook_patches_both_and_the_second_one_trains(order: str, via: str) -> None:
    """The distribution imported second (the one left unpatched before) trains through its own fsdp_strategy."""
    result = _run(FSDP_COMPAT_TEST_VIA=via, FSDP_COMPAT_TEST_IMPORT_ORDER=order)
    result.raise_for_error()
    assert result.max_abs_grad_diff == 0.0 and result.max_abs_param_diff == 0.0
    for rank in result.ranks:
        info = rank.extra["wrap"]
        assert info["strategy_replaced"] == {"skyrl-train": True, "skyrl": True}, info
        assert set(info["patched"]) == {"skyrl-train", "skyrl"}, info
        assert {p["activated_by"] for p in info["patched"].values()} == {"pth-hook"}, info
        assert "model.visual.embeddings.position_embedding" not in rank.extra["fsdp_groups"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_outdated_wrap_list_trains_with_a_warning() -> None:
    """SkyRL with a wrap list naming no class of the model: the upstream rule (embeddings) minus the unsafe table."""
    env = {"FSDP_COMPAT_TEST_VIA": "skyrl", "FSDP_COMPAT_TEST_LAYERS": "Glm4vOldDecoderLayer"}
    crashed = _run(FSDP_COMPAT="off", **env)
    assert not crashed.ok and GRID_SAMPLER_CRASH in (crashed.exception or ""), crashed.error
    fixed = _run(**env)
    fixed.raise_for_error()
    assert fixed.max_abs_grad_diff == 0.0 and fixed.max_abs_param_diff == 0.0
    for rank in fixed.ranks:
        groups = rank.extra["fsdp_groups"]
        assert "model.visual.embeddings.position_embedding" not in groups
        assert not any(".layers." in g for g in groups), groups  # no layer class matched, as upstream
        warned = [line for line in rank.extra["wrap"]["log"] if "Glm4vOldDecoderLayer" in line]
        assert len(warned) == 1 and warned[0].startswith("WARNING fsdp-compat: SkyRL:"), rank.extra["wrap"]["log"]
        assert "Glm4vTextDecoderLayer" in warned[0]


# ---------------------------------------------------------------------------- import orders, no training


_ORDER = """
    import importlib, json, logging, sys
    import lab.stacks.skyrl_side_by_side_ranks as ranks          # interpreter workarounds only; imports no adapter
    lines = []
    class H(logging.Handler):
        def emit(self, record):
            lines.append(f"{{record.levelname}} {{record.getMessage()}}")
    logging.getLogger("fsdp_compat").addHandler(H())
    logging.getLogger("fsdp_compat").setLevel(logging.DEBUG)  # patch time logs what was patched at DEBUG
    UTILS = {utils!r}
    originals, late = {{}}, []
    for item in {order!r}:
        if item == "adapter":
            importlib.import_module("fsdp_compat.adapters.skyrl")
            continue
        utils = importlib.import_module(UTILS[item])
        originals.setdefault(item, getattr(utils.apply_fsdp2, "__wrapped__", utils.apply_fsdp2))
        if item == "skyrl-train" and "fsdp_compat.adapters.skyrl" not in sys.modules:
            late.append(item)  # 0.3.1's fsdp_strategy imports only once the adapter's repair ran
        else:
            importlib.import_module(UTILS[item].rsplit(".", 1)[0] + ".fsdp_strategy")
    for item in late:
        importlib.import_module(UTILS[item].rsplit(".", 1)[0] + ".fsdp_strategy")
    adapter = sys.modules["fsdp_compat.adapters.skyrl"].ADAPTER
    out = {{"patched": sorted(adapter.patched()), "log": [l for l in lines if "patched skyrl" in l]}}
    for dist, name in UTILS.items():
        utils = sys.modules[name]
        strategy = sys.modules[name.rsplit(".", 1)[0] + ".fsdp_strategy"]
        out[dist] = {{"utils": getattr(utils.apply_fsdp2, "__fsdp_compat__", False),
                      "strategy": strategy.apply_fsdp2 is utils.apply_fsdp2}}
    adapter.unpatch()
    out["restored"] = all(sys.modules[UTILS[d]].apply_fsdp2 is originals[d] for d in UTILS)
    out["restored_strategy"] = all(
        sys.modules[UTILS[d].rsplit(".", 1)[0] + ".fsdp_strategy"].apply_fsdp2 is originals[d] for d in UTILS)
    out["mpp_removed"] = not hasattr(sys.modules[UTILS["skyrl-train"]], "MixedPrecisionPolicy")
    print(json.dumps(out))
"""


def _python(code: str, **env: str) -> dict[str, Any]:
    full_env = {**os.environ, "PYTHONPATH": RANK_PATH, **env}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=full_env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "order",
    [
        ("adapter", "skyrl-train", "skyrl"),
        ("adapter", "skyrl", "skyrl-train"),
        ("skyrl-train", "adapter", "skyrl"),
        ("skyrl", "adapter", "skyrl-train"),
        ("skyrl-train", "skyrl", "adapter"),
    ],
    ids="-".join,
)
def test_both_patched_in_every_import_order(order: tuple[str, ...]) -> None:
    """Explicit import of the adapter (``.pth`` off), before, between or after the two distributions' modules (a
    ``fsdp_strategy`` loaded before the adapter is rebound). skyrl-train 0.3.1's ``fsdp_strategy`` imports only once
    the re-export repair ran in its transaction, so it is imported after the adapter when the adapter comes later."""
    out = _python(_ORDER.format(utils=UTILS, order=list(order)), FSDP_COMPAT_AUTOLOAD="0")
    assert out["patched"] == ["skyrl", "skyrl-train"], out
    for dist in UTILS:
        assert out[dist] == {"utils": True, "strategy": True}, (dist, out)
    # each distribution's own line, at DEBUG: nothing was called, so no INFO line yet (once one is, the process logs
    # one INFO line at most, fsdp_compat.log.announce_once)
    logged = sorted(line.split(" (policy ")[0] for line in out["log"])
    assert logged == [f"DEBUG fsdp-compat: patched {d} {VERSIONS[d]}" for d in ("skyrl", "skyrl-train")], out
    assert all(line.endswith(" (logged at INFO when first used)") for line in out["log"]), out
    assert out["restored"] and out["restored_strategy"] and out["mpp_removed"], out
