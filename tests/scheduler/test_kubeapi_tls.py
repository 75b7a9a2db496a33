"""The write path's TLS as a kubeconfig asks for it, against a real HTTPS server on 127.0.0.1 that
demands a client certificate (what kubeadm's and kind's admin kubeconfigs use): the server's CA,
the client's certificate and key, verification switched off, and a proxy with its `no_proxy` bypass."""

from __future__ import annotations

import asyncio
import datetime as dt
import socket
import ssl
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID
from kubernetes import client

from gpupool_devcluster.pki import ClusterPki
from gpupool_sched.kube.kubeapi import ApiError, KubeApi

CLIENT_CN = "gpupool-test-client"


def _client_cert(pki: ClusterPki, folder: Path) -> tuple[Path, Path]:
    """A client certificate signed by the cluster CA, as a kubeconfig's client-certificate."""
    ca_key = serialization.load_pem_private_key(pki.ca_key.read_bytes(), password=None)
    ca_cert = x509.load_pem_x509_certificate(pki.ca_cert.read_bytes())
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    now = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, CLIENT_CN)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + dt.timedelta(days=1))
        .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    )
    cert_file, key_file = folder / "client.crt", folder / "client.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_file, key_file


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> tuple[ClusterPki, Path, Path]:
    folder = tmp_path_factory.mktemp("pki")
    pki = ClusterPki.create(folder)
    return (pki, *_client_cert(pki, folder))


async def _serve(pki: ClusterPki, seen: list[str]) -> tuple[web.AppRunner, int]:
    async def handle(request: web.Request) -> web.Response:
        peer = request.transport.get_extra_info("peercert") if request.transport else None
        subject = dict(pair[0] for pair in (peer or {}).get("subject", ()))
        seen.append(str(subject.get("commonName")))
        await request.read()
        return web.json_response({}, status=201)

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(pki.serving_cert, pki.serving_key)
    ctx.load_verify_locations(pki.ca_cert)
    ctx.verify_mode = ssl.CERT_REQUIRED  # no client certificate, no TLS session
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    await web.TCPSite(runner, "127.0.0.1", port, ssl_context=ctx).start()
    return runner, port


def _bind_with(pki: ClusterPki, **settings: Any) -> list[str]:
    """Bind once with a configuration of `settings`; the client CNs the server saw."""
    seen: list[str] = []

    async def run() -> None:
        runner, port = await _serve(pki, seen)
        cfg = client.Configuration(host=f"https://127.0.0.1:{port}")
        for key, value in settings.items():
            setattr(cfg, key, value)
        api = KubeApi(client.ApiClient(cfg))
        try:
            await api.bind("team-a", "p", "uid-1", "node-1", {})
        finally:
            api.close()
            await runner.cleanup()

    asyncio.run(run())
    return seen


def test_the_client_certificate_is_presented_and_the_server_checked_against_the_ca(
    pki: tuple[ClusterPki, Path, Path],
) -> None:
    cluster, cert, key = pki
    assert _bind_with(cluster, ssl_ca_cert=str(cluster.ca_cert), cert_file=str(cert), key_file=str(key)) == [CLIENT_CN]


def test_without_the_client_certificate_the_server_refuses(pki: tuple[ClusterPki, Path, Path]) -> None:
    cluster, _, _ = pki
    with pytest.raises(ApiError) as err:
        _bind_with(cluster, ssl_ca_cert=str(cluster.ca_cert))
    assert err.value.status == 0


def test_a_server_the_ca_did_not_sign_is_refused(pki: tuple[ClusterPki, Path, Path], tmp_path: Path) -> None:
    cluster, cert, key = pki
    other = ClusterPki.create(tmp_path / "other")
    with pytest.raises(ApiError) as err:
        _bind_with(cluster, ssl_ca_cert=str(other.ca_cert), cert_file=str(cert), key_file=str(key))
    assert err.value.status == 0 and "certificate" in err.value.message.lower()


def test_verification_switched_off_still_presents_the_certificate(pki: tuple[ClusterPki, Path, Path]) -> None:
    cluster, cert, key = pki
    assert _bind_with(cluster, verify_ssl=False, cert_file=str(cert), key_file=str(key)) == [CLIENT_CN]


def test_an_unreadable_client_certificate_fails_each_write_with_the_reason(
    pki: tuple[ClusterPki, Path, Path], tmp_path: Path,
) -> None:
    cluster, _, key = pki
    missing = tmp_path / "gone.crt"
    with pytest.raises(ApiError) as err:  # not a hang: the writer thread's set-up failure is the answer
        _bind_with(cluster, ssl_ca_cert=str(cluster.ca_cert), cert_file=str(missing), key_file=str(key))
    assert err.value.status == 0 and "cannot set up the API writer" in err.value.message


def test_writes_go_through_the_proxy_unless_the_host_is_in_no_proxy(pki: tuple[ClusterPki, Path, Path]) -> None:
    cluster, cert, key = pki
    tls = {"ssl_ca_cert": str(cluster.ca_cert), "cert_file": str(cert), "key_file": str(key)}
    with socket.socket() as s:  # a proxy that is not there: a write sent through it fails
        s.bind(("127.0.0.1", 0))
        dead_proxy = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(ApiError) as err:
        _bind_with(cluster, proxy=dead_proxy, no_proxy="", **tls)
    assert err.value.status == 0
    with pytest.raises(ApiError):
        _bind_with(cluster, proxy=dead_proxy, no_proxy="example.com,10.0.0.0", **tls)  # other hosts only
    for bypass in ("127.0.0.1", "localhost,127.0.0.1", "*"):
        assert _bind_with(cluster, proxy=dead_proxy, no_proxy=bypass, **tls) == [CLIENT_CN], bypass
