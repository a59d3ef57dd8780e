"""Rank-side code of the torchtitan tests: torchtitan 0.3.0's own Qwen3.5 (``torchtitan.models.qwen3_5``) built
from a tiny config of its own config builders, through its trainer's build path, sharded by its own
``parallelize_qwen3_5`` (``apply_fsdp_to_vision_encoder``: the vision encoder one group;
``apply_fsdp_to_decoder``: the token embedding, each layer, ``[norm, lm_head]``, the root).

What :func:`build` runs is ``Trainer.__init__``'s model path line by line (torchtitan 0.3.0 ``trainer.py``):
``ParallelDims.from_config``, ``set_spmd_backend``, ``set_determinism``, ``update_from_config``, the meta-device
build, ``verify_module_protocol``, ``config.loss.build``, ``model_spec.parallelize_fn``, ``to_empty`` +
``init_weights``, ``ChunkedLossWrapper.set_lm_head`` with ``_skip_lm_head``, ``config.optimizer.build``. A batch goes
through the trainer's own ``post_dataloading_process`` (the attention masks) and its forward is the first half of
``_forward_backward_body`` (``model(inputs, **extra_kwargs)``, then the chunked loss). ``Trainer`` itself cannot be
constructed on CPU: its ``__init__`` starts with ``device_module.set_device(utils.get_local_device())``, and
torchtitan's device falls back to ``cuda`` where no accelerator is found.

What differs from a GPU run, and why (each a CPU limit, none a change to torchtitan's code):

* ``torchtitan.distributed.parallel_dims.device_type = "cpu"``: the meshes are built on ``device_type``, which is
  ``"cuda"`` on a machine without an accelerator;
* ``parallelism.spmd_backend = "partial_dtensor"``: under the default ``spmd_types`` the parameters carry spmd_types
  annotations and ``fully_shard(..., dp_mesh_dims=...)`` of torch 2.13.0 accepts only DTensors ("When dp_mesh_dims is
  provided, all parameters must be DTensors on the full SPMD mesh", at the vision encoder's ``fully_shard``);
* every layer full attention (``full_attention_interval=1``): the Gated DeltaNet layers run FLA's Triton kernels;
* every forward under ``torch.no_grad()``: torchtitan's ``FlexAttention`` (and the vision encoder's) calls
  ``flex_attention``, which on CPU raises ``NotImplementedError: FlexAttention does not support backward on CPU``
  as soon as an input requires grad, in the forward already (``_validate_device``); :func:`torchtitan_rank` records
  that error where a case asks for a grad-mode forward.

Batches are built in torchtitan's ``MultiModalCollator`` layout (``input``, ``positions``, ``pixel_values`` as
padded patches ``(images, patches, 3*2*p*p)``, ``grid_thw``, ``special_tokens``, ``mrope_positions`` for image
batches): the collator module imports torchvision, which has no build for torch 2.13.0.
"""

from __future__ import annotations

import dataclasses
import logging
import traceback
from types import SimpleNamespace
from typing import Any

import torch

from fsdp_compat.testing.parity import init_group, runtime_counters
from lab.observe import LogLines, fsdp_groups

__all__ = ["IMAGE_ID", "SEQ", "build", "make_batch", "tiny_spec", "torchtitan_rank", "trainer_config"]

VOCAB = 128
DIM = 64
SEQ = 32
IMAGE_ID = 5
VIDEO_ID = 6
PATCH = 4  # pixels per patch side: a 16x16 image is 4x4 patches, 2x2 merged tokens
GRID = (1, 4, 4)


def tiny_spec() -> Any:
    """torchtitan's own ``qwen3_5`` ModelSpec (``model_registry``: ``parallelize_qwen3_5``, ``pipeline_vlm``, its
    state-dict adapter) with a tiny ``Qwen35Model.Config`` from the package's own config builders."""
    from torchtitan.models.common import Embedding, Linear
    from torchtitan.models.qwen3_5 import (
        _EMBEDDING_INIT,
        MRoPE,
        Qwen35Model,
        _build_qwen35_layers,
        _offset_norm,
        _output_linear_init,
        _qwen35_vision_encoder_config,
        model_registry,
    )

    config = Qwen35Model.Config(
        vocab_size=VOCAB,
        dim=DIM,
        norm=_offset_norm(DIM),
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=_EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_output_linear_init(DIM)),
        layers=_build_qwen35_layers(
            rope=MRoPE.Config(dim=16, max_seq_len=256, theta=10_000_000.0, mrope_section=[3, 3, 2]),
            attn_backend="flex",
            n_layers=2,
            dim=DIM,
            n_heads=4,
            n_kv_heads=2,
            head_dim=16,
            rotary_dim=16,
            hidden_dim=128,
            n_key_heads=2,
            n_value_heads=4,
            key_head_dim=16,
            value_head_dim=16,
            full_attention_interval=1,  # no Gated DeltaNet layer: FLA's kernels are Triton-only
        ),
        vision_encoder=_qwen35_vision_encoder_config(
            dim=32,
            ffn_dim=64,
            num_layers=2,
            num_heads=2,
            patch_size=PATCH,
            temporal_patch_size=2,
            spatial_merge_size=2,
            out_hidden_size=DIM,
            num_position_embeddings=16,
        ),
    )
    return dataclasses.replace(model_registry("debugmodel"), flavor="tiny", model=config)


def trainer_config(spec: Any) -> Any:
    """A ``Trainer.Config`` as ``config_registry.qwen35_debugmodel`` writes it (chunked cross-entropy, AdamW), fp32,
    the data-parallel degree filled from the world size (``data_parallel_shard_degree=-1``)."""
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.config import ParallelismConfig, TrainingConfig
    from torchtitan.trainer import Trainer

    return Trainer.Config(
        model_spec=spec,
        loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=VOCAB)),
        optimizer=default_adamw(lr=5e-3),
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
        training=TrainingConfig(
            local_batch_size=1,
            seq_len=SEQ,
            mixed_precision_param="float32",
            mixed_precision_reduce="float32",
        ),
    )


def build(world_size: int, *, shard: bool = True) -> SimpleNamespace:
    """``Trainer.__init__``'s model path (see the module doc). ``shard=False``: the same model unsharded (no
    ``parallelize_fn``), the reference of one process."""
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.tools import utils

    parallel_dims_module.device_type = "cpu"  # torchtitan's device falls back to "cuda" without an accelerator
    spec = tiny_spec()
    config = trainer_config(spec)
    parallel_dims = ParallelDims.from_config(config.parallelism, world_size)
    dist_utils.set_spmd_backend(config.parallelism.spmd_backend)
    if shard:
        dist_utils.set_determinism(parallel_dims, torch.device("cpu"), config.debug, distinct_seed_mesh_dims=["pp"])
    spec.model.update_from_config(config=config)
    with torch.device("meta"), utils.set_default_dtype(TORCH_DTYPE_MAP[config.training.dtype]):
        model = spec.model.build()
    model.verify_module_protocol()
    loss_fn = config.loss.build(compile_config=config.compile)
    if shard:
        model = spec.parallelize_fn(
            model,
            parallel_dims=parallel_dims,
            training=config.training,
            parallelism=config.parallelism,
            compile_config=config.compile,
            ac_config=config.activation_checkpoint,
            dump_folder=config.dump_folder,
        )
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    loss_fn.set_lm_head(model.lm_head)
    model._skip_lm_head = True
    optimizers = config.optimizer.build(model_parts=[model]) if shard else None
    return SimpleNamespace(
        spec=spec, config=config, parallel_dims=parallel_dims, model=model, loss_fn=loss_fn, optimizers=optimizers
    )


def make_batch(kind: str, seed: int) -> tuple[dict[str, Any], torch.Tensor]:
    """One sample in ``MultiModalCollator``'s output layout: ``image`` (one 16x16 image, 4 image tokens at 2..5,
    3-D MRoPE positions) or ``text``."""
    from torchtitan.components.loss import IGNORE_INDEX

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(10, VOCAB, (1, SEQ + 1), generator=g)
    inputs: dict[str, Any] = {
        "positions": torch.arange(SEQ).unsqueeze(0),
        "pixel_values": None,
        "grid_thw": None,
        "pixel_values_videos": None,
        "grid_thw_videos": None,
        "special_tokens": {"image_id": IMAGE_ID, "video_id": VIDEO_ID},
    }
    if kind == "image":
        t, h, w = GRID
        n = (h // 2) * (w // 2)
        tokens[0, 2 : 2 + n] = IMAGE_ID
        inputs["pixel_values"] = torch.randn(1, t * h * w, 3 * 2 * PATCH * PATCH, generator=g)
        inputs["grid_thw"] = torch.tensor([GRID])
        mrope = torch.zeros(1, SEQ, 3, dtype=torch.long)
        mrope[0, :2] = torch.arange(2).unsqueeze(-1)
        hh, ww = torch.meshgrid(torch.arange(h // 2), torch.arange(w // 2), indexing="ij")
        mrope[0, 2 : 2 + n, 0] = 2
        mrope[0, 2 : 2 + n, 1] = 2 + hh.flatten()
        mrope[0, 2 : 2 + n, 2] = 2 + ww.flatten()
        mrope[0, 2 + n :] = (torch.arange(SEQ - 2 - n) + 2 + max(h, w) // 2).unsqueeze(-1)
        inputs["mrope_positions"] = mrope
    elif kind != "text":
        raise ValueError(kind)
    labels = tokens[:, 1:].clone()
    labels[labels == IMAGE_ID] = IGNORE_INDEX
    inputs["input"] = tokens[:, :-1]
    return inputs, labels


def _prepared(run: SimpleNamespace, inputs: dict[str, Any], labels: torch.Tensor) -> tuple[Any, Any, dict[str, Any]]:
    """The trainer's own ``post_dataloading_process`` (attention masks from ``positions``), on the attributes it
    reads."""
    from torchtitan.trainer import Trainer

    holder = SimpleNamespace(
        model_config=run.spec.model, model_parts=[run.model], parallel_dims=run.parallel_dims, config=run.config,
        ntokens_seen=0,
    )  # fmt: skip
    return Trainer.post_dataloading_process(holder, dict(inputs), labels)


def _forward(run: SimpleNamespace, batch: tuple[dict[str, Any], torch.Tensor], gvt: torch.Tensor) -> dict[str, Any]:
    """No-grad: the training step's forward (hidden states and torchtitan's chunked loss), then a log-prob pass
    (eval mode, full logits: the per-token log-probabilities of the labels)."""
    from torchtitan.components.loss import IGNORE_INDEX

    model = run.model
    inputs, labels, extra = _prepared(run, *batch)
    with torch.no_grad():
        model.train()
        hidden = model(inputs, **extra)
        loss, _ = run.loss_fn(hidden, labels, gvt, positions=extra["positions"])
        model.eval()
        model._skip_lm_head = False
        try:
            logits = model(inputs, **extra)
        finally:
            model._skip_lm_head = True
            model.train()
        logprobs = torch.log_softmax(logits.float(), -1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        logprobs = logprobs.masked_fill(labels == IGNORE_INDEX, 0.0)
    return {"hidden": hidden, "loss": loss, "logprobs": logprobs}


def _full_state(model: Any) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    full = {}
    for name, p in model.named_parameters():
        # activation checkpointing (the trainer's default ac_config) wraps each layer: the unwrapped module's name
        tensor = p.full_tensor() if isinstance(p, DTensor) else p
        full[name.replace("_checkpoint_wrapped_module.", "")] = tensor.detach()
    return full


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def _stop(exc: BaseException) -> dict[str, Any]:
    """Where a grad-mode forward stopped: the error, the innermost three torchtitan frames and the last frame,
    whether fsdp-compat's replay was running it."""
    frames = traceback.extract_tb(exc.__traceback__)
    titan = [f for f in frames if "/torchtitan/" in f.filename]
    return {
        "error": f"{type(exc).__name__}: {exc}",
        "torchtitan_frames": [f"{f.filename.split('/torchtitan/')[-1]}:{f.name}" for f in titan[-3:]],
        "last_frame": f"{frames[-1].filename.split('/site-packages/')[-1]}:{frames[-1].name}",
        "in_replay": any(f.name == "_replay" for f in frames),
    }


def torchtitan_rank(cfg: dict[str, Any], rank: int, extra: dict[str, Any]) -> None:
    """``cfg["variants"][rank]`` (``image``/``text``) on this rank: torchtitan's sharded Qwen3.5, ``cfg["forwards"]``
    no-grad training forwards and log-prob passes of this rank's batch, each compared with one process (the same
    weights unsharded) on every rank's batch (``extra["diffs"]``: hidden states, loss, log-probs, max abs);
    ``cfg["grad_forward"]``: then one forward with grad on, which records where it stops (``extra["grad_stop"]``).
    ``extra``: the groups, fsdp-compat's log lines and its counters (before the grad-mode forward)."""
    lines = LogLines()
    logging.getLogger("fsdp_compat").addHandler(lines)
    extra["log"] = lines.lines
    init_group(cfg, rank)
    from torchtitan.components.loss import IGNORE_INDEX
    from torchtitan.distributed import utils as dist_utils

    run = build(cfg["world_size"])
    extra["groups"] = fsdp_groups(run.model)
    extra["optimizer"] = type(run.optimizers.optimizers[0]).__name__
    batches = [make_batch(kind, seed=100 + r) for r, kind in enumerate(cfg["variants"])]
    local = (batches[rank][1] != IGNORE_INDEX).sum()
    gvt = dist_utils.dist_sum_tensor(local, run.parallel_dims.get_mesh("batch"))
    expected: list[dict[str, Any]] = []
    if cfg.get("reference", True):
        state = _full_state(run.model)  # a collective: every rank, before any forward
        reference = build(cfg["world_size"], shard=False)
        missing, unexpected = reference.model.load_state_dict(state, strict=False)
        assert not unexpected and not set(missing) & {n for n, _ in reference.model.named_parameters()}, missing
        expected = [_forward(reference, batch, gvt) for batch in batches]  # one process, every rank's batch
    diffs = []
    for _ in range(cfg.get("forwards", 2)):
        got = _forward(run, batches[rank], gvt)
        if expected:
            diffs.append({k: _max_diff(got[k], expected[rank][k]) for k in got})
        extra["loss"] = float(got["loss"])
    extra["diffs"] = diffs
    if expected:
        other = (rank + 1) % cfg["world_size"]  # the control: another rank's reference differs
        extra["control_diff"] = _max_diff(got["logprobs"], expected[other]["logprobs"])
    extra.update(runtime_counters(run.model))
    if cfg.get("grad_forward"):
        inputs, _, kwargs = _prepared(run, *batches[rank])
        try:
            run.model(inputs, **kwargs)
            extra["grad_stop"] = None
        except Exception as exc:  # the point of the case: where a CPU step stops
            extra["grad_stop"] = _stop(exc)
