"""An adversarial corpus of ways a forward can read an embedding's weight outside the embedding's own forward.

Every pattern is a tiny module tree: a root with an ``nn.Embedding`` (``emb``, a candidate for its own FSDP2 group
under every policy), a layer ``Block`` and whatever the pattern needs; its forward returns a scalar loss and, on a
real run, reads ``emb``'s parameter in the pattern's way. :func:`corpus_rank` (a rank routine for
:func:`fsdp_compat.testing.harness.run_ranks`) trains each pattern under ``fsdp_compat.apply_fsdp2`` with a given
policy and guard setting and compares it with an unsharded twin built from the same seed (a twin, not a deep copy:
hooks and closures would still point at the sharded model).
"""

from __future__ import annotations

import functools
import os
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["PATTERNS", "corpus_rank", "full_tensor", "run_cases"]

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


# --- handing the module or its weight to other code ----------------------------------------------------------


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


def _ids() -> torch.Tensor:
    return torch.tensor([[1, 2, 3], [4, 5, 6]])


def full_tensor(t: Any) -> torch.Tensor | None:
    """A DTensor's full value (a collective), else the tensor itself."""
    if t is None:
        return None
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


def _train(name: str, policy: str, guard: bool, mesh: Any, steps: int, perturb: bool) -> dict[str, Any]:
    from fsdp_compat.apply import apply_fsdp2

    os.environ["FSDP_COMPAT_GUARD"] = "on" if guard else "off"
    torch.manual_seed(0)
    model = PATTERNS[name]()
    torch.manual_seed(0)
    twin = PATTERNS[name]()
    plan = apply_fsdp2(model, {"mesh": mesh}, ["Block"], policy=policy)
    record: dict[str, Any] = {
        "groups": [list(g.paths) for g in plan.groups],
        "no_reshard": [list(g.paths) for g in plan.groups if g.overrides.get("reshard_after_forward") is False],
    }
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    ref_params = dict(twin.named_parameters())
    worst = 0.0
    ids = _ids()
    for _ in range(steps):
        model(ids).backward()
        ref_loss = twin(ids)
        if perturb:
            ref_loss = ref_loss * (1 + 1e-6)
        ref_loss.backward()
        for pname, p in model.named_parameters():
            got, ref = full_tensor(p.grad), ref_params[pname].grad
            if got is None or ref is None:
                worst = max(worst, 0.0 if got is None and ref is None else float("inf"))
                continue
            worst = max(worst, float((got - ref).abs().max()))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        with torch.no_grad():
            for pname, p in model.named_parameters():
                worst = max(worst, float((full_tensor(p) - ref_params[pname]).abs().max()))
    record["max_abs_diff"] = worst
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
    steps, perturb = cfg.get("steps", 2), cfg.get("perturb", False)
    extra["results"] = run_cases(
        cfg, rank, lambda name, policy, guard, mesh: _train(name, policy, guard, mesh, steps, perturb)
    )
