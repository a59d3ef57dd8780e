"""A stand-in for LLaMA-Factory main's ``llamafactory/v1/plugins/trainer_plugins/distributed/fsdp2.py`` (unreleased
after 0.9.5, version 0.9.6.dev0), written from the upstream source at commit ff6d4d12eeb035d6ce06805a5733dd7b29f2ac30
(hiyouga/LLaMA-Factory, 2026-08-18; the file last changed in f28afaf6, "add FSDPTurbo EP/EFSDP plugin", which
added ``ignored_params``; 62ae3624, "Support multimodal data training", made the layer classes a set and added the
norms step). Written in our words, not copied; kept to what decides the sharding, with the release's signatures:

- ``get_transformer_layer_cls(model)`` returns a *set*: the class of the first child of every non-empty
  ``layers`` / ``blocks`` ModuleList (vision blocks included), else the ``_no_split_modules`` classes present.
- ``FSDP2Engine.prepare_model(self, model, ignored_params=None)``: no mesh -> warn, return; LoRA trainable leaves;
  in ``named_modules`` order ``type(module) in`` the set, or an ``nn.Embedding`` when untied; each
  ``fully_shard(module, mesh=, reshard_after_forward=, mp_policy=, offload_policy=, ignored_params=<its share>)``;
  with gradient checkpointing on, the input-grad hook and, under bf16, ``_make_norms_dtype_safe``; the root last,
  with every ignored parameter. ``fully_shard`` is looked up in this module at call time, as upstream.
- ``FSDPTurboFSDP2Engine`` (upstream ``fsdpturbo.py``): its ``prepare_model(self, model)`` computes the parameters
  of ``dist_config["fsdp_ignored_modules"]`` and calls ``super().prepare_model(model, ignored_params=...)``. The
  expert-parallel part (``fsdp_turbo``, CUDA) and its DP-orthogonal mesh are left out: ``ep_size`` 1.
- ``shard_model`` (the default init mode) and ``_warmup_grad_norm``; the plugin entry ``shard(model, name,
  dist_config, bf16)`` stands for ``FSDP2Distributed`` / ``FSDPTurboDistributed.shard_model``.

The process group and the model mesh come from LLaMA-Factory 0.9.5's real ``DistributedInterface`` (main's engine
reads the same ``model_device_mesh``). The rank code installs this module under the real module's name before
anything imports it, so the adapter's release table patches it exactly as it would patch the release.
"""

from __future__ import annotations

import fnmatch
from typing import Any

import torch
from llamafactory.v1.accelerator.interface import DistributedInterface
from peft.tuners.lora import LoraLayer
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

__all__ = ["FSDP2Engine", "FSDPTurboFSDP2Engine", "fully_shard", "get_transformer_layer_cls", "shard"]


def _norm_input_to_weight_dtype(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """The forward pre-hook of main's norms step: a LayerNorm's input cast to its weight's dtype."""
    weight = getattr(module, "weight", None)
    if args and isinstance(args[0], torch.Tensor) and weight is not None and args[0].dtype != weight.dtype:
        return (args[0].to(weight.dtype), *args[1:])
    return None


def _make_norms_dtype_safe(model: nn.Module) -> int:
    norms = [m for m in model.modules() if isinstance(m, nn.LayerNorm)]
    for norm in norms:
        norm.register_forward_pre_hook(_norm_input_to_weight_dtype)
    return len(norms)


def get_transformer_layer_cls(model: nn.Module) -> set[type[nn.Module]]:
    found: set[type[nn.Module]] = set()
    for module in model.modules():
        for attr in ("layers", "blocks"):
            seq = getattr(module, attr, None)
            if isinstance(seq, nn.ModuleList) and len(seq) > 0:
                found.add(type(seq[0]))
    if found:
        return found
    names = getattr(model, "_no_split_modules", None) or ()
    return {type(m) for m in model.modules() if type(m).__name__ in names}


class FSDP2Engine:
    def __init__(self, dist_config: dict[str, Any], bf16: bool = False) -> None:
        self.dist_config = dist_config
        self.dist_interface = DistributedInterface()
        self.rank = self.dist_interface.get_rank()
        self.mixed_precision = "bf16" if bf16 else "fp32"
        self.reshard_after_forward = dist_config.get("reshard_after_forward", True)
        self.offload_params = dist_config.get("offload_params", False)
        self.pin_memory = dist_config.get("pin_memory", True)
        self.fsdp_mesh = self.dist_interface.model_device_mesh

    def get_mp_policy(self) -> MixedPrecisionPolicy:
        low = torch.bfloat16 if self.mixed_precision == "bf16" else torch.float32
        return MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32, cast_forward_inputs=True)

    def is_lora_module_wrap(self, model: nn.Module) -> bool:
        return any(isinstance(m, LoraLayer) for m in model.modules())

    def prepare_model(self, model: nn.Module, ignored_params: set[nn.Parameter] | None = None) -> nn.Module:
        if self.fsdp_mesh is None:
            return model
        layer_classes = get_transformer_layer_cls(model)
        settings = dict(
            mesh=self.fsdp_mesh,
            reshard_after_forward=self.reshard_after_forward,
            mp_policy=self.get_mp_policy(),
            offload_policy=CPUOffloadPolicy(pin_memory=self.pin_memory) if self.offload_params else None,
        )

        def share_of(module: nn.Module) -> set[nn.Parameter] | None:
            return (ignored_params.intersection(module.parameters()) or None) if ignored_params else None

        if self.is_lora_module_wrap(model):
            leaves = [
                m
                for m in model.modules()
                if not list(m.children()) and any(p.requires_grad for p in m.parameters(recurse=False))
            ]
            for module in leaves:
                fully_shard(module, **settings, ignored_params=share_of(module))
        untied = not getattr(model.config, "tie_word_embeddings", True)
        for _name, module in model.named_modules():
            if type(module) in layer_classes or (untied and isinstance(module, nn.Embedding)):
                fully_shard(module, **settings, ignored_params=share_of(module))
        if getattr(model, "is_gradient_checkpointing", False):
            if hasattr(model, "enable_input_require_grads"):
                model.enable_input_require_grads()
            else:
                model.get_input_embeddings().register_forward_hook(lambda _m, _i, out: out.requires_grad_(True))
            if self.mixed_precision == "bf16":
                _make_norms_dtype_safe(model)
        fully_shard(model, **settings, ignored_params=share_of(model))
        return model

    def shard_model(self, model: nn.Module) -> nn.Module:
        model = self.prepare_model(model)
        self._warmup_grad_norm(model)
        return model

    def _warmup_grad_norm(self, model: nn.Module) -> None:
        """Zero gradients, one clip_grad_norm_ (its collectives), gradients cleared again: as upstream."""
        if self.fsdp_mesh is None:
            return
        trainable = [p for p in model.parameters() if p.requires_grad]
        for param in trainable:
            param.grad = torch.zeros_like(param)
        with torch.no_grad():
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if isinstance(norm, torch.distributed.tensor.DTensor):
                norm.full_tensor()
        for param in trainable:
            param.grad = None


class FSDPTurboFSDP2Engine(FSDP2Engine):
    def prepare_model_ep(self, model: nn.Module) -> tuple[nn.Module, set[nn.Parameter]]:
        patterns = list(self.dist_config.get("fsdp_ignored_modules", []))
        ignored: set[nn.Parameter] = set()
        for name, module in model.named_modules():
            if any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns):
                ignored.update(module.parameters())
        return model, ignored

    def prepare_model(self, model: nn.Module) -> nn.Module:  # type: ignore[override]
        model, ignored_params = self.prepare_model_ep(model)
        return super().prepare_model(model, ignored_params=ignored_params)


def shard(model: nn.Module, name: str, dist_config: dict[str, Any], bf16: bool = False) -> nn.Module:
    """``DistributedPlugin(name)``'s ``shard_model``: ``"fsdp2"`` or ``"fsdpturbo"``."""
    engine = {"fsdp2": FSDP2Engine, "fsdpturbo": FSDPTurboFSDP2Engine}[name]
    return engine(dist_config, bf16=bf16).shard_model(model)
