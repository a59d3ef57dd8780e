"""What a job's log says about fsdp-compat: nothing where nothing of it is used, at most one INFO line per process
where something is (``fsdp_compat.log.announce_once``), and a bad run-time switch refused alike on every path that
installs the run-time layer (docs/activation.md, "Switches" and "Log lines").

The subprocesses run the interpreter of this environment with fsdp-compat's ``.pth`` start-up hook active, as a job
would (``lab.fakes._run``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

import lab.fakes as fakes
import pytest
from lab.fakes import _run

from fsdp_compat import log
from fsdp_compat.errors import FsdpCompatError
from fsdp_compat.policies import Legacy
from fsdp_compat.testing import build_model

_clean_env = fakes._clean_env

NEVER_SHARDS = """
    import sys
    import fsdp_compat._autoload as autoload
    assert autoload.is_installed(), "the .pth start-up hook is not active"
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM
    from torch.distributed.fsdp import fully_shard  # FSDP2's code imported, never called
    config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=64)
    model = LlamaForCausalLM(config)
    model(input_ids=torch.tensor([[1, 2, 3]])).logits.sum().backward()
    import fsdp_compat.adapters.fsdp2 as generic
    patched = {"torch": generic.is_patched()}
    if "accelerate.utils.fsdp_utils" in sys.modules:
        import fsdp_compat.adapters.accelerate as accelerate
        patched["accelerate"] = accelerate.is_patched()
    print("PATCHED", patched)
"""


def test_a_job_that_imports_transformers_and_never_shards_prints_nothing() -> None:
    """transformers' modeling code imports torch's FSDP2 state module (and accelerate's FSDP utilities where
    accelerate is installed), so the start-up hook patches them; nothing of it is used, so nothing is printed."""
    done = _run(NEVER_SHARDS)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "PATCHED {'torch': True" in done.stdout, done.stdout  # patched, yet silent
    assert "'accelerate': False" not in done.stdout, done.stdout
    assert "fsdp-compat" not in done.stderr and "fsdp-compat" not in done.stdout, done.stdout + done.stderr


def test_announce_once_is_one_info_line_per_process(caplog: Any) -> None:
    log.reset_announcement()
    try:
        with caplog.at_level(logging.DEBUG, logger="fsdp_compat"):
            assert log.announced() is None
            assert log.announce_once("generic layer on %s: the run-time guard", "Root") is True
            assert log.announce_once("patched %s", "something else") is False
            assert log.announce_once("generic layer on %s: the run-time guard", "Root") is False
        assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
            (logging.INFO, "fsdp-compat: generic layer on Root: the run-time guard"),
            (logging.DEBUG, "fsdp-compat: patched something else"),
            (logging.DEBUG, "fsdp-compat: generic layer on Root: the run-time guard"),
        ]
        assert log.announced() == "generic layer on Root: the run-time guard"
    finally:
        log.reset_announcement()


def test_announce_once_prints_one_line_on_stderr_and_nothing_when_quiet() -> None:
    code = """
        from fsdp_compat.log import announce_once
        results = [announce_once("first %d", 1), announce_once("second")]
        print(results)
    """
    done = _run(code)
    assert done.returncode == 0 and done.stdout.strip() == "[True, False]", done.stderr
    assert [line for line in done.stderr.splitlines() if "fsdp-compat" in line] == [
        f"fsdp-compat: first 1 [INFO, pid {_pid(done.stderr)}]"
    ], done.stderr
    quiet = _run(code, env={"FSDP_COMPAT_LOG": "quiet"})
    assert quiet.returncode == 0 and quiet.stdout.strip() == "[True, False]" and quiet.stderr == "", quiet.stderr


def _pid(stderr: str) -> str:
    found = re.search(r"pid (\d+)\]", stderr)
    return found.group(1) if found else "?"


# ------------------------------------------------------------------------------- a bad switch, every path


def _direct(model: Any) -> None:
    import fsdp_compat

    fsdp_compat.apply_fsdp2(model, {})


def _accelerate(model: Any) -> None:
    """accelerate's (and axolotl's) replacement around a prepare step that leaves the model as it is."""
    from fsdp_compat.adapters.accelerate import make_fsdp2_prepare_model

    make_fsdp2_prepare_model(lambda accelerator, model: model, Legacy())(None, model)


def _verl(model: Any) -> None:
    """verl's selector replacement (0.7.1+), which installs the run-time layer before verl's own fully_shard."""
    from fsdp_compat.adapters.verl import make_select_fsdp2_wrap_targets

    make_select_fsdp2_wrap_targets(lambda model, names: [], Legacy())(model, list(model._no_split_modules))


PATHS: dict[str, Callable[[Any], None]] = {"apply_fsdp2": _direct, "accelerate": _accelerate, "verl": _verl}
SWITCHES = [
    ("FSDP_COMPAT_GUARD", ["1", "on", "true", "yes", "enable", "enabled", "0", "off", "false", "no", "disabled"]),
    ("FSDP_COMPAT_MIXED_BATCHES", ["sync", "always", "off", "on", "enable", "disable"]),
]


@pytest.mark.parametrize("model_name", ["qwen2", "glm4v"])
@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize(("variable", "choices"), SWITCHES, ids=[s[0] for s in SWITCHES])
def test_a_bad_run_time_switch_raises_the_same_error_on_every_path(
    monkeypatch: pytest.MonkeyPatch, variable: str, choices: list[str], path: str, model_name: str
) -> None:
    """``FsdpCompatError`` naming the variable, the value and the choices, whether the layer is installed by
    ``apply_fsdp2`` or by an adapter's replacement, on a text model as on a VLM; the run-time layer is not installed."""
    from fsdp_compat.runtime import runtime_installed

    model = build_model(model_name)
    monkeypatch.setenv(variable, "bogus")
    with pytest.raises(FsdpCompatError) as raised:
        PATHS[path](model)
    message = str(raised.value)
    assert message.startswith(f"{variable}='bogus' is not "), message
    listed = message.split("set it to one of ", 1)[1]
    assert all(re.search(rf"\b{choice}\b", listed) for choice in choices), message
    assert not runtime_installed(model)
