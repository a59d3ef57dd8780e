"""``.github/workflows/ci.yml`` holds to ``tox.ini``: the CPU matrix is tox's default env list, the nightly job runs
every label of breadth (the ``newest`` canary included; a label may be left out only where its envs run anyway), and
the GPU job runs ``tox -m gpu``, as docs/development.md says.

tox.ini is read with configparser, ci.yml by hand (PyYAML is not a dependency): the few lines read are the jobs'
names, their matrix lists and their ``run:`` lines. Each check is also run on a mutated copy, which it must reject.
"""

from __future__ import annotations

import configparser
import itertools
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOX = REPO / "tox.ini"
CI = REPO / ".github" / "workflows" / "ci.yml"

#: The job of each kind in ci.yml.
CPU_JOB, NIGHTLY_JOB, GPU_JOB = "cpu", "all-releases", "gpu"


def _expand(item: str) -> list[str]:
    """tox's brace expansion of one env name: ``skyrl{010,020}`` -> ``skyrl010, skyrl020``."""
    parts = re.split(r"\{([^}]*)\}", item)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(combo) for combo in itertools.product(*choices)]


def _names(value: str) -> list[str]:
    """A tox list (commas or newlines, braces kept together), expanded."""
    items = re.findall(r"[^,\s{}]*(?:\{[^}]*\}[^,\s{}]*)*", value)
    return [name for item in items if item for name in _expand(item)]


def tox_lists(text: str) -> tuple[list[str], dict[str, list[str]]]:
    """tox.ini's default env list and its labels (label -> envs)."""
    parser = configparser.ConfigParser(interpolation=None)
    parser.read_string(text)
    tox = parser["tox"]
    labels = {}
    for line in tox["labels"].strip().splitlines():
        label, _, envs = line.partition("=")
        labels[label.strip()] = _names(envs)
    return _names(tox["env_list"]), labels


def ci_jobs(text: str) -> dict[str, str]:
    """Each job of the workflow (job name -> its block of lines), read by indentation under ``jobs:``."""
    body = text.split("\njobs:\n", 1)[1]
    blocks = re.split(r"^  ([A-Za-z0-9_-]+):\s*$", body, flags=re.M)
    return dict(zip(blocks[1::2], blocks[2::2], strict=True))


def matrix(block: str, key: str) -> list[str]:
    """A job's ``matrix: {key: [a, b]}`` list."""
    found = re.findall(rf"^\s+{re.escape(key)}:\s*\[([^\]]*)\]\s*$", block, flags=re.M)
    assert len(found) == 1, f"one {key}: [...] list expected, found {len(found)}"
    return [name.strip() for name in found[0].split(",") if name.strip()]


def runs(block: str) -> list[str]:
    return [line.strip() for line in re.findall(r"^\s+- run:\s*(.+)$", block, flags=re.M)]


def drift(tox_text: str, ci_text: str) -> list[str]:
    """Every way ci.yml differs from tox.ini (empty: none)."""
    env_list, labels = tox_lists(tox_text)
    jobs = ci_jobs(ci_text)
    problems = []
    cpu = matrix(jobs[CPU_JOB], "env")
    if cpu != env_list:
        problems.append(f"the cpu matrix {cpu} is not tox's default env_list {env_list}")
    if "python -m tox -e ${{ matrix.env }}" not in runs(jobs[CPU_JOB]):
        problems.append("the cpu job does not run tox -e for each matrix env")

    nightly = jobs[NIGHTLY_JOB]
    if "github.event_name == 'schedule'" not in nightly or "schedule:" not in ci_text.split("\njobs:\n", 1)[0]:
        problems.append("the nightly job does not run on the schedule")
    if "python -m tox -m ${{ matrix.label }}" not in runs(nightly):
        problems.append("the nightly job does not run tox -m for each matrix label")
    chosen = matrix(nightly, "label")
    problems += [f"the nightly job runs {label!r}, which tox.ini does not define" for label in chosen
                 if label not in labels]  # fmt: skip
    if "newest" not in chosen:
        problems.append("the nightly job does not run the newest canary")
    covered = set(env_list).union(*(labels.get(label, []) for label in chosen))
    for label, envs in labels.items():
        if label == "gpu" or label in chosen:
            continue
        left = [env for env in envs if env not in covered]
        if left:
            problems.append(f"the nightly job leaves out label {label!r}: {left} run nowhere in CI")

    gpu = jobs[GPU_JOB]
    if "python3 -m tox -m gpu" not in runs(gpu) or "self-hosted" not in gpu or "gpu" not in labels:
        problems.append("the gpu job does not run tox -m gpu on the self-hosted GPU runner")
    return problems


def test_ci_runs_what_tox_defines() -> None:
    assert drift(TOX.read_text(), CI.read_text()) == []


def test_the_reading_is_complete() -> None:
    """The parse sees what is there: the default list, every label with its expanded envs, the three jobs."""
    env_list, labels = tox_lists(TOX.read_text())
    assert env_list[:2] == ["lint", "core"] and "hf525" in env_list
    assert labels["skyrl-all"][:4] == ["skyrltrain010", "skyrltrain020", "skyrltrain030", "skyrltrain031"]
    assert {"newest", "families", "accelerate", "nemo", "axolotl", "verl-copies", "liger", "gpu"} <= set(labels)
    assert all(env.endswith("-gpu") for env in labels["gpu"])
    assert set(ci_jobs(CI.read_text())) == {CPU_JOB, NIGHTLY_JOB, GPU_JOB}


@pytest.mark.parametrize(
    ("where", "old", "new", "problem"),
    [
        ("ci", "skyrl040, hf525]", "skyrl040, hf524]", "the cpu matrix"),
        ("ci", "label: [newest, ", "label: [", "does not run the newest canary"),
        ("ci", ", liger,", ",", "leaves out label 'liger'"),
        ("ci", "python3 -m tox -m gpu", "python3 -m tox -e core-gpu", "the gpu job"),
        ("tox", "    liger = liger085\n", "    liger = liger085\n    mistral = mistral010\n", "label 'mistral'"),
        ("tox", "skyrltrain031, skyrl040, hf525", "skyrltrain031, skyrl040, hf525, hf526", "the cpu matrix"),
    ],
)
def test_drift_is_caught(where: str, old: str, new: str, problem: str) -> None:
    """A mutated copy of either file: the check names the drift."""
    tox_text, ci_text = TOX.read_text(), CI.read_text()
    if where == "ci":
        assert old in ci_text
        ci_text = ci_text.replace(old, new)
    else:
        assert old in tox_text
        tox_text = tox_text.replace(old, new)
    problems = drift(tox_text, ci_text)
    assert any(problem in p for p in problems), problems
