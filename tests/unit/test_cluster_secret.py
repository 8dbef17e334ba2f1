"""The cluster secret: text form, derived keys, the 0600 file, and the CA every holder derives."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.exceptions import InvalidSignature

from pdserve.worker.cluster_secret import (
    TEXT_PREFIX,
    ClusterSecret,
    read_secret_file,
    write_secret_file,
)
from pdserve.worker.mutual_tls import WORKER_TLS_NAME, _ca_certificate, _ca_key, _identity


def test_text_form_round_trips_and_repr_hides_the_value() -> None:
    secret = ClusterSecret.generate()
    text = secret.to_text()
    assert text.startswith(TEXT_PREFIX) and "=" not in text
    assert ClusterSecret.from_text(text + "\n") == secret
    assert secret.value.hex() not in repr(secret) and text not in repr(secret)
    assert repr(secret) == "ClusterSecret()"


def test_malformed_text_is_refused_without_quoting_it() -> None:
    with pytest.raises(ValueError, match="must start with") as err:
        ClusterSecret.from_text("hunter2-not-a-secret")
    assert "hunter2" not in str(err.value)
    with pytest.raises(ValueError, match="is 32 bytes, got 3"):
        ClusterSecret.from_text(TEXT_PREFIX + "YWJj")


def test_each_purpose_gets_its_own_key() -> None:
    secret, other = ClusterSecret(b"\x01" * 32), ClusterSecret(b"\x02" * 32)
    keys = [secret.kv_transfer_key(), secret.tls_ca_seed(), bytes.fromhex(secret.redis_password())]
    keys.append(bytes.fromhex(secret.ray_token()))
    assert len(set(keys)) == 4 and all(len(k) == 32 for k in keys)
    assert secret.value not in keys
    assert other.kv_transfer_key() != secret.kv_transfer_key()
    assert ClusterSecret(b"\x01" * 32).redis_password() == secret.redis_password()  # stable


def test_secret_file_is_created_0600_and_read_back(tmp_path: Path) -> None:
    path = tmp_path / "state" / "up.secret"
    secret = ClusterSecret.generate()
    write_secret_file(path, secret)
    assert (path.stat().st_mode & 0o777) == 0o600
    assert read_secret_file(path) == secret
    assert list(path.parent.iterdir()) == [path]  # no temporary file left behind


def test_a_file_others_can_read_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "up.secret"
    write_secret_file(path, ClusterSecret.generate())
    os.chmod(path, 0o644)
    with pytest.raises(ValueError, match=r"mode 0644\); run `chmod 600"):
        read_secret_file(path)
    with pytest.raises(ValueError, match="does not exist"):
        read_secret_file(tmp_path / "missing")


def test_every_holder_derives_the_same_ca_and_signs_its_own_certificate() -> None:
    secret = ClusterSecret.generate()
    first = _ca_certificate(_ca_key(secret))
    again = _ca_certificate(_ca_key(ClusterSecret(secret.value)))
    assert first == again  # byte for byte: fixed fields, deterministic signature
    other = _ca_certificate(_ca_key(ClusterSecret.generate()))
    assert other.public_key() != first.public_key()
    leaf = x509.load_pem_x509_certificate(_identity(secret).cert_pem)
    leaf.verify_directly_issued_by(first)
    names = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == [WORKER_TLS_NAME]
    with pytest.raises(InvalidSignature):
        leaf.verify_directly_issued_by(other)
