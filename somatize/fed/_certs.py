"""One identity per party: a study's certificate authority, and a certificate for each
party whose common name is the party's name (an owner's, the hub's). ``somatize fed
cert`` makes them; the hub and the owners load them for mutual TLS.

    ca_dir = make_ca("pki/")                     # pki/ca.pem, pki/ca.key (keep it offline)
    issue("pki/", "hospital-a")                  # pki/hospital-a.pem: its key and certificate
"""

from __future__ import annotations

import datetime
from pathlib import Path

from .._errors import Refused


def _new_key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_ca(directory: str | Path, name: str = "somatize study CA") -> Path:
    """Create ``ca.pem`` and ``ca.key`` in ``directory`` (kept as they are if present)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import NameOID

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    if (d / "ca.pem").exists():
        return d
    key = _new_key()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=3650))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(key, hashes.SHA256()))
    (d / "ca.key").write_bytes(_pem_key(key))
    (d / "ca.key").chmod(0o600)
    (d / "ca.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return d


def issue(directory: str | Path, party: str, days: int = 825) -> Path:
    """``directory/<party>.pem``: a new key and a certificate signed by the study's CA
    (``make_ca``), common name and DNS name ``party``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    d = Path(directory)
    if not (d / "ca.key").exists():
        raise Refused(f"no ca.key in {d}: make the study's CA first (somatize fed ca {d})")
    if not party or "/" in party or party.startswith("."):
        raise Refused(f"party name {party!r}: a plain name, e.g. 'hospital-a'")
    ca_key = serialization.load_pem_private_key((d / "ca.key").read_bytes(), None)
    ca = x509.load_pem_x509_certificate((d / "ca.pem").read_bytes())
    key = _new_key()
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, party)]))
            .issuer_name(ca.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(party)]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    out = d / f"{party}.pem"
    out.write_bytes(_pem_key(key) + cert.public_bytes(serialization.Encoding.PEM))
    out.chmod(0o600)
    return out


def load_identity(path: str | Path) -> tuple[bytes, bytes]:
    """``(private key PEM, certificate PEM)`` of a party's ``.pem`` (made by ``issue``)."""
    data = Path(path).expanduser().read_bytes()
    cut = data.find(b"-----BEGIN CERTIFICATE-----")
    if cut < 0 or b"PRIVATE KEY-----" not in data[:cut]:
        raise Refused(f"{path}: not a party's identity (a private key, then its certificate); "
                      "make one with: somatize fed cert DIR NAME")
    return data[:cut], data[cut:]
