"""The refusals of the artifact store: each is one line the CLI prints before exiting non-zero."""

from __future__ import annotations


class ArtifactError(Exception):
    """Base of every refusal; the CLI prints its one-line message and exits non-zero."""


class ArtifactNotFoundError(ArtifactError):
    pass


class UncommittedArtifactError(ArtifactError):
    pass


class ArtifactExistsError(ArtifactError):
    pass


class CorruptArtifactError(ArtifactError):
    """Missing, truncated, flipped or edited files: the bytes are not what was deposited."""


class IncompatibleArtifactError(ArtifactError):
    """A sound artifact that does not belong to this model, tokenizer, format or shape."""


class UntrustedArtifactError(ArtifactError):
    """Not signed by a key the reader trusts (`--trusted_keys`)."""
