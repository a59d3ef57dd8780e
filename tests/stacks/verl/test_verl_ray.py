"""Ray: two actors of a local Ray instance form the gloo group and call verl's own ``apply_fsdp2`` on tiny GLM4V.

The actor class is shipped to the workers by value and imports nothing from fsdp_compat: the patch must come from
the environment alone (verl's ``verl.plugins`` entry point on 0.9+, else the installed ``.pth`` hook), in both
actors. Each actor reports its adapter state and its gradient/parameter parity against an unsharded copy.
"""

from __future__ import annotations

import importlib
import os
import re
import site
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from lab.support import require_framework
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from fsdp_compat.testing.crashes import GRID_SAMPLER_CRASH

VERL = require_framework("verl", lambda: Version(metadata.version("verl")))
ray = require_framework("ray", lambda: importlib.import_module("ray"))

pytestmark = [pytest.mark.slow]

TIMEOUT_S = 300.0
ADAPTER_MODULE = "fsdp_compat.adapters.verl"


class Trainer:
    """A Ray actor: one gloo rank training tiny GLM4V through verl's apply_fsdp2 (no fsdp_compat import here)."""

    def __init__(self, rank: int, world_size: int, port: int) -> None:
        self.rank, self.world_size, self.port = rank, world_size, port

    def run(self, config: dict[str, Any], state: dict[str, Any], batches: list[dict[str, Any]], call_site: str) -> dict:
        """Train this rank's own micro-batch; the one-process twin trains on every rank's with the mean loss."""
        import copy
        import importlib
        from datetime import timedelta

        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from transformers import Glm4vConfig, Glm4vForConditionalGeneration

        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{self.port}",
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=120),
        )
        cfg = Glm4vConfig.from_dict(config)
        cfg._attn_implementation = "eager"
        model = Glm4vForConditionalGeneration(cfg)
        model.load_state_dict(state)
        model.train()
        reference = copy.deepcopy(model)
        apply_fsdp2 = importlib.import_module(call_site).apply_fsdp2  # verl's call site binding
        mesh = init_device_mesh("cpu", (self.world_size,))
        apply_fsdp2(model, {"mesh": mesh, "reshard_after_forward": True}, {"wrap_policy": {}})
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
        ref_params = dict(reference.named_parameters())

        from fsdp_compat.testing.parity import full_tensor as full

        grad_diff = param_diff = 0.0
        losses = []
        for _ in range(2):
            loss = model(**batches[self.rank]).loss
            loss.backward()
            for other in batches:  # one backward per micro-batch of loss / W: FSDP2's reduce-scatter sums, 2 ranks
                (reference(**other).loss / len(batches)).backward()
            for name, p in model.named_parameters():
                g, r = full(p.grad), ref_params[name].grad
                grad_diff = _worse(grad_diff, float(((g - r).abs() / r.abs().clamp_min(1)).max()))
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
            with torch.no_grad():
                for name, p in model.named_parameters():
                    r = ref_params[name]
                    param_diff = _worse(param_diff, float(((full(p) - r).abs() / r.abs().clamp_min(1)).max()))
            losses.append(float(loss.detach()))
        dist.destroy_process_group()
        module = sys.modules.get(ADAPTER_MODULE)
        adapter = getattr(module, "ADAPTER", None)
        return {
            "pid": os.getpid(),
            "patched": bool(adapter and adapter.is_patched()),
            "activated_by": getattr(adapter, "activated_by", None),
            "describe": adapter.describe() if adapter else [],
            "actor_module": type(self).__module__,
            "grad_diff": grad_diff,
            "param_diff": param_diff,
            "losses": losses,
        }


def _worse(worst: float, x: float) -> float:
    """The comparators' running maximum, NaN-sticky (``max(worst, nan)`` keeps ``worst``); shipped with the actor."""
    return worst if x <= worst or worst != worst else x


def test_comparator_fails_on_nan() -> None:
    """Negative control for the actors' comparator: a NaN difference (a gradient times NaN) is reported, not 0.0."""
    import math

    import torch

    g = torch.ones(3)
    diff = float(((g * math.nan - g).abs() / g.abs().clamp_min(1)).max())
    assert math.isnan(_worse(0.0, diff)) and math.isnan(_worse(_worse(0.0, diff), 0.0))
    assert _worse(0.0, 0.5) == 0.5 and _worse(0.5, 0.0) == 0.5


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_actors(env: dict[str, str]) -> list[dict[str, Any]]:
    """Two actors, one gloo group, verl's apply_fsdp2 on tiny GLM4V; ``env`` is the actors' environment."""
    from fsdp_compat.testing.verl_smoke import call_site
    from fsdp_compat.testing.zoo import build_model, make_batch

    model = build_model("glm4v")
    config, state = model.config.to_dict(), {k: v.clone() for k, v in model.state_dict().items()}
    batches = [make_batch("glm4v", seed=rank) for rank in range(2)]  # each rank its own micro-batch
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=100 * 2**20,
        runtime_env={"env_vars": {"FSDP_COMPAT": "", "VERL_USE_EXTERNAL_MODULES": "", **env}},
    )
    try:
        actor = ray.remote(num_cpus=1)(Trainer)
        port = _free_port()
        actors = [actor.remote(rank, 2, port) for rank in range(2)]
        site_module = call_site(VERL)
        return ray.get([a.run.remote(config, state, batches, site_module) for a in actors], timeout=TIMEOUT_S)
    finally:
        ray.shutdown()


def test_ray_actors_unpatched_crash() -> None:
    """FSDP_COMPAT=off in the actors: verl's own selection, the grid_sampler crash (the test can fail)."""
    with pytest.raises(Exception, match=re.escape(GRID_SAMPLER_CRASH)):
        _run_actors({"FSDP_COMPAT": "off"})


def test_ray_actors_are_patched_without_importing_fsdp_compat() -> None:
    if VERL in SpecifierSet(">=0.9.0"):
        env, expected = {"FSDP_COMPAT_AUTOLOAD": "0"}, "verl.plugins entry point"
    else:
        if not any((Path(d) / "fsdp_compat.pth").exists() for d in site.getsitepackages()):
            pytest.fail("fsdp_compat.pth is not installed (install fsdp-compat as a wheel)", pytrace=False)
        env, expected = {"VERL_USE_EXTERNAL_PLUGINS": "none"}, "pth-hook"
    results = _run_actors(env)
    print(f"verl {VERL} ray actors: {results}")
    assert len({r["pid"] for r in results}) == 2
    for r in results:
        assert r["patched"] and r["activated_by"] == expected, r
        assert r["actor_module"] == __name__ and not r["actor_module"].startswith("fsdp_compat"), r
        assert r["grad_diff"] == 0.0 and r["param_diff"] == 0.0, r  # NaN fails too
    assert results[0]["losses"] != results[1]["losses"]  # the ranks trained different micro-batches
