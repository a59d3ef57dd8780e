"""The names the analysis models, and its limits.

Kept apart because every stage reads them: the collector (which builtins and calls it understands), the resolver
(which attributes are metadata or registries) and the interpreter (which nn.Module methods it follows), and
:mod:`fsdp_compat.audit` reads ``METADATA_ATTRS`` too.
"""

from __future__ import annotations

from typing import Any

import torch

# Reading these off a Parameter never touches its data, and they are correct on a sharded DTensor too. Not ``type``:
# ``Tensor.type(dtype)`` is a cast that reads every value (only the argument-less ``.type()`` is a type name; the
# analysis cannot tell the two apart from the attribute alone, so both count as a read).
METADATA_ATTRS = frozenset(
    {
        "shape", "dtype", "device", "ndim", "size", "dim", "numel", "nelement", "requires_grad", "is_cuda",
        "is_meta", "layout", "element_size", "is_floating_point", "is_complex", "names", "data_ptr",
        "is_contiguous", "stride", "__class__",
    }
)
# Getters that return submodules; calling them during analysis is safe and resolves the chain.
MODULE_GETTERS = frozenset({"get_input_embeddings", "get_output_embeddings", "get_decoder", "get_encoder"})
# Builtins that look at an object (its type, identity, length) and never at a Parameter's data.
INERT_CALLS = frozenset({"isinstance", "issubclass", "hasattr", "id", "type", "len", "callable"})
# Builtins that hand back (elements of) their argument when iterated.
ITER_WRAPPERS = frozenset({"enumerate", "zip", "reversed", "list", "tuple", "iter", "sorted"})
# fsdp-compat's own run-time hooks carry this attribute: they read no parameter, so the analysis skips them.
RUNTIME_HOOK_MARK = "__fsdp_compat_guard__"
# Calling a module through these runs its hooks (FSDP2 unshards there); calling ``.forward()`` directly does not.
HOOKED_CALLS = frozenset({"__call__", "_call_impl", "_wrapped_call_impl"})
# torch functions that call their first argument with the rest (``checkpoint(function, *args, **kwargs)`` runs
# ``function(*args, **kwargs)`` in forward and again in backward): followed as that call, less their own keywords.
CALLS_FIRST_ARGUMENT = frozenset({"torch.utils.checkpoint.checkpoint"})
CHECKPOINT_KEYWORDS = frozenset(
    {"use_reentrant", "context_fn", "determinism_check", "debug", "preserve_rng_state", "early_stop"}
)
# Attributes that expose a module's registry: touching them reaches everything below it.
REFLECTION_ATTRS = frozenset({"__dict__", "_modules", "_parameters", "_buffers"})
# transformers' ``module.dtype`` / ``.device`` look at the first parameter's dtype or device only.
MODULE_METADATA = frozenset({"dtype", "device"})
# nn.Module methods that hand out submodules (modelled as iteration over them) or register a hook (followed).
MODULE_ITERATORS = frozenset({"modules", "named_modules", "children", "named_children"})
HOOK_REGISTRATION = frozenset(
    {
        "register_forward_pre_hook", "register_forward_hook", "register_full_backward_hook",
        "register_full_backward_pre_hook", "register_backward_hook",
    }
)
# ModuleDict / ParameterDict views that hand out their own entries (modelled as iterating them, like children()).
DICT_VIEWS = frozenset({"values", "items", "keys"})
# nn.Module methods that hand out Parameters (modelled as iteration over them, with their real names).
PARAM_ITERATORS = frozenset({"parameters", "named_parameters"})
# nn.Module methods that look a submodule or Parameter up by a dotted name with getattr (a constant name resolves).
NAME_LOOKUPS = frozenset({"get_submodule", "get_parameter"})
# Registries whose constant-key subscripts are modelled (``self._modules["emb"]``); other uses reflect.
REGISTRIES = frozenset({"_modules", "_parameters", "_buffers"})
MAX_CONSTS = 8  # a name that may hold more constant strings than this is treated as computed
MAX_STEPS = 6  # longer chains (``x = x.inner`` in a loop) become "any descendant"
SCAN_DEPTH = 4  # how deep plain Python objects are searched for references to modules
SCALARS = (int, float, complex, str, bytes, bool, type(None), torch.dtype, torch.device, torch.Size)

# A step of a reference chain: str attribute | ("()", getter) | ("[]", key or None or ("sel", predicate)) |
# ("?",) computed attribute | ("**",) any below | ("isa", types) kept only if an instance | ("via", method) a
# name lookup by nn.Module's own ``method`` (escapes when the class overrides it).
Step = Any

MISSING = object()  # "not known from constants alone" (the collector) / "not a plain attribute" (the resolver)
