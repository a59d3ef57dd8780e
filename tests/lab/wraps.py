"""Test-only wrap functions for :func:`fsdp_compat.testing.parity.run_training` (``"lab.wraps:NAME"``).

- ``auto_*``: fsdp-compat's ``auto`` with a setting the tiny zoo models need to exercise a branch (size thresholds
  at 0, only the text decoder layers as layer classes).
- The rest are hand-written ``fully_shard`` wraps that do not depend on the planner (so the harness can be checked on
  its own), ranks that raise or hang on purpose, and a probe.
"""

from __future__ import annotations

import time
from typing import Any

from torch import nn

from fsdp_compat.apply import apply_fsdp2


def auto_outside_the_table(model: nn.Module, fsdp_kwargs: dict[str, Any]) -> str:
    """``auto`` on a model whose family has no row: the row of every family the model holds is taken out of the table
    in this rank process first (its vision-language model then stands for the families the table cannot align)."""
    import fsdp_compat.runtime.mixed_batches as mixed_batches

    names = {cls.__name__ for module in model.modules() for cls in type(module).__mro__}
    mixed_batches.FAMILIES = tuple(f for f in mixed_batches.FAMILIES if not names.intersection(f.classes))
    return str(apply_fsdp2(model, fsdp_kwargs))


def auto_lift_all(model: nn.Module, fsdp_kwargs: dict[str, Any]) -> str:
    """``auto`` with ``lift_min_bytes=0``: every raw-read table is lifted into a group at its reader, however
    small (on the tiny zoo models the default size threshold would keep them in the enclosing group instead)."""
    from fsdp_compat.policies import Auto

    return str(apply_fsdp2(model, fsdp_kwargs, policy=Auto(lift_min_bytes=0)))


def auto_split_all(model: nn.Module, fsdp_kwargs: dict[str, Any]) -> str:
    """``auto`` with ``split_root_min_bytes=0``: every module left in the root group that only its own forward
    reads gets a group, however small (the tiny zoo models are under the default 32 MiB threshold)."""
    from fsdp_compat.policies import Auto

    return str(apply_fsdp2(model, fsdp_kwargs, policy=Auto(split_root_min_bytes=0)))


def auto_text_layers(model: nn.Module, fsdp_kwargs: dict[str, Any]) -> str:
    """``auto`` with only the text decoder layers as layer classes: a vision-language model's whole vision tower
    stays in the root group (no group of its own)."""
    text_layer = type(model.get_decoder().layers[0]).__name__
    return str(apply_fsdp2(model, fsdp_kwargs, [text_layer]))


# ------------------------------------------------------------------------------------------------------------
# Hand-written fully_shard wraps, independent of fsdp_compat's planner.


def _layer_classes(model: nn.Module) -> set[str]:
    return set(getattr(model, "_no_split_modules", None) or ())


def _shard_bottom_up(model: nn.Module, targets: list[nn.Module], fsdp_kwargs: dict[str, Any]) -> list[str]:
    from torch.distributed.fsdp import fully_shard

    chosen = {id(m) for m in targets}
    paths = [p for p, m in model.named_modules() if id(m) in chosen and m is not model]
    by_path = dict(model.named_modules())
    for path in sorted(paths, key=lambda p: -p.count(".")):  # deepest first: children before parents
        fully_shard(by_path[path], **fsdp_kwargs)
    fully_shard(model, **fsdp_kwargs)
    return paths


def every_embedding(model: nn.Module, fsdp_kwargs: dict[str, Any]) -> list[str]:
    """Legacy-like wrap: every layer and every nn.Embedding its own group (crashes on GLM4V)."""
    layers = _layer_classes(model)
    targets = [m for m in model.modules() if type(m).__name__ in layers or isinstance(m, nn.Embedding)]
    return _shard_bottom_up(model, targets, fsdp_kwargs)


def layers_and_input(model: nn.Module, fsdp_kwargs: dict[str, Any]) -> list[str]:
    """Safe wrap: every layer plus get_input_embeddings() (exact parity on GLM4V)."""
    layers = _layer_classes(model)
    targets = [m for m in model.modules() if type(m).__name__ in layers]
    targets.append(model.get_input_embeddings())
    return _shard_bottom_up(model, targets, fsdp_kwargs)


def tied_pair(model: nn.Module, fsdp_kwargs: dict[str, Any]) -> list[str]:
    """Layers, then one group holding both sharers of the tied embedding/lm_head Parameter."""
    from torch.distributed.fsdp import fully_shard

    layers = _layer_classes(model)
    by_path = dict(model.named_modules())
    paths = [p for p, m in by_path.items() if type(m).__name__ in layers]
    for path in sorted(paths, key=lambda p: -p.count(".")):
        fully_shard(by_path[path], **fsdp_kwargs)
    fully_shard([model.get_input_embeddings(), model.get_output_embeddings()], **fsdp_kwargs)
    fully_shard(model, **fsdp_kwargs)
    return paths


def root_only(model: nn.Module, fsdp_kwargs: dict[str, Any]) -> list[str]:
    """One group, the root."""
    return _shard_bottom_up(model, [], fsdp_kwargs)


def raise_on_rank1(model: nn.Module, fsdp_kwargs: dict[str, Any]) -> list[str]:
    """Rank 1 raises a recognisable error; the others wrap safely, then block in a collective."""
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise RuntimeError("deliberate failure on rank 1 (fsdp_compat test helper)")
    return layers_and_input(model, fsdp_kwargs)


def hang_on_rank1(model: nn.Module, fsdp_kwargs: dict[str, Any]) -> list[str]:
    """Rank 1 sleeps forever (until killed); the others wait for it in the first collective."""
    import torch.distributed as dist

    if dist.get_rank() == 1:
        while True:
            time.sleep(3600)
    return layers_and_input(model, fsdp_kwargs)


def probe() -> dict[str, Any]:
    """Reports this rank's identity and the test marker variable from its environment."""
    import os

    import torch.distributed as dist

    return {"rank": dist.get_rank(), "pid": os.getpid(), "mark": os.environ.get("FSDP_COMPAT_TEST_MARK")}


def auto_unrefused(model: nn.Module, fsdp_kwargs: dict[str, Any]) -> str:
    """``auto`` on a family the alignment refuses by name (``fsdp_compat.runtime.vlm_families.refused``), its refusal
    taken out in this rank process first: what the generic mechanism alone does with it."""
    from fsdp_compat.runtime.vlm_families import refused

    names = {type(module).__name__ for module in model.modules()}
    for name in names & set(refused.REFUSED):
        del refused.REFUSED[name]
    return str(apply_fsdp2(model, fsdp_kwargs))
