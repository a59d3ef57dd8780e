"""Small models that read a parameter while its FSDP2 group is sharded, and wrap functions for the guard tests.

The models are named to :func:`fsdp_compat.testing.harness.run_training` as ``"fsdp_compat.testing.guard_models:
NAME"`` (the zoo resolves such names: an object with ``build()`` and ``batch(generator)``). Each reproduces one read
pattern the run-time guard exists for:

- ``passed_embedding``: a child gets the embedding module as an argument and reads ``other.weight`` after the
  embedding's own forward (an output projection tied by passing the module).
- ``weight_before_forward``: the root reads a layer's weight (a penalty) *before* calling that layer, so the
  layer's own post-backward would come before the read's backward (``both_layers_before_forward``: both layers).

``model.checkpointing`` (None, ``"reentrant"``, ``"non-reentrant"``) runs the reading child / the layers under
``torch.utils.checkpoint``; the wrap functions below set it before sharding (the unsharded reference keeps None:
recomputation does not change the arithmetic).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["both_layers_before_forward", "passed_embedding", "weight_before_forward"]

_VOCAB, _DIM, _ROWS, _LEN = 64, 32, 2, 10


@dataclass
class Output:
    loss: torch.Tensor


@dataclass(frozen=True)
class GuardModel:
    """A test model outside the zoo: how to build it and a valid batch for it."""

    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], dict[str, torch.Tensor]]


class _Config:
    tie_word_embeddings = False


class Block(nn.Module):
    """The layer class (``_no_split_modules``): a residual MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(_DIM)
        self.lin = nn.Linear(_DIM, _DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.lin(self.norm(h)))


class TiedProjection(nn.Module):
    """Projects onto the vocabulary with another module's weight, handed in as an argument."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(_DIM)

    def forward(self, h: torch.Tensor, other: nn.Module) -> torch.Tensor:
        return F.linear(self.norm(h), other.weight)


class _Base(nn.Module):
    _no_split_modules: ClassVar[list[str]] = ["Block"]

    def __init__(self) -> None:
        super().__init__()
        self.config = _Config()
        self.checkpointing: str | None = None

    def _maybe_checkpoint(self, fn: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
        if self.checkpointing is None:
            return fn(*args)
        return checkpoint(fn, *args, use_reentrant=self.checkpointing == "reentrant")


class PassedEmbeddingLM(_Base):
    """``self.head(h, self.embed)``: the head reads ``embed.weight`` after the embedding's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(_VOCAB, _DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = TiedProjection()

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Output:
        h = self.embed(input_ids)
        for block in self.blocks:
            h = block(h)
        logits = self._maybe_checkpoint(self.head, h, self.embed)
        return Output(F.cross_entropy(logits.reshape(-1, _VOCAB), labels.reshape(-1)))


class WeightBeforeForwardLM(_Base):
    """The root reads ``blocks.1.lin.weight`` (a penalty) before the blocks run."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(_VOCAB, _DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.out = nn.Linear(_DIM, _VOCAB)

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Output:
        penalty = self.blocks[1].lin.weight.pow(2).mean()
        h = self.embed(input_ids)
        for block in self.blocks:
            h = self._maybe_checkpoint(block, h)
        loss = F.cross_entropy(self.out(h).reshape(-1, _VOCAB), labels.reshape(-1))
        return Output(loss + 0.1 * penalty)


class BothLayersBeforeForwardLM(WeightBeforeForwardLM):
    """The root reads both layers' weights before the blocks run: two groups to unshard, two log lines."""

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Output:
        penalty = sum(block.lin.weight.pow(2).mean() for block in self.blocks)
        h = self.embed(input_ids)
        for block in self.blocks:
            h = self._maybe_checkpoint(block, h)
        loss = F.cross_entropy(self.out(h).reshape(-1, _VOCAB), labels.reshape(-1))
        return Output(loss + 0.1 * penalty)


def _batch(g: torch.Generator) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, _VOCAB, (_ROWS, _LEN), generator=g)
    return {"input_ids": ids, "labels": torch.roll(ids, -1, dims=1)}


passed_embedding = GuardModel(PassedEmbeddingLM, _batch)
weight_before_forward = GuardModel(WeightBeforeForwardLM, _batch)
both_layers_before_forward = GuardModel(BothLayersBeforeForwardLM, _batch)


# ------------------------------------------------------------------------------------------------ wrap functions


def _apply(model: nn.Module, fsdp_kwargs: dict[str, Any], policy: str, *, checkpointing: str | None = None) -> str:
    from fsdp_compat.apply import apply_fsdp2

    if checkpointing is not None:
        if hasattr(model, "gradient_checkpointing_enable"):
            model.gradient_checkpointing_enable({"use_reentrant": checkpointing == "reentrant"})
        else:
            model.checkpointing = checkpointing
    _record(model)
    return str(apply_fsdp2(model, fsdp_kwargs, policy=policy))


def legacy(model: nn.Module, fsdp_kwargs: dict[str, Any]) -> str:
    """The verl >= 0.7.1 rule (every untied nn.Embedding and ``lm_head`` own a group), guard per environment."""
    return _apply(model, fsdp_kwargs, "legacy")


def auto(model: nn.Module, fsdp_kwargs: dict[str, Any]) -> str:
    return _apply(model, fsdp_kwargs, "auto")


def layers_only(model: nn.Module, fsdp_kwargs: dict[str, Any]) -> str:
    return _apply(model, fsdp_kwargs, "layers-only")


def input_only(model: nn.Module, fsdp_kwargs: dict[str, Any]) -> str:
    return _apply(model, fsdp_kwargs, "input-only")


def legacy_reentrant(model: nn.Module, fsdp_kwargs: dict[str, Any]) -> str:
    return _apply(model, fsdp_kwargs, "legacy", checkpointing="reentrant")


def legacy_non_reentrant(model: nn.Module, fsdp_kwargs: dict[str, Any]) -> str:
    return _apply(model, fsdp_kwargs, "legacy", checkpointing="non-reentrant")


def layers_only_reentrant(model: nn.Module, fsdp_kwargs: dict[str, Any]) -> str:
    return _apply(model, fsdp_kwargs, "layers-only", checkpointing="reentrant")


def layers_only_non_reentrant(model: nn.Module, fsdp_kwargs: dict[str, Any]) -> str:
    return _apply(model, fsdp_kwargs, "layers-only", checkpointing="non-reentrant")


def legacy_selector(model: nn.Module, fsdp_kwargs: dict[str, Any]) -> str:
    """What verl >= 0.7.1 does with fsdp-compat's selector: the guard is installed by the selector, then the
    framework calls ``fully_shard`` on each target and on the root itself."""
    from torch.distributed.fsdp import fully_shard

    from fsdp_compat.guard import install_guard
    from fsdp_compat.plan import select_wrap_targets

    _record(model)
    targets = select_wrap_targets(model, policy="legacy")
    install_guard(model)
    for module in targets:
        fully_shard(module, **fsdp_kwargs)
    fully_shard(model, **fsdp_kwargs)
    return str(len(targets))


def _bf16(fsdp_kwargs: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return {**fsdp_kwargs, "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}


def apply_plan_without(
    model: nn.Module, fsdp_kwargs: dict[str, Any], policy: str, leave: Iterable[str]
) -> list[tuple[str, ...]]:
    """Apply ``policy``'s plan minus the groups of the modules named in ``leave`` (full paths or leaf names): what
    the guard's log line recommends ("leave X in its enclosing group"). Returns the groups applied."""
    from torch.distributed.fsdp import fully_shard

    from fsdp_compat.plan import plan_wrap

    names = set(leave)
    kept = [
        g
        for g in plan_wrap(model, policy=policy).groups
        if not any(p in names or p.rsplit(".", 1)[-1] in names for p in g.paths)
    ]
    for group in kept:
        fully_shard(list(group.modules) if len(group.modules) > 1 else group.modules[0], **fsdp_kwargs)
    fully_shard(model, **fsdp_kwargs)
    return [g.paths for g in kept]


def legacy_recommended_bf16(model: nn.Module, fsdp_kwargs: dict[str, Any]) -> str:
    """``legacy`` with the change the guard recommends on these read patterns: the read table (GLM4V's
    ``position_embedding``, ``passed_embedding``'s ``embed``) left in its enclosing group; bf16 parameters."""
    _record(model)
    return str(apply_plan_without(model, _bf16(fsdp_kwargs), "legacy", ["position_embedding", "embed"]))


def legacy_bf16(model: nn.Module, fsdp_kwargs: dict[str, Any]) -> str:
    return _apply(model, _bf16(fsdp_kwargs), "legacy")


def input_only_bf16(model: nn.Module, fsdp_kwargs: dict[str, Any]) -> str:
    return _apply(model, _bf16(fsdp_kwargs), "input-only")


def layers_only_bf16(model: nn.Module, fsdp_kwargs: dict[str, Any]) -> str:
    return _apply(model, _bf16(fsdp_kwargs), "layers-only")


# ------------------------------------------------------------------------------------------------------ probes

_MODELS: list[nn.Module] = []
_RECORDS: list[str] = []
_ALL_GATHERS = [0]
_MODE_IN_FORWARD: list[bool] = []


def _record(model: nn.Module) -> None:
    """Keep the model, this rank's ``fsdp_compat`` log messages, whether a torch function mode is active inside
    and outside the forward, and the number of FSDP2 all-gathers (for :func:`probe`)."""
    import logging

    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    class Handler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            _RECORDS.append(record.getMessage())

    logging.getLogger("fsdp_compat").addHandler(Handler(logging.INFO))
    original = _fsdp_param_group.foreach_all_gather

    def counting(*args: Any, **kwargs: Any) -> Any:
        _ALL_GATHERS[0] += 1
        return original(*args, **kwargs)

    _fsdp_param_group.foreach_all_gather = counting
    _MODELS.append(model)
    model.get_input_embeddings().register_forward_pre_hook(
        lambda *_: _MODE_IN_FORWARD.append(torch._C._is_torch_function_mode_enabled())
    )


def probe() -> dict[str, Any]:
    """What the guard did on this rank, the log lines, the all-gather count and a digest of the final weights."""
    from fsdp_compat.guard import guard_of

    model = _MODELS[-1]
    guard = guard_of(model)
    digest = hashlib.sha256()
    with torch.no_grad():
        for _, p in sorted(model.named_parameters(), key=lambda item: item[0]):
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            digest.update(full.detach().float().cpu().numpy().tobytes())
    return {
        "guard": guard is not None,
        "events": [e.message for e in guard.events] if guard else [],
        "unsharded_bytes": [e.unsharded_bytes for e in guard.events] if guard else [],
        "unshards": guard.unshards if guard else 0,
        "log": [r for r in _RECORDS if "run-time guard" in r],
        "all_gathers": _ALL_GATHERS[0],
        "mode_in_forward": all(_MODE_IN_FORWARD) and bool(_MODE_IN_FORWARD),
        "mode_outside_forward": torch._C._is_torch_function_mode_enabled(),
        "weights": digest.hexdigest(),
    }


def probe_no_grad() -> dict[str, Any]:
    """A forward under ``torch.no_grad()`` after training (a rollout's log-prob pass): the guard unshards at the
    read and reshards when that forward ends, since no backward will come; the groups it touched are sharded after."""
    from torch.distributed.fsdp import FSDPModule

    from fsdp_compat.guard import guard_of

    model = _MODELS[-1]
    guard = guard_of(model)
    before = guard.unshards if guard else 0
    device = next(model.parameters()).device
    batch = {k: v.to(device) for k, v in _batch(torch.Generator().manual_seed(1)).items()}
    with torch.no_grad():
        loss = float(model(**batch).loss)
    states = [m._get_fsdp_state() for m in model.modules() if isinstance(m, FSDPModule) and m is not model]
    groups = [g for state in states for g in state._fsdp_param_groups]
    return {
        "loss": loss,
        "unshards": (guard.unshards - before) if guard else 0,
        "all_sharded_after": all(g.is_sharded for g in groups),
        "reshard_after_forward_restored": all(g.post_forward_mesh_info is not None for g in groups),
    }


def probe_reinstall() -> dict[str, Any]:
    """Remove the guard, install a fresh one, train one more step: the new guard still finds the groups, unshards
    at the read and has FSDP2 reduce-scatter every gradient (each parameter gets its sharded ``.grad``)."""
    from fsdp_compat.guard import guard_of, install_guard

    model = _MODELS[-1]
    old = guard_of(model)
    old.remove()
    new = install_guard(model)
    device = next(model.parameters()).device
    batch = {k: v.to(device) for k, v in _batch(torch.Generator().manual_seed(1)).items()}
    model(**batch).loss.backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None]
    groups = [g for g in new._groups or [] if g.fsdp_params and g not in _root_groups(model)]
    return {
        "new_guard": new is not old,
        "unshards": new.unshards,
        "missing_grads": missing,
        "all_sharded_after": all(g.is_sharded for g in groups),
    }


def _root_groups(model: nn.Module) -> list[Any]:
    from fsdp_compat.guard import _param_groups

    return _param_groups(model._get_fsdp_state())
