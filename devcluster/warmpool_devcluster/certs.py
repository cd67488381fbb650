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
    # kwok keeps the fake nodes' status and leases for every fake node at once: one admin client.
    ClientIdentity("kwok", "warmpool-kwok", ("system:masters",)),
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


def _load_ca(pki_dir: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert = x509.load_pem_x509_certificate((pki_dir / "ca.crt").read_bytes())
    key = serialization.load_pem_private_key((pki_dir / "ca.key").read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{pki_dir / 'ca.key'} is not the EC key this tool writes")
    return cert, key


def _issue(pki_dir: Path, stem: str, subject: x509.Name, usage: x509.ObjectIdentifier,
           sans: list[x509.GeneralName] | None = None) -> None:
    ca_cert, ca_key = _load_ca(pki_dir)
    key = _key()
    _write_key(pki_dir / f"{stem}.key", key)
    _write_cert(pki_dir / f"{stem}.crt", _sign(subject, key.public_key(), ca_cert, ca_key, usage, sans))


def _ips(addresses: tuple[str, ...]) -> list[x509.GeneralName]:
    return [x509.IPAddress(ipaddress.ip_address(address)) for address in addresses]


def generate_pki(pki_dir: Path, serving_ips: tuple[str, ...] = ()) -> None:
    """Write ca.{crt,key}, apiserver.{crt,key}, <identity>.{crt,key} and sa.{key,pub}.

    The CA, the client identities and the service-account key are kept once made, so
    kubeconfigs handed out earlier stay valid; the API server's serving certificate is issued
    at every call for 127.0.0.1 plus ``serving_ips`` (a real node's address, the ``kubernetes``
    Service IP), which may differ from the last start.
    """
    pki_dir.mkdir(parents=True, exist_ok=True)
    ca_cert_path, ca_key_path = pki_dir / "ca.crt", pki_dir / "ca.key"
    if not (ca_cert_path.exists() and ca_key_path.exists() and (pki_dir / "sa.pub").exists()):
        _generate_ca_and_clients(pki_dir)
    sans: list[x509.GeneralName] = [
        *_ips(("127.0.0.1", *serving_ips)),
        x509.DNSName("localhost"),
        x509.DNSName("kubernetes"),
        x509.DNSName("kubernetes.default"),
        x509.DNSName("kubernetes.default.svc"),
        x509.DNSName("kubernetes.default.svc.cluster.local"),
    ]
    _issue(pki_dir, "apiserver", _name("kube-apiserver"), ExtendedKeyUsageOID.SERVER_AUTH, sans)


#: The real node's certificate files (stems under pki/), issued by :func:`issue_node_pki`.
KUBELET_CLIENT = "kubelet-node"
KUBELET_SERVING = "kubelet-serving"
KUBE_PROXY_CLIENT = "kube-proxy"
APISERVER_KUBELET_CLIENT = "apiserver-kubelet-client"


def issue_node_pki(pki_dir: Path, node_name: str, node_ip: str) -> None:
    """The real node's identities, from the cluster's CA:

    * the kubelet's client certificate as ``system:node:<name>`` in ``system:nodes``, so the
      Node authorizer and NodeRestriction hold it to its own Node and its own pods' objects;
    * the kubelet's serving certificate for the node's address (the API server verifies it);
    * kube-proxy's as ``system:kube-proxy`` (bound to ``system:node-proxier`` by default RBAC);
    * the API server's client certificate towards kubelets (logs, exec, port-forward), which the
      kubelet authenticates by the CA and authorizes through a SubjectAccessReview.
    """
    issue_kubelet_pki(pki_dir, node_name, node_ip)
    _issue(pki_dir, KUBE_PROXY_CLIENT, _name("system:kube-proxy"), ExtendedKeyUsageOID.CLIENT_AUTH)
    _issue(pki_dir, APISERVER_KUBELET_CLIENT, _name("kube-apiserver-kubelet-client", ("system:masters",)),
           ExtendedKeyUsageOID.CLIENT_AUTH)


def issue_kubelet_pki(pki_dir: Path, node_name: str, node_ip: str, suffix: str = "") -> tuple[str, str]:
    """One node's kubelet client and serving certificates (``suffix`` tells a further node's files
    apart); their file stems, client first."""
    client, serving = f"{KUBELET_CLIENT}{suffix}", f"{KUBELET_SERVING}{suffix}"
    _issue(pki_dir, client, _name(f"system:node:{node_name}", ("system:nodes",)), ExtendedKeyUsageOID.CLIENT_AUTH)
    _issue(pki_dir, serving, _name(f"system:node:{node_name}", ("system:nodes",)),
           ExtendedKeyUsageOID.SERVER_AUTH, [*_ips((node_ip,)), x509.DNSName(node_name)])
    return client, serving


def _generate_ca_and_clients(pki_dir: Path) -> None:
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
    _write_key(pki_dir / "ca.key", ca_key)
    _write_cert(pki_dir / "ca.crt", ca_cert)
    for identity in IDENTITIES:
        _issue(pki_dir, identity.file_stem, _name(identity.user, identity.groups), ExtendedKeyUsageOID.CLIENT_AUTH)
    # Service-account tokens are signed with RSA (what every client library verifies).
    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    _write_key(pki_dir / "sa.key", sa_key)
    (pki_dir / "sa.pub").write_bytes(
        sa_key.public_key().public_bytes(serialization.Encoding.PEM,
                                         serialization.PublicFormat.SubjectPublicKeyInfo)
    )
