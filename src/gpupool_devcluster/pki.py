"""The dev cluster's credentials, made locally for each cluster: a CA, the apiserver's serving certificate
(valid for 127.0.0.1 and the in-cluster service names), the service-account signing key pair, and one
bearer token per client (admin, kube-scheduler, kube-controller-manager, kwok) for --token-auth-file."""

from __future__ import annotations

import datetime as dt
import ipaddress
import secrets
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CERT_LIFETIME = dt.timedelta(days=365)
SERVING_NAMES = (
    "localhost",
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
)


@dataclass(frozen=True)
class TokenUser:
    """One line of the apiserver's token file: who a bearer token authenticates as."""

    name: str  # also the kubeconfig's file stem
    user: str
    groups: tuple[str, ...]


# The scheduler and controller manager authenticate as the users the bootstrap RBAC policy binds to their
# roles, so they run with the permissions they have in a real cluster; admin and kwok are cluster admins
# (kwok writes the status of every fake node and pod).
TOKEN_USERS = (
    TokenUser("admin", "admin", ("system:masters",)),
    TokenUser("kube-scheduler", "system:kube-scheduler", ()),
    TokenUser("kube-controller-manager", "system:kube-controller-manager", ()),
    TokenUser("kwok", "kwok", ("system:masters",)),
)


@dataclass(frozen=True)
class ClusterPki:
    """Paths of the files written by `ClusterPki.create` into one folder."""

    folder: Path

    @property
    def ca_cert(self) -> Path:
        return self.folder / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.folder / "ca.key"

    @property
    def serving_cert(self) -> Path:
        return self.folder / "apiserver.crt"

    @property
    def serving_key(self) -> Path:
        return self.folder / "apiserver.key"

    @property
    def service_account_key(self) -> Path:
        return self.folder / "sa.key"

    @property
    def service_account_pub(self) -> Path:
        return self.folder / "sa.pub"

    @property
    def token_file(self) -> Path:
        return self.folder / "tokens.csv"

    def tokens(self) -> dict[str, str]:
        """TokenUser.name -> its bearer token, read back from the token file."""
        result: dict[str, str] = {}
        for line in self.token_file.read_text().splitlines():
            token, user = line.split(",")[:2]
            for known in TOKEN_USERS:
                if known.user == user:
                    result[known.name] = token
        return result

    @classmethod
    def create(cls, folder: Path) -> ClusterPki:
        folder.mkdir(parents=True, exist_ok=True)
        folder.chmod(0o700)
        pki = cls(folder)
        now = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)  # tolerate small clock skew

        ca_key = _new_key()
        ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gpupool-dev-cluster-ca")])
        ca_cert = (
            x509.CertificateBuilder()
            .subject_name(ca_name)
            .issuer_name(ca_name)
            .public_key(ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now)
            .not_valid_after(now + CERT_LIFETIME)
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
            .sign(ca_key, hashes.SHA256())
        )

        serving_key = _new_key()
        names: list[x509.GeneralName] = [x509.DNSName(name) for name in SERVING_NAMES]
        names += [
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
            x509.IPAddress(ipaddress.ip_address("10.96.0.1")),
        ]  # first IP of the service range
        serving_cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")]))
            .issuer_name(ca_name)
            .public_key(serving_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now)
            .not_valid_after(now + CERT_LIFETIME)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(ca_key, hashes.SHA256())
        )

        sa_key = _new_key()
        _write_key(pki.ca_key, ca_key)
        _write(pki.ca_cert, ca_cert.public_bytes(serialization.Encoding.PEM))
        _write_key(pki.serving_key, serving_key)
        _write(pki.serving_cert, serving_cert.public_bytes(serialization.Encoding.PEM))
        _write_key(pki.service_account_key, sa_key)
        _write(
            pki.service_account_pub,
            sa_key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            ),
        )
        lines = []
        for user in TOKEN_USERS:
            groups = f',"{",".join(user.groups)}"' if user.groups else ""
            lines.append(f"{secrets.token_urlsafe(32)},{user.user},{user.user}{groups}")
        _write(pki.token_file, ("\n".join(lines) + "\n").encode())
        return pki


def issue_client_cert(pki: ClusterPki, cert: Path, key: Path, *, user: str, groups: tuple[str, ...] = ()) -> None:
    """A client certificate signed by the cluster CA: the apiserver authenticates it as `user` (CN) in
    `groups` (O), as kubeadm does for kubelets (system:node:<name>, system:nodes) and kube-proxy."""
    ca_key = serialization.load_pem_private_key(pki.ca_key.read_bytes(), password=None)
    ca_cert = x509.load_pem_x509_certificate(pki.ca_cert.read_bytes())
    assert isinstance(ca_key, rsa.RSAPrivateKey)
    now = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)
    attributes = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, group) for group in groups]
    attributes.append(x509.NameAttribute(NameOID.COMMON_NAME, user))
    client_key = _new_key()
    certificate = (
        x509.CertificateBuilder()
        .subject_name(x509.Name(attributes))
        .issuer_name(ca_cert.subject)
        .public_key(client_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + CERT_LIFETIME)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    cert.parent.mkdir(parents=True, exist_ok=True)
    _write_key(key, client_key)
    _write(cert, certificate.public_bytes(serialization.Encoding.PEM))


def _new_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def _write_key(path: Path, key: rsa.RSAPrivateKey) -> None:
    _write(
        path,
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()
        ),
    )


def _write(path: Path, data: bytes) -> None:
    path.write_bytes(data)
    path.chmod(0o600)
