"""verl adapter: every FSDP2-capable verl release (0.4.0 - 0.9.1, and main) shards with fsdp-compat's plan.

verl's FSDP2 path (``strategy: fsdp2``) gives every untied ``nn.Embedding`` its own ``fully_shard`` group, and from
0.7.1 on also the untied ``lm_head``. GLM4V reads its vision ``position_embedding.weight`` raw (``F.grid_sample``:
``aten.grid_sampler_2d.default got mixed torch.Tensor and DTensor``) and verl's own fused kernels read
``lm_head.weight`` raw (``aten.mm.default got mixed ...``). What is replaced, per release:

=================  ==========================================  ==============================================
verl               replaced in ``verl.utils.fsdp_utils``        also rebound in (``from fsdp_utils import``)
=================  ==========================================  ==============================================
0.4.0 - 0.4.1      ``apply_fsdp2`` (selects inline)            workers.fsdp_workers, trainer.fsdp_sft_trainer
0.5.0              ``apply_fsdp2``                             + workers.engine.fsdp.engine_impl
0.6.0 - 0.7.0      ``apply_fsdp2``                             + workers.engine.fsdp.transformer_impl
0.7.1 - 0.9.1,     ``_select_fsdp2_wrap_targets`` (verl's      none: verl's ``apply_fsdp2`` looks the selector
main (0.10.0.dev)  ``apply_fsdp2`` looks it up at call time)   up in its module at call time
=================  ==========================================  ==============================================

Other versions (0.3.x has no FSDP2; anything newer is unknown): a warning and no patch (``FSDP_COMPAT_FORCE=1``
applies the 0.7.1+ row anyway). The 0.7.1+ row also carries verl's GLM4V forward repair (``verl_glm4v``, deferred
until verl imports its GLM4V code), in the same transaction.

From 0.7.1 the replacement runs verl's own selector and removes only what would crash, so text models keep exactly
verl's groups; on 0.4-0.7.0 fsdp-compat's plan applies the groups. A wrap list that matches no class of the model
(an outdated ``transformer_layer_cls_to_wrap``) warns once and shards what verl would, never raising in a job.

Activation, all of which only import this module: the ``verl.plugins`` entry point (verl >= 0.9.0 loads it on
``import verl``), ``VERL_USE_EXTERNAL_MODULES=fsdp_compat.adapters.verl`` (verl >= 0.6.0), the config drop-in
``actor_rollout_ref.model.external_lib=fsdp_compat.adapters.verl`` (verl's ``import_external_libs``), or the
installed ``.pth`` hook (any release, any process). ``FSDP_COMPAT=off`` disables them all.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from packaging.version import Version

from fsdp_compat.activation import Release, Replacement, declare
from fsdp_compat.log import logger
from fsdp_compat.policies import Policy

from . import trigger
from ._selection import configured_wrap_list, layer_class_names
from .verl_glm4v import QWEN2_VL_REPAIRS as QWEN2_VL_FORWARD
from .verl_glm4v import REPAIRS as GLM4V_FORWARD

__all__ = [
    "ADAPTER",
    "RELEASES",
    "SUPPORTED",
    "Release",
    "configured_layer_classes",
    "is_patched",
    "make_apply_fsdp2",
    "make_select_fsdp2_wrap_targets",
    "patch",
    "unpatch",
]

#: the trigger module (its one home is the index row); every release defines the FSDP2 selection here
UTILS = trigger("verl")
_WORKERS = "verl.workers.fsdp_workers"
_SFT = "verl.trainer.fsdp_sft_trainer"
_ENGINE_05 = "verl.workers.engine.fsdp.engine_impl"
_ENGINE = "verl.workers.engine.fsdp.transformer_impl"



# ------------------------------------------------------------------------------------------------ replacements


def configured_layer_classes(model: Any, config: Any) -> list[str]:
    """What verl 0.4-0.7.0 computed: ``config.get("wrap_policy", {}).get("transformer_layer_cls_to_wrap",
    model._no_split_modules)``, with the set-valued ``_no_split_modules`` of transformers 5 accepted."""
    found = layer_class_names(configured_wrap_list(config)) or layer_class_names(
        getattr(model, "_no_split_modules", None)
    )
    if not found:
        from fsdp_compat.errors import FsdpCompatError

        raise FsdpCompatError(
            f"verl apply_fsdp2: no layer classes to wrap for {type(model).__name__} (its _no_split_modules is "
            f"{getattr(model, '_no_split_modules', None)!r}); set "
            "fsdp_config.wrap_policy.transformer_layer_cls_to_wrap to the decoder layer class names."
        )
    return found


def _fsdp_module_context(utils: Any) -> Callable[[Any], AbstractContextManager[Any]]:
    """verl's ``maybe_patch_fsdp_module`` (0.6.0+: lets ABC models be wrapped), or nothing on older releases."""
    context = getattr(utils, "maybe_patch_fsdp_module", None)
    return context if callable(context) else (lambda _module: nullcontext())


def make_apply_fsdp2(original: Callable[..., Any], policy: Policy) -> Callable[..., None]:
    """verl 0.4-0.7.0 ``apply_fsdp2(model, fsdp_kwargs, config)`` with the groups of fsdp-compat's plan.

    Keeps the release's contract: the config's wrap-list override (a str or set is accepted), ``fsdp_kwargs`` on
    every group, the ``fully_shard`` and ``maybe_patch_fsdp_module`` bound in verl's module, the root last, None
    returned. Groups the plan makes of several modules or with their own kwargs are applied as such.
    """

    @functools.wraps(original)
    def apply_fsdp2(model: Any, fsdp_kwargs: Any, config: Any) -> None:
        from fsdp_compat.plan import plan_wrap
        from fsdp_compat.runtime import install_runtime

        from ._selection import outdated_fallback, unmatched

        utils = sys.modules[original.__module__]
        fully_shard, context = getattr(utils, "fully_shard", None), _fsdp_module_context(utils)
        if fully_shard is None:
            raise RuntimeError("PyTorch version >= 2.4 is required for using fully_shard API (FSDP2)")
        names = configured_layer_classes(model, config)
        kwargs = dict(fsdp_kwargs or {})
        outdated = unmatched(model, names)
        if outdated is not None:  # verl trains with such a list (embeddings only): so do we, with a warning
            plan: Any = "wrap list matched nothing"
            for module in outdated_fallback("verl", model, outdated, policy.analyzed):
                with context(module):
                    fully_shard(module, **kwargs)
        else:
            plan = plan_wrap(model, names, policy=policy)
            for group in plan.groups:
                target = group.modules[0] if len(group.modules) == 1 else list(group.modules)
                with context(group.modules[0]):
                    fully_shard(target, **{**kwargs, **group.overrides})
        with context(model):
            fully_shard(model, **kwargs)  # the root last; FSDP2 keeps it unsharded through the forward
        install_runtime(model)  # the run-time guard, and mixed micro-batches kept in step
        logger.debug("verl apply_fsdp2 (policy %s):\n%s", policy, plan)

    apply_fsdp2.__fsdp_compat__ = True  # type: ignore[attr-defined]
    return apply_fsdp2


def _reads_lm_head_raw(model: Any, use_fused_kernels: bool) -> bool:
    """verl's fused kernels read ``lm_head.weight`` in the root forward (0.9.1 marks the model; the swapped
    forward of earlier releases is also caught by the planner's static analysis)."""
    return bool(use_fused_kernels or getattr(model, "_verl_fused_kernels_backend", None))


def _output_heads(model: Any) -> Iterator[Any]:
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if head is not None:
        yield head
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == "lm_head":
            yield module


def _accepted(function: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keywords ``function`` takes (verl 0.9.1's selector takes none; an upstream change adds one)."""
    import inspect

    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return kwargs
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return kwargs
    names = {p.name for p in parameters}
    return {k: v for k, v in kwargs.items() if k in names}


def make_select_fsdp2_wrap_targets(original: Callable[..., Any], policy: Policy) -> Callable[..., list[Any]]:
    """verl >= 0.7.1 ``_select_fsdp2_wrap_targets(model, cls_names, **kw)``: verl's own selection minus what is unsafe.

    Under ``auto`` the candidates are exactly the release's (verl's own function runs: layer classes, untied
    ``nn.Embedding``, by-name ``embed_tokens`` / ``lm_head`` with a ``weight``), so text models keep verl's groups;
    removed are only the modules static analysis shows would crash (GLM4V's raw-read position table) and an
    ``lm_head`` whose weight verl's fused kernels read raw; children come before parents. Extra keywords (an
    unmerged upstream change adds ``use_fused_kernels``) are passed through. A wrap list that matches nothing
    warns and goes on like verl (no exception). ``legacy`` & co reproduce an upstream rule as it is.
    """

    @functools.wraps(original)
    def _select_fsdp2_wrap_targets(
        model: Any, fsdp_transformer_layer_cls_to_wrap: Iterable[str] | str | None = None, *args: Any, **kwargs: Any
    ) -> list[Any]:
        from fsdp_compat.runtime import install_runtime

        from ._selection import keep_safe, unmatched, warn_unmatched

        names = layer_class_names(fsdp_transformer_layer_cls_to_wrap)
        outdated = unmatched(model, names)
        if not policy.analyzed:  # legacy & co reproduce an upstream rule as it is
            if outdated is None:
                from fsdp_compat.plan import select_wrap_targets

                chosen = select_wrap_targets(model, names, policy=policy)
            else:
                warn_unmatched("verl", model, outdated, ["verl's own selection"])
                chosen = list(original(model, names, *args, **_accepted(original, kwargs)))
            install_runtime(model)  # before verl's own fully_shard calls: it finds the groups at the first forward
            return chosen
        targets = list(original(model, names, *args, **_accepted(original, kwargs)))  # the release's own candidates
        raw_head = {}
        if _reads_lm_head_raw(model, kwargs.get("use_fused_kernels", False)):
            raw_head = {id(m): "its weight is read raw by verl's fused kernels" for m in _output_heads(model)}
        kept = keep_safe("verl", model, targets, raw_head)
        if outdated is not None:
            paths = {id(m): p for p, m in model.named_modules()}
            warn_unmatched("verl", model, outdated, [paths.get(id(m), "?") for m in kept])
        # after the analysis (which reads the model's own forwards), before verl's own fully_shard calls
        install_runtime(model)
        return kept

    _select_fsdp2_wrap_targets.__fsdp_compat__ = True  # type: ignore[attr-defined]
    return _select_fsdp2_wrap_targets


# --------------------------------------------------------------------------------------------- release table


def _selection(name: str, make: Callable[..., Any], importers: tuple[str, ...] = ()) -> tuple[Replacement, ...]:
    return (Replacement(UTILS, name, make, importers),)


RELEASES: tuple[Release, ...] = (
    Release(">=0.4.0,<0.5.0", _selection("apply_fsdp2", make_apply_fsdp2, (_WORKERS, _SFT))),
    Release(">=0.5.0,<0.6.0", _selection("apply_fsdp2", make_apply_fsdp2, (_WORKERS, _SFT, _ENGINE_05))),
    Release(">=0.6.0,<0.7.1", _selection("apply_fsdp2", make_apply_fsdp2, (_WORKERS, _SFT, _ENGINE))),
    # + verl's Qwen2-VL and GLM4V forwards on transformers 5 (fsdp_compat.adapters.verl_glm4v; left out on 4.x)
    Release(
        ">=0.7.1",
        _selection("_select_fsdp2_wrap_targets", make_select_fsdp2_wrap_targets) + QWEN2_VL_FORWARD + GLM4V_FORWARD,
    ),
)


def release_for(version: Version) -> Release | None:
    """The table row for ``version`` (None below 0.4.0: no FSDP2)."""
    return next((row for row in RELEASES if row.matches("verl", version)), None)


def _loading_path() -> str:
    """Which verl hook imported this module: the entry point, VERL_USE_EXTERNAL_MODULES, or external_lib."""
    frame = sys._getframe(1)
    seen_import_external_libs = False
    while frame is not None:
        code = frame.f_code
        in_verl_init = code.co_filename.replace("\\", "/").endswith("verl/__init__.py")
        if code.co_name == "import_external_libs":
            seen_import_external_libs = True
        elif in_verl_init:
            if seen_import_external_libs:
                return "VERL_USE_EXTERNAL_MODULES"
            if "_ep" in frame.f_locals:
                return "verl.plugins entry point"
        elif seen_import_external_libs:
            return "external_lib"
        frame = frame.f_back
    return "external_lib" if seen_import_external_libs else "import"


ADAPTER = declare("verl", RELEASES, source=_loading_path)
patch, unpatch, is_patched = ADAPTER.patch, ADAPTER.unpatch, ADAPTER.is_patched
SUPPORTED: dict[str, str] = ADAPTER.supported  #: distribution -> supported versions (the index row's)
