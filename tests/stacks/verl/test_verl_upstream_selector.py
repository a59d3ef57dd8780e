"""verl's own selector tests run against the adapter, and an outdated wrap list in a real verl job.

1. ``tests/utils/test_fsdp2_peft_wrapping.py`` of verl (vendored unchanged in ``_verl_upstream``; the wheels do not
   ship it) runs first against verl's own ``_select_fsdp2_wrap_targets`` (baseline: every test passes, which
   shows the file matches the installed release) and then against the adapter's replacement. Its mock models have
   no ``forward``; the static analysis then sees no raw read, so the adapter keeps verl's candidates, except one
   that the mock makes unsafe: ``MockModulesToSaveWrapper`` shares its ``weight`` Parameter with the
   ``original_module`` inside it, and verl's list holds both (``fully_shard`` would split one Parameter across two
   groups); the adapter keeps the wrapper and leaves the inner module to it. No upstream test asserts on that module,
   so the expected set of failures is empty (``EXPECTED_FAILURES``), and the differences are asserted exactly.
   (verl >= 0.7.1: earlier releases have no separate selector.)
2. ``fsdp_config.wrap_policy.transformer_layer_cls_to_wrap`` naming a class the model does not have: verl trains
   (only its other rules shard); with the adapter it trains too, with one warning, never an exception. The direct
   API still raises. Crash first: GLM4V with that list crashes unpatched (verl still shards its position table).
   The 2-rank runs go through the ``apply_fsdp2`` verl's call site binds, so they cover every release (0.4-0.7.0
   replace ``apply_fsdp2`` itself).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from lab.support import rank_pythonpath, require_framework
from packaging.version import Version

VERL = require_framework("verl", lambda: Version(metadata.version("verl")))

from fsdp_compat.testing.parity import run_training  # noqa: E402
from fsdp_compat.testing.verl_smoke import GRID_SAMPLER_CRASH  # noqa: E402

#: the selector (and so verl's tests of it) exists from 0.7.1; 0.4-0.7.0 select inside apply_fsdp2
needs_selector = pytest.mark.skipif(
    Version("0.7.1") > VERL, reason=f"verl {VERL} has no _select_fsdp2_wrap_targets (0.7.1+)"
)

HERE = Path(__file__).resolve().parent  # _verl_upstream, the vendored verl test
NO_HOOKS = {"FSDP_COMPAT_AUTOLOAD": "0", "VERL_USE_EXTERNAL_PLUGINS": "none"}
OUTDATED = "Qwen2OldDecoderLayer"  # a wrap-list entry that matches no module of the zoo models

#: upstream test -> why it fails against the adapter. Empty: every upstream test passes (see the module docstring).
EXPECTED_FAILURES: dict[str, str] = {}


def _python(code: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    full_env = {**os.environ, **NO_HOOKS, "PYTHONPATH": rank_pythonpath(HERE), **(env or {})}
    full_env.pop("VERL_USE_EXTERNAL_MODULES", None)
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=full_env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["stderr"] = proc.stderr
    return out


_UPSTREAM = """
    import json, unittest, warnings
    warnings.simplefilter("ignore")
    import verl.utils.fsdp_utils as utils
    verl_select = utils._select_fsdp2_wrap_targets
    if {patched}:
        import fsdp_compat.adapters.verl as adapter
        assert adapter.patch() and utils._select_fsdp2_wrap_targets is not verl_select
    import _verl_upstream.fsdp2_peft_wrapping as upstream   # binds the selector by name, as verl's test does
    suite = unittest.defaultTestLoader.loadTestsFromModule(upstream)
    result = unittest.TestResult()
    suite.run(result)
    failed = sorted(t.id().rsplit(".", 1)[-1] for t, _ in result.failures + result.errors)
    # the selections themselves, verl's and the one under test, on each of the upstream mock models
    cases = {{}}
    for tied in (False, True):
        for peft in (False, True):
            model = upstream.MockCausalLM(tie_word_embeddings=tied)
            if peft:
                model.model.embed_tokens = upstream.MockModulesToSaveWrapper(model.model.embed_tokens)
            names = {{id(m): n for n, m in model.named_modules()}}
            cases[f"tied={{tied}} peft={{peft}}"] = {{
                "verl": [names[id(m)] for m in verl_select(model, ["MockDecoderLayer"])],
                "tested": [names[id(m)] for m in upstream._select_fsdp2_wrap_targets(model, ["MockDecoderLayer"])],
            }}
    print(json.dumps({{"ran": result.testsRun, "failed": failed, "cases": cases}}))
"""


@needs_selector
def test_upstream_selector_tests_pass_against_verls_own_selector() -> None:
    """Baseline: the vendored file is verl's test of this release's selector (all pass unpatched)."""
    out = _python(_UPSTREAM.format(patched=False), env={"FSDP_COMPAT": "off"})
    assert out["ran"] == 5 and out["failed"] == [], out
    for case, got in out["cases"].items():
        assert got["tested"] == got["verl"], case


@needs_selector
def test_upstream_selector_tests_against_the_adapter() -> None:
    out = _python(_UPSTREAM.format(patched=True))
    print(json.dumps(out["cases"], indent=1))
    assert out["ran"] == 5
    assert set(out["failed"]) == set(EXPECTED_FAILURES), out["failed"]
    inner = "model.embed_tokens.original_module"
    for case, got in out["cases"].items():
        verl, tested = got["verl"], got["tested"]
        if case.endswith("peft=True") and "tied=False" in case:
            # verl's own list holds the wrapper and the module inside it, which share one Parameter
            assert inner in verl and tested == [n for n in verl if n != inner], (case, got)
        else:
            assert tested == verl, (case, got)  # text models keep exactly verl's groups, in verl's order


# ------------------------------------------------------------------------------------------- outdated wrap list


_OUTDATED = """
    import json, logging, warnings
    warnings.simplefilter("ignore")
    import verl.utils.fsdp_utils as utils
    from fsdp_compat.testing.zoo import build_model
    verl_select = utils._select_fsdp2_wrap_targets
    import fsdp_compat.adapters.verl as adapter
    adapter.patch()
    lines = []
    class H(logging.Handler):
        def emit(self, record):
            lines.append(record.levelname + " " + record.getMessage())
    logging.getLogger("fsdp_compat").addHandler(H())
    out = {{}}
    for zoo in ("qwen2", "glm4v"):
        names = lambda model, mods: [n for n, m in model.named_modules() if any(m is x for x in mods)]
        model = build_model(zoo)
        expected = names(model, verl_select(model, ["{outdated}"]))
        model = build_model(zoo)
        got = names(model, utils._select_fsdp2_wrap_targets(model, ["{outdated}"]))
        out[zoo] = {{"verl": expected, "adapter": got}}
    from fsdp_compat.errors import FsdpCompatError
    from fsdp_compat.plan import plan_wrap
    try:
        plan_wrap(build_model("qwen2"), ["{outdated}"])
        out["direct"] = "no error"
    except FsdpCompatError as exc:
        out["direct"] = str(exc)
    out["log"] = lines
    print(json.dumps(out))
"""


@needs_selector
def test_outdated_wrap_list_warns_and_keeps_verls_selection_minus_unsafe() -> None:
    out = _python(_OUTDATED.format(outdated=OUTDATED))
    assert out["qwen2"]["adapter"] == out["qwen2"]["verl"] == ["model.embed_tokens", "lm_head"], out["qwen2"]
    table = "model.visual.embeddings.position_embedding"
    assert table in out["glm4v"]["verl"] and table not in out["glm4v"]["adapter"], out["glm4v"]
    assert set(out["glm4v"]["adapter"]) == set(out["glm4v"]["verl"]) - {table}, out["glm4v"]
    warnings = [line for line in out["log"] if line.startswith("WARNING") and OUTDATED in line]
    assert len(warnings) == 2, out["log"]  # one per model class
    assert "Qwen2DecoderLayer" in warnings[0] and "fsdp-compat: verl: the layer classes" in warnings[0], warnings
    assert "matches a module" in out["direct"] or "match" in out["direct"], out["direct"]  # the direct API raises


def _train(model: str, env: dict[str, str]) -> Any:
    clean = {k: "" for k in ("FSDP_COMPAT", "FSDP_COMPAT_POLICY", "VERL_USE_EXTERNAL_MODULES")}
    return run_training(
        model,
        "lab.stacks.verl_ranks:verl_outdated",
        world_size=2,
        steps=2,
        timeout_s=240.0,
        env={**clean, "PYTHONPATH": rank_pythonpath(HERE), "FSDP_COMPAT_VERL_LAYERS": OUTDATED, **env},
    )


@pytest.mark.slow
def test_outdated_wrap_list_job_trains_unpatched_and_patched() -> None:
    """A text model with the outdated list: verl as released trains; with fsdp-compat (the .pth) it trains too,
    with the same groups and the warning, instead of an exception."""
    plain = _train("qwen2", NO_HOOKS)
    plain.raise_for_error()
    patched = _train("qwen2", {"VERL_USE_EXTERNAL_PLUGINS": "none"})
    patched.raise_for_error()
    assert patched.max_abs_grad_diff == 0.0 and patched.max_abs_param_diff == 0.0  # a batch per rank; NaN fails
    for a, b in zip(plain.ranks, patched.ranks, strict=True):
        assert a.extra["fsdp_groups"] == b.extra["fsdp_groups"], (a.extra["fsdp_groups"], b.extra["fsdp_groups"])
        assert b.extra["wrap"]["patched"] and not a.extra["wrap"]["patched"]
        assert any(OUTDATED in line and line.startswith("WARNING fsdp-compat:") for line in b.extra["wrap"]["log"])


@pytest.mark.slow
def test_outdated_wrap_list_glm4v_crashes_unpatched_and_trains_patched() -> None:
    crashed = _train("glm4v", NO_HOOKS)
    assert not crashed.ok and GRID_SAMPLER_CRASH in (crashed.exception or ""), crashed.error
    fixed = _train("glm4v", {"VERL_USE_EXTERNAL_PLUGINS": "none"})
    fixed.raise_for_error()
    assert fixed.max_abs_grad_diff == 0.0 and fixed.max_abs_param_diff == 0.0  # a batch per rank; NaN fails
    for rank in fixed.ranks:
        assert "model.visual.embeddings.position_embedding" not in rank.extra["fsdp_groups"]
        assert any(OUTDATED in line for line in rank.extra["wrap"]["log"])
