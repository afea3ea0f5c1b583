"""The stack's TLS material, made on first use: for Kafka, a private CA and one broker
certificate; for SeaweedFS's gRPC, another CA and one certificate its components share.

* ``kafka-ca.pem``: the CA's certificate, the one file a client needs (``ssl.ca.location``,
  :meth:`common.settings.BusSettings.client_conf`); the brokers trust it for their own
  inter-broker connections (a PEM truststore).
* ``kafka-ca.key``: the CA's private key, kept only to sign a new broker certificate.
* ``kafka-broker.p12``: the brokers' key and certificate (PKCS#12, encrypted with the stack
  secret ``kafka-keystore``), for ``127.0.0.1``, ``::1``, ``localhost`` and the stack's host.

* ``seaweedfs-ca.pem``/``.key``, ``seaweedfs-node.pem``/``.key``: SeaweedFS's gRPC CA and the
  certificate (server and client auth) each of its components presents to the others
  (``[grpc.*]`` of its ``security.toml``, ops/stack/seaweedfs.py).

Everything is in the stack's secrets directory (0700, each file 0600). EC P-256 keys: a TLS
handshake costs a fraction of an RSA one on this box. A certificate is made again when it is
missing, expires within 30 days, does not name the stack's host, or its CA is new.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from common.settings import kafka_ca_file, stack_secret

CA_KEY = "kafka-ca.key"
BROKER_STORE = "kafka-broker.p12"
KEYSTORE_SECRET = "kafka-keystore"


@dataclass(frozen=True)
class KafkaTls:
    ca_file: Path
    keystore: Path
    keystore_password: str


def _names(host: str) -> list:
    from cryptography import x509

    names: list = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                   x509.IPAddress(ipaddress.ip_address("::1"))]
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        if host != "localhost":
            names.append(x509.DNSName(host))
    else:
        if x509.IPAddress(addr) not in names:
            names.append(x509.IPAddress(addr))
    return names


def _write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)  # a concurrent reader sees the old file or the new, never half


def _ca(ca_file: Path, ca_key_file: Path, common_name: str, now: dt.datetime):
    """The CA in ``ca_file``/``ca_key_file``, made (10 years, EC P-256) when either is missing.
    Returns (certificate, key, made now)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    if ca_file.exists() and ca_key_file.exists():
        return (x509.load_pem_x509_certificate(ca_file.read_bytes()),
                serialization.load_pem_private_key(ca_key_file.read_bytes(), None), False)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    ca_cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(ca_key.public_key())
               .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
               .not_valid_after(now + dt.timedelta(days=3650))
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                            key_encipherment=False, data_encipherment=False, key_agreement=False,
                                            key_cert_sign=True, crl_sign=True, encipher_only=False,
                                            decipher_only=False), critical=True)
               .sign(ca_key, hashes.SHA256()))
    _write_bytes(ca_key_file, ca_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                   serialization.NoEncryption()))
    _write_bytes(ca_file, ca_cert.public_bytes(serialization.Encoding.PEM))
    return ca_cert, ca_key, True


def _still_good(cert, ca_cert, names: list, now: dt.datetime) -> bool:
    """Issued by ``ca_cert``, naming every one of ``names``, valid for 30 more days."""
    from cryptography import x509

    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return False
    return (cert.not_valid_after_utc - now > dt.timedelta(days=30) and all(n in san for n in names)
            and cert.issuer == ca_cert.subject)


def _issue(ca_cert, ca_key, common_name: str, names: list, now: dt.datetime):
    """A new key and a certificate for ``names`` (server and client auth), signed by the CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=825))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    return key, cert


def ensure_kafka_tls(secrets_dir: Path, host: str = "127.0.0.1") -> KafkaTls:
    """The CA and broker certificate in ``secrets_dir``, made or renewed as needed."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.serialization import pkcs12

    now = dt.datetime.now(dt.timezone.utc)
    ca_file, ca_key_file, store = kafka_ca_file(secrets_dir), secrets_dir / CA_KEY, secrets_dir / BROKER_STORE
    password = stack_secret(secrets_dir, KEYSTORE_SECRET)
    ca_cert, ca_key, new_ca = _ca(ca_file, ca_key_file, "Switchyard stack CA", now)
    if new_ca:
        store.unlink(missing_ok=True)  # signed by another CA

    names = _names(host)
    if store.exists():
        try:
            _key, cert, _cas = pkcs12.load_key_and_certificates(store.read_bytes(), password.encode())
            if _still_good(cert, ca_cert, names, now):
                return KafkaTls(ca_file, store, password)
        except ValueError:
            pass  # unreadable: made again below
    key, cert = _issue(ca_cert, ca_key, "switchyard-kafka", names, now)
    _write_bytes(store, pkcs12.serialize_key_and_certificates(
        b"kafka", key, cert, [ca_cert], serialization.BestAvailableEncryption(password.encode())))
    return KafkaTls(ca_file, store, password)


@dataclass(frozen=True)
class GrpcTls:
    """PEM files of SeaweedFS's gRPC mutual TLS: its own CA, and one certificate every component
    presents, as a server and as a client."""

    ca_file: Path
    cert_file: Path
    key_file: Path


def ensure_seaweedfs_tls(secrets_dir: Path, host: str = "127.0.0.1") -> GrpcTls:
    """SeaweedFS's gRPC CA and certificate in ``secrets_dir`` (a CA of its own: a certificate
    from Kafka's would be let in too), made or renewed like Kafka's."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    now = dt.datetime.now(dt.timezone.utc)
    tls = GrpcTls(secrets_dir / "seaweedfs-ca.pem", secrets_dir / "seaweedfs-node.pem",
                  secrets_dir / "seaweedfs-node.key")
    ca_cert, ca_key, new_ca = _ca(tls.ca_file, secrets_dir / "seaweedfs-ca.key", "Switchyard SeaweedFS gRPC CA", now)
    names = _names(host)
    if not new_ca and tls.cert_file.exists() and tls.key_file.exists():
        try:
            if _still_good(x509.load_pem_x509_certificate(tls.cert_file.read_bytes()), ca_cert, names, now):
                return tls
        except ValueError:
            pass  # unreadable: made again below
    key, cert = _issue(ca_cert, ca_key, "switchyard-seaweedfs", names, now)
    _write_bytes(tls.key_file, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                 serialization.NoEncryption()))
    _write_bytes(tls.cert_file, cert.public_bytes(serialization.Encoding.PEM))
    return tls
