"""A ``torch.compile``d submodule inside a guarded forward: the armed guard adds no graph break and changes no number
(a whole root under ``torch.compile``: tests/runtime/test_root_compile.py).

The armed guard keeps a ``TorchFunctionMode`` entered for the whole root forward, and Dynamo traces the modes on the
stack into every compiled region: a check it cannot trace would split the region (``fullgraph=True`` raises) or run
it op by op. Each case runs in one fresh gloo rank (1 rank, FSDP2 from ``fsdp_compat.apply_fsdp2``): the same model
from one seed, once with ``FSDP_COMPAT_GUARD=off`` and once armed, two forward + backward passes each, compiled with
``fullgraph=True`` through a counting ``aot_eager`` backend (the guard armed by hand: ``apply_fsdp2``'s own plan
needs no per-op check, so it installs the guard disarmed). Armed must compile the same frames and ops with the same
graph-break count (0) as off, with the guard's mode on the stack when the compiled code runs, and give equal losses
and gradients (``torch.equal``). A control run wraps the forward in a mode whose check Dynamo cannot trace: its
breaks must show up in the same counters (and ``fullgraph=True`` must raise), so a guard that broke graphs would
fail this test.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from fsdp_compat.testing.launch import run_ranks

TIMEOUT_S = 90  # per case: 3.5-26 s each seen on this shared 2-core machine
#: The rank routine below, as the rank processes import it (``tests/`` is on their ``PYTHONPATH``).
BODY = "runtime.test_guard_compile:compile_rank"
SCENARIOS = ("off", "armed", "breaking", "breaking-fullgraph")


# ------------------------------------------------------------------------------------------------------ rank side


def _net(compiled: str, backend: Any, fullgraph: bool) -> Any:
    """A tiny LM (embedding, two blocks, head) with one part compiled: ``inner`` wraps a block's MLP in
    ``torch.compile`` (a compiled submodule inside an FSDP2 group); ``block`` compiles a whole block in place
    (``nn.Module.compile``, the per-block pattern of torchtitan), which ``apply_fsdp2`` then shards as a group."""
    import torch
    from torch import nn

    class Mlp(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return self.down(nn.functional.gelu(self.up(h))) + h

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.mlp = nn.LayerNorm(16), Mlp()

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return self.mlp(self.norm(h))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(64, 16)
            self.layers = nn.ModuleList([Block(), Block()])
            self.head = nn.Linear(16, 64)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            h = self.embed(ids)
            for layer in self.layers:
                h = layer(h)
            return nn.functional.cross_entropy(self.head(h).flatten(0, 1), ids.flatten())

    torch.manual_seed(0)
    net = Net()
    if compiled == "inner":
        net.layers[1].mlp = torch.compile(net.layers[1].mlp, backend=backend, fullgraph=fullgraph)
    else:
        net.layers[1].compile(backend=backend, fullgraph=fullgraph)
    return net


def _scenario(name: str, compiled: str, mesh: Any) -> dict[str, Any]:
    """One model, two forward + backward passes; the compile counters, the losses and gradients it gave."""
    import torch
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters
    from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

    import fsdp_compat
    from fsdp_compat.runtime.guard import ENV_GUARD, guard_of

    class Breaking(TorchFunctionMode):
        """The control: a per-op check Dynamo cannot trace (an explicit graph break at every op)."""

        def __torch_function__(
            self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
        ) -> Any:
            torch._dynamo.graph_break()
            return func(*args, **(kwargs or {}))

    torch._dynamo.reset()
    counters.clear()
    counter = CompileCounterWithBackend("aot_eager")
    net = _net(compiled, counter, fullgraph=name != "breaking")
    os.environ[ENV_GUARD] = "off" if name == "off" else "on"
    fsdp_compat.apply_fsdp2(net, {"mesh": mesh}, layer_classes=[type(net.layers[0])])
    guard = guard_of(net)
    if guard is not None:
        guard.armed = True  # apply_fsdp2's own plan needs no per-op check: armed here to test the check itself
    # The mode stack once per forward, right before the compiled part is called (from the eager block before it: a
    # hook on the compiled part itself would be traced with it).
    stacks: list[list[str]] = []
    net.layers[0].register_forward_hook(
        lambda *_: stacks.append([type(m).__name__ for m in _get_current_function_mode_stack()])
    )
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    out: dict[str, Any] = {"armed": bool(guard and guard.armed), "error": None}
    losses = []
    try:
        for _ in range(2):
            if name.startswith("breaking"):
                with Breaking():
                    loss = net(ids)
            else:
                loss = net(ids)
            loss.backward()
            losses.append(loss.detach())
    except Exception as exc:  # the counters so far still say what happened
        out["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
    grads = [p.grad.full_tensor() if p.grad is not None else None for p in net.parameters()]
    out.update(
        frames=counter.frame_count,
        ops=counter.op_count,
        graph_breaks=sum(counters["graph_break"].values()),
        unique_graphs=counters["stats"]["unique_graphs"],
        stacks=stacks,
        losses=losses,
        grads=grads,
    )
    return out


def compile_rank(cfg: dict[str, Any], rank: int, extra: dict[str, Any]) -> None:
    """Every scenario in one rank process (Dynamo reset between them); tensors compared here, figures reported."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{cfg['port']}",
        rank=rank,
        world_size=cfg["world_size"],
        timeout=timedelta(seconds=cfg["timeout_s"]),
    )
    mesh = init_device_mesh("cpu", (cfg["world_size"],))
    runs = {name: _scenario(name, cfg["compiled"], mesh) for name in SCENARIOS}
    off = runs["off"]
    for run in runs.values():
        same = len(run["losses"]) == len(off["losses"]) and all(
            torch.equal(a, b) for a, b in zip(run["losses"], off["losses"], strict=True)
        )
        same = same and all(
            (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
            for a, b in zip(run["grads"], off["grads"], strict=True)
        )
        run["same_as_off"] = same and run["error"] is None
    for run in runs.values():  # JSON for the parent, once every run is compared
        run["losses"] = [float(x) for x in run["losses"]]
        run["grads_set"] = sum(g is not None for g in run.pop("grads"))
    extra["runs"] = runs
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------- the test


@pytest.mark.timeout(TIMEOUT_S + 30)
@pytest.mark.parametrize("compiled", ["inner", "block"], ids=["compiled-submodule", "compiled-fsdp2-block"])
def test_compiled_part_of_an_armed_forward_adds_no_graph_break(compiled: str) -> None:
    # FSDP_COMPAT=off: no start-up activation in the rank, so the guard is exactly what apply_fsdp2 installs (armed)
    result = run_ranks(BODY, {"compiled": compiled}, world_size=1, timeout_s=TIMEOUT_S, env={"FSDP_COMPAT": "off"})
    result.raise_for_error()
    runs = result.ranks[0].extra["runs"]
    off, armed, breaking, breaking_fullgraph = (runs[name] for name in SCENARIOS)

    # A real compile with the guard off: one frame, a graph with ops, no break, two passes, every gradient.
    assert off["error"] is None and not off["armed"], off
    assert off["frames"] >= 1 and off["ops"] > 0 and off["graph_breaks"] == 0, off
    assert off["grads_set"] > 0 and len(off["losses"]) == 2, off

    # Armed: the guard's mode is on the stack where the compiled part runs, and Dynamo compiles what it did without
    # it, in full (fullgraph=True did not raise), with equal numbers.
    assert armed["armed"] and all("_GuardMode" in stack for stack in armed["stacks"]) and armed["stacks"], armed
    assert armed["error"] is None, f"the armed guard broke the compiled graph (fullgraph=True): {armed['error']}"
    figures = ("frames", "ops", "graph_breaks", "unique_graphs")
    assert {k: armed[k] for k in figures} == {k: off[k] for k in figures}, (armed, off)
    assert armed["same_as_off"], (armed["losses"], off["losses"])

    # The control: a mode Dynamo cannot trace shows up in the same counters, and fullgraph=True refuses it.
    assert breaking["error"] is None and breaking["graph_breaks"] > 0 and breaking["frames"] > off["frames"], breaking
    assert breaking["same_as_off"], breaking  # a graph break changes no number either: only the counters tell
    assert breaking_fullgraph["error"] is not None, breaking_fullgraph
