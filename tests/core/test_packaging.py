"""The wheel ships ``fsdp_compat.pth``, ``fsdp_compat.adapters`` and the testing kit, not the test lab; the start-up
hook is cheap and safe; ``fsdp-compat plan`` runs from the installed wheel alone.

Builds the wheel (and an editable wheel) from a copy of the source tree and installs each into a throwaway
venv made with ``--without-pip``; pip runs from this interpreter (``pip --python``), with PYTHONPATH removed.
packaging (the one pure-Python dependency the adapters need) comes from this interpreter's site-packages through a
plain path line: no download.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import packaging
import pytest

REPO = Path(__file__).resolve().parents[2]
SOURCES = ("fsdp_compat", "adapters", "src_pth", "setup.py", "pyproject.toml", "MANIFEST.in", "README.md", "LICENSE")
HEAVY = ("torch", "wrapt", "packaging", "logging", "fsdp_compat.activation", "verl", "skyrl", "skyrl_train")
CLEAN_ENV = {k: v for k, v in os.environ.items() if not k.startswith(("FSDP_COMPAT", "PYTHON"))}
#: ``fsdp_compat.testing``, the public kit: the zoo, skeletons, rank launching, parity, the smoke tables
KIT = (
    "__init__", "zoo", "skeleton", "launch", "crashes", "parity", "smoke", "core_smoke", "verl_smoke", "skyrl_smoke",
    "wraps",
)  # fmt: skip
#: the project's own test lab (tests/lab/, imported as ``lab``): never in the wheel
LAB = ("read_corpus", "guard_models", "checkpoints", "transformers_smoke", "peft_glm4v")

needs_setuptools = pytest.mark.skipif(
    importlib.util.find_spec("setuptools") is None, reason="building needs setuptools in this environment"
)


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "-q", *args], check=True, timeout=300, env=CLEAN_ENV)


def _copy_sources(dest: Path) -> Path:
    dest.mkdir()
    for name in SOURCES:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        elif src.exists():
            shutil.copy2(src, dest / name)
    if not (dest / "README.md").exists():
        (dest / "README.md").write_text("fsdp-compat\n")
    return dest


def _venv(path: Path, wheel: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    python = path / "bin" / "python"
    _pip("--python", str(python), "install", "--no-deps", "--no-index", str(wheel))
    site_dir = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
            env=CLEAN_ENV,
        ).stdout.strip()
    )
    # A copy of packaging from this interpreter, on a plain path entry. Not this interpreter's whole
    # site-packages: under tox that holds an installed fsdp_compat, which would shadow the one under test.
    deps = path / "test-deps"
    for package in (packaging,):
        source = Path(package.__file__).parent
        shutil.copytree(source, deps / source.name, ignore=shutil.ignore_patterns("__pycache__"))
    (site_dir / "zz_test_deps.pth").write_text(f"{deps}\n")
    return python


def _py(python: Path, code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(python), *(["-c", textwrap.dedent(code)] if code else [])],
        capture_output=True,
        text=True,
        timeout=300,
        env={**CLEAN_ENV, **env},
        cwd="/",
        check=False,
    )


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    if importlib.util.find_spec("setuptools") is None:
        pytest.skip("building needs setuptools in this environment")
    base = tmp_path_factory.mktemp("pkg")
    src = _copy_sources(base / "src")
    _pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(base / "dist"), str(src))
    (wheel,) = (base / "dist").glob("fsdp_compat-*.whl")
    return {"base": base, "src": src, "wheel": wheel}


@pytest.fixture(scope="module")
def venv(built: dict[str, Path]) -> Path:
    return _venv(built["base"] / "venv", built["wheel"])


def test_wheel_ships_the_pth_at_its_root_and_the_adapters(built: dict[str, Path]) -> None:
    with zipfile.ZipFile(built["wheel"]) as whl:
        names = set(whl.namelist())
        pth = whl.read("fsdp_compat.pth").decode()
    assert {"fsdp_compat/_autoload.py", "fsdp_compat/adapters/__init__.py", "fsdp_compat.pth"} <= names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), sorted(names)  # the Apache-2.0 text
    assert pth.count("\n") == 1 and pth.startswith("import ")  # one executable line, as site.py requires
    assert "install()" in pth and "except Exception" in pth


def test_wheel_holds_the_kit_and_no_test_lab(built: dict[str, Path]) -> None:
    with zipfile.ZipFile(built["wheel"]) as whl:
        names = set(whl.namelist())
    kit = {n.removeprefix("fsdp_compat/testing/") for n in names if n.startswith("fsdp_compat/testing/")}
    assert kit == {f"{module}.py" for module in KIT}, sorted(kit)
    shipped = sorted(n for n in names if n.endswith(".py") and Path(n).stem in LAB)
    assert shipped == [], f"test-only modules in the wheel: {shipped}"
    assert not [n for n in names if n.split("/")[0] in ("lab", "tests", "benchmarks")], sorted(names)


def test_plan_of_a_zoo_model_runs_from_the_installed_wheel(built: dict[str, Path], tmp_path: Path) -> None:
    """``fsdp-compat plan glm4v`` in a venv holding only the wheel (torch and transformers from this interpreter's
    site-packages on a path line after the venv's own), run from ``/``: no checkout, tests or benchmarks on the path.
    Every fsdp_compat module it loads comes from the wheel."""
    python = _venv(tmp_path / "venv", built["wheel"])
    site_dir = next((tmp_path / "venv").glob("lib/python*/site-packages"))
    deps = {str(Path(importlib.util.find_spec(name).origin).parents[1]) for name in ("torch", "transformers")}
    (site_dir / "zz_torch.pth").write_text("".join(f"{d}\n" for d in sorted(deps)))
    script = tmp_path / "venv" / "bin" / "fsdp-compat"  # the console script pip wrote
    done = _py(
        python,
        f"""
        import runpy, sys
        from pathlib import Path
        sys.argv = ["fsdp-compat", "plan", "glm4v"]
        try:
            runpy.run_path({str(script)!r}, run_name="__main__")
        except SystemExit as exc:
            print("EXIT", exc.code)
        site = Path({str(site_dir)!r}).resolve()
        files = [m.__file__ for n, m in list(sys.modules.items()) if n.split(".")[0] == "fsdp_compat"]
        print("OUTSIDE", sorted(f for f in files if f and not Path(f).resolve().is_relative_to(site)))
        print("FOREIGN", sorted(n for n in sys.modules if n.split(".")[0] in ("lab", "benchmarks", "lab.support")))
        """,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("WrapPlan for Glm4vForConditionalGeneration (policy auto;"), done.stdout[:500]
    assert re.search(r"^\s+auto\s.*\sok$", done.stdout, re.M), done.stdout  # the policies table's auto row
    assert done.stdout.splitlines()[-3:] == ["EXIT 0", "OUTSIDE []", "FOREIGN []"], done.stdout[-2000:]


def test_sdist_carries_the_pth_source_so_its_wheel_has_the_hook(
    built: dict[str, Path], tmp_path: Path
) -> None:
    """tox and pip build from an sdist by default: MANIFEST.in must put src_pth/ into it."""
    subprocess.run(
        [
            sys.executable,
            "-c",
            f"from setuptools import build_meta; build_meta.build_sdist({str(tmp_path)!r})",
        ],
        cwd=built["src"],
        check=True,
        capture_output=True,
        timeout=300,
        env=CLEAN_ENV,
    )
    (sdist,) = tmp_path.glob("fsdp_compat-*.tar.gz")
    _pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(sdist))
    (wheel,) = (tmp_path / "dist").glob("fsdp_compat-*.whl")
    with zipfile.ZipFile(wheel) as whl:
        assert "fsdp_compat.pth" in whl.namelist()


def test_wheel_install_hook_is_active_and_imports_nothing_heavy(venv: Path) -> None:
    done = _py(
        venv,
        """
        import sys
        import fsdp_compat._autoload as a
        print(a.is_installed(), a.__file__)
        print(sorted(m for m in sys.modules if m.split(".")[0] in {"torch", "wrapt", "packaging", "logging",
              "verl", "skyrl", "skyrl_train"} or m == "fsdp_compat.activation"))
        """,
    )
    assert done.returncode == 0 and done.stderr == "", done.stderr
    installed, loaded = done.stdout.splitlines()
    assert installed.startswith("True ") and str(venv.parents[1]) in installed
    assert loaded == "[]"
    probe = "import fsdp_compat._autoload as a; print(a.is_installed())"
    assert _py(venv, probe, FSDP_COMPAT="off").stdout == "False\n"
    assert _py(venv, probe, FSDP_COMPAT_AUTOLOAD="0").stdout == "False\n"


def test_start_up_cost_of_the_hook_is_small(venv: Path) -> None:
    """``-X importtime`` of what the .pth imports, best of 5 (on a shared machine the best is the cost)."""
    costs = []
    for _ in range(5):
        done = _py(venv, "pass", PYTHONPROFILEIMPORTTIME="1")
        match = re.search(r"\|\s*(\d+) \|\s*fsdp_compat\._autoload$", done.stderr, re.M)
        assert match, done.stderr
        costs.append(int(match.group(1)) / 1000)
    # Measured quietly: ~2 ms with a typing-free fsdp_compat/__init__.py, ~7 ms while it imports typing. The
    # bound is loose because the machine is shared; it catches a heavy import (torch alone costs > 1 s).
    assert min(costs) < 50.0, f"start-up hook costs {min(costs):.1f} ms (best of 5: {costs})"


def test_wheel_install_imports_the_adapters_package(venv: Path) -> None:
    done = _py(venv, "import fsdp_compat.adapters as a; print(a.__file__)")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("site-packages/fsdp_compat/adapters/__init__.py")


def test_pth_hook_activates_an_adapter_when_its_trigger_is_imported(venv: Path, tmp_path: Path) -> None:
    """The finder the .pth installed at start (not one made by the test) imports the adapter and patches."""
    (tmp_path / "hookfw").mkdir()
    (tmp_path / "hookfw" / "__init__.py").write_text("")
    (tmp_path / "hookfw" / "utils.py").write_text("def fn():\n    return 'orig'\n")
    (tmp_path / "hookfw_adapter.py").write_text(
        textwrap.dedent(
            """
            from packaging.version import Version
            from fsdp_compat.activation import Adapter, Release, Replacement, activate_on_import

            class HookAdapter(Adapter):
                key = "hook"
                releases = (Release(">=1", (Replacement("hookfw.utils", "fn", lambda o, p: (lambda: "patched")),)),)
                def version_of(self, distribution):
                    return Version("1.0")
                def policy(self):
                    from fsdp_compat.policies import Auto

                    return Auto()

            ADAPTER = HookAdapter()
            activate_on_import(ADAPTER)
            """
        )
    )
    code = f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        import fsdp_compat._autoload as a
        assert a.is_installed(), "the .pth did not install the hook"
        from fsdp_compat.adapters import ADAPTERS, AdapterEntry
        ADAPTERS["hook"] = AdapterEntry("hookfw_adapter", {{"hookfw": ("hookfw.utils", ">=1")}})
        a.install()  # re-reads the index (a real adapter's row is in fsdp_compat.adapters from the start)
        assert "hookfw_adapter" not in sys.modules
        from hookfw.utils import fn
        adapter = sys.modules["hookfw_adapter"].ADAPTER
        print(fn(), adapter.activated_by)
    """
    done = _py(venv, code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "patched pth-hook"
    assert "fsdp-compat: patched hookfw 1.0 (policy auto, activated by pth-hook): hookfw.utils.fn" in done.stderr


def test_broken_install_never_breaks_the_interpreter(built: dict[str, Path], tmp_path: Path) -> None:
    python = _venv(tmp_path / "venv", built["wheel"])
    site_dir = next((tmp_path / "venv").glob("lib/python*/site-packages"))
    autoload = site_dir / "fsdp_compat" / "_autoload.py"
    autoload.write_text("raise RuntimeError('simulated broken install')\n")
    done = _py(python, "print('alive')")
    assert done.returncode == 0 and done.stdout == "alive\n"
    # one line per processing of the .pth (a Linux venv lists its site-packages twice, via the lib64 link)
    lines = done.stderr.splitlines()
    assert lines and set(lines) == {
        "fsdp-compat: start-up hook off: RuntimeError('simulated broken install')"
    }
    shutil.rmtree(site_dir / "fsdp_compat")  # package gone, .pth left behind: silent
    done = _py(python, "print('alive')")
    assert done.returncode == 0 and done.stdout == "alive\n" and done.stderr == ""


@needs_setuptools
def test_editable_install_imports_adapters_but_has_no_pth(built: dict[str, Path], tmp_path: Path) -> None:
    """Documented: ``pip install -e .`` maps fsdp_compat.adapters to adapters/ but installs no .pth hook."""
    out = tmp_path / "ewhl"
    subprocess.run(
        [sys.executable, "-c", f"from setuptools import build_meta; build_meta.build_editable({str(out)!r})"],
        cwd=built["src"],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (editable,) = out.glob("*.whl")
    python = _venv(tmp_path / "venv", editable)
    done = _py(
        python,
        "import fsdp_compat.adapters as a, fsdp_compat._autoload as h; print(a.__file__, h.is_installed())",
    )
    assert done.returncode == 0, done.stderr
    path, active = done.stdout.split()
    assert Path(path) == built["src"] / "adapters" / "__init__.py" and active == "False"
    site_dir = next((tmp_path / "venv").glob("lib/python*/site-packages"))
    assert not (site_dir / "fsdp_compat.pth").exists()


def test_doctor_reports_the_hook(venv: Path) -> None:
    done = _py(venv, "from fsdp_compat.doctor import report; print(report())")
    assert done.returncode == 0, done.stderr
    assert re.search(
        r"\.pth start-up hook: installed at \S+fsdp_compat\.pth; active in this process", done.stdout
    )
    assert "automatic activation: on" in done.stdout
    # the wheel's adapter index reaches the doctor: a framework absent here is named on the one "not installed" line
    assert re.search(r"^not installed: .*\bverl\b", done.stdout, re.M), done.stdout
    done = _py(venv, "from fsdp_compat.doctor import report; print(report())", FSDP_COMPAT="off")
    assert "automatic activation: OFF (FSDP_COMPAT=off)" in done.stdout
    assert "NOT active in this process" in done.stdout
