"""Certificates made at test time: a CA, a server certificate for localhost / 127.0.0.1 and a
client certificate, signed by that CA, plus an unrelated CA to play the impostor."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_Issuer = tuple[ec.EllipticCurvePrivateKey, x509.Certificate]


@dataclass(frozen=True)
class Pair:
    cert: str  # PEM path
    key: str  # PEM path


@dataclass(frozen=True)
class Certs:
    ca: str  # PEM path of the CA that signs server and client
    server: Pair
    client: Pair
    other_ca: str  # an unrelated CA: it signs only other_client
    other_client: Pair  # a client certificate signed by other_ca


def make_certs(folder: Path) -> Certs:
    ca = _ca("flowgrpo test CA")
    other = _ca("impostor CA")
    server_sans = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    return Certs(
        ca=_write(folder / "ca.pem", ca[1]),
        server=_leaf(folder, "server", ca, server_sans, ExtendedKeyUsageOID.SERVER_AUTH),
        client=_leaf(folder, "client", ca, [], ExtendedKeyUsageOID.CLIENT_AUTH),
        other_ca=_write(folder / "other-ca.pem", other[1]),
        other_client=_leaf(folder, "other-client", other, [], ExtendedKeyUsageOID.CLIENT_AUTH),
    )


def _ca(name: str) -> _Issuer:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = (
        _builder(subject, subject, key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _leaf(
    folder: Path, name: str, ca: _Issuer, sans: list[x509.GeneralName], usage: x509.ObjectIdentifier
) -> Pair:
    ca_key, ca_cert = ca
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    builder = _builder(subject, ca_cert.subject, key.public_key()).add_extension(
        x509.ExtendedKeyUsage([usage]), critical=False
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    key_path = folder / f"{name}.key"
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return Pair(cert=_write(folder / f"{name}.pem", cert), key=str(key_path))


def _builder(
    subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )


def _write(path: Path, cert: x509.Certificate) -> str:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(path)
