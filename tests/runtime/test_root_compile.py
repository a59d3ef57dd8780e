"""``torch.compile`` of a whole FSDP2 root with fsdp-compat installed (the generic layer on a trainer's own groups).

A tiny LM whose root forward reads its embedding table raw (``F.embedding(ids, self.embed.weight)``, as many VLM
forwards read a position table): giving ``embed`` a ``fully_shard`` group of its own makes that read find the table
sharded. Each run: 2 gloo ranks, fp32, each rank on its own batch, the root compiled as a whole
(``torch.compile(model, backend="aot_eager")``), 2 AdamW steps; each rank reports its losses and its parameters after
the steps.

- A safe grouping (``proj`` and the root): with fsdp-compat installed it runs exactly as plain FSDP2 compiled
  (``FSDP_COMPAT=off``): the same losses and parameters, bit for bit; the guard is installed disarmed.
- The unsafe grouping (``embed`` too): plain FSDP2 compiled crashes at the raw read; with fsdp-compat the guard
  cannot run its per-op check inside the compiled region, so it unshards the group its check named (``embed``) at the
  pass's start and holds it to the end of backward: the run trains, equal to the safe grouping's run bit for bit.
"""

from __future__ import annotations

from typing import Any

import pytest
from lab.support import BREADTH, OFF, ON, WORLD_SIZE, rank_output

from fsdp_compat.testing.launch import RunResult, run_ranks

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]

BODY = "runtime.test_root_compile:root_compile_rank"


def root_compile_rank(cfg: dict[str, Any], rank: int, extra: dict[str, Any]) -> None:
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fsdp_compat.testing.parity import init_group, loss_scale

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(64, 16)
            self.proj = nn.Linear(16, 16)
            self.head = nn.Linear(16, 64)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            h = F.embedding(ids, self.embed.weight)  # a raw read: embed's own forward never runs
            h = torch.tanh(self.proj(h)) + h
            return F.cross_entropy(self.head(h).flatten(0, 1), ids.flatten())

    init_group(cfg, rank)
    torch.manual_seed(0)
    net = Net()
    mesh = init_device_mesh("cpu", (cfg["world_size"],))
    if cfg["grouping"] == "unsafe":
        fully_shard(net.embed, mesh=mesh)
    fully_shard(net.proj, mesh=mesh)
    fully_shard(net, mesh=mesh)
    compiled = torch.compile(net, backend="aot_eager")
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(100 + rank))
    losses = []
    for _ in range(2):
        loss = compiled(ids)
        (loss * loss_scale(mesh)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    extra["losses"] = losses
    extra["params"] = [p.full_tensor().flatten().tolist() for p in net.parameters()]
    from fsdp_compat.runtime.guard import guard_of

    guard = guard_of(net)
    extra["guard"] = None if guard is None else {"armed": guard.armed, "unsafe": guard.unsafe_groups,
                                                 "unshards": guard.unshards}  # fmt: skip


def _run(grouping: str, env: dict[str, str | None]) -> RunResult:
    return run_ranks(BODY, {"grouping": grouping}, world_size=WORLD_SIZE, timeout_s=300, env={**ON, **env})


@BREADTH  # the torch-pinned envs run the unsafe grouping, which runs the safe one as its reference
def test_a_compiled_root_on_a_safe_grouping_runs_as_plain_fsdp2_compiled() -> None:
    plain, ours = _run("safe", OFF), _run("safe", {})
    plain.raise_for_error()
    ours.raise_for_error()
    for a, b in zip(plain.ranks, ours.ranks, strict=True):
        assert a.extra["losses"] == b.extra["losses"] and a.extra["params"] == b.extra["params"], rank_output(ours)
        assert a.extra["guard"] is None and b.extra["guard"]["armed"] is False, b.extra["guard"]


def test_a_compiled_root_on_a_grouping_the_guard_must_mend_trains() -> None:
    off = _run("unsafe", OFF)
    assert not off.ok and "got mixed torch.Tensor and DTensor" in "\n".join(r.error or "" for r in off.ranks), (
        rank_output(off)
    )
    safe, ours = _run("safe", {}), _run("unsafe", {})
    safe.raise_for_error()
    ours.raise_for_error()
    for a, b in zip(safe.ranks, ours.ranks, strict=True):
        assert b.extra["guard"] == {"armed": True, "unsafe": ["embed"], "unshards": 2}, b.extra["guard"]
        assert a.extra["losses"] == b.extra["losses"] and a.extra["params"] == b.extra["params"], rank_output(ours)
