"""Process launching for distributed tests: W fresh rank interpreters, one deadline, every process reaped.

Each rank is a fresh interpreter (``subprocess``, its own session) so that environment switches and ``.pth``
start-up hooks behave as in a real launch, and so that the parent can kill a rank and anything it started.
Ranks write their result as JSON; the parent enforces one deadline for the whole run, kills every other rank
shortly after one fails (no waiting for gloo's timeout), and always reaps every process it started. Nothing here
imports torch: what a rank runs is named as ``"package.module:function"`` (see :func:`run_ranks`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import site
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fsdp_compat.testing.crashes import GLOO_MISMATCH

__all__ = ["RankResult", "RunResult", "current_wording", "rank_entry", "run_ranks", "spawn_ranks"]

#: Errors that older torch releases word differently: (older wording, the wording of torch >= 2.10).
_OLDER_WORDINGS = (
    (".default: got mixed", ".default got mixed"),  # DTensor's mixed-operand error, torch 2.8
    # gloo's mismatched collective (one rank's all-gather or reduce-scatter larger than the other's), torch 2.8
    ("op.preamble.length <= op.nbytes", GLOO_MISMATCH),
)


def current_wording(text: str) -> str:
    """``text`` with the older torch releases' wordings of the same failures rewritten to the current one, so that a
    test or smoke row that expects a crash names it once, whatever torch the ranks ran."""
    for old, new in _OLDER_WORDINGS:
        text = text.replace(old, new)
    return text

_FAIL_GRACE_S = 2.0  # after one rank fails, how long the others get to report their own error before the kill


@dataclass
class RankResult:
    """What one rank measured, or why it failed."""

    rank: int
    ok: bool
    losses: list[float] = field(default_factory=list)
    max_abs_grad_diff: float = math.nan  # max over steps, params, elements of |g_fsdp - g_ref|
    max_rel_grad_diff: float = math.nan  # ... of |g_fsdp - g_ref| / max(1, |g_ref|)
    max_abs_param_diff: float = math.nan  # after each optimizer step
    max_rel_param_diff: float = math.nan
    step_time_s: float = math.nan  # median FSDP step time (forward, backward, optimizer step)
    error: str | None = None  # full traceback text of this rank, or "timed out after Ns"
    extra: dict[str, Any] = field(default_factory=dict)


def _nanmax(values: list[float]) -> float:
    vals = [v for v in values if not math.isnan(v)]
    return max(vals) if vals else math.nan


@dataclass
class RunResult:
    """All ranks of one run."""

    ranks: list[RankResult]
    seconds: float = math.nan  # wall time of the whole run, start-up included
    relaunches: int = 0  # launches thrown away because another process took the chosen port before rank 0 bound it

    @property
    def ok(self) -> bool:
        return bool(self.ranks) and all(r.ok for r in self.ranks)

    @property
    def error(self) -> str | None:
        """The first failing rank's text: the rank that failed earliest (the cause, not a peer's echo)."""
        for r in self.failing_ranks:
            return f"rank {r.rank}: {r.error}"
        return None if self.ranks else "no ranks ran"

    @property
    def failing_ranks(self) -> list[RankResult]:
        """Failing ranks, earliest failure first (ranks that were killed come last)."""
        failed = [r for r in self.ranks if not r.ok]
        return sorted(failed, key=lambda r: (float(r.extra.get("failed_at", math.inf)), r.rank))

    @property
    def exception(self) -> str | None:
        """The first failing rank's exception line, e.g. ``RuntimeError: aten.grid_sampler_2d...``."""
        for r in self.failing_ranks:
            if r.extra.get("exception"):
                return str(r.extra["exception"])
        first = self.error
        return first.splitlines()[-1] if first else None

    def _worst(self, figure: str) -> float:
        """A parity figure over the ranks: NaN if any rank that ran measured NaN (a NaN fails); NaN when none ran."""
        measured = [getattr(r, figure) for r in self.ranks if r.ok]
        if any(math.isnan(v) for v in measured):
            return math.nan
        return max(measured) if measured else _nanmax([getattr(r, figure) for r in self.ranks])

    @property
    def max_abs_grad_diff(self) -> float:
        return self._worst("max_abs_grad_diff")

    @property
    def max_rel_grad_diff(self) -> float:
        return self._worst("max_rel_grad_diff")

    @property
    def max_abs_param_diff(self) -> float:
        return self._worst("max_abs_param_diff")

    @property
    def max_rel_param_diff(self) -> float:
        return self._worst("max_rel_param_diff")

    @property
    def step_time_s(self) -> float:
        return _nanmax([r.step_time_s for r in self.ranks])

    def raise_for_error(self) -> None:
        """Raise AssertionError carrying every failing rank's traceback."""
        if self.ok:
            return
        if not self.ranks:
            raise AssertionError("distributed run produced no rank results")
        parts = [f"--- rank {r.rank} ---\n{r.error}" for r in self.failing_ranks]
        raise AssertionError(f"{len(parts)} of {len(self.ranks)} ranks failed:\n" + "\n".join(parts))


# ------------------------------------------------------------------------------------------------------------
# Parent side


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wrap_spec(fn: Any) -> str | None:
    """Accept "module:function" or an importable module-level function."""
    if fn is None or isinstance(fn, str):
        return fn
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or "<" in qualname or module == "__main__":
        from fsdp_compat.errors import FsdpCompatError

        raise FsdpCompatError(
            f"wrap/probe {fn!r} is not importable in a fresh process; pass a 'package.module:function' "
            "string naming a module-level function"
        )
    return f"{module}:{qualname}"


def _child_env(env: dict[str, str | None] | None) -> dict[str, str]:
    """The parent's environment, plus ``env``, plus the folder holding this fsdp_compat on PYTHONPATH."""
    out = dict(os.environ)
    for key, value in (env or {}).items():
        if value is None:  # None removes a variable from the ranks' environment
            out.pop(key, None)
        else:
            out[key] = value
    root = str(Path(__file__).resolve().parents[2])
    site_dirs = {str(Path(p).resolve()) for p in [*site.getsitepackages(), site.getusersitepackages()]}
    if root not in site_dirs:
        parts = [p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p]
        if root not in parts:
            out["PYTHONPATH"] = os.pathsep.join([root, *parts])
    out.setdefault("PYTHONUNBUFFERED", "1")
    return out


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL a still-running rank's whole session (the rank and anything it started), then reap it.

    Only while the rank is unreaped does its pid name our session for sure, so an exited rank is not signalled.
    """
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def spawn_ranks(
    work: Path,
    code: str,
    world_size: int,
    env: dict[str, str],
    *,
    python: str | None = None,
    cwd: str | None = None,
) -> list[subprocess.Popen[bytes]]:
    """Start ``world_size`` fresh interpreters running ``code`` with argv ``WORK RANK``, each in its own session
    (so a kill takes its children too), output in ``WORK/rank<N>.log``."""
    procs: list[subprocess.Popen[bytes]] = []
    for rank in range(world_size):
        with open(work / f"rank{rank}.log", "wb") as out:  # Popen dups the descriptor
            procs.append(
                subprocess.Popen(
                    [python or sys.executable, "-c", code, str(work), str(rank)],
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    cwd=cwd,
                )
            )
    return procs


def _tail(path: Path, limit: int = 4000) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return text[-limit:]


#: How often :func:`run_ranks` relaunches when the port it chose was taken before rank 0 could bind it (another
#: process's socket in the moment between choosing and binding; seen on a busy machine).
_PORT_RELAUNCHES = 2
_PORT_TAKEN = ("EADDRINUSE", "address already in use")


def run_ranks(
    body: str,
    cfg: dict[str, Any],
    *,
    world_size: int = 2,
    timeout_s: float = 180.0,
    env: dict[str, str | None] | None = None,
    python: str | None = None,
) -> RunResult:
    """Run ``body(cfg, rank, extra)`` ("package.module:function", see :func:`rank_entry`) on ``world_size``
    fresh ranks under one deadline; the rank code gets ``cfg`` plus ``world_size``, ``timeout_s`` and a free
    ``port`` for its process group. A rank that fails gets the others killed shortly after; all are reaped. Where
    the chosen port was taken before rank 0 bound it (``EADDRINUSE``), the ranks are started again on another port,
    within the same deadline (``RunResult.relaunches``)."""
    start = time.monotonic()
    deadline = start + timeout_s
    child_env = _child_env(env)
    relaunches = 0
    while True:
        run_cfg = {**cfg, "world_size": world_size, "timeout_s": timeout_s, "port": _free_port()}
        ranks = _launch(body, run_cfg, world_size, deadline, child_env, python)
        if relaunches >= _PORT_RELAUNCHES or time.monotonic() >= deadline or not _port_taken(ranks):
            return RunResult(ranks=ranks, seconds=time.monotonic() - start, relaunches=relaunches)
        relaunches += 1


def _port_taken(ranks: list[RankResult]) -> bool:
    """Whether the run failed because its rendezvous port was taken (then nothing of the body's work was done)."""
    return any(not r.ok and any(s in (r.error or "") for s in _PORT_TAKEN) for r in ranks)


def _launch(
    body: str,
    cfg: dict[str, Any],
    world_size: int,
    deadline: float,
    child_env: dict[str, str],
    python: str | None,
) -> list[RankResult]:
    """One launch of :func:`run_ranks`: start the ranks, wait for them (or the first failure, or the deadline),
    reap them all and collect what each reported."""
    timeout_s = cfg["timeout_s"]
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="fsdp_compat_run_") as tmp:
        work = Path(tmp)
        (work / "config.json").write_text(json.dumps(cfg))
        code = f"from fsdp_compat.testing.launch import _body_main; _body_main({body!r})"
        killed_reason: dict[int, str] = {}
        try:
            procs.extend(spawn_ranks(work, code, world_size, child_env, python=python))
            first_failure: float | None = None
            while True:
                codes = [p.poll() for p in procs]
                if all(c is not None for c in codes):
                    break
                now = time.monotonic()
                if first_failure is None and any(c not in (None, 0) for c in codes):
                    first_failure = now
                if first_failure is not None and now - first_failure > _FAIL_GRACE_S:
                    for rank, p in enumerate(procs):
                        if p.poll() is None:
                            killed_reason[rank] = "killed: another rank failed first (see its traceback)"
                    break
                if now > deadline:
                    for rank, p in enumerate(procs):
                        if p.poll() is None:
                            killed_reason[rank] = f"timed out after {timeout_s:g}s"
                    break
                time.sleep(0.05)
        finally:
            for p in procs:
                _kill_group(p)
        return [_collect(work, rank, p, killed_reason.get(rank)) for rank, p in enumerate(procs)]


def _collect(work: Path, rank: int, proc: subprocess.Popen[bytes], killed: str | None) -> RankResult:
    path = work / f"rank{rank}.json"
    log = _tail(work / f"rank{rank}.log")
    if path.exists():
        try:
            data = json.loads(path.read_text())
            result = RankResult(**data)
            result.extra["pid"] = proc.pid
            if log:
                result.extra.setdefault("log_tail", log)
            return result
        except (ValueError, TypeError):
            pass
    if killed:
        error = f"{killed}\n--- output tail ---\n{log}" if log else killed
    else:
        error = f"rank exited with code {proc.returncode} without reporting a result\n--- output tail ---\n{log}"
    return RankResult(rank=rank, ok=False, error=error, extra={"exit_code": proc.returncode, "pid": proc.pid})


# ------------------------------------------------------------------------------------------------------------
# Rank side


def _resolve(spec: str) -> Any:
    import importlib

    module_name, _, attr = spec.partition(":")
    if not attr:
        raise ValueError(f"wrap fn {spec!r} must look like 'package.module:function'")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return str(value) if hasattr(value, "__str__") else repr(value)


def _exit_when_orphaned() -> None:
    """Ranks run in their own session; if the parent dies without killing them (SIGKILL), they exit too."""
    import threading

    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(3)

    threading.Thread(target=watch, name="fsdp-compat-orphan-watch", daemon=True).start()


def _body_main(body: str) -> None:
    """Entry point of one rank of :func:`run_ranks`: ``body`` names the rank routine."""
    rank_entry(_resolve(body))


def rank_entry(body: Callable[[dict[str, Any], int, dict[str, Any]], RankResult | None]) -> None:
    """Run ``body(cfg, rank, extra)`` in a rank started by :func:`spawn_ranks` and write ``rank<N>.json``.

    A body that returns None succeeded; an exception becomes a failed RankResult carrying its traceback.
    """
    work, rank = Path(sys.argv[1]), int(sys.argv[2])
    _exit_when_orphaned()
    cfg = json.loads((work / "config.json").read_text())
    extra: dict[str, Any] = {}
    try:
        result = body(cfg, rank, extra) or RankResult(rank=rank, ok=True, extra=extra)
    except BaseException as exc:
        extra["failed_at"] = time.time()
        extra["exception"] = traceback.format_exception_only(type(exc), exc)[-1].strip()
        result = RankResult(rank=rank, ok=False, error=traceback.format_exc(), extra=_jsonable_dict(extra))
    tmp = work / f"rank{rank}.json.tmp"
    tmp.write_text(json.dumps(asdict(result), default=str))
    tmp.replace(work / f"rank{rank}.json")
    sys.stdout.flush()
    sys.stderr.flush()
    # No atexit/process-group teardown: after a failure the peers may be stuck in a collective.
    os._exit(0 if result.ok else 1)


def _jsonable_dict(d: dict[str, Any]) -> dict[str, Any]:
    return {k: _jsonable(v) for k, v in d.items()}
