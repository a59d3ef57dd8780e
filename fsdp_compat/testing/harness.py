"""Distributed FSDP2 training harness: W fresh ranks, N AdamW steps, exact parity against one process.

Each rank is a fresh interpreter (``subprocess``, its own session) so that environment switches and ``.pth``
start-up hooks behave as in a real launch, and so that the parent can kill a rank and anything it started.
Ranks write their result as JSON; the parent enforces one deadline for the whole run, kills every other rank
shortly after one fails (no waiting for gloo's timeout), and always reaps every process it started.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import site
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "RankResult",
    "RunResult",
    "SmokeRow",
    "WrapFn",
    "format_smoke_table",
    "gradient_reduction_factor",
    "rank_batches",
    "reference_backward",
    "run_ranks",
    "run_training",
]

WrapFn = str  # "package.module:function", imported in each rank; called as fn(model, fsdp_kwargs) -> Any

PARITY_TOL = 1e-6  # max |Δ| / max(1, |reference|) accepted as exact fp32 parity
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

    @property
    def max_abs_grad_diff(self) -> float:
        return _nanmax([r.max_abs_grad_diff for r in self.ranks])

    @property
    def max_rel_grad_diff(self) -> float:
        return _nanmax([r.max_rel_grad_diff for r in self.ranks])

    @property
    def max_abs_param_diff(self) -> float:
        return _nanmax([r.max_abs_param_diff for r in self.ranks])

    @property
    def max_rel_param_diff(self) -> float:
        return _nanmax([r.max_rel_param_diff for r in self.ranks])

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


def run_training(
    model: str,
    wrap: WrapFn,
    *,
    world_size: int = 2,
    steps: int = 3,
    device: str = "cpu",
    timeout_s: float = 180.0,
    env: dict[str, str | None] | None = None,
    seed: int = 0,
    wrap_kwargs: dict[str, Any] | None = None,
    probe: WrapFn | None = None,
    python: str | None = None,
    variants: list[str] | None = None,
    same_batch: bool = False,
) -> RunResult:
    """Train zoo model ``model`` for ``steps`` AdamW steps on ``world_size`` ranks under ``wrap``: data-parallel.

    Every rank builds the model with ``seed`` and its own micro-batch (seed ``seed + rank``; ``variants[rank]``
    picks a vision-language model's kind of batch, e.g. ``["image", "text"]``), deep-copies the model as the
    single-process reference, and calls the wrap fn as ``fn(model, fsdp_kwargs)``. The reference trains on all the
    ranks' micro-batches with the mean of their losses (one backward per micro-batch of ``loss / world_size``,
    so that with 2 ranks its gradient sums are the ones FSDP2's reduce-scatter makes: exact, 0.0). Gradients are
    compared after each backward and parameters after each AdamW step. ``same_batch`` gives every rank rank 0's
    micro-batch. ``env`` is set in each rank before Python starts (a None value unsets that variable); ``python``
    runs the ranks under another interpreter (e.g. a framework's venv).
    """
    if world_size < 1:
        from fsdp_compat.errors import FsdpCompatError

        raise FsdpCompatError(f"world_size must be >= 1, got {world_size}")
    cfg = {
        "model": model,
        "wrap": _wrap_spec(wrap),
        "probe": _wrap_spec(probe),
        "steps": steps,
        "device": device,
        "seed": seed,
        "wrap_kwargs": wrap_kwargs or {},
        "variants": list(variants) if variants else None,
        "same_batch": same_batch,
    }
    if variants is not None and len(variants) != world_size:
        from fsdp_compat.errors import FsdpCompatError

        raise FsdpCompatError(f"variants names one batch kind per rank: {len(variants)} for {world_size} ranks")
    return run_ranks(
        "fsdp_compat.testing.harness:_train", cfg, world_size=world_size, timeout_s=timeout_s, env=env, python=python
    )


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
    ``port`` for its process group. A rank that fails gets the others killed shortly after; all are reaped."""
    start = time.monotonic()
    deadline = start + timeout_s
    cfg = {**cfg, "world_size": world_size, "timeout_s": timeout_s, "port": _free_port()}
    child_env = _child_env(env)
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="fsdp_compat_run_") as tmp:
        work = Path(tmp)
        (work / "config.json").write_text(json.dumps(cfg))
        code = f"from fsdp_compat.testing.harness import _body_main; _body_main({body!r})"
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
        ranks = [_collect(work, rank, p, killed_reason.get(rank)) for rank, p in enumerate(procs)]
    return RunResult(ranks=ranks, seconds=time.monotonic() - start)


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


def _full(t: Any) -> Any:
    """A DTensor's full value (a collective: every rank calls it in the same order), else the tensor."""
    if t is None:
        return None
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


class _Diff:
    """Running max of absolute and relative differences, and where the worst one was."""

    def __init__(self) -> None:
        self.abs = 0.0
        self.rel = 0.0
        self.where = ""

    def add(self, name: str, got: Any, ref: Any) -> None:
        import torch

        if got is None and ref is None:
            return
        got = torch.zeros_like(ref) if got is None else got.detach().float()
        ref = torch.zeros_like(got) if ref is None else ref.detach().float()
        diff = (got - ref).abs()
        if diff.numel() == 0:
            return
        a = float(diff.max())
        r = float((diff / ref.abs().clamp_min(1.0)).max())
        if not (a <= self.abs):  # also catches nan
            self.abs = a
        if not (r <= self.rel):
            self.rel, self.where = r, name


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


def _train(cfg: dict[str, Any], rank: int, extra: dict[str, Any]) -> RankResult:
    """Set up the process group, wrap, train and compare; ``extra`` collects facts even when this fails."""
    import copy
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_compat.testing.zoo import build_model

    world_size, steps, device = cfg["world_size"], cfg["steps"], cfg["device"]
    cuda = device.startswith("cuda")
    extra.update(world_size=world_size, backend="nccl" if cuda else "gloo")
    t0 = time.perf_counter()
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
        dev = torch.device("cuda", torch.cuda.current_device())
    else:
        dev = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))  # ranks share the CPU cores
    dist.init_process_group(
        backend=extra["backend"],
        init_method=f"tcp://127.0.0.1:{cfg['port']}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=cfg["timeout_s"]),
    )
    model = build_model(cfg["model"], seed=cfg["seed"], device=dev)
    reference = copy.deepcopy(model)
    mesh = init_device_mesh(dev.type, (world_size,))
    fsdp_kwargs = {"mesh": mesh, "reshard_after_forward": True, **cfg["wrap_kwargs"]}
    extra["wrap"] = _jsonable(_resolve(cfg["wrap"])(model, fsdp_kwargs))
    extra["fsdp_groups"] = _fsdp_group_paths(model)
    extra["fsdp_group_sets"] = _fsdp_group_sets(model)
    extra["setup_s"] = time.perf_counter() - t0

    batches = rank_batches(cfg, dev)
    batch = batches[rank]
    scale = 1.0 / gradient_reduction_factor(mesh)  # torch 2.8's FSDP2 over gloo sums gradients instead of averaging
    extra["gradient_reduction_factor"] = 1.0 / scale
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    ref_params = dict(reference.named_parameters())
    grads, params = _Diff(), _Diff()
    losses: list[float] = []
    ref_losses: list[float] = []
    times: list[float] = []
    for _ in range(steps):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        loss = model(**batch).loss
        (loss * scale if scale != 1.0 else loss).backward()
        t_fb = time.perf_counter() - t
        ref_loss = reference_backward(reference, batches)[rank]
        named = list(model.named_parameters())
        with torch.no_grad():
            for name, p in named:
                grads.add(name, _full(p.grad), ref_params[name].grad)
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        times.append(t_fb + time.perf_counter() - t)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for name, p in named:
                params.add(name, _full(p), ref_params[name])
        losses.append(float(loss.detach()))
        ref_losses.append(float(ref_loss.detach()))
    extra["reference_losses"] = ref_losses
    extra["mixed_batches"] = _mixed_batch_counters(model)
    guard = _guard_of(model)
    extra["guard_unshards"] = guard.unshards if guard is not None else None
    extra["worst_grad_param"] = grads.where
    extra["worst_param"] = params.where
    if cfg.get("probe"):
        extra["probe"] = _jsonable(_resolve(cfg["probe"])())
    return RankResult(
        rank=rank,
        ok=True,
        losses=losses,
        max_abs_grad_diff=grads.abs,
        max_rel_grad_diff=grads.rel,
        max_abs_param_diff=params.abs,
        max_rel_param_diff=params.rel,
        step_time_s=statistics.median(times) if times else math.nan,
        extra=extra,
    )


def _mixed_batch_counters(model: Any) -> dict[str, int]:
    """This rank's dummy vision-tower calls and count exchanges (:mod:`fsdp_compat.mixed_batches`)."""
    from fsdp_compat.mixed_batches import mixed_batches_of

    installed = mixed_batches_of(model)
    return {
        "installed": len(installed),
        "dummy_calls": sum(m.dummy_calls for m in installed),
        "exchanges": sum(m.exchanges for m in installed),
    }


def _guard_of(model: Any) -> Any:
    from fsdp_compat.guard import guard_of

    return guard_of(model)


def rank_batches(cfg: dict[str, Any], device: Any) -> list[dict[str, Any]]:
    """Every rank's micro-batch (each rank builds all of them, for the reference): seed ``seed + rank`` and
    ``variants[rank]``, or rank 0's batch everywhere when ``same_batch``."""
    from fsdp_compat.testing.zoo import is_vlm, make_batch

    world, seed, name = cfg["world_size"], cfg["seed"], cfg["model"]
    variants = cfg.get("variants") or ["image"] * world
    out = []
    for r in range(world):
        kw = {"variant": variants[r]} if is_vlm(name) else {}
        out.append(make_batch(name, seed=seed if cfg.get("same_batch") else seed + r, device=device, **kw))
    return out


def reference_backward(reference: Any, batches: list[dict[str, Any]]) -> list[Any]:
    """One process training on all the ranks' micro-batches with the mean loss: ``(loss_r / W).backward()`` per
    micro-batch, accumulating into ``.grad``. Returns the per-micro-batch losses (unscaled)."""
    losses = []
    for b in batches:
        loss = reference(**b).loss
        (loss / len(batches)).backward()
        losses.append(loss.detach())
    return losses


def gradient_reduction_factor(mesh: Any) -> float:
    """What FSDP2 does to gradients across ranks on this torch and backend: 1.0 = averages (torch >= 2.9, NCCL),
    the world size = sums (torch 2.8 over gloo). Measured on a one-weight probe, so a test can scale its loss and
    still compare with the one-process mean; the product never does this."""
    import torch
    from torch.distributed.fsdp import fully_shard

    probe = torch.nn.Linear(1, 1, bias=False, device=mesh.device_type)
    with torch.no_grad():
        probe.weight.fill_(1.0)
    fully_shard(probe, mesh=mesh)
    probe(torch.ones(1, 1, device=mesh.device_type)).sum().backward()
    return float(_full(probe.weight.grad).item())


def _fsdp_group_sets(model: Any) -> list[list[str]]:
    """Module paths grouped by FSDP2 state: ``fully_shard([a, b])`` gives one entry with both paths."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    sets: dict[int, list[str]] = {}
    for path, m in model.named_modules(remove_duplicate=False):
        if isinstance(m, FSDPModule):
            paths = sets.setdefault(id(fully_shard.state(m)), [])
            if path not in paths:
                paths.append(path)
    return list(sets.values())


def _fsdp_group_paths(model: Any) -> list[str]:
    """Paths of the modules that are FSDP2 groups ("" is the root), in ``named_modules`` order."""
    from torch.distributed.fsdp import FSDPModule

    return [path for path, m in model.named_modules() if isinstance(m, FSDPModule)]


# ------------------------------------------------------------------------------------------------------------
# Smoke tables


@dataclass
class SmokeRow:
    """One line of a smoke table: a framework/case, what should happen, and what did."""

    framework: str  # "core", "verl 0.9.1", "skyrl-train 0.3.1"
    case: str  # "legacy", "auto", "unpatched", "patched (pth hook)"...
    expected: str  # "crash" | "ok"
    outcome: str  # "crash" | "ok"
    detail: str  # the crash's exception line, or "parity Δgrad=0.0 Δparam=0.0"
    max_rel_grad_diff: float | None
    max_rel_param_diff: float | None
    seconds: float
    expect_text: str = ""  # for expected crashes: text the exception line must contain
    tolerance: float = 0.0  # for expected parity: the max relative difference accepted (0.0: exact)

    @property
    def passed(self) -> bool:
        if self.outcome != self.expected:
            return False
        if self.expected == "crash":  # torch 2.8 words DTensor's error "aten.op.default: got mixed ..."
            return self.expect_text in self.detail.replace(".default: got mixed", ".default got mixed")
        return (
            self.max_rel_grad_diff is not None
            and self.max_rel_param_diff is not None
            and self.max_rel_grad_diff <= self.tolerance  # NaN fails: every comparison with NaN is False
            and self.max_rel_param_diff <= self.tolerance
        )

    @classmethod
    def from_run(
        cls,
        framework: str,
        case: str,
        expected: str,
        run: RunResult,
        *,
        expect_text: str = "",
        tolerance: float = 0.0,
    ) -> SmokeRow:
        """Summarise a :class:`RunResult` as a row. A crash's detail is the line naming ``expect_text`` in any
        rank's report (an aborted rank leaves only its output), else the first failing rank's exception line."""
        if run.ok:
            g, p = run.max_rel_grad_diff, run.max_rel_param_diff
            detail = f"parity Δgrad={_fmt(g)} Δparam={_fmt(p)}"
            return cls(framework, case, expected, "ok", detail, g, p, run.seconds, expect_text, tolerance)
        detail = run.exception or ""
        if expect_text and expect_text not in detail:
            texts = [f"{r.error or ''}\n{r.extra.get('log_tail', '')}" for r in run.failing_ranks]
            lines = [ln[ln.index(expect_text) :] for text in texts for ln in text.splitlines() if expect_text in ln]
            detail = f"(a rank aborted) {lines[0]}" if lines else detail
        return cls(framework, case, expected, "crash", detail, None, None, run.seconds, expect_text, tolerance)


def _fmt(x: float) -> str:
    return "0.0" if x == 0 else f"{x:.3g}"


def format_smoke_table(rows: list[SmokeRow]) -> str:
    """A plain-text table: one row per case, PASS/FAIL, and the crash line or the parity figures."""
    header = ("framework", "case", "expected", "outcome", "result", "seconds", "detail")
    body = [
        (
            r.framework,
            r.case,
            r.expected,
            r.outcome,
            "PASS" if r.passed else "FAIL",
            f"{r.seconds:.1f}",
            r.detail.splitlines()[0] if r.detail else "",
        )
        for r in rows
    ]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *body, strict=True)]
    widths[-1] = 0  # the detail column is last and not padded
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=True)).rstrip() for row in (header, *body)]
    lines.insert(1, "  ".join("-" * max(w, 6) for w in widths).rstrip())
    return "\n".join(lines)
