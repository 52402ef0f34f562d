"""The gateway's own certificate authority, and the certificate its embedded broker shows.

Beyond loopback the embedded broker speaks TLS (`coordinator serve`'s secure default): a
device's connect proof and every model would otherwise cross the LAN in clear, readable by
anyone on it. No public CA can vouch for a gateway at 192.168.1.10, so the gateway is its
own: a CA made once in its state folder (`tls/ca.pem`, its key `tls/ca.key` readable by the
gateway's user only), whose certificate each device's bundle carries (`coordinator admit`).
The broker's certificate is issued from it afresh at every start, naming the gateway's
addresses and names as they are then: a gateway whose DHCP address changed shows a new
certificate that the devices still trust, since they trust the CA, not one certificate.
"""

from __future__ import annotations

import datetime
import ipaddress
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import psutil
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from coordinator.broker_config import write_file

TLS_DIR = "tls"
CA_CERT, CA_KEY, BROKER_CERT, BROKER_KEY = "ca.pem", "ca.key", "broker.pem", "broker.key"
CA_DAYS, BROKER_DAYS = 3650, 825
"""The CA outlives any device; a broker certificate lasts what browsers accept (and is
issued again at every start anyway)."""


@dataclass(frozen=True)
class BrokerCertificate:
    """The files the broker's TLS listener serves (`cert`, `key`) and the CA that devices
    check it against (`ca`)."""

    ca: Path
    cert: Path
    key: Path


def ca_certificate(folder: Path) -> Path:
    """The gateway CA's certificate in the state `folder`, made with its key on first use."""
    home = folder / TLS_DIR
    cert_path, key_path = home / CA_CERT, home / CA_KEY
    if cert_path.is_file() and key_path.is_file():
        return cert_path
    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name(
        [x509.NameAttribute(NameOID.COMMON_NAME, f"edgefl gateway CA {socket.gethostname()}")]
    )
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_usage(cert_sign=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    write_file(key_path, _private_pem(key), 0o600)
    write_file(cert_path, cert.public_bytes(serialization.Encoding.PEM).decode(), 0o644)
    return cert_path


def broker_certificate(folder: Path, names: Iterable[str]) -> BrokerCertificate:
    """A certificate for the broker, issued now by the gateway CA (made if missing) for
    `names` (host names and IP addresses); its key is made once and kept."""
    ca_path = ca_certificate(folder)
    home = folder / TLS_DIR
    ca_cert = x509.load_pem_x509_certificate(ca_path.read_bytes())
    ca_key = serialization.load_pem_private_key((home / CA_KEY).read_bytes(), password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key_path = home / BROKER_KEY
    if key_path.is_file():
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        assert isinstance(key, ec.EllipticCurvePrivateKey)
    else:
        key = ec.generate_private_key(ec.SECP256R1())
        write_file(key_path, _private_pem(key), 0o600)
    now = datetime.datetime.now(datetime.timezone.utc)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, socket.gethostname())])
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=BROKER_DAYS))
        .add_extension(x509.SubjectAlternativeName(_alt_names(names)), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_usage(cert_sign=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    cert_path = home / BROKER_CERT
    write_file(cert_path, cert.public_bytes(serialization.Encoding.PEM).decode(), 0o644)
    return BrokerCertificate(ca_path, cert_path, key_path)


def gateway_names(*given: str) -> list[str]:
    """What devices may call the gateway: the addresses given (its --host, --mdns), every
    address of its interfaces, its host name (and `.local`, as mDNS answers it) and
    localhost."""
    host = socket.gethostname()
    names = [*given, host, f"{host}.local", "localhost"]
    for addresses in psutil.net_if_addrs().values():
        names += [
            a.address.split("%")[0]
            for a in addresses
            if a.family in (socket.AF_INET, socket.AF_INET6)
        ]
    wildcard = {"", "0.0.0.0", "::"}
    return list(dict.fromkeys(name for name in names if name not in wildcard))


def _alt_names(names: Iterable[str]) -> list[x509.GeneralName]:
    entries: list[x509.GeneralName] = []
    for name in names:
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return entries


def _usage(cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=not cert_sign,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )


def _private_pem(key: ec.EllipticCurvePrivateKey) -> str:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()
