"""Rank-side code for verl's engine with Ulysses sequence parallelism: 4 ranks, 2 data-parallel groups of 2
sequence-parallel ranks (verl's ``(dp, sp)`` device mesh: ranks 0, 1 are data-parallel group 0, ranks 2, 3 group 1).
Also, with a case's ``sp`` 1, verl's engine without it (GLM4V's sibling GLM4V-MoE, which verl has no forward of its
own for: tests/stacks/verl_sp/test_verl_engine_siblings.py).

What each case does is what :mod:`lab.stacks.verl_engine_ranks` does for 2 ranks (verl's own ``TrainingWorker``,
``train_batch``, verl's SFT collator; the patch-14 GLM4V, the zoo's Qwen2.5-VL or GLM4V-MoE: :data:`FAMILIES`), with
``ulysses_sequence_parallel_size=2`` and ``use_remove_padding=True`` (verl requires remove padding for Ulysses).
The two sequence-parallel ranks of a data-parallel group get the same micro-batch (verl's contract: they split its
packed row after the embedding); one group's micro-batches have images, the other's are text only. On CPU: verl's
public platform registry (``lab.stacks.verl_cpu_platform``) and the pure-torch stand-in for flash-attn's varlen
kernel; Ulysses' own collectives (``dist.all_to_all`` with lists, ``all_gather_into_tensor``, ``all_gather``) are
gloo's, unchanged.

Every rank prints a progress line (``ulysses-progress rank R: ...``) before and after each step, so that a run that
hangs and is killed by the launcher's deadline still shows, in its output tail, where each rank stopped.
"""

from __future__ import annotations

import copy
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import lab.stacks.verl_engine_ranks as base

SP = 2  #: ulysses_sequence_parallel_size

#: the exception lines a case with ``expect_failure`` records instead of raising
EXPECTED_ERRORS = (
    *base.EXPECTED_ERRORS,
    # verl 0.9.1's Qwen2-VL forward on transformers 5 without fsdp-compat: its text-only dummy does .mean() on the
    # vision tower's model output (verl/models/transformers/qwen2_vl.py)
    "'BaseModelOutputWithPooling' object has no attribute 'mean'",
    # gloo's collective timeout (the process group's, cfg["collective_timeout_s"]): a rank left waiting in a
    # collective that another rank never makes (NCCL would wait for its watchdog)
    "Timed out waiting",
)


def _progress(rank: int, text: str) -> None:
    print(f"ulysses-progress rank {rank}: {text}", flush=True)


#: per family: verl's module holding its forward (``_get_input_embeds``, the flash-attn names), the directory key
FAMILIES = {
    "glm4v": {"verl_module": "verl.models.transformers.glm4v", "model_dir": "p14_dir"},
    "qwen2.5-vl": {"verl_module": "verl.models.transformers.qwen2_vl", "model_dir": "qwen_dir"},
    # GLM4V's sibling: verl has no forward of its own for it (apply_monkey_patch leaves transformers' forward, which
    # calls the tower only with pixel values), nor Ulysses input slicing: it runs with sp 1
    "glm4v-moe": {"verl_module": None, "model_dir": "moe_dir"},
}
#: the names verl's qwen2_vl module binds only when flash-attn (or an NPU) is available
QWEN_FLASH_NAMES = (*base.FLASH_NAMES, "_flash_supports_window_size")


def build_qwen25_vl(seed: int = 0) -> Any:
    """The zoo's tiny Qwen2.5-VL (windowed vision blocks, patch 4: verl's dummy takes the config's patch size)."""
    from fsdp_compat.testing.zoo import build_model

    return build_model("qwen2.5-vl", seed=seed)


_MODELS: dict[str, Any] = {}


def _rope_model(family: str) -> Any:
    """One model per family and process, only for its ``get_rope_index`` (position ids depend on config only)."""
    if family not in _MODELS:
        from fsdp_compat.testing.zoo import build_model

        _MODELS[family] = base.build_glm4v_p14() if family == "glm4v" else build_model(family)
    return _MODELS[family]


def sft_batch(family: str, kind: str, seed: int, world_size: int, remove_padding: bool = True) -> Any:
    """:func:`lab.stacks.verl_engine_ranks.p14_sft_batch` for ``family``: the same rows; for the other families
    pixel values of their patch size (3 * 2 * 4 * 4 = 96 per patch) and their own mrope position ids."""
    if family == "glm4v":
        return base.p14_sft_batch(kind, seed, world_size, remove_padding)
    import torch

    from fsdp_compat.testing.verl_smoke import glm4v_position_ids

    batch = base.p14_batch(kind, seed)
    if "pixel_values" in batch:
        vision = _rope_model(family).config.vision_config
        dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
        g = torch.Generator().manual_seed(2000 + seed)
        batch["pixel_values"] = torch.randn(batch["pixel_values"].shape[0], dim, generator=g)
    return base.collate(batch, glm4v_position_ids(_rope_model(family), batch), world_size, remove_padding)


def install_flash_stand_in(family: str) -> list[int]:
    """:func:`lab.stacks.verl_engine_ranks.install_flash_stand_in` for GLM4V; for Qwen2.5-VL the same stand-in bound
    in verl's qwen2_vl module (plus ``_flash_supports_window_size`` False: the tiny model has no sliding window)."""
    if family == "glm4v":
        return base.install_flash_stand_in()
    import importlib

    qwen = importlib.import_module(FAMILIES[family]["verl_module"])
    calls: list[int] = []

    def varlen(q: Any, k: Any, v: Any, cu_seqlens_q: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(int(cu_seqlens_q.numel()) - 1)
        return base.cpu_varlen_attention(q, k, v, cu_seqlens_q, *args, **kwargs)

    varlen.stand_in = True  # type: ignore[attr-defined]
    qwen.flash_attn_varlen_func = varlen
    qwen._flash_use_top_left_mask = False
    qwen._flash_supports_deterministic = False
    qwen._flash_supports_window_size = False
    return calls


@contextmanager
def verl_globals_restored() -> Iterator[None]:
    """:func:`lab.stacks.verl_engine_ranks.verl_globals_restored`, plus what a Qwen2.5-VL case leaves: verl's
    ``qwen2_vl_attn_forward`` on transformers' Qwen2-VL / Qwen2.5-VL attention classes, the stand-in's names."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLAttention
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLAttention

    kept = (Qwen2_5_VLAttention.forward, Qwen2VLAttention.forward)
    try:
        with base.verl_globals_restored():
            yield
    finally:
        Qwen2_5_VLAttention.forward, Qwen2VLAttention.forward = kept
        qwen = sys.modules.get(FAMILIES["qwen2.5-vl"]["verl_module"])
        if getattr(getattr(qwen, "flash_attn_varlen_func", None), "stand_in", False):
            for name in QWEN_FLASH_NAMES:
                delattr(qwen, name)


def adapter_state() -> dict[str, Any]:
    """:func:`lab.stacks.verl_engine_ranks.adapter_state` plus whether verl's Qwen2-VL ``_get_input_embeds`` is
    fsdp-compat's repair (read from sys.modules only)."""
    qwen = sys.modules.get(FAMILIES["qwen2.5-vl"]["verl_module"])
    embeds = getattr(qwen, "_get_input_embeds", None)
    return {**base.adapter_state(), "qwen2_vl_repaired": bool(getattr(embeds, "__fsdp_compat__", False))}


def _dummy_calls(module: Any) -> int:
    """Dummy tower calls of fsdp-compat's mixed-batch alignment on this rank so far (0 where it is not installed)."""
    runtime = sys.modules.get("fsdp_compat.runtime.mixed_batches")
    return sum(h.dummy_calls for h in runtime.mixed_batches_of(module)) if runtime else 0


def _family(case: dict[str, Any]) -> str:
    return case.get("family", "glm4v")


def _sp_case(case: dict[str, Any]) -> dict[str, Any]:
    """The case as :func:`lab.stacks.verl_engine_ranks._worker` builds it, with Ulysses on."""
    engine = {**case.get("engine", {}), "ulysses_sequence_parallel_size": case.get("sp", SP)}
    return {"model_dir": FAMILIES[_family(case)]["model_dir"], "remove_padding": True, **case, "engine": engine}


def _single_process(engine: Any) -> Any:
    """A shallow copy of the engine that runs verl's forward with no sequence parallelism: what one process (the
    reference) does. The copy's ``forward_step`` packs the rows (remove padding) but neither pads nor slices for
    Ulysses; verl's module-level SP group is None outside ``train_batch`` (verl restores it on exit), so verl's
    input slicing and attention all-to-all are no-ops there too."""
    single = copy.copy(engine)
    single.use_ulysses_sp = False
    single.ulysses_sequence_parallel_size = 1
    single.ulysses_device_mesh = None
    single.ulysses_parallel_group = None
    return single


def _digest(tensors: dict[str, Any]) -> str:
    """sha256 of every tensor's bytes, in name order (None for a missing gradient): two runs trained bit for bit
    alike when their digests agree."""
    import hashlib

    import torch

    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        t = tensors[name]
        h.update(b"none" if t is None else t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _split(x: Any, parts: int) -> list[Any]:
    """A packed (1, tokens, ...) tensor cut along the token dimension into ``parts`` equal slices, as verl's
    ``slice_input_tensor`` cuts it for the ranks of one SP group (after ``ulysses_pad``: a multiple of parts)."""
    assert x.shape[1] % parts == 0, (x.shape, parts)
    return list(x.chunk(parts, dim=1))


def _per_slice(leaf: Any, twins: list[Any]) -> None:
    """``leaf`` (a token-wise module with parameters of its own: a Linear or an RMSNorm of the text model, or the
    lm_head) runs slice s of its input with virtual rank s's copy of the module (``twins[s]``, twins[0] is
    ``leaf``): the parameter gradients of each slice stay apart, as they do on the SP ranks, where each rank holds
    only its slice of the packed row."""
    import torch

    forwards = [type(m).forward.__get__(m) for m in twins]

    def forward(x: Any, *args: Any, **kwargs: Any) -> Any:
        pieces = _split(x, len(twins))
        return torch.cat([f(p, *args, **kwargs) for f, p in zip(forwards, pieces, strict=True)], dim=1)

    leaf.forward = forward


def _virtual_sp(copies: list[Any], family: str) -> None:
    """One process, SP split emulated: ``copies`` are the virtual SP ranks' models (same weights). Like a rank,
    each copy embeds the whole packed row and runs the vision tower on all of the micro-batch's images (or verl's
    own dummy), through verl's ``_get_input_embeds``; virtual rank s keeps token slice s of its embeddings (verl's
    ``patch_vlm_for_ulysses_input_slicing``). The text model runs once over the whole row in copy 0 (attention over
    the whole sequence, as Ulysses' all-to-all gives each rank all tokens), but every module with parameters in it
    runs slice s with copy s's parameters. Forward values are those of one process (verl's forward, SP off); the
    parameter gradients are summed per slice, as the SP ranks sum them."""
    import importlib

    verl_forward = importlib.import_module(FAMILIES[family]["verl_module"])
    sp = len(copies)
    main = copies[0].model
    for path, leaf in list(copies[0].named_modules()):
        inside = path == "lm_head" or (
            path.startswith("model.language_model.") and not path.startswith("model.language_model.embed_tokens")
        )
        if inside and any(True for _ in leaf.parameters(recurse=False)):
            _per_slice(leaf, [c.get_submodule(path) for c in copies])

    def forward(
        input_ids: Any,
        attention_mask: Any = None,
        labels: Any = None,
        pixel_values: Any = None,
        pixel_values_videos: Any = None,
        image_grid_thw: Any = None,
        video_grid_thw: Any = None,
        **kwargs: Any,
    ) -> Any:
        import torch
        from verl.utils.ulysses import ulysses_pad

        # verl's engine pads the packed row to a multiple of sp before the model (ulysses_pad: token 0, positions
        # 0, 1, ... as a sequence of its own) and drops the padding after gathering the log-probs
        tokens = input_ids.shape[1]
        input_ids, kwargs["position_ids"], _ = ulysses_pad(input_ids, kwargs["position_ids"], sp_size=sp)
        padded.append(input_ids.shape[1] - tokens)
        embeds = []
        for c in copies:  # verl's glm4v_base_forward on each virtual rank (the repaired _get_input_embeds)
            e, mask = verl_forward._get_input_embeds(
                c.model, input_ids, attention_mask, pixel_values, pixel_values_videos, image_grid_thw, video_grid_thw
            )
            embeds.append(e)
        kwargs["inputs_embeds"] = torch.cat([_split(e, sp)[s] for s, e in enumerate(embeds)], dim=1)
        kwargs["attention_mask"] = mask
        return main.language_model(input_ids=None, **kwargs)

    main.forward = forward
    padded: list[int] = []

    def unpad(_module: Any, _args: Any, output: Any) -> Any:
        pad = padded.pop()
        if pad:
            output.logits = output.logits[:, : output.logits.shape[1] - pad]
        return output

    copies[0].register_forward_hook(unpad)


def _left_sum(terms: list[Any]) -> Any:
    total = terms[0]
    for t in terms[1:]:
        total = total + t
    return total


def _tree_sums(terms: list[Any]) -> list[Any]:
    """The sum of ``terms`` in every order a reduction may take: every bracketing of every permutation, up to
    a + b == b + a (15 values for 4 terms, 1 for 2)."""
    if len(terms) == 1:
        return [terms[0]]
    out = []
    n = len(terms)
    for mask in range(1, 2**n - 1):
        if not mask & 1:  # the part holding term 0 on the left: a + b and b + a are one value
            continue
        left = [terms[i] for i in range(n) if mask >> i & 1]
        right = [terms[i] for i in range(n) if not mask >> i & 1]
        out.extend(a + b for a in _tree_sums(left) for b in _tree_sums(right))
    return out


def ulysses_reference(
    engine: Any,
    cfg: dict[str, Any],
    case: dict[str, Any],
    ranks: list[Any],
    grads: list[Any],
    params: list[Any],
    sp: int,
) -> dict[str, Any]:
    """:func:`lab.stacks.verl_engine_ranks.parity_reference` (one process, no FSDP, verl's GLM4V forward through
    the engine's ``forward_step`` with SP off, each data-parallel group's micro-batch, ``(loss_g / dp).backward()``,
    FSDP2's bf16 policy by hand, the engine's AdamW), with ``sp == 1`` the same; with ``sp > 1`` the SP ranks'
    split of each packed row is emulated (:func:`_virtual_sp`): the per-slice bf16 gradients of the ``sp`` virtual
    ranks are cast to fp32 and summed, as FSDP2 reduce-scatters them over all ``dp * sp`` ranks (verl's Ulysses
    gather scales each rank's gradient by ``sp``, FSDP2 divides the sum by ``dp * sp``: the same powers of two)."""
    import inspect

    import torch
    from verl.utils import tensordict_utils as tu
    from verl.utils.device import get_device_name
    from verl.utils.model import get_hf_auto_model_class

    from fsdp_compat.testing.parity import worse

    world = len(ranks)
    kinds = case["kinds"]
    hf_config = engine.model_config.hf_config
    copies = [
        get_hf_auto_model_class(hf_config=hf_config)
        .from_pretrained(cfg[case["model_dir"]], torch_dtype=torch.float32, config=hf_config)
        .to(get_device_name())
        .train()
        for _ in range(sp)
    ]
    single = _single_process(engine)
    single.module = copies[0]
    compute = getattr(engine, "_autocast_dtype", torch.float32)
    mixed = compute != torch.float32
    named = [dict(c.named_parameters()) for c in copies]
    master = {n: p.detach().clone().requires_grad_(True) for n, p in named[0].items()}
    cast = base._cast_floating(compute, in_recompute=base.fsdp_casts_recompute_inputs())
    groups = base.fsdp_groups(engine.module)
    for s, c in enumerate(copies):
        if engine.module.is_gradient_checkpointing:
            c.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if mixed:
            for p in named[s].values():
                p.data = p.data.to(compute)
            for name in groups:  # copy 0 runs every group; the other copies their vision blocks and embedding
                if s == 0 or name.startswith(("model.visual.", "model.language_model.embed_tokens")):
                    c.get_submodule(name).register_forward_pre_hook(cast, with_kwargs=True)
    if sp > 1:
        _virtual_sp(copies, _family(case))
    kind = type(engine.optimizer)
    accepted = inspect.signature(kind).parameters
    optimizer = kind(master.values(), **{k: v for k, v in engine.optimizer.defaults.items() if k in accepted})
    calls: list[list[int]] = []
    copies[0].model.visual.register_forward_pre_hook(lambda _m, args: calls.append(list(args[0].shape)) and None)
    out: dict[str, Any] = {"steps": [], "mixed_precision": mixed, "virtual_sp": sp}
    for step in range(case.get("steps", 2)):
        for group in optimizer.param_groups:
            group["lr"] = ranks[0][step]["lr"]
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():  # FSDP2's all-gather of the (bf16 cast of the) fp32 shards, on every rank
            for s in range(sp):
                for n, p in named[s].items():
                    p.copy_(master[n])
        batches = [
            sft_batch(_family(case), kinds[g % len(kinds)], base._seed(step, g), world, case["remove_padding"])
            for g in range(world)
        ]
        tokens = sum(int(b["loss_mask"].sum()) for b in batches)
        losses, first = [], len(calls)
        terms: dict[str, list[Any]] = {}  # per parameter: each (data, sequence) rank's gradient, fp32
        for batch in batches:
            tu.assign_non_tensor(batch, sp_size=1, dp_size=world, batch_num_tokens=tokens)
            for c in copies:
                c.zero_grad(set_to_none=True)
            loss, _ = single.forward_step(batch, loss_function=base.engine_loss(), forward_only=False)
            (loss / world).backward()
            losses.append(float(loss.detach()))
            for s in range(sp):  # the reduce dtype (fp32)
                for n, p in named[s].items():
                    if p.grad is not None:
                        terms.setdefault(n, []).append(p.grad.float())
        fixed = {n: _left_sum(t) for n, t in terms.items()}  # one summation order: rank 0 + rank 1 + ...
        fixed_diff, fixed_at, _ = base._worst(grads[step], fixed)
        # FSDP2 reduce-scatters the dp * sp fp32 terms; in which order the collective adds them is its own (gloo: per
        # chunk of the buffer). With 2 terms every order is one value (a + b == b + a); with 4, an element whose
        # terms span more than fp32's 24 bits can round differently per order. Per element: the engine's value must
        # be the sum in one of the orders (every bracketing of every permutation), and that value is stepped with.
        chosen, order_dependent = {}, 0
        for n, t in terms.items():
            got = grads[step].get(n)
            candidates = torch.stack(_tree_sums(t)) if got is not None else None
            if candidates is None or tuple(got.shape) != tuple(candidates.shape[1:]):
                chosen[n] = fixed[n]
                continue
            match = (candidates == got.float()).any(0)
            order_dependent += int((candidates != candidates[0]).any(0).sum())
            chosen[n] = torch.where(match, got.float(), fixed[n])
        for n, m in master.items():
            m.grad = chosen.get(n)
        grad_diff, grad_at, grad_missing = base._worst(grads[step], {n: p.grad for n, p in master.items()})
        optimizer.step()
        param_diff, param_at, param_missing = base._worst(params[step], {n: p.detach() for n, p in master.items()})
        loss_diff = 0.0
        for g in range(world):
            loss_diff = worse(loss_diff, abs(ranks[g][step]["loss"] - losses[g]))
        out["steps"].append(
            {
                "losses": losses,
                "loss_diff": loss_diff,
                "grad_diff": grad_diff,
                "grad_at": grad_at,
                "grad_diff_one_order": fixed_diff,  # summed rank 0 + rank 1 + ... only
                "grad_at_one_order": fixed_at,
                "order_dependent_elements": order_dependent,
                "terms": len(next(iter(terms.values()))),
                "param_diff": param_diff,
                "param_at": param_at,
                "missing": grad_missing + param_missing,
                "vision_calls": calls[first:],
                "grad_norm_vision": float(
                    sum(p.grad.float().pow(2).sum() for n, p in master.items() if "visual" in n and p.grad is not None)
                ),
                "params": len(master),
            }
        )
    return out


def run_ulysses(cfg: dict[str, Any], case: dict[str, Any], rank: int, out: dict[str, Any]) -> dict[str, Any]:
    """verl's engine trains ``steps`` steps with Ulysses; data-parallel group g (rank // sp) trains on micro-batch
    kind ``case["kinds"][g]`` with seed (step, g); rank 0 then trains one unsharded process on both groups'
    micro-batches (:func:`lab.stacks.verl_engine_ranks.parity_reference`) and compares."""
    import torch.distributed as dist
    from verl.utils.ulysses import get_ulysses_sequence_parallel_group

    case = _sp_case(case)
    world = dist.get_world_size()
    sp = case["engine"]["ulysses_sequence_parallel_size"]
    dp, dp_rank = world // sp, rank // sp
    kinds = case["kinds"]
    _progress(rank, f"{case['name']}: reset")
    worker, losses, grads = base.recording_worker(cfg, case)
    engine = worker.engine
    out["groups"] = base.fsdp_groups(engine.module)
    out["sp_size"] = engine.ulysses_sequence_parallel_size
    out["dp_size"], out["dp_rank"] = engine.get_data_parallel_size(), engine.get_data_parallel_rank()
    mesh = engine.ulysses_device_mesh
    out["mesh"] = None if mesh is None else mesh.mesh.tolist()
    inner = getattr(engine.module, "_fsdp_wrapped_module", engine.module)
    out["gradient_checkpointing"] = bool(getattr(inner, "is_gradient_checkpointing", False))
    out["compute_dtype"] = str(getattr(engine, "_autocast_dtype", None))
    out["flash_attn"] = base._has_flash_attn()  # flash-attn importable (verl's glm4v module bound its names)
    stand_in = case.get("flash_stand_in") and not out["flash_attn"]
    attention = install_flash_stand_in(_family(case)) if stand_in else []
    out["hidden_size"] = engine.model_config.hf_config.get_text_config().hidden_size
    out["flash_stand_in"] = bool(stand_in)
    calls: list[list[int]] = []
    engine.module.model.visual.register_forward_pre_hook(lambda _m, args: calls.append(list(args[0].shape)) and None)
    model_inputs: list[dict[str, Any]] = []
    text_inputs: list[list[int]] = []  # what verl's language model got: its slice of the packed row
    out["vision_calls"], out["model_inputs"], out["text_inputs"] = calls, model_inputs, text_inputs
    engine.module.register_forward_pre_hook(
        lambda _m, _a, kw: model_inputs.append(base._shapes(kw)) and None, with_kwargs=True
    )
    layers = engine.module.model.language_model.layers
    layers[0].register_forward_pre_hook(lambda _m, args: text_inputs.append(list(args[0].shape)) and None)
    sp_groups: list[int | None] = []
    params: list[dict[str, Any]] = []
    step_optimizer = engine.optimizer_step  # recording_worker's: it keeps the gradients verl steps with

    def optimizer_step() -> Any:  # and the sequence-parallel group's size at each step
        group = get_ulysses_sequence_parallel_group()
        sp_groups.append(None if group is None else dist.get_world_size(group))
        return step_optimizer()

    engine.optimizer_step = optimizer_step
    out["steps"] = []
    for step in range(case.get("steps", 2)):
        lr, first = engine.optimizer.param_groups[0]["lr"], len(calls)
        batch = sft_batch(
            _family(case), kinds[dp_rank % len(kinds)], base._seed(step, dp_rank), dp, case["remove_padding"]
        )
        dummies = _dummy_calls(engine.module)
        out.setdefault("rows", []).append(int(batch["input_ids"].shape[0]))
        seen, attended, texts = len(model_inputs), len(attention), len(text_inputs)
        _progress(rank, f"{case['name']}: step {step + 1} starts ({kinds[dp_rank % len(kinds)]} rows)")
        worker.train_batch(batch)
        _progress(rank, f"{case['name']}: step {step + 1} done, loss {losses[-1]!r}")
        out["steps"].append(
            {
                "lr": lr,
                "loss": losses[-1],
                "vision_calls": calls[first:],
                "model_inputs": model_inputs[seen:],
                "text_inputs": text_inputs[texts:],
                "attention_calls": attention[attended:],
                "alignment_dummies": _dummy_calls(engine.module) - dummies,  # fsdp-compat's, not verl's
            }
        )
        params.append({n: base._full(p) for n, p in engine.module.named_parameters()})
        out["steps"][-1]["digest"] = {"grads": _digest(grads[-1]), "params": _digest(params[-1])}
    out["sp_group_at_step"] = sp_groups
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, out["steps"])
    out["all_ranks_steps"] = everyone
    if rank == 0:
        # one representative per data-parallel group (its first SP rank): the reference's "ranks"
        _progress(rank, f"{case['name']}: reference")
        reference_case = {**case, "kinds": [kinds[g % len(kinds)] for g in range(dp)]}
        for virtual in case.get("references", [1, sp]):  # 1: verl's forward, SP off; sp: the SP split emulated
            out[f"reference_sp{virtual}"] = ulysses_reference(
                engine, cfg, reference_case, everyone[::sp], grads, params, virtual
            )
    return out


def run_expected_failure(cfg: dict[str, Any], case: dict[str, Any], rank: int) -> dict[str, Any]:
    """A case that must stop with one of EXPECTED_ERRORS (:func:`lab.stacks.verl_engine_ranks.stopped`)."""
    return base.stopped(run_ulysses, cfg, case, rank, EXPECTED_ERRORS)


def ulysses_ranks(cfg: dict[str, Any], rank: int, extra: dict[str, Any]) -> None:
    """The rank body: one process group, then every case of ``cfg["cases"]`` in order (results in ``extra``)."""
    extra["backend"] = base._setup(cfg, rank)
    import torch.distributed as dist

    extra["cases"] = {}
    for case in cfg["cases"]:
        t0 = time.perf_counter()
        with verl_globals_restored():
            if case.get("expect_failure"):
                result = run_expected_failure(cfg, case, rank)
            else:
                result = run_ulysses(cfg, case, rank, {})
        result["case_s"] = time.perf_counter() - t0
        extra["cases"][case["name"]] = result
        extra["state"] = adapter_state()
        stopped = case.get("expect_failure") and result["error"]
        if stopped and not case.get("same_stop"):
            return  # stopped mid-forward: collectives may be left unmatched, so no barrier
        if stopped:
            dist.barrier()
    dist.barrier()


# ------------------------------------------------------------------------ verl's Qwen2-VL forward, one process


def qwen_forward_probe() -> dict[str, Any]:
    """verl's own Qwen2.5-VL forward (``apply_monkey_patch``, no FSDP, one process) against transformers' own, on
    an image micro-batch and a text-only one (verl runs its dummy there), on the rows' real tokens (right padding).
    Nothing imports fsdp-compat here: the installed wheel's hooks activate it, or not (``FSDP_COMPAT=off``)."""
    import torch
    from verl.models.transformers.monkey_patch import apply_monkey_patch

    from fsdp_compat.testing.verl_smoke import glm4v_position_ids

    model = build_qwen25_vl()
    out: dict[str, Any] = {}
    batches = {kind: base.p14_batch(kind, 0) for kind in ("image", "text")}
    vision = model.config.vision_config
    dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    image = batches["image"]
    image["pixel_values"] = torch.randn(image["pixel_values"].shape[0], dim, generator=torch.Generator().manual_seed(3))
    reference = {}
    with torch.no_grad():
        for kind, batch in batches.items():
            reference[kind] = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    apply_monkey_patch(model=model, use_remove_padding=False)
    out["state"] = adapter_state()
    for kind, batch in batches.items():
        inputs = {k: v for k, v in batch.items() if k not in ("labels", "mm_token_type_ids")}  # as verl's datasets
        inputs["position_ids"] = glm4v_position_ids(model, batch)
        try:
            with torch.no_grad():
                logits = model(**inputs).logits
            real = batch["attention_mask"].bool()  # the padded tail's positions are the two forwards' own choice
            out[kind] = {"max_abs_logit_diff": float((logits - reference[kind])[real].abs().max())}
        except Exception as exc:
            out[kind] = {"error": traceback.format_exception_only(type(exc), exc)[-1].strip()}
    return out
