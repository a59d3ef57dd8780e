"""An adversarial corpus of ways a forward can read an embedding's weight outside the embedding's own forward.

Every pattern is a tiny module tree: a root with an ``nn.Embedding`` (``emb``, a candidate for its own FSDP2 group
under every policy), a layer ``Block`` and whatever the pattern needs; its forward returns a scalar loss and, on a
real run, reads ``emb``'s parameter in the pattern's way. :func:`corpus_rank` (a rank routine for
:func:`fsdp_compat.testing.launch.run_ranks`) trains each pattern under ``fsdp_compat.apply_fsdp2`` with a given
policy and guard setting and compares it with an unsharded twin built from the same seed (a twin, not a deep copy:
hooks and closures would still point at the sharded model).
"""

from __future__ import annotations

import functools
import operator
import os
import traceback
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from fsdp_compat.testing.parity import Diff, loss_scale, twin_step, worse

__all__ = ["PATTERNS", "corpus_rank", "run_cases", "worse"]

VOCAB, DIM = 8, 4


class Block(nn.Module):
    """The layer class every pattern declares (so every plan has layer groups too)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(h))


class Base(nn.Module):
    _no_split_modules = ("Block",)

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.block = Block()

    def body(self, ids: torch.Tensor) -> torch.Tensor:
        return self.block(self.emb(ids))


PATTERNS: dict[str, Callable[[], nn.Module]] = {}  # filled at the end of the file: every Base subclass


# --- plain chains and aliases --------------------------------------------------------------------------------


class AttrChain(Base):
    def forward(self, ids):
        return (self.body(ids) + self.emb.weight.sum()).sum()


class TupleAlias(Base):
    def forward(self, ids):
        table, block = self.emb, self.block
        return (block(table(ids)) * table.weight.mean()).sum()


class Walrus(Base):
    def forward(self, ids):
        h = self.body(ids)
        if (w := self.emb.weight) is not None:
            h = h + w.sum()
        return h.sum()


class DataAttr(Base):
    def forward(self, ids):
        return (self.body(ids) * self.emb.weight.data.abs().max()).sum()


class AliasBeforeCall(Base):
    def forward(self, ids):
        w = self.emb.weight  # fetched before the embedding's call: still the sharded Parameter after it
        return (self.block(self.emb(ids)) * w.mean()).sum()


class TypeCast(Base):
    def forward(self, ids):
        h = self.body(ids)
        return (h * self.emb.weight.type(h.dtype).mean()).sum()  # Tensor.type(dtype) reads the values


class TypeCastWiden(Base):
    def forward(self, ids):
        h = self.body(ids)
        return (h * self.emb.weight.type(torch.float64).mean().to(h.dtype)).sum()  # only .type sees the Parameter


class FunctionalEmbedding(Base):
    def forward(self, ids):
        return self.block(F.embedding(ids, self.emb.weight)).sum()


class Transpose(Base):
    def forward(self, ids):
        h = self.body(ids)
        return (h @ self.emb.weight.T).sum()


class InPlace(Base):
    def forward(self, ids):
        h = self.body(ids).clone()
        h.add_(self.emb.weight[ids])
        return h.sum()


class NoGradNorm(Base):
    def forward(self, ids):
        with torch.no_grad():
            scale = self.emb.weight.norm()
        return (self.body(ids) / scale).sum()


class DirectForward(Base):
    def forward(self, ids):
        return self.block(self.emb.forward(ids)).sum()  # bypasses the embedding's hooks


# --- indirection: properties, getters, reflection ------------------------------------------------------------


class Property(Base):
    @property
    def table(self) -> torch.Tensor:
        return self.emb.weight

    def forward(self, ids):
        return (self.body(ids) + self.table.mean()).sum()


class Getter(Base):
    def get_input_embeddings(self) -> nn.Module:
        return self.emb

    def forward(self, ids):
        return (self.body(ids) * self.get_input_embeddings().weight.mean()).sum()


class NamedParameters(Base):
    def forward(self, ids):
        extra = 0.0
        for name, p in self.named_parameters():
            if name == "emb.weight":
                extra = p.sum()
        return (self.body(ids) + extra).sum()


class ParametersOfChild(Base):
    def forward(self, ids):
        return (self.body(ids) + sum(p.sum() for p in self.emb.parameters())).sum()


class ChildrenIter(Base):
    def forward(self, ids):
        h = self.body(ids)
        for child in self.children():
            if isinstance(child, nn.Embedding):
                h = h * child.weight.mean()
        return h.sum()


class ComputedGetattr(Base):
    def forward(self, ids):
        name = "em" + "b"
        return (self.body(ids) + getattr(self, name).weight.sum()).sum()


class ModulesDict(Base):
    def forward(self, ids):
        return (self.body(ids) + self._modules["emb"].weight.sum()).sum()


class Vars(Base):
    def forward(self, ids):
        return (self.body(ids) + vars(self)["_modules"]["emb"].weight.sum()).sum()


class ModuleDictKey(Base):
    def __init__(self) -> None:
        super().__init__()
        self.tables = nn.ModuleDict({"pos": nn.Embedding(VOCAB, DIM)})

    def forward(self, ids):
        return (self.body(ids) + self.tables["pos"].weight[: ids.shape[-1]]).sum()


# --- dynamic access Python resolves from constants (the analysis resolves it too: the layer keeps its group) ---

_TABLE = "emb"  # a module-level constant
_TABLES = ("emb",)


class GetattrLocalName(Base):
    def forward(self, ids):
        name = "emb"
        return (self.body(ids) * getattr(self, name).weight.mean()).sum()


class GetattrModuleConstant(Base):
    def forward(self, ids):
        w = getattr(self, _TABLE).weight.sum()  # before the embedding's own call
        return (self.body(ids) + w).sum()


class GetattrConstantLoop(Base):
    def forward(self, ids):
        h = self.body(ids)
        for name in _TABLES:
            h = h + getattr(self, name).weight.mean()
        return h.sum()


class GetattrTwoConstants(Base):
    def forward(self, ids):
        name = "block"
        if ids.numel() > 0:
            name = f"em{'b'}"  # either constant may be the one: both are followed
        return (self.body(ids) + getattr(self, name).weight.sum()).sum()


class ParametersSubscript(Base):
    def forward(self, ids):
        return (self.body(ids) + self._modules["emb"]._parameters["weight"].sum()).sum()


class DunderDict(Base):
    def forward(self, ids):
        w = self.__dict__["_modules"]["emb"].weight  # nn.Module keeps submodules in _modules, not __dict__
        return (self.body(ids) * w.mean()).sum()


class GetSubmodule(Base):
    def forward(self, ids):
        return (self.body(ids) + self.get_submodule("emb").weight.sum()).sum()


class GetParameter(Base):
    def forward(self, ids):
        w = self.get_parameter("emb.weight")
        return (self.block(self.emb(ids)) * w.mean()).sum()


class AttrGetter(Base):
    def forward(self, ids):
        return (self.body(ids) + operator.attrgetter("emb.weight")(self).sum()).sum()


class ModulesIsinstance(Base):
    def forward(self, ids):
        scale = 1.0
        for m in self.modules():
            if isinstance(m, nn.Embedding):
                scale = m.weight.mean()  # before any module's own call
        return (self.body(ids) * scale).sum()


class NamedModulesName(Base):
    def forward(self, ids):
        extra = 0.0
        for name, m in self.named_modules():
            if name == "emb":
                extra = m.weight.sum()  # before the embedding's own call
        return (self.body(ids) + extra).sum()


class NamedParametersContinue(Base):
    def forward(self, ids):
        h = self.body(ids)
        for name, p in self.named_parameters():
            if not name.startswith("emb."):
                continue
            h = h + p.mean()
        return h.sum()


class ComprehensionFilter(Base):
    def forward(self, ids):
        extra = sum(p.sum() for n, p in self.named_parameters() if n == "emb.weight")
        return (self.body(ids) + extra).sum()


def _ns_scale(model: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return h * model.emb.weight.mean()


_HELPERS = types.SimpleNamespace(scale=_ns_scale)


class NamespaceHelper(Base):
    def forward(self, ids):
        return _HELPERS.scale(self, self.body(ids)).sum()


class _Ops:
    @staticmethod
    def scale(model: nn.Module, h: torch.Tensor) -> torch.Tensor:
        return h * model.emb.weight.mean()


_OPS = _Ops()


class StaticHelpers(Base):
    def forward(self, ids):
        return _OPS.scale(self, _Ops.scale(self, self.body(ids))).sum()


# --- look-alikes the analysis must not resolve (a wrong resolution would shard the table that is read) --------


class GetattrFromAttribute(Base):
    def __init__(self) -> None:
        super().__init__()
        self.table_name = "emb"  # a name held in state, not a constant: stays an escape

    def forward(self, ids):
        return (self.body(ids) + getattr(self, self.table_name).weight.sum()).sum()


class OverriddenGetSubmodule(Base):
    def get_submodule(self, target: str) -> nn.Module:
        return self.emb if target == "block" else super().get_submodule(target)  # not what the name says

    def forward(self, ids):
        return (self.body(ids) * self.get_submodule("block").weight.mean()).sum()


class NarrowThenRebind(Base):
    def forward(self, ids):
        extra = 0.0
        for m in self.modules():
            if isinstance(m, Block):
                m = self.emb  # the isinstance test no longer says anything about m
                extra = m.weight.mean()
        return (self.body(ids) + extra).sum()


class NameTestRebound(Base):
    def forward(self, ids):
        extra = 0.0
        for name, p in self.named_parameters():
            if name == "block.lin.bias":
                p = self.emb.weight  # the rebinding is the pattern
                extra = p.sum()
        return (self.body(ids) + extra).sum()


class LateBindingClosure(Base):
    def __init__(self) -> None:
        super().__init__()
        self.tail = nn.Embedding(VOCAB, DIM)

    def forward(self, ids):
        extra = None
        for m in self.children():
            if isinstance(m, Block):
                extra = lambda: m.weight.sum()  # noqa: E731, B023 - runs after the loop: m is the last child, tail
        return (self.body(ids) + self.tail(ids) + extra()).sum()


# --- handing the module or its weight to other code ----------------------------------------------------------


class CheckpointedBlock(Base):
    """The layer through ``torch.utils.checkpoint`` (timm's Eva with gradient checkpointing on): a call through its
    hooks, so the layer keeps its group; the table is read raw after it."""

    def forward(self, ids):
        h = torch.utils.checkpoint.checkpoint(self.block, self.emb(ids), use_reentrant=False)
        return (h + self.emb.weight.sum()).sum()


class CheckpointedMethod(Base):
    """A method of the model through ``torch.utils.checkpoint``: the read inside it is found as in a direct call."""

    def mix(self, h):
        return self.block(h) * self.emb.weight.mean()

    def forward(self, ids):
        return torch.utils.checkpoint.checkpoint(self.mix, self.emb(ids), use_reentrant=False).sum()


class User(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, h: torch.Tensor, other: nn.Module) -> torch.Tensor:
        return self.lin(h) * other.weight.mean()


class ChildArgument(Base):
    def __init__(self) -> None:
        super().__init__()
        self.user = User()

    def forward(self, ids):
        return self.user(self.body(ids), self.emb).sum()


class WeightUser(nn.Module):
    def forward(self, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return h + w.sum()


class WeightArgument(Base):
    def __init__(self) -> None:
        super().__init__()
        self.user = WeightUser()

    def forward(self, ids):
        return self.user(self.body(ids), self.emb.weight).sum()


def _scaled(module: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return h * module.emb.weight.mean()


class HelperTakingSelf(Base):
    def forward(self, ids):
        return _scaled(self, self.body(ids)).sum()


def _first_weight(pair: tuple[nn.Module, nn.Module]) -> torch.Tensor:
    return pair[0].weight


class TuplePass(Base):
    def forward(self, ids):
        pair = (self.emb, self.block)
        return (self.body(ids) + _first_weight(pair).sum()).sum()


@dataclass
class Holder:
    weight: torch.Tensor


def _use_holder(holder: Holder, h: torch.Tensor) -> torch.Tensor:
    return h + holder.weight.mean()


class DataclassPass(Base):
    def forward(self, ids):
        return _use_holder(Holder(self.emb.weight), self.body(ids)).sum()


def _sum_all(*modules: nn.Module) -> torch.Tensor:
    return sum(m.weight.sum() for m in modules)


class StarArgs(Base):
    def forward(self, ids):
        return (self.body(ids) + _sum_all(*[self.emb])).sum()


class _Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(h, w)
        return h * w.mean()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, w = ctx.saved_tensors
        return grad * w.mean(), torch.full_like(w, float((grad * h).sum()) / w.numel())


class AutogradFunction(Base):
    def forward(self, ids):
        return _Scale.apply(self.body(ids), self.emb.weight).sum()


class FunctionalCall(Base):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM, bias=False)

    def forward(self, ids):
        h = self.body(ids)
        return torch.func.functional_call(self.proj, {"weight": self.emb.weight[:DIM]}, (h,)).sum()


_REGISTRY: dict[int, nn.Module] = {}


class GlobalRegistry(Base):
    def __init__(self) -> None:
        super().__init__()
        _REGISTRY[id(self)] = self.emb

    def forward(self, ids):
        return (self.body(ids) + _REGISTRY[id(self)].weight.sum()).sum()


# --- beyond what a static analysis can see (the run-time guard covers these) ---------------------------------

_WEAK: dict[int, Any] = {}


class WeakRegistry(Base):
    def __init__(self) -> None:
        super().__init__()
        _WEAK[id(self)] = weakref.ref(self.emb)

    def forward(self, ids):
        return (self.body(ids) + _WEAK[id(self)]().weight.sum()).sum()


class EvalString(Base):
    def forward(self, ids):
        return (self.body(ids) + eval("self.emb.weight").sum()).sum()


# --- code that is not the forward's own source: closures, partials, hooks, __call__ --------------------------


class StoredLambda(Base):
    def __init__(self) -> None:
        super().__init__()
        self.extra = lambda: self.emb.weight.sum()

    def forward(self, ids):
        return (self.body(ids) + self.extra()).sum()


def _weight_mean(emb: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return h * emb.weight.mean()


class StoredPartial(Base):
    def __init__(self) -> None:
        super().__init__()
        self.scale = functools.partial(_weight_mean, self.emb)

    def forward(self, ids):
        return self.scale(self.body(ids)).sum()


class NestedFunction(Base):
    def forward(self, ids):
        def extra() -> torch.Tensor:
            return self.emb.weight.sum()

        return (self.body(ids) + extra()).sum()


class LambdaDefault(Base):
    def forward(self, ids):
        extra = lambda w=self.emb.weight: w.sum()  # noqa: E731
        return (self.body(ids) + extra()).sum()


class ListComprehension(Base):
    def forward(self, ids):
        parts = [m.weight.mean() for m in (self.emb,)]
        return (self.body(ids) * parts[0]).sum()


class ForwardHookClosure(Base):
    def __init__(self) -> None:
        super().__init__()
        emb = self.emb
        self.block.register_forward_hook(lambda module, args, out: out + emb.weight.mean())

    def forward(self, ids):
        return self.body(ids).sum()


class PreHookMethod(Base):
    def __init__(self) -> None:
        super().__init__()
        self.block.register_forward_pre_hook(self._shift)

    def _shift(self, module: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return (args[0] + self.emb.weight.mean(),)

    def forward(self, ids):
        return self.body(ids).sum()


class PeekEmbedding(nn.Embedding):
    def __call__(self, ids: torch.Tensor) -> torch.Tensor:  # runs before the module's hooks
        self.last_norm = self.weight.detach().norm()
        return super().__call__(ids) * (self.weight.mean() + 1)


class CallOverride(Base):
    def __init__(self) -> None:
        super().__init__()
        self.emb = PeekEmbedding(VOCAB, DIM)

    def forward(self, ids):
        return self.body(ids).sum()


class TiedInForward(Base):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        logits = F.linear(self.body(ids), self.emb.weight)  # the head shares the table, set up here
        return logits.logsumexp(-1).sum()


# --- control flow: a read after the module's call in the text but not at run time -----------------------------


class OtherBranch(Base):
    def forward(self, ids):
        if ids.numel() < 0:  # noqa: SIM108 - the statement form is the pattern
            h = self.emb(ids)
        else:
            h = self.emb.weight[ids]  # textually after the call, runs instead of it
        return self.block(h).sum()


class LoopBefore(Base):
    def forward(self, ids):
        acc = 0.0
        for step in range(2):
            if step == 1:
                h = self.emb(ids)
            if step == 0:
                acc = self.emb.weight.sum()  # textually after the call, runs before it
        return (self.block(h) + acc).sum()


class WhileLoop(Base):
    def forward(self, ids):
        i, acc = 0, 0.0
        while i < 2:
            if i == 1:
                h = self.emb(ids)
            if i == 0:
                acc = self.emb.weight.mean()
            i += 1
        return (self.block(h) * acc).sum()


class EarlyReturn(Base):
    def forward(self, ids):
        if ids.numel() > 0:
            return (self.block(self.emb.weight[ids]) + 1).sum()  # the call below never runs
        h = self.emb(ids)
        return (h * self.emb.weight.mean()).sum()


class TryExcept(Base):
    def forward(self, ids):
        try:
            h = self.emb(ids[:, 100])  # raises before the embedding runs
        except IndexError:
            h = self.emb.weight[ids]
        return self.block(h).sum()


class AfterOwnForward(Base):
    def forward(self, ids):
        h = self.body(ids)
        return h.sum() + self.emb.weight.pow(2).mean()  # after the call on every path: no-reshard is safe


for _cls in [v for v in list(globals().values()) if isinstance(v, type) and issubclass(v, Base) and v is not Base]:
    PATTERNS[_cls.__name__] = _cls


# ---------------------------------------------------------------------------------------------------------------
# Rank routine


def _ids(rank: int) -> torch.Tensor:
    """Rank ``rank``'s batch: every rank trains on different token ids."""
    return torch.randint(0, VOCAB, (2, 3), generator=torch.Generator().manual_seed(100 + rank))


def _call(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(ids)


def _poison(model: nn.Module) -> None:
    """Multiply one gradient by NaN: the control that the comparator fails on NaN."""
    next(p for p in model.parameters() if p.grad is not None).grad.mul_(float("nan"))


def _train(name: str, policy: str, guard: bool, mesh: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    """Train ``name`` data-parallel (rank r on ``_ids(r)``) against an unsharded twin that, per step, runs every
    rank's batch with loss / W (one backward each, gradients accumulate) and then steps: the mean loss. With W <= 2
    the scaling by 1/W is exact and the sum commutative, so the figure asserted is exactly 0.0. ``cfg["poison"]``
    multiplies one gradient by NaN before the comparison (the control that the comparator fails on NaN)."""
    import torch.distributed as dist

    from fsdp_compat.apply import apply_fsdp2

    # "always": the per-op check armed on fsdp-compat's own (safe) plan too; the default arms it only where the plan or
    # the group check cannot rule a sharded read out, so the known gaps need it
    os.environ["FSDP_COMPAT_GUARD"] = "always" if guard else "off"
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = PATTERNS[name]()
    torch.manual_seed(0)
    twin = PATTERNS[name]()
    plan = apply_fsdp2(model, {"mesh": mesh}, ["Block"], policy=policy)
    record: dict[str, Any] = {
        "groups": [list(g.paths) for g in plan.groups],
        "no_reshard": [list(g.paths) for g in plan.groups if g.overrides.get("reshard_after_forward") is False],
    }
    opts = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(twin.parameters(), lr=0.1)
    diff = Diff()
    batches = [_ids(r) for r in range(world)]
    perturb = 1 + 1e-6 if cfg.get("perturb") else 1.0  # (loss * p) / 2 == (loss / 2) * p: halving is exact
    for _ in range(cfg.get("steps", 2)):
        twin_step(model, twin, opts, batches, rank, (diff, diff), scale=loss_scale(mesh), loss=_call,
                  ref_loss=(lambda m, ids: m(ids) * perturb) if perturb != 1.0 else None,
                  before_compare=(lambda: _poison(model)) if cfg.get("poison") else None)
    record["max_abs_diff"] = diff.abs
    return record


def run_cases(cfg: dict[str, Any], rank: int, case: Callable[[str, str, bool, Any], dict[str, Any]]) -> dict[str, Any]:
    """Join the gloo group, then run ``case(name, policy, guard, mesh)`` for every ``cfg["cases"]`` entry in this
    one process; a case that raises is recorded (exception line, traceback tail) and the next one runs."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{cfg['port']}", rank=rank, world_size=cfg["world_size"],
        timeout=timedelta(seconds=cfg["timeout_s"]),
    )
    mesh = init_device_mesh("cpu", (cfg["world_size"],))
    results: dict[str, Any] = {}
    for name, policy, guard in cfg["cases"]:
        key = f"{name}|{policy}|{'guard' if guard else 'noguard'}"
        try:
            results[key] = {"ok": True, **case(name, policy, guard, mesh)}
        except Exception as exc:
            results[key] = {
                "ok": False,
                "exception": traceback.format_exception_only(type(exc), exc)[-1].strip(),
                "traceback": traceback.format_exc()[-2000:],
            }
    return results


def corpus_rank(cfg: dict[str, Any], rank: int, extra: dict[str, Any]) -> None:
    """Rank routine: train every (pattern, policy, guard) case of ``cfg["cases"]`` against its twin."""
    torch.set_num_threads(1)  # the ranks share the cores
    extra["results"] = run_cases(cfg, rank, lambda name, policy, guard, mesh: _train(name, policy, guard, mesh, cfg))
