"""The command line: flags into a `RunConfig`, one function per `--mode` returning a typed report,
and the quiet logging the CLI runs with. The entry point is `kvgraft_jax/main.py`.

May import every other sub-package; nothing imports it but `main`.
"""
