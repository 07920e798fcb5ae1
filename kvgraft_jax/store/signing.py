"""Ed25519 signatures over an artifact's manifest: who deposited it, not only that it is intact.

Digests prove integrity against accidents; whoever can rewrite an artifact can also reseal its
manifest. A signature by the depositor's key, checked against keys the reader trusts, proves
authenticity. The signature covers the manifest's SHA-256, which covers every array digest, the
Merkle root, every state file's SHA-256, the tokens and the whole exactness contract: one check
before any array is read.

    python -m kvgraft_jax.store.signing keys/depositor        # keys/depositor (private), .pub (public)
    python -m kvgraft_jax.main --mode=deposit ... --signing_key=keys/depositor
    python -m kvgraft_jax.main --mode=graft ... --trusted_keys=keys/depositor.pub

Keys are PEM files (PKCS#8 private, SubjectPublicKeyInfo public), so `openssl genpkey -algorithm
ed25519` keys work too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
from collections.abc import Sequence

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

ALGORITHM = "ed25519"


class SigningError(ValueError):
    """A key file that cannot be used (missing, not PEM, not Ed25519)."""


def key_id(public: ed25519.Ed25519PublicKey) -> str:
    """SHA-256 of the raw 32-byte public key, hex: names a key in signatures and messages."""
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()


def _read(path: str | os.PathLike) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(1 << 16)
    except OSError as e:
        raise SigningError(f"key file {os.fspath(path)}: {e.strerror}") from None


@dataclasses.dataclass(frozen=True)
class Signer:
    key: ed25519.Ed25519PrivateKey

    @property
    def key_id(self) -> str:
        return key_id(self.key.public_key())

    def sign(self, manifest_sha256: str) -> dict[str, str]:
        """The signature record stored in the artifact's commit marker."""
        return {
            "algorithm": ALGORITHM,
            "key_id": self.key_id,
            "signature": self.key.sign(manifest_sha256.encode()).hex(),
        }


def load_signer(path: str | os.PathLike) -> Signer:
    try:
        key = serialization.load_pem_private_key(_read(path), password=None)
    except (ValueError, TypeError) as e:
        raise SigningError(
            f"{os.fspath(path)} is not an unencrypted PEM private key: {e}"
        ) from None
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise SigningError(f"{os.fspath(path)} is not an Ed25519 key")
    return Signer(key)


@dataclasses.dataclass(frozen=True)
class TrustedKeys:
    """The public keys a reader accepts signatures from, by key id."""

    keys: dict[str, ed25519.Ed25519PublicKey]

    def problem(self, manifest_sha256: str, signature: object) -> str | None:
        """None when `signature` is a valid signature of one of these keys, else why not."""
        if not isinstance(signature, dict):
            return "it is not signed, and --trusted_keys requires a signature"
        if signature.get("algorithm") != ALGORITHM:
            return f"its signature algorithm {str(signature.get('algorithm'))[:40]!r} is not {ALGORITHM}"
        key = self.keys.get(str(signature.get("key_id")))
        if key is None:
            return f"it is signed by key {str(signature.get('key_id'))[:16]}, which is not trusted"
        try:
            key.verify(bytes.fromhex(str(signature.get("signature"))), manifest_sha256.encode())
        except (InvalidSignature, ValueError):
            return f"its signature by key {str(signature.get('key_id'))[:16]} does not verify"
        return None


def load_trusted(paths: Sequence[str | os.PathLike]) -> TrustedKeys:
    keys = {}
    for path in paths:
        try:
            key = serialization.load_pem_public_key(_read(path))
        except (ValueError, TypeError) as e:
            raise SigningError(f"{os.fspath(path)} is not a PEM public key: {e}") from None
        if not isinstance(key, ed25519.Ed25519PublicKey):
            raise SigningError(f"{os.fspath(path)} is not an Ed25519 public key")
        keys[key_id(key)] = key
    return TrustedKeys(keys)


def generate(path: str | os.PathLike) -> tuple[str, str]:
    """Writes a new private key to `path` (mode 0600) and its public key to `path.pub`."""
    key = ed25519.Ed25519PrivateKey.generate()
    private = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    public = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(private)
    with open(path + ".pub", "wb") as f:
        f.write(public)
    return path, path + ".pub"


def main(argv: Sequence[str]) -> int:
    if len(argv) != 2:
        print(
            "usage: python -m kvgraft_jax.store.signing PATH  (writes PATH and PATH.pub)",
            file=sys.stderr,
        )
        return 2
    try:
        private, public = generate(argv[1])
    except FileExistsError:
        print(f"kvgraft_jax.store.signing: {argv[1]} exists; not overwritten", file=sys.stderr)
        return 2
    print(
        f"private key: {private}\npublic key: {public} (key id {key_id(load_signer(private).key.public_key())[:16]})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
