"""Signed artifacts: a depositor's Ed25519 key over the manifest; readers that require one refuse
anything else before a byte of state is read, a resealed forgery included."""

import json
import os
import stat
import subprocess
import sys

import numpy as np
import pytest
from conftest import reseal

from kvgraft_jax.core import engine, environment, model, sharding
from kvgraft_jax.exact import deposit
from kvgraft_jax.store import errors, files, restore, signing
from kvgraft_jax.store import manifest as manifest_lib


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    base = tmp_path_factory.mktemp("keys")
    return {name: signing.generate(base / name) for name in ("depositor", "forger")}


def _deposit(tiny_params_on, path, signer=None):
    mesh, params = tiny_params_on("1")
    module = model.build_model("tiny")
    ids = np.random.default_rng(0).integers(4, 1024, size=(1, 40)).astype(np.int32)
    eng = engine.Engine(module, params, mesh, batch_size=1, cache_length=40)
    return deposit.deposit(
        eng,
        ids,
        chunk_size=16,
        path=path,
        model=model.describe_model("tiny", module, params),
        tokenizer=None,
        versions=environment.versions(),
        text="signed",
        signer=signer,
    )


def _trusting(*public_paths):
    return manifest_lib.Expected(trusted_keys=signing.load_trusted(public_paths))


def _restore(path, expected):
    return restore.restore(path, sharding.make_mesh(sharding.MeshSpec(1, 1)), expected=expected)


def test_keygen_writes_a_private_key_only_its_owner_reads(keys, tmp_path):
    private, public = keys["depositor"]
    assert stat.S_IMODE(os.stat(private).st_mode) == 0o600
    assert signing.load_signer(private).key_id == next(iter(signing.load_trusted([public]).keys))
    again = subprocess.run(
        [sys.executable, "-m", "kvgraft_jax.store.signing", private],
        capture_output=True,
        text=True,
        check=False,
    )
    assert again.returncode == 2 and "not overwritten" in again.stderr


def test_a_signed_artifact_restores_for_its_trusting_reader(tiny_params_on, keys, tmp_path):
    signer = signing.load_signer(keys["depositor"][0])
    signed = _deposit(tiny_params_on, tmp_path / "a", signer)
    assert manifest_lib.signature_of(signed.path)["key_id"] == signer.key_id
    restored = _restore(signed.path, _trusting(keys["depositor"][1]))
    assert restored.root == signed.root
    # Trusting another key only, or reading an unsigned artifact, is refused.
    with pytest.raises(errors.UntrustedArtifactError, match="not trusted"):
        _restore(signed.path, _trusting(keys["forger"][1]))
    unsigned = _deposit(tiny_params_on, tmp_path / "b")
    with pytest.raises(errors.UntrustedArtifactError, match="not signed"):
        _restore(unsigned.path, _trusting(keys["depositor"][1]))
    _restore(unsigned.path, None)  # without --trusted_keys the digests alone decide


def test_a_resealed_forgery_is_refused_when_keys_are_required(tiny_params_on, keys, tmp_path):
    signed = _deposit(tiny_params_on, tmp_path / "a", signing.load_signer(keys["depositor"][0]))
    data = json.loads((signed.path / files.MANIFEST).read_text())
    # The forger rewrites the provenance and reseals: digests consistent, signature stale.
    reseal(signed.path, provenance=dict(data["provenance"], source="forged"))
    manifest_lib.read_manifest(signed.path)  # integrity checks alone cannot tell
    with pytest.raises(errors.UntrustedArtifactError, match="does not verify"):
        _restore(signed.path, _trusting(keys["depositor"][1]))
    # Re-signing with the forger's own key does not help either.
    marker = json.loads((signed.path / files.COMMIT_MARKER).read_text())
    marker["signature"] = signing.load_signer(keys["forger"][0]).sign(marker["manifest_sha256"])
    (signed.path / files.COMMIT_MARKER).write_text(json.dumps(marker))
    with pytest.raises(errors.UntrustedArtifactError, match="not trusted"):
        _restore(signed.path, _trusting(keys["depositor"][1]))


def test_bad_key_files_are_one_error(keys, tmp_path):
    junk = tmp_path / "junk.pem"
    junk.write_text("not a key")
    with pytest.raises(signing.SigningError, match="not an unencrypted PEM private key"):
        signing.load_signer(junk)
    with pytest.raises(signing.SigningError, match="not a PEM public key"):
        signing.load_trusted([junk])
    with pytest.raises(signing.SigningError, match="No such file"):
        signing.load_trusted([tmp_path / "missing.pub"])
    with pytest.raises(signing.SigningError, match="not a PEM public key"):
        signing.load_trusted([keys["depositor"][0]])  # a private key where a public one belongs
