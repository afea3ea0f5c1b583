"""The stack's Kafka TLS material: made once, private, renewed only when it must be."""

from __future__ import annotations

import ipaddress

from cryptography import x509
from cryptography.hazmat.primitives.serialization import pkcs12

from ops.stack.tls import BROKER_STORE, CA_KEY, ensure_kafka_tls


def _cert(tls):
    return pkcs12.load_key_and_certificates(tls.keystore.read_bytes(), tls.keystore_password.encode())[1]


def test_a_ca_and_a_broker_certificate_for_loopback_readable_by_the_owner_only(tmp_path) -> None:
    tls = ensure_kafka_tls(tmp_path / "secrets")
    for f in (tls.ca_file, tls.keystore, tmp_path / "secrets" / CA_KEY):
        assert f.stat().st_mode & 0o077 == 0, f
    cert = _cert(tls)
    ca = x509.load_pem_x509_certificate(tls.ca_file.read_bytes())
    assert cert.issuer == ca.subject
    cert.verify_directly_issued_by(ca)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert ipaddress.ip_address("127.0.0.1") in san.get_values_for_type(x509.IPAddress)
    assert "localhost" in san.get_values_for_type(x509.DNSName)


def test_kept_while_valid_made_again_for_a_new_host_or_a_new_ca(tmp_path) -> None:
    d = tmp_path / "secrets"
    first = ensure_kafka_tls(d)
    serial = _cert(first).serial_number
    assert _cert(ensure_kafka_tls(d)).serial_number == serial  # nothing to do
    other = ensure_kafka_tls(d, "10.1.2.3")
    assert _cert(other).serial_number != serial
    assert ipaddress.ip_address("10.1.2.3") in _cert(other).extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value.get_values_for_type(x509.IPAddress)
    (d / CA_KEY).unlink()  # a new CA: the broker certificate must chain to it
    renewed = ensure_kafka_tls(d, "10.1.2.3")
    ca = x509.load_pem_x509_certificate(renewed.ca_file.read_bytes())
    _cert(renewed).verify_directly_issued_by(ca)
    assert (d / BROKER_STORE).exists()
