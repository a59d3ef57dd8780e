"""Forward hooks registered on a model before it is planned (a profiler's, a logger's, a counter's): a hook that takes
the module or its inputs opaquely (``*args``) but reaches no parameter keeps the layers sharded; one that reads a
parameter through them is still seen; one that hands them to code the analysis cannot follow keeps what it must in
the root, with one WARNING naming the hook and the bytes (before: every ``*args`` hook collapsed ``auto`` to the root
group alone, silently: 0 groups + root instead of 6 + root on tiny GLM4V and Qwen2.5-VL)."""

from __future__ import annotations

import logging
import pickle
from collections.abc import Callable
from typing import Any

import pytest

from fsdp_compat.plan import plan_wrap
from fsdp_compat.testing import build_model

CALLS: list[Any] = []


def counter(*args: Any) -> None:
    CALLS.append(1)


def arity_counter(*args: Any, **kwargs: Any) -> None:
    CALLS.append(len(args))


def logger_hook(module: Any, args: Any, output: Any) -> None:
    CALLS.append(type(module).__name__)


def head_reader(*args: Any) -> None:
    CALLS.append(args[0].lm_head.weight.sum())  # a real read of lm_head's parameter, through the tuple


def each_head_reader(*args: Any) -> None:
    for module in args:
        CALLS.append(module.lm_head.weight.sum())


def opaque(*args: Any) -> None:
    CALLS.append(pickle.dumps(args))  # pickle: code the analysis does not follow


def _plan(model_name: str, hook: Callable[..., Any] | None, post: bool = False) -> Any:
    model = build_model(model_name)
    if hook is not None:
        (model.register_forward_hook if post else model.register_forward_pre_hook)(hook)
    return plan_wrap(model)


@pytest.mark.parametrize("model_name", ["glm4v", "qwen2.5-vl"])
@pytest.mark.parametrize("hook", [counter, arity_counter, logger_hook], ids=lambda h: h.__name__)
def test_a_hook_that_reads_no_parameter_keeps_the_layers_sharded(model_name: str, hook: Callable[..., Any]) -> None:
    plain = _plan(model_name, None)
    hooked = _plan(model_name, hook, post=hook is logger_hook)
    assert len(plain.groups) == 6
    assert [g.paths for g in hooked.groups] == [g.paths for g in plain.groups]
    assert not hooked.warnings


@pytest.mark.parametrize("hook", [head_reader, each_head_reader], ids=lambda h: h.__name__)
def test_a_hook_that_reads_a_parameter_through_its_arguments_is_seen(hook: Callable[..., Any]) -> None:
    plan = _plan("glm4v", hook)
    assert not any("lm_head" in g.paths for g in plan.groups), plan
    assert any(e.param == "lm_head.weight" and e.kind == "raw-read" for e in plan.evidence), plan.evidence


def test_a_hook_the_analysis_cannot_follow_warns_once_with_the_bytes(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="fsdp_compat"):
        plan = _plan("glm4v", opaque)
    assert len(plan.groups) == 0
    lines = [r.getMessage() for r in caplog.records if "cannot follow keeps candidates" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "test_hooks.py" in lines[0] and "in opaque (7 candidates, 443.5 KiB" in lines[0], lines[0]
