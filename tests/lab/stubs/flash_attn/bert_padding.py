"""Test-only stubs: importable names, never called by the FSDP2 wrap path (see the package docstring)."""

from typing import Any


def _unavailable(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("flash_attn is a test stub here (flash-attn needs CUDA); install the real one")


pad_input = unpad_input = index_first_axis = index_put_first_axis = _unavailable
