"""Start-up cost of automatic activation: the ``.pth`` hook in every interpreter, and ``import verl`` with it.

``python -m benchmarks.startup [--runs 30] [--verl-venv /work/venvs/verl091 | --no-verl] [--compare GIT_REF]``

``--compare REF`` measures the package as committed at ``REF`` (``git archive``) next to this checkout, interleaved in
the same run: every case below is then reported for both, "before" (REF) and "after" (the working tree).

What is measured, exactly:

1. A throwaway venv (``python -m venv --without-pip`` in a temp folder, same base interpreter, no torch) in three
   states, ``python -c pass`` run ``--runs`` times each, interleaved, median wall time of the whole process:
   *bare* (fsdp-compat not installed), *installed* (the repository's ``src_pth/fsdp_compat.pth`` and a copy of
   this checkout's ``fsdp_compat`` package in site-packages, byte-compiled: the layout a wheel install produces,
   without building one), and *installed, FSDP_COMPAT=off*. The difference installed - bare is the whole cost the
   hook adds to every interpreter of an environment (Ray workers included).
2. ``python -X importtime -c pass`` in the installed venv (the median of 5 runs): the import time of
   ``fsdp_compat`` modules (self and cumulative microseconds, as Python reports them).
3. In-process: ``import fsdp_compat._autoload`` + ``install()`` timed with ``perf_counter`` in the bare venv
   (median of ``--runs`` fresh interpreters): the hook's own cost without process noise.
4. If a verl venv with fsdp-compat installed exists: ``import verl`` and ``import verl.utils.fsdp_utils`` (the
   trigger module: the adapter patches here) with ``FSDP_COMPAT=off`` vs default, wall medians (noisy: these
   imports take seconds), and from ``-X importtime`` the cumulative time of the top-level ``fsdp_compat*``
   imports, i.e. the import cost that fsdp-compat adds (modules it is first to import are counted in it).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import format_table

ROOT = Path(__file__).resolve().parents[1]
TARGET_MS = 20.0
DEFAULT_VERL_VENV = Path("/work/venvs/verl091")


def _clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "FSDP_COMPAT", "FSDP_COMPAT_AUTOLOAD", "PYTHONSTARTUP", "VIRTUAL_ENV")
    }
    env.update(extra)
    return env


def _wall(cmd: list[str], env: dict[str, str]) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t


def _site_packages(venv: Path) -> Path:
    return next((venv / "lib").glob("python3*/site-packages"))


def export_ref(ref: str, dest: Path) -> Path:
    """The source tree of ``ref`` (``git archive`` of the package folders) in ``dest``."""
    dest.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", ref, "fsdp_compat", "adapters", "src_pth"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def overlay(source: Path, dest: Path) -> Path:
    """The installed layout of ``source`` (``adapters/`` becomes ``fsdp_compat/adapters``), byte-compiled: a folder
    to put first on PYTHONPATH, so that an environment's .pth hook and entry point load this version."""
    shutil.copytree(source / "fsdp_compat", dest / "fsdp_compat", ignore=shutil.ignore_patterns("__pycache__"))
    if (source / "adapters").is_dir():
        shutil.copytree(
            source / "adapters", dest / "fsdp_compat" / "adapters", ignore=shutil.ignore_patterns("__pycache__")
        )
    # pip byte-compiles what it installs; without .pyc files every start would compile the hook's modules.
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(dest / "fsdp_compat")], check=True, env=_clean_env())
    return dest


def make_venvs(tmp: Path, sources: dict[str, Path] | None = None) -> tuple[Path, dict[str, Path]]:
    """Throwaway venvs: bare, and one per source with its .pth and package installed (copied, no build)."""
    base = getattr(sys, "_base_executable", sys.executable)
    sources = sources or {"installed": ROOT}
    venvs = {}
    for name in ("bare", *sources):
        venv = tmp / name
        subprocess.run([base, "-m", "venv", "--without-pip", str(venv)], check=True)
        venvs[name] = venv
    for name, source in sources.items():
        site = _site_packages(venvs[name])
        shutil.copy(source / "src_pth" / "fsdp_compat.pth", site / "fsdp_compat.pth")
        overlay(source, site)
        # a hook that fails at start prints one line and costs nothing: measuring that would flatter the package
        check = "import fsdp_compat._autoload as a, sys; sys.exit(0 if a.is_installed() else 1)"
        done = subprocess.run(
            [str(venvs[name] / "bin" / "python"), "-c", check], env=_clean_env(), capture_output=True, text=True
        )
        if done.returncode != 0 or done.stderr:
            raise RuntimeError(f"the start-up hook is not active in the {name} venv: {done.stderr.strip()}")
    bare = venvs.pop("bare")
    return bare, venvs


def parse_importtime(stderr: str, prefix: str = "fsdp_compat") -> dict[str, Any]:
    """From ``-X importtime`` output: total cumulative µs of top-level ``prefix*`` imports, and each module's line."""
    total, modules = 0, []
    stack: list[tuple[int, str]] = []
    for line in stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)", line)
        if not m:
            continue
        self_us, cum_us, depth, name = int(m[1]), int(m[2]), len(m[3]), m[4]
        if name.startswith(prefix):
            modules.append((name, self_us, cum_us))
        # importtime prints children before their parent; a prefix module whose parent is not a prefix module is
        # a top-level entry. Track by depth: lines are post-order, so keep pending children per depth.
        stack.append((depth, name))
    # second pass: an entry is top-level for the prefix when no enclosing (shallower, later) line is a prefix module
    for i, (depth, name) in enumerate(stack):
        if not name.startswith(prefix):
            continue
        parent = next((n for d, n in stack[i + 1 :] if d < depth), None)
        if parent is None or not parent.startswith(prefix):
            total += next(c for n, _, c in modules if n == name)
    return {"total_us": total, "modules": modules}


def _median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3


_ENGINE_CHECK = (
    "import sys; print(any(type(f).__name__ in ('ImportHooks', '_TriggerFinder') for f in sys.meta_path))"
)


def bench_hook(runs: int, sources: dict[str, Path] | None = None) -> dict[str, Any]:
    """``python -c pass`` bare and with each source installed (hook on, and FSDP_COMPAT=off), interleaved."""
    sources = sources or {"installed": ROOT}
    with tempfile.TemporaryDirectory(prefix="fsdp_compat_startup_") as tmp:
        bare, installed = make_venvs(Path(tmp), sources)
        py_bare = str(bare / "bin" / "python")
        cases = {"bare (not installed)": (py_bare, _clean_env())}
        for label, venv in installed.items():
            py = str(venv / "bin" / "python")
            cases[f"{label} (hook on)"] = (py, _clean_env())
            cases[f"{label}, FSDP_COMPAT=off"] = (py, _clean_env(FSDP_COMPAT="off"))
        finder = {
            label: subprocess.run(
                [str(venv / "bin" / "python"), "-c", _ENGINE_CHECK], env=_clean_env(), capture_output=True, text=True
            ).stdout.strip()
            == "True"
            for label, venv in installed.items()
        }
        times: dict[str, list[float]] = {k: [] for k in cases}
        for _ in range(2):  # warm the page cache
            for py, env in cases.values():
                _wall([py, "-c", "pass"], env)
        for _ in range(runs):
            for key, (py, env) in cases.items():
                times[key].append(_wall([py, "-c", "pass"], env))
        importtime, direct = {}, {}
        code = (
            "import sys, time; sys.path.insert(0, sys.argv[1]); t = time.perf_counter(); "
            "import fsdp_compat._autoload as a; ok = a.install(); print(time.perf_counter() - t, ok)"
        )
        for label, venv in installed.items():
            py = str(venv / "bin" / "python")
            runs_it = [
                parse_importtime(
                    subprocess.run(
                        [py, "-X", "importtime", "-c", "pass"],
                        env=_clean_env(),
                        capture_output=True,
                        text=True,
                        check=True,
                    ).stderr
                )
                for _ in range(5)
            ]
            importtime[label] = sorted(runs_it, key=lambda r: r["total_us"])[2]  # the median run
            samples = []
            for _ in range(runs):
                out = subprocess.run(
                    [py_bare, "-c", code, str(_site_packages(venv))],
                    env=_clean_env(),
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout.split()
                samples.append(float(out[0]))
            direct[label] = _median_ms(samples)
    return {
        "finder_installed": finder,
        "wall_ms": {k: _median_ms(v) for k, v in times.items()},
        "wall_min_ms": {k: min(v) * 1e3 for k, v in times.items()},
        "importtime": importtime,
        "direct_ms": direct,
        "runs": runs,
    }


def bench_verl(venv: Path, runs: int, sources: dict[str, Path] | None = None) -> dict[str, Any] | None:
    """``import verl`` and of the trigger module, FSDP_COMPAT=off vs on for each source (PYTHONPATH overlay of its
    installed layout; without sources, the version installed in the venv), interleaved."""
    python = venv / "bin" / "python"
    site = _site_packages(venv) if (venv / "lib").exists() else None
    if not python.exists() or site is None or not (site / "fsdp_compat.pth").exists():
        return None
    version = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; print(m.version('verl'))"],
        env=_clean_env(FSDP_COMPAT="off"),
        capture_output=True,
        text=True,
    ).stdout.strip()
    out: dict[str, Any] = {"venv": str(venv), "verl": version, "targets": {}}
    with tempfile.TemporaryDirectory(prefix="fsdp_compat_overlay_") as tmp:
        envs = {"off": _clean_env(FSDP_COMPAT="off")}
        if sources is None:
            envs["installed"] = _clean_env()
        else:
            for label, source in sources.items():
                envs[label] = _clean_env(PYTHONPATH=str(overlay(source, Path(tmp) / label)))
        for target in ("verl", "verl.utils.fsdp_utils"):
            cmd = [str(python), "-c", f"import {target}"]
            imp = {  # these runs also warm the page cache for the timed ones
                mode: subprocess.run(
                    [str(python), "-X", "importtime", "-c", f"import {target}"], env=env, capture_output=True, text=True
                ).stderr
                for mode, env in envs.items()
            }
            times: dict[str, list[float]] = {mode: [] for mode in envs}
            for _ in range(runs):
                for mode, env in envs.items():
                    times[mode].append(_wall(cmd, env))
            out["targets"][target] = {
                mode: {
                    "ms": _median_ms(times[mode]),
                    "spread_ms": (max(times[mode]) - min(times[mode])) * 1e3,
                    "importtime": parse_importtime(imp[mode]),
                    "patched": "patched verl" in imp[mode],
                }
                for mode in envs
            }
    return out


def format_results(hook: dict[str, Any], verl: dict[str, Any] | None) -> str:
    wall = hook["wall_ms"]
    bare = wall["bare (not installed)"]
    rows = [
        [k, f"{v:.1f}", f"{hook['wall_min_ms'][k]:.1f}", f"{v - bare:+.1f}", f"{v / bare:.3f}x"]
        for k, v in wall.items()
    ]
    finder = ", ".join(f"{label}: {ok}" for label, ok in hook["finder_installed"].items())
    lines = [
        f"Interpreter start-up: `python -c pass` in throwaway venvs, {hook['runs']} runs each, interleaved "
        f"(import-hook engine active when installed: {finder})",
        "",
        format_table(["case", "median ms", "min ms", "vs bare ms", "ratio"], rows, right=(1, 2, 3, 4)),
        "",
    ]
    for label, it in hook["importtime"].items():
        mods = ", ".join(f"{n} {s}/{c} µs" for n, s, c in it["modules"]) or "none"
        lines.append(
            f"-X importtime ({label}, hook on): fsdp_compat modules imported at start-up (self/cumulative): "
            f"{mods}; total {it['total_us'] / 1e3:.2f} ms"
        )
        lines.append(
            f"import fsdp_compat._autoload + install() ({label}), timed in-process: median "
            f"{hook['direct_ms'][label]:.2f} ms"
        )
        added = wall[f"{label} (hook on)"] - bare
        worst = max(added, hook["direct_ms"][label])
        lines.append(
            f"target: activation < {TARGET_MS:.0f} ms at start-up ({label}) -> "
            f"{'HOLDS' if worst < TARGET_MS else 'MISSED'} (wall +{added:.1f} ms, in-process "
            f"{hook['direct_ms'][label]:.2f} ms)"
        )
    if verl is None:
        lines.append("\nverl: no verl venv with fsdp-compat installed found (pass --verl-venv); skipped")
        return "\n".join(lines)
    rows = []
    for target, modes in verl["targets"].items():
        off = modes["off"]["ms"]
        for mode, t in modes.items():
            rows.append(
                [
                    f"import {target}",
                    mode if mode == "off" else f"on ({mode})",
                    f"{t['ms']:.0f} (±{t['spread_ms'] / 2:.0f})",
                    "" if mode == "off" else f"{t['ms'] - off:+.0f}",
                    f"{t['importtime']['total_us'] / 1e3:.1f}",
                    "yes" if t["patched"] else "no",
                ]
            )
    lines += [
        "",
        f"verl {verl['verl']} ({verl['venv']}): FSDP_COMPAT=off vs on (median wall ms, ± half the range; these "
        "imports take seconds, so wall differences are noise-bound; the fsdp_compat column is -X importtime's "
        "cumulative time of the top-level fsdp_compat imports, i.e. what fsdp-compat adds)",
        "",
        format_table(
            ["command", "mode", "wall ms", "on - off ms", "fsdp_compat imports ms", "patched"],
            rows,
            right=(2, 3, 4),
        ),
    ]
    for target, modes in verl["targets"].items():
        for mode, t in modes.items():
            if mode == "off":
                continue
            top = sorted(t["importtime"]["modules"], key=lambda m: -m[2])[:4]
            lines.append(
                f"  import {target}, on ({mode}): largest fsdp_compat entries (cumulative µs): "
                + ", ".join(f"{n} {c}" for n, _, c in top)
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.startup", description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30, help="python -c pass runs per case")
    parser.add_argument("--verl-runs", type=int, default=2, help="import verl runs per case")
    parser.add_argument("--verl-venv", type=Path, default=DEFAULT_VERL_VENV)
    parser.add_argument("--no-verl", action="store_true")
    parser.add_argument("--compare", metavar="GIT_REF", help="also measure the package as committed at GIT_REF")
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fsdp_compat_ref_") as tmp:
        sources = None
        if args.compare:
            sources = {f"before ({args.compare})": export_ref(args.compare, Path(tmp) / "ref"), "after": ROOT}
        hook = bench_hook(args.runs, sources)
        verl = None if args.no_verl else bench_verl(args.verl_venv, args.verl_runs, sources)
    print(format_results(hook, verl))
    print(f"\n(startup: {time.monotonic() - t0:.0f}s wall)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
