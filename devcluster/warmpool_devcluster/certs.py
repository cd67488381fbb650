"""Real PKI for the local control plane: a CA, serving certs, client certs, SA signing keys.

The chart's RBAC is tested for real, so the API server runs with a client CA and
`--authorization-mode=Node,RBAC`; every component gets its own identity.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_VALIDITY = datetime.timedelta(days=365)


@dataclass(frozen=True)
class ClientIdentity:
    """A client certificate's subject: CN is the user, O entries are the groups."""

    file_stem: str
    user: str
    groups: tuple[str, ...] = ()


#: The identities the control plane needs; admin is in system:masters (cluster-admin).
IDENTITIES = (
    ClientIdentity("admin", "warmpool-admin", ("system:masters",)),
    ClientIdentity("controller-manager", "system:kube-controller-manager"),
    ClientIdentity("scheduler", "system:kube-scheduler"),
    # The local kubelet reconciles pod status on every fake node; as a single process it
    # cannot hold one system:node:<name> identity per node, so it acts as an admin client.
    ClientIdentity("kubelet", "warmpool-kubelet", ("system:masters",)),
)


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                          serialization.NoEncryption())
    )
    path.chmod(0o600)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _name(common_name: str, organizations: tuple[str, ...] = ()) -> x509.Name:
    attributes = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, org) for org in organizations]
    attributes.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
    return x509.Name(attributes)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=5)


def _sign(
    subject: x509.Name,
    public_key: ec.EllipticCurvePublicKey,
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    usage: x509.ObjectIdentifier,
    sans: list[x509.GeneralName] | None = None,
) -> x509.Certificate:
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca_cert.subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now())
        .not_valid_after(_now() + _VALIDITY)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(
            x509.KeyUsage(digital_signature=True, key_encipherment=False, content_commitment=False,
                          data_encipherment=False, key_agreement=False, key_cert_sign=False,
                          crl_sign=False, encipher_only=False, decipher_only=False),
            critical=True,
        )
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(ca_key, hashes.SHA256())


def generate_pki(pki_dir: Path) -> None:
    """Write ca.{crt,key}, apiserver.{crt,key}, <identity>.{crt,key} and sa.{key,pub}.

    Idempotent: an existing CA is kept, so kubeconfigs handed out earlier stay valid.
    """
    pki_dir.mkdir(parents=True, exist_ok=True)
    ca_cert_path, ca_key_path = pki_dir / "ca.crt", pki_dir / "ca.key"
    if ca_cert_path.exists() and ca_key_path.exists() and (pki_dir / "sa.pub").exists():
        return
    ca_key = _key()
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(_name("warmpool-local-ca"))
        .issuer_name(_name("warmpool-local-ca"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now())
        .not_valid_after(_now() + _VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(digital_signature=True, key_encipherment=False, content_commitment=False,
                          data_encipherment=False, key_agreement=False, key_cert_sign=True,
                          crl_sign=True, encipher_only=False, decipher_only=False),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    _write_key(ca_key_path, ca_key)
    _write_cert(ca_cert_path, ca_cert)

    serving_key = _key()
    sans: list[x509.GeneralName] = [
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        x509.DNSName("localhost"),
        x509.DNSName("kubernetes"),
        x509.DNSName("kubernetes.default"),
        x509.DNSName("kubernetes.default.svc"),
        x509.DNSName("kubernetes.default.svc.cluster.local"),
    ]
    serving = _sign(_name("kube-apiserver"), serving_key.public_key(), ca_cert, ca_key,
                    ExtendedKeyUsageOID.SERVER_AUTH, sans)
    _write_key(pki_dir / "apiserver.key", serving_key)
    _write_cert(pki_dir / "apiserver.crt", serving)

    for identity in IDENTITIES:
        key = _key()
        cert = _sign(_name(identity.user, identity.groups), key.public_key(), ca_cert, ca_key,
                     ExtendedKeyUsageOID.CLIENT_AUTH)
        _write_key(pki_dir / f"{identity.file_stem}.key", key)
        _write_cert(pki_dir / f"{identity.file_stem}.crt", cert)

    # Service-account tokens are signed with RSA (what every client library verifies).
    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    _write_key(pki_dir / "sa.key", sa_key)
    (pki_dir / "sa.pub").write_bytes(
        sa_key.public_key().public_bytes(serialization.Encoding.PEM,
                                         serialization.PublicFormat.SubjectPublicKeyInfo)
    )
