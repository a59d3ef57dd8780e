"""Small promises of the run-time layer, checked in one process without a process group."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fsdp_compat.runtime.guard import Guard
from fsdp_compat.runtime.mixed_batches import _zero_of
from fsdp_compat.runtime.vlm_families import grid_inputs


def test_the_dummys_zero_term_is_zero_in_fp16_where_the_sum_overflows() -> None:
    features = torch.full((8, 4), 60000.0, dtype=torch.float16, requires_grad=True)  # sum: inf in fp16
    zero = _zero_of(features)
    assert zero is not None and zero.dtype == torch.float16
    assert zero.item() == 0.0  # t.sum() * 0.0 was inf * 0.0 = NaN
    zero.backward()
    assert features.grad is not None and torch.count_nonzero(features.grad).item() == 0


def test_a_dummys_index_tensor_is_made_once_per_value_and_device() -> None:
    from fsdp_compat.testing.zoo import glm4v_config

    config = glm4v_config()
    first = grid_inputs(config, torch.device("cpu"), torch.float32)["image_grid_thw"]
    second = grid_inputs(config, torch.device("cpu"), torch.float32)["image_grid_thw"]
    assert first is second  # no host list copied to the device again (on a GPU: a copy and a stream sync each)


def test_an_fsdp2_assertion_reaches_the_user_instead_of_switching_the_guard_off() -> None:
    guard = Guard(nn.Linear(2, 2), armed=True)

    def fsdp2_asserts() -> None:
        raise AssertionError("Expected all-gather state in FORWARD")

    with pytest.raises(AssertionError):
        guard._safely(fsdp2_asserts)
    assert not guard._broken

    def internals_moved() -> None:
        raise AttributeError("'FSDPParamGroup' object has no attribute 'fsdp_params'")

    assert guard._safely(internals_moved) is False and guard._broken  # another torch's internals: stand aside
    guard.remove()
