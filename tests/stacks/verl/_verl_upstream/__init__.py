"""Upstream frameworks' test files, vendored unchanged with their licence headers, run against the adapters."""
