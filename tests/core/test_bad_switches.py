"""A switch value the run would refuse changes nothing: ``fsdp_compat.apply_fsdp2`` raises a clear error before its
first ``fully_shard`` (before: after every ``fully_shard`` had run, leaving the model sharded with the guard's hooks
on, and a second call said "already wrapped"); ``fsdp-compat doctor`` flags the value and exits non-zero."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

APPLY_TWICE = textwrap.dedent(
    """
    import os, socket
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    import fsdp_compat
    from fsdp_compat.errors import FsdpCompatError
    from fsdp_compat.testing import build_model, make_batch

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    model = build_model("glm4v")
    try:
        fsdp_compat.apply_fsdp2(model, {"mesh": init_device_mesh("cpu", (1,))})
    except FsdpCompatError as exc:
        print("REFUSED:", exc)
    print("SHARDED:", any(isinstance(m, FSDPModule) for m in model.modules()))
    print("HOOKS:", len(model._forward_pre_hooks))
    os.environ.pop("VARIABLE")
    fsdp_compat.apply_fsdp2(model, {"mesh": init_device_mesh("cpu", (1,))})
    model(**make_batch("glm4v")).loss.backward()
    print("TRAINED")
    dist.destroy_process_group()
    """
)


@pytest.mark.parametrize(
    ("variable", "value", "choices"),
    [
        ("FSDP_COMPAT_GUARD", "perhaps", "on, always, off"),
        ("FSDP_COMPAT_MIXED_BATCHES", "sometimes", "sync, always, off"),
        ("FSDP_COMPAT_GUARD_AGREE_S", "soon", "positive number of seconds"),
    ],
)
def test_a_bad_switch_is_refused_before_anything_is_sharded(variable: str, value: str, choices: str) -> None:
    env = {**os.environ, variable: value}
    code = APPLY_TWICE.replace('"VARIABLE"', repr(variable))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"REFUSED: {variable}={value!r}" in proc.stdout and choices in proc.stdout, proc.stdout
    assert "SHARDED: False" in proc.stdout and "HOOKS: 0" in proc.stdout, proc.stdout
    assert "TRAINED" in proc.stdout, proc.stdout


@pytest.mark.parametrize(
    ("variable", "value"),
    [("FSDP_COMPAT_GUARD", "perhaps"), ("FSDP_COMPAT_MIXED_BATCHES", "sometimes"), ("FSDP_COMPAT", "maybe"),
     ("FSDP_COMPAT_POLICY", "best"), ("FSDP_COMPAT_GENERIC", "kinda")],
)  # fmt: skip
def test_doctor_flags_a_bad_switch_and_exits_non_zero(variable: str, value: str) -> None:
    env = {**os.environ, variable: value}
    proc = subprocess.run(
        [sys.executable, "-m", "fsdp_compat.cli", "doctor"], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    assert f"INVALID: {variable}={value!r}" in proc.stdout, proc.stdout


def test_doctor_exits_zero_on_good_switches() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FSDP_COMPAT")}
    proc = subprocess.run(
        [sys.executable, "-m", "fsdp_compat.cli", "doctor"], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert "INVALID" not in proc.stdout
