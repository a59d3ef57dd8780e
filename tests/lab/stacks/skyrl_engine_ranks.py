"""Rank side of ``test_skyrl_engine.py``: SkyRL's model building and FSDP2 init, then PPO steps, per rank.

A reproduction of ``FSDPStrategy._fsdp_init_model`` / ``_fsdp_init_train_model`` (skyrl 0.4.0
``skyrl/backends/skyrl_train/distributed/fsdp_strategy.py`` lines 202-285; skyrl-train 0.3.1
``skyrl_train/distributed/fsdp_strategy.py`` lines 254-300, its ``fsdp2`` branch), because the real methods
only run with CUDA (see the module docstring of the test). What runs is SkyRL's own code wherever it can run on
CPU: ``should_use_meta_init`` / ``get_init_weight_context_manager``, ``HFModelWrapper`` (loading the saved model
and its forward), ``PrecisionType``, ``fsdp_strategy.MixedPrecisionPolicy``, ``fsdp_strategy.apply_fsdp2`` (the
name SkyRL calls, which the adapter patches), the policy loss from ``PolicyLossRegistry``, and
``FSDPStrategy.backward`` / ``optimizer_step``. Reproduced here are only the lines that hard-code CUDA:
``create_device_mesh`` (``init_device_mesh("cuda")``; here the same mesh on "cpu") and
``fsdp2_load_full_state_dict`` (``.cuda()``; here torch's ``set_model_state_dict`` with the options skyrl >= 0.3
passes, plus its rank-0 broadcast of non-persistent buffers, on CPU; older releases broadcast each parameter from
rank 0 by hand, which loads the same values).

Imported only in fresh rank interpreters (``tests/`` and ``tests/lab/stubs`` on PYTHONPATH); it imports no
fsdp_compat adapter, so whatever patches SkyRL here is the ``.pth`` start-up hook.
"""

from __future__ import annotations

import importlib
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

from fsdp_compat.testing.launch import RankResult
from fsdp_compat.testing.parity import (
    Diff,
    _fsdp_group_paths,
    full_tensor,
    gradient_reduction_factor,
    init_group,
    rank_result,
    runtime_counters,
)
from fsdp_compat.testing.skyrl_smoke import _PACKAGES, installed_skyrl, probe

#: Whether anything imported fsdp_compat's SkyRL adapter before this module (and with it SkyRL) loaded.
ADAPTER_BEFORE_SKYRL = "fsdp_compat.adapters.skyrl" in sys.modules

import lab.stacks.skyrl_ranks as skyrl_ranks  # noqa: E402, F401  (Python 3.11 TypedDict workaround; may import SkyRL)

#: Where each distribution keeps HFModelWrapper and the PPO loss registry.
_WRAPPER = {"skyrl": "skyrl.backends.skyrl_train.workers.model_wrapper", "skyrl-train": "skyrl_train.model_wrapper"}
_PPO = {"skyrl": "skyrl.backends.skyrl_train.utils.ppo_utils", "skyrl-train": "skyrl_train.utils.ppo_utils"}
LR = 1e-3


def _configs(distribution: str) -> tuple[Any, Any, Any]:
    """(fsdp_config, optimizer_config, algorithm_config): the release's shipped trainer defaults, fp32.

    ``max_grad_norm=0`` skips ``fsdp2_clip_grad_norm_``, which moves the norm to ``torch.cuda.current_device()``.
    """
    from omegaconf import OmegaConf

    fp32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
    optim = {"lr": LR, "adam_betas": [0.9, 0.999], "weight_decay": 1e-2, "max_grad_norm": 0.0}
    optim |= {"offload_after_step": False, "num_warmup_steps": 0, "scheduler": "constant_with_warmup"}
    if distribution == "skyrl":
        from skyrl.train.config import AlgorithmConfig, FSDPConfig, MixedPrecisionConfig, OptimizerConfig

        return FSDPConfig(mixed_precision=MixedPrecisionConfig(**fp32)), OptimizerConfig(**optim), AlgorithmConfig()
    import skyrl_train

    yaml = Path(skyrl_train.__file__).parent / "config" / "ppo_base_config.yaml"
    if yaml.is_file():
        shipped = OmegaConf.load(yaml).trainer
    else:  # skyrl-train 0.1.0 ships no config: the keys its fsdp2 path and PPO loss read, 0.3.1's defaults
        policy = {"fsdp_config": {"cpu_offload": False, "reshard_after_forward": True, "fsdp_size": -1}}
        algorithm = {"policy_loss_type": "regular", "loss_reduction": "token_mean", "eps_clip_low": 0.2}
        algorithm |= {"eps_clip_high": 0.2, "clip_ratio_c": 3.0, "use_tis": False, "tis_imp_ratio_cap": -1.0}
        shipped = OmegaConf.create({"policy": {**policy, "optimizer_config": optim}, "algorithm": algorithm})
    fsdp = OmegaConf.merge(shipped.policy.fsdp_config, {"mixed_precision": fp32})
    algorithm = OmegaConf.merge(shipped.algorithm, {"max_seq_len": 64})  # the trainer fills it in from data
    return fsdp, OmegaConf.merge(shipped.policy.optimizer_config, optim), algorithm


def _build_wrapper(distribution: str, path: str, mesh: Any, *, sharded: bool) -> tuple[Any, bool]:
    """``HFModelWrapper`` as the policy worker's ``init_model`` builds it: meta weights on ranks other than 0
    (``should_use_meta_init`` + ``meta_init``, or ``get_init_weight_context_manager`` on older releases)."""
    wrapper_cls = _wrapper_class(distribution)
    from transformers import AutoConfig

    tied = AutoConfig.from_pretrained(path, trust_remote_code=True).tie_word_embeddings
    utils = importlib.import_module(f"{_PACKAGES[distribution]}.fsdp_utils")
    if not sharded:
        return wrapper_cls(path, use_flash_attention_2=False, bf16=False), False
    if hasattr(utils, "should_use_meta_init"):
        use_meta = bool(utils.should_use_meta_init(use_meta_tensor=not tied, mesh=mesh))
        return wrapper_cls(path, use_flash_attention_2=False, bf16=False, meta_init=use_meta), use_meta
    context = utils.get_init_weight_context_manager(use_meta_tensor=not tied, mesh=mesh)
    with context():
        return wrapper_cls(path, use_flash_attention_2=False, bf16=False), context.__name__ == "init_empty_weights"


def _fsdp2_only(distribution: str) -> bool:
    """skyrl >= 0.3: FSDPStrategy is FSDP2 only ("fsdp") and moves the module to meta before apply_fsdp2;
    older releases select FSDP2 with ``fsdp_strategy="fsdp2"`` and keep rank 0's weights in place."""
    from packaging.version import Version

    found = installed_skyrl()
    return found is not None and found[0] == "skyrl" and found[1] >= Version("0.3")


def make_strategy(strategy: Any, distribution: str, fsdp_config: Any, optim_config: Any) -> Any:
    """``FSDPStrategy`` as the policy worker constructs it (FSDP2)."""
    kwargs = {} if _fsdp2_only(distribution) else {"fsdp_strategy": "fsdp2"}
    return strategy.FSDPStrategy(fsdp_config=fsdp_config, optimizer_config=optim_config, **kwargs)


def _load_full_state_dict_cpu(module: Any, full_state: dict[str, Any]) -> None:
    """``fsdp2_load_full_state_dict`` on CPU: the same torch call, then the non-persistent buffer broadcast
    (SkyRL's ``_sync_non_persistent_buffers`` stages through ``.cuda()``; here the buffers stay on CPU)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(module, full_state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for sub in module.modules():
        for key in sorted(getattr(sub, "_non_persistent_buffers_set", set())):
            buf = sub._buffers.get(key)
            if buf is None:
                continue
            src = buf.detach().clone() if dist.get_rank() == 0 else torch.empty(buf.shape, dtype=buf.dtype)
            dist.broadcast(src, src=0)
            sub._buffers[key] = src


def fsdp_init_model(distribution: str, strategy: Any, wrapped: Any, fsdp_config: Any, mesh: Any) -> Any:
    """``FSDPStrategy._fsdp_init_model(wrapped, is_train=True, is_wrapped=True)``, line by line (fsdp2)."""
    import torch
    import torch.distributed as dist

    mixed = getattr(fsdp_config, "mixed_precision", None)  # the dataclass and a DictConfig both answer this
    param_dtype = strategy.PrecisionType.to_dtype(mixed.param_dtype) if mixed else torch.bfloat16
    reduce_dtype = strategy.PrecisionType.to_dtype(mixed.reduce_dtype) if mixed else torch.float32
    mp_policy = strategy.MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=True
    )
    fsdp_kwargs = {"mesh": mesh, "mp_policy": mp_policy, "offload_policy": None, "reshard_after_forward": True}
    module = wrapped.model
    full_state = module.state_dict()
    if _fsdp2_only(distribution):  # skyrl >= 0.3 moves the whole module to meta on every rank first
        snapshot = {}
        if dist.get_rank() == 0:
            for sub_name, sub in module.named_modules():
                for name in getattr(sub, "_non_persistent_buffers_set", set()):
                    buf = sub._buffers.get(name)
                    if buf is not None and not buf.is_meta:
                        snapshot[(sub_name, name)] = buf.detach().clone()
        module.to(torch.device("meta"))
        for (sub_name, name), buf in snapshot.items():
            (module.get_submodule(sub_name) if sub_name else module)._buffers[name] = buf
    strategy.apply_fsdp2(module, fsdp_kwargs, fsdp_config)
    _load_full_state_dict_cpu(module, full_state)
    return module


def _optimizer(optim_config: Any, params: Any) -> tuple[Any, Any]:
    """``_fsdp_init_train_model``'s AdamW and scheduler."""
    from torch import optim
    from transformers.trainer import get_scheduler

    optimizer = optim.AdamW(
        params, lr=optim_config.lr, betas=optim_config.adam_betas, weight_decay=optim_config.weight_decay
    )
    return optimizer, get_scheduler(optim_config.scheduler, optimizer, num_warmup_steps=optim_config.num_warmup_steps)


def _batch(cfg: dict[str, Any], rank: int) -> dict[str, Any]:
    """Rank ``rank``'s zoo micro-batch as a SkyRL experience: seed ``seed + rank`` and ``variants[rank]`` (a
    vision-language model's kind of batch: "image", "text", ...); sequences, mask, every token an action, images as
    TensorList (absent for a text-only batch, as SkyRL's experiences carry them)."""
    import torch

    from fsdp_compat.testing.zoo import is_vlm, make_batch

    variants = cfg.get("variants") or ["image"] * cfg["world_size"]
    kind = {"variant": variants[rank]} if is_vlm(cfg["model"]) else {}
    seed = cfg["seed"] + rank
    batch = make_batch(cfg["model"], seed=seed, **kind)
    mask = batch["attention_mask"]
    g = torch.Generator().manual_seed(seed + 1000)
    out = {
        "sequences": batch["input_ids"],
        "num_actions": mask.shape[1] - 1,
        "attention_mask": mask,
        "loss_mask": mask[:, 1:].float(),
        "advantages": torch.randn(mask.shape[0], mask.shape[1] - 1, generator=g),
    }
    if "pixel_values" in batch:
        training_batch = importlib.import_module(_PACKAGES[cfg["distribution"]].rsplit(".", 1)[0] + ".training_batch")
        for key in ("pixel_values", "image_grid_thw"):  # the image fields a SkyRL experience carries
            if key in batch:
                out[key] = training_batch.TensorList([batch[key]])
    return out


def _action_log_probs(wrapped: Any, experience: dict[str, Any]) -> Any:
    """``HFModelWrapper.forward`` as the policy worker calls it for one micro batch."""
    images = {k: experience[k] for k in ("pixel_values", "image_grid_thw") if k in experience}
    action_log_probs, _ = wrapped(
        experience["sequences"],
        experience["num_actions"],
        attention_mask=experience["attention_mask"],
        temperature=1.0,
        return_output=True,
        **images,
    )
    return action_log_probs


def _ppo_loss(distribution: str, wrapped: Any, experience: dict[str, Any], algorithm: Any) -> Any:
    """The policy worker's forward and SkyRL's "regular" PPO loss against the experience's old log-probs."""
    loss_fn = importlib.import_module(_PPO[distribution]).PolicyLossRegistry.get("regular")
    loss, _ = loss_fn(
        _action_log_probs(wrapped, experience),
        experience["action_log_probs"],
        experience["advantages"],
        config=algorithm,
        loss_mask=experience["loss_mask"],
    )
    return loss


def init_and_train(cfg: dict[str, Any], rank: int, extra: dict[str, Any]) -> RankResult:
    """Rank routine for ``launch.run_ranks``: build, shard and train as SkyRL does, each rank on its own micro-batch
    (``_batch``); parity against a local unsharded ``HFModelWrapper`` of the same saved model (same optimizer and
    scheduler) that trains on all the ranks' micro-batches with the mean loss (one backward of ``loss_r / W`` per
    micro-batch: with 2 ranks the sums FSDP2's reduce-scatter makes, so the figures are exactly 0.0)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    distribution, version = installed_skyrl() or ("", "")
    cfg["distribution"] = distribution
    strategy = importlib.import_module(f"{_PACKAGES[distribution]}.fsdp_strategy")
    extra.update(
        release=f"{distribution} {version}",
        adapter_imported_before_skyrl=ADAPTER_BEFORE_SKYRL,
        strategy_apply_fsdp2_patched=bool(getattr(strategy.apply_fsdp2, "__fsdp_compat__", False)),
        fsdp_compat_env=os.environ.get("FSDP_COMPAT"),
    )
    init_group({**cfg, "device": "cpu"}, rank)  # gloo: SkyRL's CUDA lines are replaced by a CPU mesh here
    mesh = init_device_mesh("cpu", (cfg["world_size"],), mesh_dim_names=["fsdp"])  # create_device_mesh, on CPU
    fsdp_config, optim_config, algorithm = _configs(distribution)
    fsdp_strategy = make_strategy(strategy, distribution, fsdp_config, optim_config)
    torch.manual_seed(cfg["seed"])

    wrapped, extra["meta_init"] = _build_wrapper(distribution, cfg["path"], mesh, sharded=True)
    reference, _ = _build_wrapper(distribution, cfg["path"], mesh, sharded=False)
    wrapped.model = fsdp_init_model(distribution, strategy, wrapped, fsdp_config, mesh)
    extra["fsdp_groups"] = _fsdp_group_paths(wrapped.model)
    optimizer, scheduler = _optimizer(optim_config, wrapped.model.parameters())
    ref_optimizer, ref_scheduler = _optimizer(optim_config, reference.model.parameters())

    # Every rank builds every rank's experience: its own for the sharded model, all of them for the reference.
    experiences = [_batch(cfg, r) for r in range(cfg["world_size"])]
    with torch.no_grad():  # the rollout policy's log-probs: the initial weights (PPO's ratio is 1 at step 1)
        for experience in experiences:
            experience["action_log_probs"] = _action_log_probs(reference, experience)
    experience = experiences[rank]
    scale = 1.0 / gradient_reduction_factor(mesh)  # torch 2.8's FSDP2 over gloo sums gradients instead of averaging
    extra["gradient_reduction_factor"] = 1.0 / scale
    ref_params = dict(reference.model.named_parameters())
    initial = {name: p.detach().clone() for name, p in ref_params.items()}
    grads, params = Diff(), Diff()
    losses: list[float] = []
    ref_losses: list[float] = []
    for model in (wrapped, reference):
        model.train()
    for _ in range(cfg["steps"]):
        loss = _ppo_loss(distribution, wrapped, experience, algorithm)
        fsdp_strategy.backward(loss * scale if scale != 1.0 else loss, wrapped, optimizer)
        # one process on all the ranks' micro-batches with the mean loss: one backward of loss_r / W per batch
        for r, other in enumerate(experiences):
            ref_loss = _ppo_loss(distribution, reference, other, algorithm)
            fsdp_strategy.backward(ref_loss / len(experiences), reference, ref_optimizer)
            if r == rank:
                ref_losses.append(float(ref_loss.detach()))
        named = list(wrapped.model.named_parameters())
        with torch.no_grad():
            for name, p in named:
                grads.add(name, full_tensor(p.grad), ref_params[name].grad)
        fsdp_strategy.optimizer_step(optimizer, wrapped, scheduler)
        fsdp_strategy.optimizer_step(ref_optimizer, reference, ref_scheduler)
        with torch.no_grad():
            for name, p in named:
                params.add(name, full_tensor(p), ref_params[name])
        losses.append(float(loss.detach()))
    extra["reference_losses"] = ref_losses
    extra["mixed_batches"] = runtime_counters(wrapped.model)["mixed_batches"]
    extra["max_param_update"] = max(float((p - initial[n]).abs().max()) for n, p in ref_params.items())
    extra["probe"] = probe()
    return rank_result(rank, losses, grads, params, extra)


def _failure(exc: BaseException) -> dict[str, Any]:
    """The exception line and the innermost SkyRL frame it came from (file, function, source line)."""
    import traceback

    distribution, _ = installed_skyrl() or ("", "")
    root = Path(importlib.import_module(_PACKAGES[distribution].split(".")[0]).__file__ or "").parent
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename).is_relative_to(root)]
    where = frames[-1] if frames else None
    return {
        "exception": traceback.format_exception_only(type(exc), exc)[-1].strip(),
        "skyrl_frame": None if where is None else f"{Path(where.filename).relative_to(root.parent)}:{where.name}",
        "skyrl_line": None if where is None else where.line,
        "traceback": "".join(traceback.format_exception(exc))[-3000:],
    }


def real_strategy(cfg: dict[str, Any], rank: int, extra: dict[str, Any]) -> RankResult | None:
    """Rank routine: SkyRL's real ``FSDPStrategy`` as the policy worker's ``init_model`` drives it.

    On CUDA: ``setup_distributed``, ``HFModelWrapper``, ``prepare``, then PPO steps through the strategy. On CPU
    the CUDA blockers are recorded, not raised: first the real sequence (the mesh ``setup_distributed`` makes is a
    "cuda" mesh, which ``fully_shard`` cannot use), then ``prepare`` again on a fresh wrapper given the CPU mesh a
    CPU platform would have made (the next blocker is in ``fsdp2_load_full_state_dict``).
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    distribution, version = installed_skyrl() or ("", "")
    cfg["distribution"] = distribution
    strategy = importlib.import_module(f"{_PACKAGES[distribution]}.fsdp_strategy")
    cuda = cfg["device"] == "cuda"
    extra.update(release=f"{distribution} {version}", patched=bool(getattr(strategy.apply_fsdp2, "__fsdp_compat__", 0)))
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"tcp://127.0.0.1:{cfg['port']}",
        rank=rank,
        world_size=cfg["world_size"],
        timeout=timedelta(seconds=cfg["timeout_s"]),
    )
    if cuda:
        torch.cuda.set_device(rank)
    fsdp_config, optim_config, algorithm = _configs(distribution)
    fsdp_strategy = make_strategy(strategy, distribution, fsdp_config, optim_config)
    fsdp_strategy.setup_distributed()
    extra["mesh_device_type"] = fsdp_strategy.device_mesh.device_type
    attempts = [fsdp_strategy.device_mesh]
    if not cuda:
        attempts.append(init_device_mesh("cpu", (cfg["world_size"],), mesh_dim_names=["fsdp"]))
    for mesh in attempts:
        fsdp_strategy.device_mesh = mesh
        wrapped, extra["meta_init"] = _build_wrapper(distribution, cfg["path"], mesh, sharded=True)
        try:
            wrapped, optimizer, scheduler = fsdp_strategy.prepare((wrapped, None, None))
        except Exception as exc:
            if cuda:
                raise
            extra[f"prepare_{mesh.device_type}_mesh"] = {
                **_failure(exc),
                "fsdp_groups": _fsdp_group_paths(wrapped.model),
            }
    if not cuda:
        return None
    extra["fsdp_groups"] = _fsdp_group_paths(wrapped.model)
    experience = {k: v.cuda() if hasattr(v, "cuda") else v for k, v in _batch(cfg, rank).items()}
    for key in ("pixel_values", "image_grid_thw"):
        if key in experience:
            experience[key].tensors = [t.cuda() for t in experience[key].tensors]
    wrapped.train()
    with torch.no_grad():
        experience["action_log_probs"] = _action_log_probs(wrapped, experience)
    reference, _ = _build_wrapper(distribution, cfg["path"], None, sharded=False)
    reference.model.cuda()
    reference.train()
    extra["reference_step1_loss"] = float(_ppo_loss(distribution, reference, experience, algorithm).detach())
    del reference
    losses = []
    for _ in range(cfg["steps"]):
        loss = _ppo_loss(distribution, wrapped, experience, algorithm)
        fsdp_strategy.backward(loss, wrapped, optimizer)
        extra.setdefault("grad_norms", []).append(float(fsdp_strategy.optimizer_step(optimizer, wrapped, scheduler)))
        losses.append(float(loss.detach()))
    extra["probe"] = probe()
    return RankResult(rank=rank, ok=True, losses=losses, extra=extra)


def _model_module(distribution: str) -> Any:
    """The module holding ``HFModelWrapper`` (skyrl-train 0.1.0: ``Actor`` in ``skyrl_train.models``)."""
    try:
        return importlib.import_module(_WRAPPER[distribution])
    except ModuleNotFoundError:
        return importlib.import_module("skyrl_train.models")


def _wrapper_class(distribution: str) -> Any:
    module = _model_module(distribution)
    return getattr(module, "HFModelWrapper", None) or module.Actor


def loading_paths(cfg: dict[str, Any], rank: int, extra: dict[str, Any]) -> None:
    """Rank routine (one rank, no process group): which of the release's model builders load ``cfg["path"]``.

    policy/ref: ``HFModelWrapper(path, bf16=False)``; language_model_only (releases that have the flag); critic:
    ``get_llm_for_sequence_regression(path, "critic", ...)`` as the critic worker calls it. Records the built
    class or the exception line for each.
    """
    import inspect

    distribution, version = installed_skyrl() or ("", "")
    module = _model_module(distribution)
    wrapper_cls = _wrapper_class(distribution)
    builders: dict[str, Any] = {"policy": lambda: wrapper_cls(cfg["path"], bf16=False).model}
    if "language_model_only" in inspect.signature(wrapper_cls.__init__).parameters:
        builders["language_model_only"] = lambda: wrapper_cls(cfg["path"], bf16=False, language_model_only=True).model
    builders["critic"] = lambda: module.get_llm_for_sequence_regression(
        cfg["path"], "critic", bf16=False, init_value_head=True, value_head_prefix="value_head"
    )
    extra.update(release=f"{distribution} {version}", builder=f"{module.__name__}.{wrapper_cls.__name__}")
    for path, build in builders.items():
        try:
            extra[path] = {"loaded": type(build()).__name__}
        except Exception as exc:
            extra[path] = {"error": _failure(exc)["exception"].splitlines()[0]}
