"""A run's settings (`RunConfig`) and the live objects they build (mesh, model, tokenizer).

Imports only `core`.
"""
