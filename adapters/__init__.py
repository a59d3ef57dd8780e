"""Framework adapters: one module per framework, each its release table (for these versions, in these modules, this
name becomes that function, and these repairs run). Importing an adapter module activates it. Their index
(:data:`ADAPTERS`: trigger modules and supported ranges) lives in the low module :mod:`fsdp_compat.adapter_index`,
re-exported here; adding an adapter is one row there plus its module here (docs/development.md)."""

from __future__ import annotations

from fsdp_compat.adapter_index import ADAPTERS, AdapterEntry, trigger

__all__ = ["ADAPTERS", "AdapterEntry", "trigger"]
