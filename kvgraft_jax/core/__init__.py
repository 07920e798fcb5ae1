"""The model and its KV state, with nothing of files: sharding, Gemma 3 and its weights, the
tokenizer, the typed KV state and its compaction, cache-length-invariant attention, the compiled
engine, bit comparison and canonical digests, multi-process helpers.

Imports nothing else of kvgraft_jax. Layers above: store, exact, library; run, bench, cli.
"""
