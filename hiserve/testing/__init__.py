"""Helpers for tests and benchmarks that need a model without downloading one."""
