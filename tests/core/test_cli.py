"""The ``fsdp-compat`` command line: plan explains, compares and predicts; errors exit 2 with a clear message."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from fsdp_compat import cli
from fsdp_compat.cli import main

REPO = Path(__file__).resolve().parents[2]


def test_plan_glm4v_explains_the_position_table_and_predicts_the_legacy_crash(capsys: pytest.CaptureFixture) -> None:
    assert main(["plan", "glm4v", "--world-size", "8"]) == 0
    out = capsys.readouterr().out
    print(out)
    assert "model.visual.embeddings.position_embedding (2,048 params, now in <root>)" in out
    assert "read raw by model.visual.embeddings (modeling_glm4v.py:" in out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ") and len(line.split()) > 5}
    assert "crash: model.visual.embeddings.position_embedding.weight read raw" in rows["legacy"]
    assert rows["auto"].rstrip().endswith("ok")
    assert rows["input-only"].rstrip().endswith("ok")


def test_plan_from_a_config_folder_on_meta(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from transformers import Qwen2Config

    Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, tie_word_embeddings=False, architectures=["Qwen2ForCausalLM"],
    ).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    assert main(["plan", str(tmp_path), "--policy", "legacy", "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "WrapPlan for Qwen2ForCausalLM (policy legacy" in out
    assert "model.layers.{0..1}  x2" in out and "lm_head" in out


def test_bad_input_exits_2_with_the_fix(capsys: pytest.CaptureFixture) -> None:
    assert main(["plan", "glm4v", "--policy", "nope"]) == 2
    assert "unknown wrap policy 'nope'; use one of auto, legacy" in capsys.readouterr().err
    assert main(["plan", "no-such-model"]) == 2
    assert "is not a zoo model" in capsys.readouterr().err
    assert main(["plan", "qwen2", "--layer-classes", "NoSuchLayer"]) == 2
    assert "Its module classes are:" in capsys.readouterr().err


def test_the_commands_are_plan_smoke_doctor(capsys: pytest.CaptureFixture) -> None:
    """The installed CLI needs nothing from a checkout: the benchmarks run as ``python -m benchmarks`` there."""
    choices = next(a for a in cli.build_parser()._actions if a.dest == "command").choices
    assert sorted(choices) == ["doctor", "plan", "smoke"]
    with pytest.raises(SystemExit) as exc:
        main(["bench"])
    assert exc.value.code == 2 and "invalid choice: 'bench'" in capsys.readouterr().err


def test_doctor_runs(capsys: pytest.CaptureFixture) -> None:
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "verl" in out and "skyrl" in out
    assert main(["doctor", "--json"]) == 0  # the same facts, one JSON object (tests/activation/test_doctor.py)
    facts = json.loads(capsys.readouterr().out)
    names = [row["distribution"] for row in facts["installed"]] + facts["not_installed"]
    assert "verl" in names and "skyrl" in names and "torch" in names


@pytest.mark.skipif(
    shutil.which("fsdp-compat") is None and "TOX_ENV_NAME" not in os.environ,
    reason="console script not installed here (tox installs it; there this test always runs)",
)
def test_console_script_is_installed() -> None:
    done = subprocess.run(["fsdp-compat", "plan", "full:qwen2-7b"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "WrapPlan for Qwen2ForCausalLM" in done.stdout


def test_plan_of_a_real_model_lists_only_evidence_that_costs_sharding(capsys: pytest.CaptureFixture) -> None:
    """A full-size text model: every candidate owns its group, so no evidence line, one summary line instead."""
    assert main(["plan", "full:qwen2-7b"]) == 0
    out = capsys.readouterr().out
    assert "evidence (static analysis" not in out and "forward source unreadable" not in out, out[-3000:]
    hidden = re.search(r"\((\d+) more reads stay inside the group that owns them and cost no sharding", out)
    assert hidden and int(hidden.group(1)) > 0, out[-2000:]
    assert main(["plan", "full:qwen2-7b", "--all-evidence"]) == 0
    full = capsys.readouterr().out
    assert full.count("\n    - ") == int(hidden.group(1))


def test_smoke_cuda_without_a_gpu_is_a_one_line_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert main(["smoke", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fsdp-compat: error: --device cuda needs a CUDA GPU"), err
    assert "--device cpu" in err and "ZeroDivisionError" not in err


@pytest.mark.parametrize("framework", ["verl", "skyrl"])
def test_smoke_of_a_missing_framework_is_a_one_line_error(
    framework: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    if cli._installed(framework):  # in an environment that has it, pretend it is missing
        monkeypatch.setattr(cli, "_installed", lambda name: False)
    assert main(["smoke", "--framework", framework]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--framework {framework}: " in err and "is not installed" in err, err
    assert "Traceback" not in err


def test_license_is_the_apache_2_text_that_pyproject_declares() -> None:
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and "APPENDIX: How to apply the Apache License" in text
    assert 'license = "Apache-2.0"' in (REPO / "pyproject.toml").read_text()


def test_changelog_has_unreleased_and_the_current_version() -> None:
    from fsdp_compat import __version__

    text = (REPO / "CHANGELOG.md").read_text()
    headings = re.findall(r"^## \[([^\]]+)\]", text, re.M)
    assert headings[:2] == ["Unreleased", __version__], headings
    assert "keepachangelog.com" in text


def test_plan_folds_repeated_layers_unless_asked_for_every_row(capsys: pytest.CaptureFixture) -> None:
    assert main(["plan", "full:glm4v"]) == 0
    folded = capsys.readouterr().out.split("\n\n")[0]
    assert "model.language_model.layers.{0..39}  x40" in folded
    assert "model.visual.blocks.{0..23}  x24" in folded
    assert "groups: 68 + root" in folded  # the count is of groups, not rows
    numbered = [line for line in folded.splitlines()[2:] if line.strip()[:1].isdigit()]
    assert len(numbered) == 6  # vision blocks, merger, downsample (split from root), embed_tokens, layers, lm_head
    assert main(["plan", "full:glm4v", "--all-rows"]) == 0
    every = capsys.readouterr().out.split("\n\n")[0]
    assert len([line for line in every.splitlines()[2:] if line.strip()[:1].isdigit()]) == 68
    assert "x40" not in every and "model.language_model.layers.39 " in every


def test_version_is_the_packages(capsys: pytest.CaptureFixture) -> None:
    from fsdp_compat import __version__

    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"fsdp-compat {__version__}"


@pytest.mark.parametrize(
    "argv",
    [["smoke", "--steps", "-1"], ["smoke", "--steps", "0"], ["smoke", "--world-size", "0"],
     ["plan", "glm4v", "--world-size", "-2"], ["smoke", "--steps", "two"]],
)  # fmt: skip
def test_impossible_numbers_are_refused_before_any_work(argv: list[str], capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "is not a whole number >= 1" in err, err


@pytest.mark.parametrize("command", [[], ["plan"], ["smoke"], ["doctor"]])
def test_help_describes_every_option_in_plain_text(command: list[str], capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        main([*command, "--help"])
    out = capsys.readouterr().out
    assert "``" not in out and ":func:" not in out, out
    options = re.findall(r"^  (--[a-z-]+)", out, flags=re.M)
    for option in options:
        block = out.split(option, 1)[1].split("\n  --", 1)[0]
        assert len(block.split()) > 2, (option, block)  # a description follows the option's metavar
