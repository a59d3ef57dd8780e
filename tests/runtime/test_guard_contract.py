"""The FSDP2 internals the run-time guard relies on, checked on the torch under test, and its stand-aside path.

``fsdp_compat.runtime.guard`` uses private FSDP2 API (``FSDPState``, ``FSDPParamGroup``, ``FSDPParam``) that moves
between torch releases. The first test exercises each one the way the guard does, on 2 gloo ranks, and fails naming the
internal that no longer exists or behaves differently (e.g. a group with ``post_forward_mesh_info=None`` must still
be unsharded after its forward). The others force the stand-aside path (an internal hidden from the guard) and
show training continues exactly as without the guard (0.0 against the mean-loss twin, each rank its own batch),
with exactly one warning per rank.
"""

from __future__ import annotations

import pytest
from lab.support import WORLD_SIZE

from fsdp_compat.runtime.guard import ENV_GUARD
from fsdp_compat.testing.launch import run_ranks

MODELS = "lab.guard_models"
STOOD_ASIDE = "fsdp-compat: run-time guard disabled"
CHECKS = 17  # every check of guard_models.contract_rank (a check lost on the way must show up here)

pytestmark = pytest.mark.timeout(180)


def test_every_fsdp2_internal_the_guard_uses_behaves_as_it_assumes() -> None:
    run = run_ranks(f"{MODELS}:contract_rank", {}, world_size=WORLD_SIZE, timeout_s=60)
    run.raise_for_error()
    for rank in run.ranks:
        checks = rank.extra["checks"]
        failed = {name: seen for name, (holds, seen) in checks.items() if not holds}
        assert not failed, failed
        assert len(checks) == CHECKS, sorted(checks)


def _dp(env: dict[str, str | None], **cfg: object) -> list[dict]:
    run = run_ranks(f"{MODELS}:dp_rank", {"model": "passed_embedding", "policy": "auto", **cfg},
                    world_size=WORLD_SIZE, timeout_s=60, env=env)
    run.raise_for_error()
    return [rank.extra for rank in run.ranks]


@pytest.mark.parametrize(
    "hidden",
    [
        ["FSDPState._fsdp_param_groups", "FSDPState._fsdp_param_group"],  # the groups cannot be found
        ["FSDPState._state_ctx"],  # the root cannot be found
        ["FSDPParam.sharded_param"],  # the sharded parameters cannot be indexed
    ],
    ids=["param-groups", "state-ctx", "sharded-param"],
)
def test_a_missing_internal_stands_aside_and_training_continues_as_without_the_guard(hidden: list[str]) -> None:
    """``auto`` plans ``passed_embedding`` safely (the guard stays idle); its per-op check armed everywhere
    (``FSDP_COMPAT_GUARD=always``: the default leaves it disarmed on a safe plan, and a disarmed guard reads no
    internal): with an internal hidden from the guard, 3 steps train exactly as with the guard off (same losses, 0.0
    against the twin), one warning per rank."""
    off = _dp({ENV_GUARD: "off"}, steps=3)
    broken = _dp({ENV_GUARD: "always"}, steps=3, hide=hidden)
    for o, b in zip(off, broken, strict=True):
        assert o["max_abs_diff"] == 0.0 and b["max_abs_diff"] == 0.0, (o, b)
        assert b["losses"] == o["losses"], (o["losses"], b["losses"])
        assert b["guard"] and b["stood_aside"] and b["unshards"] == 0, b
        warnings = [line for line in b["log"] if line.startswith(STOOD_ASIDE)]
        assert len(warnings) == 1 and "AttributeError" in warnings[0], b["log"]
        assert not [line for line in o["log"] if line.startswith(STOOD_ASIDE)]


def test_the_generic_layers_hook_point_is_where_it_assumes() -> None:
    """``FSDPState._root_pre_forward(self, module, args, kwargs)`` exists, is called through ``self`` (a class lookup
    at every call, so the replacement reaches every root) and decides the root (``_is_root`` None before, True
    after): what ``fsdp_compat.runtime.every_root`` relies on, on this torch."""
    import inspect

    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    assert list(inspect.signature(FSDPState._root_pre_forward).parameters) == ["self", "module", "args", "kwargs"]
    assert "self._root_pre_forward(module, args, kwargs)" in inspect.getsource(FSDPState._pre_forward)
    assert "self._lazy_init()" in inspect.getsource(FSDPState._root_pre_forward)
    assert "self._is_root = True" in inspect.getsource(FSDPState._lazy_init)


def test_the_generic_layer_trains_an_unseen_trainers_glm4v_exactly_on_image_text_ranks() -> None:
    """A trainer's own ``fully_shard`` rule on GLM4V (its vision position table in a group of its own), image|text
    ranks, fsdp-compat merely installed: the generic layer's guard and alignment make it exact (0.0) on this torch
    (``tests/runtime/test_every_root.py`` has the crash-first cases)."""
    kinds = ["image", "text"]
    run = run_ranks(
        "lab.every_root:own_trainer_rank",
        {"model": "glm4v", "steps": 2, "variants": [kinds[r % 2] for r in range(WORLD_SIZE)]},
        world_size=WORLD_SIZE,
        timeout_s=120,
    )
    run.raise_for_error()
    for rank in run.ranks:
        assert rank.extra["grad_diff"] == 0.0 and rank.extra["param_diff"] == 0.0, rank.extra
        assert rank.extra["guard_armed"] is True and rank.extra["guard_unshards"] == 2, rank.extra
