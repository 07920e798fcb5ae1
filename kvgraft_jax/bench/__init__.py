"""Benchmarks that print JSON: artifact restore and digest throughput, and graft against recompute
and llama.cpp per prefix length.

Imports `core`, `store`, `exact` and `run`.
"""
