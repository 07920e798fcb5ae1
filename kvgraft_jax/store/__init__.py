"""Artifacts on disk: the manifest and the files, writing with an atomic commit, prefix chains, and
a restore that recomputes every digest while it reads. Anything doubtful is refused with an
`errors.ArtifactError`.

Imports only `core`.
"""
