"""Start-up cost of automatic activation: the ``.pth`` hook in every interpreter, and ``import verl`` with it.

``python -m benchmarks.startup [--runs 30] [--verl-venv /work/venvs/verl091 | --no-verl]``

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


def make_venvs(tmp: Path) -> tuple[Path, Path]:
    """Two throwaway venvs: bare, and with the .pth and the package installed (symlinked, no build)."""
    base = getattr(sys, "_base_executable", sys.executable)
    out = []
    for name in ("bare", "installed"):
        venv = tmp / name
        subprocess.run([base, "-m", "venv", "--without-pip", str(venv)], check=True)
        out.append(venv)
    site = _site_packages(out[1])
    shutil.copy(ROOT / "src_pth" / "fsdp_compat.pth", site / "fsdp_compat.pth")
    shutil.copytree(ROOT / "fsdp_compat", site / "fsdp_compat", ignore=shutil.ignore_patterns("__pycache__"))
    # pip byte-compiles what it installs; without .pyc files every start would compile the hook's modules.
    subprocess.run(
        [str(out[1] / "bin" / "python"), "-m", "compileall", "-q", str(site / "fsdp_compat")],
        check=True,
        env=_clean_env(),
    )
    return out[0], out[1]


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


def bench_hook(runs: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="fsdp_compat_startup_") as tmp:
        bare, installed = make_venvs(Path(tmp))
        py_bare, py_inst = str(bare / "bin" / "python"), str(installed / "bin" / "python")
        cases = {
            "bare (not installed)": (py_bare, _clean_env()),
            "installed (hook on)": (py_inst, _clean_env()),
            "installed, FSDP_COMPAT=off": (py_inst, _clean_env(FSDP_COMPAT="off")),
        }
        check = subprocess.run(
            [py_inst, "-c", "import sys; print(any(type(f).__name__ == '_TriggerFinder' for f in sys.meta_path))"],
            env=_clean_env(),
            capture_output=True,
            text=True,
        )
        times: dict[str, list[float]] = {k: [] for k in cases}
        for _ in range(2):  # warm the page cache
            for py, env in cases.values():
                _wall([py, "-c", "pass"], env)
        for _ in range(runs):
            for key, (py, env) in cases.items():
                times[key].append(_wall([py, "-c", "pass"], env))
        importtimes = [
            parse_importtime(
                subprocess.run(
                    [py_inst, "-X", "importtime", "-c", "pass"],
                    env=_clean_env(),
                    capture_output=True,
                    text=True,
                    check=True,
                ).stderr
            )
            for _ in range(5)
        ]
        importtime = sorted(importtimes, key=lambda r: r["total_us"])[2]  # the median run
        code = (
            "import sys, time; sys.path.insert(0, sys.argv[1]); t = time.perf_counter(); "
            "import fsdp_compat._autoload as a; ok = a.install(); print(time.perf_counter() - t, ok)"
        )
        direct = []
        for _ in range(runs):
            out = subprocess.run(
                [py_bare, "-c", code, str(_site_packages(installed))],
                env=_clean_env(),
                capture_output=True,
                text=True,
                check=True,
            ).stdout.split()
            direct.append(float(out[0]))
    return {
        "finder_installed": check.stdout.strip() == "True",
        "wall_ms": {k: _median_ms(v) for k, v in times.items()},
        "wall_min_ms": {k: min(v) * 1e3 for k, v in times.items()},
        "importtime": importtime,
        "direct_ms": _median_ms(direct),
        "runs": runs,
    }


def bench_verl(venv: Path, runs: int) -> dict[str, Any] | None:
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
    for target in ("verl", "verl.utils.fsdp_utils"):
        cmd = [str(python), "-c", f"import {target}"]
        imp = {
            mode: subprocess.run(
                [str(python), "-X", "importtime", "-c", f"import {target}"],
                env=_clean_env(**({"FSDP_COMPAT": "off"} if mode == "off" else {})),
                capture_output=True,
                text=True,
            ).stderr
            for mode in ("off", "on")
        }  # these runs also warm the page cache for the timed ones
        times: dict[str, list[float]] = {"off": [], "on": []}
        for _ in range(runs):
            times["off"].append(_wall(cmd, _clean_env(FSDP_COMPAT="off")))
            times["on"].append(_wall(cmd, _clean_env()))
        out["targets"][target] = {
            "off_ms": _median_ms(times["off"]),
            "on_ms": _median_ms(times["on"]),
            "off_spread_ms": (max(times["off"]) - min(times["off"])) * 1e3,
            "on_spread_ms": (max(times["on"]) - min(times["on"])) * 1e3,
            "importtime_off": parse_importtime(imp["off"]),
            "importtime": parse_importtime(imp["on"]),
            "patched": "patched verl" in imp["on"],
        }
    return out


def format_results(hook: dict[str, Any], verl: dict[str, Any] | None) -> str:
    wall = hook["wall_ms"]
    bare = wall["bare (not installed)"]
    rows = [
        [k, f"{v:.1f}", f"{hook['wall_min_ms'][k]:.1f}", f"{v - bare:+.1f}", f"{v / bare:.3f}x"]
        for k, v in wall.items()
    ]
    lines = [
        f"Interpreter start-up: `python -c pass` in a throwaway venv, {hook['runs']} runs each, interleaved "
        f"(finder active when installed: {hook['finder_installed']})",
        "",
        format_table(["case", "median ms", "min ms", "vs bare ms", "ratio"], rows, right=(1, 2, 3, 4)),
        "",
    ]
    it = hook["importtime"]
    mods = ", ".join(f"{n} {s}/{c} µs" for n, s, c in it["modules"]) or "none"
    lines.append(
        f"-X importtime (installed, hook on): fsdp_compat modules imported at start-up (self/cumulative): "
        f"{mods}; total {it['total_us'] / 1e3:.2f} ms"
    )
    lines.append(f"import fsdp_compat._autoload + install(), timed in-process: median {hook['direct_ms']:.2f} ms")
    added = wall["installed (hook on)"] - bare
    lines.append(
        f"target: activation < {TARGET_MS:.0f} ms at start-up -> "
        f"{'HOLDS' if max(added, hook['direct_ms']) < TARGET_MS else 'MISSED'} "
        f"(wall +{added:.1f} ms, in-process {hook['direct_ms']:.2f} ms)"
    )
    if verl is None:
        lines.append("\nverl: no verl venv with fsdp-compat installed found (pass --verl-venv); skipped")
        return "\n".join(lines)
    rows = []
    for target, t in verl["targets"].items():
        rows.append(
            [
                f"import {target}",
                f"{t['off_ms']:.0f} (±{t['off_spread_ms'] / 2:.0f})",
                f"{t['on_ms']:.0f} (±{t['on_spread_ms'] / 2:.0f})",
                f"{t['on_ms'] - t['off_ms']:+.0f}",
                f"{t['importtime_off']['total_us'] / 1e3:.1f}",
                f"{t['importtime']['total_us'] / 1e3:.1f}",
                "yes" if t["patched"] else "no",
            ]
        )
    lines += [
        "",
        f"verl {verl['verl']} ({verl['venv']}): FSDP_COMPAT=off vs default (median wall ms, ± half the "
        "range; these imports take seconds, so wall differences are noise-bound)",
        "",
        format_table(
            [
                "command",
                "off ms",
                "on ms",
                "on - off ms",
                "fsdp_compat imports ms, off",
                "fsdp_compat imports ms, on",
                "patched",
            ],
            rows,
            right=(1, 2, 3, 4, 5),
        ),
    ]
    for target, t in verl["targets"].items():
        top = sorted(t["importtime"]["modules"], key=lambda m: -m[2])[:4]
        lines.append(
            f"  import {target}, on: largest fsdp_compat entries (cumulative µs): "
            + ", ".join(f"{n} {c}" for n, _, c in top)
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.startup", description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30, help="python -c pass runs per case")
    parser.add_argument("--verl-runs", type=int, default=2, help="import verl runs per case")
    parser.add_argument("--verl-venv", type=Path, default=DEFAULT_VERL_VENV)
    parser.add_argument("--no-verl", action="store_true")
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    hook = bench_hook(args.runs)
    verl = None if args.no_verl else bench_verl(args.verl_venv, args.verl_runs)
    print(format_results(hook, verl))
    print(f"\n(startup: {time.monotonic() - t0:.0f}s wall)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
