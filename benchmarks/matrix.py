"""Compatibility matrix: real transformers architectures, built tiny from their config classes, under every FSDP2
wrap rule in use, trained on 2 gloo ranks; each cell says whether it crashed or matched one process exactly.

``python -m benchmarks matrix [--models a,b] [--rules r,s] [--world-size 2] [--steps 2] [--chunk 6]``

Rules: ``verl`` (policy ``legacy``: verl >= 0.7.1, AReaL, ROLL, miles copy it), ``skyrl`` (``legacy-skyrl``),
``input-only`` (the fix proposed upstream), ``native`` (transformers' own plan: the model is saved with
``save_pretrained`` and loaded with ``from_pretrained(dir, distributed_config=DistributedConfig(fsdp_size=W))``, the
reference with a plain ``from_pretrained``), ``native+fc`` (the same load with fsdp-compat's transformers adapter
patched in), ``accelerate`` (accelerate 1.15's
``fsdp2_prepare_model`` grouping, with accelerate's own bottom-up walk and final-norm finder) and ``auto``.

Runs are real: each rank builds every model of a chunk, trains an unsharded reference once (2 AdamW steps, fp32,
on every rank's micro-batch with the mean loss) and then, per rule, a fresh copy sharded under that rule on its own
micro-batch, comparing gradients and parameters after every step (exact = within 1e-6 relative). A chunk of
models shares one pair of ranks. The static prediction (:func:`fsdp_compat.plan.unsafe_reads` on the rule's groups)
is shown next to a cell only where it disagrees with the run. Cells: ``exact g/r`` (g groups besides the root,
r % of the parameters left in the root), ``crash: <op>``, ``diff <max rel>``.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
NATIVE = ("native", "native+fc")
RULES = ("verl", "skyrl", "input-only", "native", "native+fc", "accelerate", "auto")
POLICY_OF = {"verl": "legacy", "skyrl": "legacy-skyrl", "input-only": "input-only", "auto": "auto"}
TOL = 1e-6

# ---------------------------------------------------------------------------------------------------------------
# Architectures: name -> (kind, builder). Sizes are as small as each config's validation allows.

_T = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=128,
    pad_token_id=0,
    tie_word_embeddings=False,
)


def _cfg(cls_name: str, **kwargs: Any) -> Any:
    import transformers

    config = getattr(transformers, cls_name)(**kwargs)
    config._attn_implementation = "eager"
    return config


def _model(model_cls: str, config: Any) -> Any:
    import transformers

    return getattr(transformers, model_cls)(config)


def _causal(config_cls: str, model_cls: str, **overrides: Any) -> Callable[[], Any]:
    return lambda: _model(model_cls, _cfg(config_cls, **{**_T, **overrides}))


def _zoo(name: str) -> Callable[[], Any]:
    def build() -> Any:
        from fsdp_compat.testing.zoo import builder

        return builder(name)()

    return build


def _gemma4() -> Any:
    from lab.transformers_smoke import _gemma4

    return _gemma4()


def _seq2seq(config_cls: str, model_cls: str, **overrides: Any) -> Callable[[], Any]:
    base = dict(
        vocab_size=128,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
        pad_token_id=0,
        decoder_start_token_id=2,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
    )
    return lambda: _model(model_cls, _cfg(config_cls, **{**base, **overrides}))


_MOE = dict(num_local_experts=4, num_experts_per_tok=2)

ARCHS: dict[str, tuple[str, Callable[[], Any]]] = {
    # text decoders
    "llama": ("text", _causal("LlamaConfig", "LlamaForCausalLM")),
    "llama-tied": ("text", _causal("LlamaConfig", "LlamaForCausalLM", tie_word_embeddings=True)),
    "qwen2": ("text", _zoo("qwen2")),
    "qwen3": ("text", _causal("Qwen3Config", "Qwen3ForCausalLM", head_dim=16)),
    "mistral": ("text", _causal("MistralConfig", "MistralForCausalLM", sliding_window=None)),
    "gemma": ("text", _causal("GemmaConfig", "GemmaForCausalLM", head_dim=16)),
    "gemma2": ("text", _causal("Gemma2Config", "Gemma2ForCausalLM", head_dim=16, sliding_window=16)),
    "gemma3-text": ("text", _causal("Gemma3TextConfig", "Gemma3ForCausalLM", head_dim=16, sliding_window=16)),
    "gemma3n-text": ("text", _zoo("gemma3n")),
    "phi3": ("text", _causal("Phi3Config", "Phi3ForCausalLM")),
    "olmo2": ("text", _causal("Olmo2Config", "Olmo2ForCausalLM")),
    "cohere": ("text", _causal("CohereConfig", "CohereForCausalLM")),
    "granite": ("text", _causal("GraniteConfig", "GraniteForCausalLM")),
    "starcoder2": ("text", _causal("Starcoder2Config", "Starcoder2ForCausalLM", sliding_window=None)),
    "stablelm": ("text", _causal("StableLmConfig", "StableLmForCausalLM")),
    "gpt-neox": ("text", _causal("GPTNeoXConfig", "GPTNeoXForCausalLM")),
    "gpt2": (
        "text",
        lambda: _model(
            "GPT2LMHeadModel",
            _cfg("GPT2Config", vocab_size=128, n_embd=32, n_layer=2, n_head=2, n_positions=64,
                 tie_word_embeddings=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
        ),
    ),
    "opt": (
        "text",
        lambda: _model(
            "OPTForCausalLM",
            _cfg("OPTConfig", vocab_size=128, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                 num_attention_heads=2, max_position_embeddings=64, word_embed_proj_dim=32, pad_token_id=1,
                 tie_word_embeddings=False, dropout=0.0),
        ),
    ),
    "qwen2-fused-lmhead": ("text", _zoo("qwen2-fused-lmhead")),
    "qwen2-zloss": ("text", _zoo("qwen2-zloss")),
    # mixture of experts
    "mixtral": ("moe", _causal("MixtralConfig", "MixtralForCausalLM", sliding_window=None, **_MOE)),
    "qwen2-moe": (
        "moe",
        _causal("Qwen2MoeConfig", "Qwen2MoeForCausalLM", num_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=32, shared_expert_intermediate_size=32),
    ),
    "qwen3-moe": (
        "moe",
        _causal("Qwen3MoeConfig", "Qwen3MoeForCausalLM", head_dim=16, num_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=32),
    ),
    "olmoe": ("moe", _causal("OlmoeConfig", "OlmoeForCausalLM", num_experts=4, num_experts_per_tok=2)),
    "granitemoe": ("moe", _causal("GraniteMoeConfig", "GraniteMoeForCausalLM", **_MOE)),
    "phimoe": (
        "moe",
        _causal("PhimoeConfig", "PhimoeForCausalLM", sliding_window=None, router_jitter_noise=0.0,
                input_jitter_noise=0.0, **_MOE),
    ),
    # encoder-decoder
    "t5-shared": ("enc-dec", _zoo("t5-shared")),
    "bart": ("enc-dec", _seq2seq("BartConfig", "BartForConditionalGeneration")),
    "marian": ("enc-dec", _seq2seq("MarianConfig", "MarianMTModel", decoder_start_token_id=0)),
    "pegasus": ("enc-dec", _seq2seq("PegasusConfig", "PegasusForConditionalGeneration")),
    # vision-language (the GLM family with images; the others train on text rows)
    "glm4v": ("vision-language", _zoo("glm4v")),
    "glm4v-tied": ("vision-language", _zoo("glm4v-tied")),
    "glm4v-moe": ("vision-language", _zoo("glm4v-moe")),
    "gemma4": ("vision-language", _gemma4),
    "qwen2-vl": (
        "vision-language",
        lambda: _model(
            "Qwen2VLForConditionalGeneration",
            _cfg("Qwen2VLConfig",
                 text_config={**_T, "hidden_size": 32, "rope_parameters": {"rope_type": "default",
                              "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}},
                 vision_config={"depth": 1, "embed_dim": 32, "hidden_size": 32, "num_heads": 2,
                                "mlp_ratio": 2, "in_channels": 3, "patch_size": 4, "spatial_merge_size": 2},
                 tie_word_embeddings=False, image_token_id=120, video_token_id=121,
                 vision_start_token_id=122),
        ),
    ),
    # audio
    "whisper": (
        "audio",
        lambda: _model(
            "WhisperForConditionalGeneration",
            _cfg("WhisperConfig", vocab_size=128, d_model=32, encoder_layers=2, decoder_layers=2,
                 encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                 num_mel_bins=8, max_source_positions=16, max_target_positions=32, pad_token_id=0,
                 decoder_start_token_id=1, eos_token_id=2, bos_token_id=1, suppress_tokens=None,
                 begin_suppress_tokens=None, tie_word_embeddings=False),
        ),
    ),
}


def make_batch(name: str, kind: str, seed: int = 0) -> dict[str, Any]:
    """Inputs with labels for ``ARCHS[name]``: the zoo's batches where the zoo has the model, else text rows; a
    function of the name and ``seed`` (each rank trains its own micro-batch: seed = rank)."""
    import torch

    from fsdp_compat.testing.zoo import ZOO
    from fsdp_compat.testing.zoo import make_batch as zoo_batch

    if name in ZOO:
        return zoo_batch(name, seed=seed)
    g = torch.Generator().manual_seed(12345 + seed)
    if name == "whisper":
        labels = torch.randint(3, 128, (2, 6), generator=g)
        return {"input_features": torch.randn(2, 8, 32, generator=g), "labels": labels}
    if kind == "enc-dec":
        ids = torch.randint(3, 128, (2, 10), generator=g)
        labels = torch.randint(3, 128, (2, 7), generator=g)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    ids = torch.randint(3, 120, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def build(name: str, seed: int = 0) -> Any:
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = ARCHS[name][1]()
    return train_mode(model.float())


def train_mode(model: Any) -> Any:
    """Train mode with every dropout off (parity needs a deterministic forward)."""
    import torch

    model.train()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


# ---------------------------------------------------------------------------------------------------------------
# Rules: each returns the groups it will make (paths, reshard_after_forward), bottom-up, and applies them.

Groups = list[tuple[tuple[str, ...], bool]]


def _policy_groups(model: Any, rule: str) -> Groups:
    from fsdp_compat.plan import plan_wrap

    plan = plan_wrap(model, policy=POLICY_OF[rule])
    return [(g.paths, g.overrides.get("reshard_after_forward") is not False) for g in plan.groups]


def transformers_adapter() -> Any:
    """fsdp-compat's transformers adapter: the installed package's, or ``adapters/`` of this checkout (a checkout
    on ``sys.path`` shadows the installed ``fsdp_compat`` and has no ``fsdp_compat.adapters``)."""
    import importlib
    import importlib.util

    try:
        return importlib.import_module("fsdp_compat.adapters.transformers")
    except ModuleNotFoundError:
        folder = ROOT / "adapters"
        spec = importlib.util.spec_from_file_location(
            "fsdp_compat.adapters", folder / "__init__.py", submodule_search_locations=[str(folder)]
        )
        assert spec is not None and spec.loader is not None
        package = importlib.util.module_from_spec(spec)
        sys.modules["fsdp_compat.adapters"] = package
        spec.loader.exec_module(package)
        return importlib.import_module("fsdp_compat.adapters.transformers")


def _native_plan(model: Any, world_size: int) -> dict[str, str]:
    import transformers

    _, _, plan = model._resolve_parallel_plans(transformers.DistributedConfig(fsdp_size=world_size))
    return plan


def _native_groups(model: Any, world_size: int, fixed: bool) -> Groups:
    from transformers.distributed import fsdp

    adapter = transformers_adapter()
    plan = _native_plan(model, world_size)
    if fixed:
        plan, _ = adapter.fix_fsdp_plan(model, plan, fsdp.is_norm_and_head_pair)
    return [(g.paths, g.reshard_after_forward) for g in adapter.plan_groups(model, plan, fsdp.is_norm_and_head_pair)]


def _accelerate_groups(model: Any) -> Groups:
    """accelerate 1.15 ``fsdp2_prepare_model``: layer classes in accelerate's bottom-up walk, the input embedding
    alone when untied, ``[final norm, head]`` (tied: plus the embedding) with ``reshard_after_forward=False``."""
    from accelerate.utils.fsdp_utils import _find_final_norm
    from accelerate.utils.other import get_module_children_bottom_up

    paths = {id(m): p for p, m in model.named_modules()}
    layers = set(getattr(model, "_no_split_modules", None) or ())
    taken: set[int] = set()
    groups: Groups = []
    for module in get_module_children_bottom_up(model)[:-1]:
        if type(module).__name__ in layers and id(module) not in taken:
            taken.add(id(module))
            groups.append(((paths[id(module)],), True))
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = embed is not None and getattr(embed, "weight", None) is getattr(head, "weight", object())
    if not tied and embed is not None and id(embed) not in taken:
        taken.add(id(embed))
        groups.append(((paths[id(embed)],), True))
    tail = [_find_final_norm(model), *((embed, head) if tied else (head,))]
    tail = [m for m in tail if m is not None and id(m) not in taken and id(m) in paths]
    if tail:
        groups.append((tuple(paths[id(m)] for m in tail), False))
    return groups


def rule_groups(rule: str, model: Any, world_size: int) -> Groups:
    if rule in POLICY_OF:
        return _policy_groups(model, rule)
    if rule in ("native", "native+fc"):
        return _native_groups(model, world_size, fixed=rule == "native+fc")
    if rule == "accelerate":
        return _accelerate_groups(model)
    raise ValueError(f"unknown rule {rule!r}; choose from {', '.join(RULES)}")


def apply_rule(model: Any, groups: Groups, mesh: Any) -> None:
    """Shard ``model``: ``groups`` bottom-up, then the root."""
    from torch.distributed.fsdp import fully_shard

    for paths, reshard in groups:
        modules = [model.get_submodule(p) for p in paths]
        fully_shard(modules[0] if len(modules) == 1 else modules, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh)


def load_native(base: Any, directory: Path, world_size: int, rule: str | None) -> Any:
    """The user's path for the native rules: ``from_pretrained(directory, distributed_config=...)`` (``native+fc``:
    with fsdp-compat's transformers adapter patched in for the call); ``rule=None`` loads the unsharded reference."""
    import torch
    import transformers

    load: dict[str, Any] = {"dtype": torch.float32, "attn_implementation": "eager"}
    if rule is not None:
        load["distributed_config"] = transformers.DistributedConfig(fsdp_size=world_size)
    adapter = transformers_adapter() if rule == "native+fc" else None
    if adapter is not None:
        adapter.patch()
    try:
        model = type(base).from_pretrained(str(directory), **load)
    finally:
        if adapter is not None:
            adapter.unpatch()
    return train_mode(model)


def predict(model: Any, groups: Groups, evidence: Any) -> str:
    """"crash" when the static evidence says some read finds its group sharded (or a Parameter is split)."""
    from types import SimpleNamespace

    from fsdp_compat.plan import Group, unsafe_reads

    plan = SimpleNamespace(
        groups=[
            Group(modules=(), paths=p, reason="", kind="rule", overrides={} if r else {"reshard_after_forward": False})
            for p, r in groups
        ]
    )
    return "crash" if unsafe_reads(model, plan, evidence) else "ok"


# ---------------------------------------------------------------------------------------------------------------
# Rank side


def _trace(model: Any, batches: list[dict[str, Any]], steps: int) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """The unsharded reference, one process on every rank's micro-batch with the mean loss: gradients and
    parameters after each AdamW step."""
    import torch

    from fsdp_compat.testing.parity import reference_backward

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = []
    for _ in range(steps):
        reference_backward(model, batches)
        grads = {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append((grads, {n: p.detach().clone() for n, p in model.named_parameters()}))
    return out


def _root_share(model: Any) -> tuple[int, float]:
    """(groups besides the root, % of parameters in the root group) from FSDP2's own state."""
    from torch.distributed.fsdp import fully_shard

    from benchmarks.policies import _param_groups

    groups = _param_groups(model)
    state = fully_shard.state(model)
    root = getattr(state, "_fsdp_param_groups", None) or [getattr(state, "_fsdp_param_group", None)]
    root_ids = {id(g) for g in root if g is not None}
    numel = {id(g): sum(fp.sharded_param.numel() for fp in g.fsdp_params) for g in groups}
    total = sum(numel.values()) or 1
    return len(groups) - len(root_ids), 100.0 * sum(numel[i] for i in root_ids if i in numel) / total


def _compare(model: Any, batch: dict[str, Any], reference: list[Any]) -> float:
    import torch

    from fsdp_compat.testing.parity import Diff

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    diff = Diff()
    for ref_grads, ref_params in reference:
        model(**batch).loss.backward()
        diff.add_grads(model, ref_grads)
        opt.step()
        opt.zero_grad(set_to_none=True)
        diff.add_params(model, ref_params)
    return diff.rel


def _short(exc: BaseException) -> str:
    line = traceback.format_exception_only(type(exc), exc)[-1].strip()
    if "got mixed torch.Tensor and DTensor" in line:
        return line.split(":", 1)[1].split(" got mixed")[0].strip() + " (mixed Tensor/DTensor)"
    if "is shared with a parameter already managed" in line:
        return "shared Parameter in two groups (ValueError)"
    if "declares no layer classes" in line:
        return "no layer classes (_no_split_modules is empty)"
    return line[:70]


def matrix_rank(cfg: dict[str, Any], rank: int, extra: dict[str, Any]) -> None:
    """Every (model, rule) cell of ``cfg["models"]`` x ``cfg["rules"]`` on this rank; results in ``extra``."""
    import torch
    from lab.transformers_smoke import init_gloo
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_compat.analysis import find_raw_reads

    init_gloo(cfg, rank)
    world = cfg["world_size"]
    mesh = init_device_mesh("cpu", (world,))
    cells: dict[str, dict[str, Any]] = {}
    extra["cells"] = cells
    for name in cfg["models"]:
        t0 = time.perf_counter()
        base = build(name)
        batches = [make_batch(name, ARCHS[name][0], seed=r) for r in range(world)]
        batch = batches[rank]
        reference = _trace(copy.deepcopy(base), batches, cfg["steps"])
        evidence = find_raw_reads(base).events
        native_reference = None
        directory = Path(cfg["workdir"]) / name
        if any(rule in NATIVE for rule in cfg["rules"]):
            if rank == 0:
                base.save_pretrained(directory)
            torch.distributed.barrier()
            native_reference = _trace(load_native(base, directory, world, None), batches, cfg["steps"])
        for rule in cfg["rules"]:
            cell: dict[str, Any] = {}
            model = copy.deepcopy(base)
            try:
                groups = rule_groups(rule, model, world)
                cell["predicted"] = predict(model, groups, evidence)
                if rule in NATIVE:
                    model = load_native(base, directory, world, rule)
                else:
                    apply_rule(model, groups, mesh)
                cell["groups"], cell["root_pct"] = _root_share(model)
                cell["rel"] = _compare(model, batch, native_reference if rule in NATIVE else reference)
                cell["outcome"] = "exact" if cell["rel"] <= TOL else "diff"
            except Exception as exc:
                cell.update(outcome="crash", error=_short(exc), traceback=traceback.format_exc()[-3000:])
            cells[f"{name}|{rule}"] = cell
            torch.distributed.barrier()
        extra.setdefault("seconds", {})[name] = time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------------------------
# Parent side


def run_matrix(
    models: list[str], rules: list[str], *, world_size: int, steps: int, chunk: int, verbose: bool = False
) -> dict[str, Any]:
    import tempfile

    from fsdp_compat.testing.launch import run_ranks

    cells: dict[str, Any] = {}
    workdir = tempfile.TemporaryDirectory(prefix="fsdp_compat_matrix_")
    for start in range(0, len(models), chunk):
        part = models[start : start + chunk]
        t0 = time.monotonic()
        result = run_ranks(
            "benchmarks.matrix:matrix_rank",
            {"models": part, "rules": rules, "steps": steps, "workdir": workdir.name},
            world_size=world_size,
            timeout_s=120.0 + 60.0 * len(part),
            env={"PYTHONPATH": str(ROOT), "FSDP_COMPAT": "off"},
        )
        got = (result.ranks[0].extra.get("cells") or {}) if result.ranks else {}
        if not result.ok:
            print(f"chunk {part} failed:\n{(result.error or '')[-3000:]}", file=sys.stderr)
        if verbose:
            for key, cell in got.items():
                if cell.get("traceback"):
                    print(f"--- {key}\n{cell['traceback']}", file=sys.stderr)
        for name in part:
            for rule in rules:
                cells[f"{name}|{rule}"] = got.get(f"{name}|{rule}", {"outcome": "no result", "error": "rank failed"})
        print(f"  {', '.join(part)}: {time.monotonic() - t0:.0f}s", file=sys.stderr, flush=True)
    workdir.cleanup()
    return cells


def _cell_text(cell: dict[str, Any], rule: str) -> str:
    outcome = cell.get("outcome", "?")
    if outcome == "crash":
        text = f"crash: {cell.get('error', '')}"
    elif outcome == "exact":
        text = f"exact {cell['groups']}/{cell['root_pct']:.0f}%"
    elif outcome == "diff":
        text = f"diff {cell['rel']:.2g} {cell['groups']}/{cell['root_pct']:.0f}%"
    else:
        text = f"{outcome}: {cell.get('error', '')}"
    ran_ok = outcome in ("exact", "diff")
    predicted = cell.get("predicted")
    if predicted and (predicted == "crash") == ran_ok:
        text += f" (predicted {predicted})"
    return text


def format_matrix(models: list[str], rules: list[str], cells: dict[str, Any]) -> str:
    from benchmarks import format_table

    rows = [[name, ARCHS[name][0], *(_cell_text(cells[f"{name}|{r}"], r) for r in rules)] for name in models]
    return format_table(["model", "kind", *rules], rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks matrix", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(ARCHS))
    parser.add_argument("--rules", default=",".join(RULES))
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=6)
    parser.add_argument("--verbose", action="store_true", help="print each crashed cell's traceback to stderr")
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    rules = [r for r in args.rules.split(",") if r]
    unknown = [m for m in models if m not in ARCHS] + [r for r in rules if r not in RULES]
    if unknown:
        print(f"unknown models/rules {unknown}; models: {', '.join(ARCHS)}; rules: {', '.join(RULES)}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    cells = run_matrix(
        models, rules, world_size=args.world_size, steps=args.steps, chunk=args.chunk, verbose=args.verbose
    )
    print(format_matrix(models, rules, cells))
    crashed = sum(c.get("outcome") == "crash" for c in cells.values())
    print(
        f"\n{len(models)} models x {len(rules)} rules on {args.world_size} gloo ranks, {args.steps} AdamW steps, "
        f"fp32; cells: 'exact g/r%' = exact parity (<= {TOL:g} relative), g groups besides the root, r % of the "
        f"parameters in the root; {crashed} crashed; {time.monotonic() - t0:.0f}s wall"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
