"""Framework adapters: each file declares the versions it supports and the names it replaces."""
