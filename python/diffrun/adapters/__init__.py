"""Adapters that turn other frameworks' forward passes into diffrun dumps (transformers: python -m diffrun.adapters.transformers)."""
