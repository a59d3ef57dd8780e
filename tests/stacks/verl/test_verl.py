"""The verl adapter against the real, installed verl wheel: tiny GLM4V on 2 gloo ranks through verl's own
``apply_fsdp2`` (the name bound where verl calls it), every loading path in fresh interpreters.

Collected only by the verl tox envs: a missing verl, entry point or ``.pth`` fails. Each distributed run first proves it
can fail: unpatched runs reproduce the exact upstream crash.
"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from lab.support import require_framework
from packaging.specifiers import SpecifierSet
from packaging.version import Version

VERL = require_framework("verl", lambda: Version(metadata.version("verl")))

from fsdp_compat.testing.launch import RunResult  # noqa: E402
from fsdp_compat.testing.parity import run_training  # noqa: E402
from fsdp_compat.testing.verl_smoke import FUSED_CRASH, GRID_SAMPLER_CRASH, call_site  # noqa: E402


def _missing(reason: str) -> None:
    pytest.fail(f"{reason} (tests/stacks/verl runs only where verl is installed)", pytrace=False)


SMOKE = "fsdp_compat.testing.verl_smoke"
DEVICE = os.environ.get("FSDP_COMPAT_TEST_DEVICE", "cpu")
TIMEOUT_S = 240.0
#: no automatic activation at all: .pth hooks off, verl's plugin loading off (0.9+)
NO_HOOKS = {"FSDP_COMPAT_AUTOLOAD": "0", "VERL_USE_EXTERNAL_PLUGINS": "none"}


def _since(spec: str) -> bool:
    return SpecifierSet(spec).contains(VERL, prereleases=True)


def _needs(spec: str, what: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(not _since(spec), reason=f"{what} needs verl {spec} (installed: {VERL})")


@pytest.fixture(autouse=True, scope="module")
def _device() -> None:
    if DEVICE.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            pytest.fail("FSDP_COMPAT_TEST_DEVICE=cuda but CUDA is not available", pytrace=False)


def _train(model: str, wrap: str, env: dict[str, str], steps: int = 3) -> RunResult:
    clean = {k: "" for k in ("FSDP_COMPAT", "FSDP_COMPAT_POLICY", "VERL_USE_EXTERNAL_MODULES")}
    return run_training(
        model,
        f"{SMOKE}:{wrap}",
        world_size=2,
        steps=steps,
        device=DEVICE,
        timeout_s=TIMEOUT_S,
        env={**clean, **env},
    )


def _assert_crash(result: RunResult, text: str) -> None:
    assert not result.ok, f"expected the upstream crash, but training succeeded: {result.ranks[0].extra}"
    assert text in (result.exception or ""), result.error
    for rank in result.ranks:
        state = rank.extra.get("wrap") or {}
        assert not state.get("patched"), state


def _assert_parity(result: RunResult, activated_by: str) -> list[dict[str, Any]]:
    result.raise_for_error()
    # each rank its own micro-batch against one process on both (mean loss): exact, and NaN fails
    assert result.max_abs_grad_diff == 0.0, (result.max_abs_grad_diff, result.ranks[0].extra.get("worst_grad_param"))
    assert result.max_abs_param_diff == 0.0, (result.max_abs_param_diff, result.ranks[0].extra.get("worst_param"))
    states = [rank.extra["wrap"] for rank in result.ranks]
    for state in states:
        assert state["patched"], state
        assert state["activated_by"] == activated_by, state
        assert state["call_site"] == call_site(VERL), state
        if not _since(">=0.7.1"):  # apply_fsdp2 itself is replaced: the call site must hold the replacement
            assert state["apply_fsdp2_patched"], state
    print(
        f"verl {VERL} {activated_by}: Δgrad={result.max_rel_grad_diff} Δparam={result.max_rel_param_diff} "
        f"groups={result.ranks[0].extra['fsdp_groups']} {result.seconds:.1f}s"
    )
    return states


def _site_file(name: str) -> Path | None:
    for directory in [*site.getsitepackages(), site.getusersitepackages()]:
        path = Path(directory) / name
        if path.exists():
            return path
    return None


# --------------------------------------------------------------------------------------- crash, then fixed


@pytest.mark.slow
def test_unpatched_crashes_with_grid_sampler() -> None:
    """No adapter anywhere: verl's own apply_fsdp2 gives position_embedding a group and GLM4V crashes."""
    _assert_crash(_train("glm4v", "wrap_verl", NO_HOOKS), GRID_SAMPLER_CRASH)


@pytest.mark.slow
def test_off_switch_disables_every_loading_path() -> None:
    """FSDP_COMPAT=off with every loading path asked for (.pth, entry point, env list, external_lib): crash."""
    env = {"FSDP_COMPAT": "off", "VERL_USE_EXTERNAL_MODULES": "fsdp_compat.adapters.verl"}
    _assert_crash(_train("glm4v", "wrap_external_lib", env), GRID_SAMPLER_CRASH)


@pytest.mark.slow
def test_external_lib_via_verl_import_external_libs() -> None:
    """``model.external_lib=fsdp_compat.adapters.verl``: verl's import_external_libs imports it in the worker
    after the call site bound apply_fsdp2 (so 0.4-0.7.0 needs the importer rebinding)."""
    _assert_parity(_train("glm4v", "wrap_external_lib", NO_HOOKS), "external_lib")


@pytest.mark.slow
@_needs(">=0.6.0", "VERL_USE_EXTERNAL_MODULES")
def test_verl_use_external_modules() -> None:
    env = {**NO_HOOKS, "VERL_USE_EXTERNAL_MODULES": "fsdp_compat.adapters.verl"}
    _assert_parity(_train("glm4v", "wrap_verl", env), "VERL_USE_EXTERNAL_MODULES")


@pytest.mark.slow
@_needs(">=0.9.0", "the verl.plugins entry point")
def test_entry_point_on_import_verl() -> None:
    """A plain ``import verl`` loads the entry point; nothing in the rank imports the adapter; .pth hooks off."""
    names = [ep.value for ep in metadata.entry_points(group="verl.plugins") if ep.name == "fsdp_compat"]
    if names != ["fsdp_compat.adapters.verl"]:
        _missing(f"fsdp-compat's verl.plugins entry point is not installed (found {names})")
    _assert_parity(_train("glm4v", "wrap_verl", {"FSDP_COMPAT_AUTOLOAD": "0"}), "verl.plugins entry point")


@pytest.mark.slow
def test_pth_hook() -> None:
    """The installed fsdp_compat.pth patches verl the moment fsdp_utils is imported; no verl hook involved."""
    if _site_file("fsdp_compat.pth") is None:
        _missing("fsdp_compat.pth is not in site-packages (install fsdp-compat as a wheel, not editable)")
    _assert_parity(_train("glm4v", "wrap_verl", {"VERL_USE_EXTERNAL_PLUGINS": "none"}), "pth-hook")


@pytest.mark.slow
def test_policy_env_reaches_the_adapter() -> None:
    """FSDP_COMPAT_POLICY=legacy makes the adapter reproduce verl's own rule: the crash again, while patched."""
    env = {**NO_HOOKS, "FSDP_COMPAT_POLICY": "legacy" if _since(">=0.7.1") else "legacy-skyrl"}
    result = _train("glm4v", "wrap_external_lib", {**env, "FSDP_COMPAT_GUARD": "off"})  # the guard would fix it
    assert not result.ok and GRID_SAMPLER_CRASH in (result.exception or ""), result.error


@pytest.mark.slow
def test_guard_turns_the_legacy_crash_into_parity_inside_verl() -> None:
    """The run-time guard is on in the adapter: verl's own rule (legacy) through verl's own FSDP2 code, where 0.7.1+
    calls fully_shard itself after fsdp-compat's selector, trains with exact parity instead of the crash above."""
    env = {**NO_HOOKS, "FSDP_COMPAT_POLICY": "legacy" if _since(">=0.7.1") else "legacy-skyrl"}
    result = _train("glm4v", "wrap_external_lib", env)
    _assert_parity(result, "external_lib")
    assert result.max_abs_grad_diff == 0.0 and result.max_abs_param_diff == 0.0
    logs = [rank.extra.get("log_tail", "") for rank in result.ranks]
    assert all("run-time guard: model.visual.embeddings.position_embedding.weight was read" in log for log in logs)


# ------------------------------------------------------------------------------------------ fused kernels


@pytest.mark.slow
@_needs(">=0.7.1", "an lm_head group (the fused-kernel crash)")
def test_fused_kernels_unpatched_crash() -> None:
    """verl's own fused forward (torch backend) reads lm_head.weight raw; 0.7.1+ gives lm_head a group."""
    _assert_crash(_train("qwen2", "wrap_fused", NO_HOOKS), FUSED_CRASH)


@pytest.mark.slow
@_needs(">=0.7.1", "an lm_head group (the fused-kernel crash)")
@pytest.mark.parametrize(
    "model",
    [
        "qwen2",
        pytest.param(
            "glm4v",
            marks=pytest.mark.skipif(
                Version(metadata.version("transformers")).major < 5,
                reason="verl's GLM4V fused forward passes 4-row position ids, which transformers 4.x's Glm4vModel "
                "takes only after verl's full apply_monkey_patch (not run on CPU here)",
            ),
        ),
    ],
)
def test_fused_kernels_patched(model: str) -> None:
    result = _train(model, "wrap_fused_external_lib", NO_HOOKS)
    _assert_parity(result, "external_lib")
    assert "lm_head" not in result.ranks[0].extra["fsdp_groups"]


@pytest.mark.slow
@_needs(">=0.7.1", "an lm_head group (the fused-kernel crash)")
def test_fused_lmhead_zoo_model() -> None:
    """The zoo's raw-lm_head model through verl's own apply_fsdp2: crash unpatched, parity patched."""
    _assert_crash(_train("qwen2-fused-lmhead", "wrap_verl", NO_HOOKS), FUSED_CRASH)
    _assert_parity(_train("qwen2-fused-lmhead", "wrap_external_lib", NO_HOOKS), "external_lib")


# ------------------------------------------------------------------------------- in-process adapter checks


def _python(code: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``code`` in a fresh interpreter (nothing patched yet); it prints one JSON line last."""
    full_env = {**os.environ, "FSDP_COMPAT_AUTOLOAD": "0", "VERL_USE_EXTERNAL_PLUGINS": "none", **(env or {})}
    full_env.pop("VERL_USE_EXTERNAL_MODULES", None)
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_patch_rebinds_every_importer_and_unpatch_restores_exact_originals() -> None:
    """Importers loaded before the patch are rebound now, later ones on import; unpatch puts back the very
    objects verl defined; patch is idempotent."""
    out = _python(
        """
        import importlib, json, sys, warnings
        warnings.simplefilter("ignore")
        from importlib import metadata
        from packaging.version import Version
        import verl.utils.fsdp_utils as utils
        site = "verl.workers.engine.fsdp.transformer_impl" if Version(metadata.version("verl")) >= Version(
            "0.8.0") else "verl.workers.fsdp_workers"
        importlib.import_module(site)  # the call site, loaded before the adapter
        originals = {n: getattr(utils, n, None) for n in ("apply_fsdp2", "_select_fsdp2_wrap_targets")}
        import fsdp_compat.adapters.verl as adapter  # activates: the trigger module is already loaded
        assert adapter.is_patched() and adapter.ADAPTER.activated_by == "import"
        row = adapter.release_for(Version(metadata.version("verl")))
        originals = {"utils": originals[row.name]}
        late = [n for n in row.importers if n not in sys.modules]
        failed = {}
        for name in late:
            try:
                importlib.import_module(name)
            except Exception as exc:  # reported and asserted below: an importer the test cannot load proves nothing
                failed[name] = f"{type(exc).__name__}: {exc}"
        loaded = [n for n in row.importers if n in sys.modules]
        patched = {n: getattr(sys.modules[n], row.name) for n in ["verl.utils.fsdp_utils", *loaded]}
        again = adapter.patch()
        adapter.unpatch()
        restored = getattr(utils, row.name) is originals["utils"]
        restored_importers = all(getattr(sys.modules[n], row.name) is originals["utils"] for n in loaded)
        print(json.dumps({
            "name": row.name,
            "importers": list(row.importers),
            "loaded": loaded,
            "late": [n for n in late if n in sys.modules],
            "failed": failed,
            "all_replaced": all(getattr(f, "__fsdp_compat__", False) for f in patched.values()),
            "one_object": len({id(f) for f in patched.values()}) == 1,
            "again": again,
            "restored": restored,
            "restored_importers": restored_importers,
            "unpatched": not adapter.is_patched(),
            "describe_after": adapter.ADAPTER.describe(),
        }))
        """
    )
    print(f"verl {VERL}: {out}")
    expected = "_select_fsdp2_wrap_targets" if _since(">=0.7.1") else "apply_fsdp2"
    assert out["name"] == expected
    if expected == "apply_fsdp2":
        assert call_site(VERL) in out["loaded"], out
    assert out["failed"] == {}, out  # every by-name importer of this release was loaded, then rebound
    assert sorted(out["loaded"]) == sorted(out["importers"]), out
    assert out["all_replaced"] and out["one_object"] and out["again"], out
    assert out["restored"] and out["restored_importers"] and out["unpatched"], out
    assert out["describe_after"] == []


def _fake_release(fake: str) -> dict[str, Any]:
    """The adapter's table applied as if the installed verl were release ``fake``: whether it patched, which names of
    ``verl.utils.fsdp_utils`` changed, the warnings and fsdp-compat's log lines from DEBUG up, each starting with
    its level (patch time logs what was patched at DEBUG; the INFO line waits for a replacement's first call)."""
    return _python(
        f"""
        import json, logging, warnings
        from packaging.version import Version
        import verl.utils.fsdp_utils as utils
        from fsdp_compat.activation import Adapter
        from fsdp_compat.adapters.verl import RELEASES
        lines = []
        handler = logging.Handler()
        handler.emit = lambda record: lines.append(f"{{record.levelname}} {{record.getMessage()}}")
        logging.getLogger("fsdp_compat").addHandler(handler)
        logging.getLogger("fsdp_compat").setLevel(logging.DEBUG)
        before = dict(vars(utils))
        class Fake(Adapter):
            def version_of(self, distribution):
                return Version("{fake}")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ok = Fake("verl", RELEASES).patch(activated_by="import")
        changed = [k for k, v in vars(utils).items() if before.get(k) is not v]
        print(json.dumps({{"ok": ok, "changed": changed, "warnings": [str(w.message) for w in caught], "log": lines}}))
        """,
        env={"FSDP_COMPAT": "off"},
    )


def test_an_older_version_warns_and_patches_nothing() -> None:
    out = _fake_release("0.3.1")
    assert out["ok"] is False and out["changed"] == [], out
    assert any("0.3.1 is not supported" in w and ">=0.4.0" in w for w in out["warnings"]), out


def test_a_newer_version_is_judged_by_the_recorded_fingerprint() -> None:
    """A release newer than the range (0.10.1 here) over the installed code: patched, with one DEBUG line naming the
    fingerprint verdict (the INFO line, the same text, waits for the replacement's first call) and no warning, where
    that code is what fsdp-compat recorded for the newest tested release (0.9.1); else left alone with one warning
    naming what changed (fsdp_compat.fingerprints)."""
    out = _fake_release("0.10.1")
    if out["ok"]:
        assert [line for line in out["log"] if line.startswith(("INFO ", "WARNING ", "ERROR "))] == [], out
    if Version("0.9.1") == VERL:
        assert out["ok"] is True and out["changed"] == ["_select_fsdp2_wrap_targets"], out
        assert out["warnings"] == [], out
        # the line the first call logs at INFO, logged at patch time at DEBUG: the verdict and what was patched
        patched = [line for line in out["log"] if "0.10.1 is newer than the tested" in line and ", patched (" in line]
        assert len(patched) == 1 and patched[0].startswith("DEBUG fsdp-compat: verl 0.10.1 is newer"), out
        assert "unchanged from 0.9.1 (fingerprint), patched (policy auto, activated by import): " in patched[0], out
    elif out["ok"]:  # this release's code equals 0.9.1's in everything the adapter replaces
        assert out["changed"] == ["_select_fsdp2_wrap_targets"] and out["warnings"] == [], out
        assert any(line.startswith("DEBUG ") and "unchanged from 0.9.1" in line for line in out["log"]), out
    else:
        assert out["changed"] == [], out
        assert any("may have changed since 0.9.1" in w and "nothing was patched" in w for w in out["warnings"]), out


@_needs(">=0.7.1", "the _select_fsdp2_wrap_targets selector")
def test_selector_semantics() -> None:
    """legacy reproduces verl's own selection exactly; auto drops GLM4V's raw-read table and keeps a fused
    model's lm_head out of its own group (0.9.1 marker, use_fused_kernels keyword); set/str wrap lists work."""
    out = _python(
        """
        import json, warnings
        warnings.simplefilter("ignore")
        import verl.utils.fsdp_utils as utils
        from fsdp_compat.adapters.verl import make_select_fsdp2_wrap_targets
        from fsdp_compat.policies import Auto, Legacy
        from fsdp_compat.testing.zoo import build_model
        original = utils._select_fsdp2_wrap_targets
        def names(model, mods):
            ids = {id(m) for m in mods}
            return sorted(n for n, m in model.named_modules() if id(m) in ids)
        out = {}
        for zoo in ["glm4v", "qwen2", "glm4v-tied"]:
            model = build_model(zoo)
            layers = list(model._no_split_modules)
            legacy = make_select_fsdp2_wrap_targets(original, Legacy())(model, set(layers))
            auto = make_select_fsdp2_wrap_targets(original, Auto())
            out[zoo] = {
                "verl": names(model, original(model, layers)),
                "legacy": names(model, legacy),
                "auto": names(model, auto(model, layers)),
                "auto_fused_kw": names(model, auto(model, layers, use_fused_kernels=True)),
            }
            model._verl_fused_kernels_backend = "torch"
            out[zoo]["auto_marked"] = names(model, auto(model, layers[0]))
        print(json.dumps(out))
        """,
        env={"FSDP_COMPAT": "off"},  # importing the adapter must not patch: `original` is verl's own
    )
    for zoo, got in out.items():
        assert got["legacy"] == got["verl"], (zoo, got)
        assert "lm_head" not in got["auto_fused_kw"] and "lm_head" not in got["auto_marked"], (zoo, got)
    assert "model.visual.embeddings.position_embedding" in out["glm4v"]["verl"]
    assert not any("position_embedding" in n for n in out["glm4v"]["auto"]), out["glm4v"]
    assert "lm_head" in out["qwen2"]["auto"], "an lm_head used only through its forward stays sharded"
    assert out["qwen2"]["auto"] == out["qwen2"]["verl"], "text models see no change"


@_needs(">=0.7.1", "the _select_fsdp2_wrap_targets selector")
def test_selector_keeps_by_name_peft_wrappers_where_safe() -> None:
    """peft's ModulesToSaveWrapper is no nn.Embedding: verl matches it by leaf name. The replacement keeps the
    lm_head wrapper as a group (only its own forward reads it), drops it when fused kernels read it raw, and
    returns children before parents (verl's own list puts the embed_tokens wrapper before its children)."""
    import peft  # noqa: F401  (the verl envs install it)
    out = _python(
        """
        import json, warnings
        warnings.simplefilter("ignore")
        import verl.utils.fsdp_utils as utils
        from peft import LoraConfig, get_peft_model
        from fsdp_compat.adapters.verl import make_select_fsdp2_wrap_targets
        from fsdp_compat.policies import Auto
        from fsdp_compat.testing.zoo import build_model
        model = get_peft_model(build_model("qwen2"), LoraConfig(
            r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["embed_tokens", "lm_head"]))
        paths = {id(m): p for p, m in model.named_modules()}
        select = make_select_fsdp2_wrap_targets(utils._select_fsdp2_wrap_targets, Auto())
        print(json.dumps({
            "verl": [paths[id(m)] for m in utils._select_fsdp2_wrap_targets(model, ["Qwen2DecoderLayer"])],
            "auto": [paths[id(m)] for m in select(model, ["Qwen2DecoderLayer"])],
            "fused": [paths[id(m)] for m in select(model, ["Qwen2DecoderLayer"], use_fused_kernels=True)],
        }))
        """,
        env={"FSDP_COMPAT": "off"},
    )
    head = "base_model.model.lm_head"
    assert head in out["verl"] and head in out["auto"] and head not in out["fused"], out
    for order in (out["auto"], out["fused"]):
        for i, path in enumerate(order):
            assert not any(later.startswith(path + ".") for later in order[i + 1 :]), ("parent first", order)
