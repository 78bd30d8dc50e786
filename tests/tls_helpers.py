"""A throwaway PKI for the TLS tests: a CA, a server certificate for 127.0.0.1/localhost, and
client certificates by CN, written as PEM files in a tmp dir (the `cryptography` package)."""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(path: Path, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> None:
    path.with_suffix(".key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.with_suffix(".crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))


@dataclass
class Pki:
    dir: Path
    ca_key: ec.EllipticCurvePrivateKey
    ca_cert: x509.Certificate

    @property
    def ca(self) -> str:
        return str(self.dir / "ca.crt")

    @property
    def server_cert(self) -> str:
        return str(self.dir / "server.crt")

    @property
    def server_key(self) -> str:
        return str(self.dir / "server.key")

    def issue(self, name: str, cn: str, *, server: bool = False) -> tuple[str, str]:
        """A certificate signed by this CA: (cert path, key path)."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(cn))
            .issuer_name(self.ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if server:
            san = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        cert = builder.sign(self.ca_key, hashes.SHA256())
        _write(self.dir / name, key, cert)
        return str(self.dir / f"{name}.crt"), str(self.dir / f"{name}.key")


def make_pki(directory: Path, ca_cn: str = "Lightgate test CA") -> Pki:
    """A CA (`ca.crt`) and a server certificate (`server.crt`, `server.key`) in `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(ca_cn))
        .issuer_name(_name(ca_cn))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )  # fmt: skip
        .sign(key, hashes.SHA256())
    )
    _write(directory / "ca", key, cert)
    pki = Pki(directory, key, cert)
    pki.issue("server", "localhost", server=True)
    return pki
