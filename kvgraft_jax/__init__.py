"""kvgraft_jax: byte-exact KV-cache grafting for Gemma 3 on JAX."""

# Load Python's SQLite (and the system libsqlite3 it links) before anything imports TensorFlow:
# TensorFlow loads its own SQLite build, without FTS5, into the global symbol scope, and a
# `sqlite3` first imported after that binds to it. The library catalog needs FTS5.
import sqlite3 as _sqlite3  # noqa: F401
