"""How each process of the dev cluster is started (its command line, every address on 127.0.0.1) and how
we tell that it is ready. The order and bookkeeping live in `cluster.py`."""

from __future__ import annotations

import json
import socket
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from gpupool_devcluster.binaries import ClusterBinaries
from gpupool_devcluster.errors import DevClusterError
from gpupool_devcluster.layout import ClusterLayout, ClusterState
from gpupool_devcluster.process import TrackedProcess

LOOPBACK = "127.0.0.1"
SERVICE_CIDR = "10.96.0.0/16"
# kwok hands out pod IPs from this range; its default /24 runs out after 254 pods
POD_CIDR = "10.128.0.0/12"
FAKE_NODE_SELECTOR = "kwok.x-k8s.io/node=fake"
# Without kube-controller-manager nothing would lift the not-ready taint from new nodes or create service
# accounts, so the admission plugins that wait for them are off (see docs/dev-cluster.md).
DISABLED_ADMISSION = "ServiceAccount,TaintNodesByCondition"
NODE_LEASE_SECONDS = 40  # kubelet's default; only used when kube-controller-manager watches leases


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the OS picks; ports are never hard-coded)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def kwok_stages_file() -> Path:
    return Path(str(resources.files("gpupool_devcluster") / "kwok-stages.yaml"))


def kwok_config_file() -> Path:
    return Path(str(resources.files("gpupool_devcluster") / "kwok-config.yaml"))


# The apiserver's audit log records what service accounts do (level Metadata: who, verb, resource,
# answer; no bodies), so a test can compare the RBAC a chart grants with the calls its identities make.
# Every other user (admin, kwok, the components' own token users) and the kube-system controllers'
# accounts are left out: the log stays small and costs the other tests nothing.
AUDIT_POLICY: dict[str, object] = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived"],
    "rules": [
        {"level": "None", "userGroups": ["system:serviceaccounts:kube-system"]},
        {"level": "Metadata", "userGroups": ["system:serviceaccounts"]},
        {"level": "None"},
    ],
}


def audit_policy_file(layout: ClusterLayout) -> Path:
    return layout.config_file("audit-policy")


def audit_log_file(layout: ClusterLayout) -> Path:
    """JSON lines, one audit event each; absent when the cluster was started without audit."""
    return layout.log_file("kube-apiserver-audit")


def write_audit_policy(layout: ClusterLayout) -> Path:
    path = audit_policy_file(layout)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(AUDIT_POLICY, sort_keys=False))
    return path


def audit_argv(layout: ClusterLayout) -> list[str]:
    return [
        f"--audit-policy-file={audit_policy_file(layout)}",
        f"--audit-log-path={audit_log_file(layout)}",
        "--audit-log-format=json",
        "--audit-log-mode=blocking",  # written before the answer: a test reads it right after the call
        "--audit-log-maxsize=100",  # MB, then rotated once
        "--audit-log-maxbackup=1",
    ]


def etcd_argv(bins: ClusterBinaries, state: ClusterState) -> list[str]:
    peer_url = f"http://{LOOPBACK}:{state.ports['etcd-peer']}"
    return [
        str(bins.etcd),
        "--name=gpupool",
        f"--data-dir={state.etcd_data_dir}",
        f"--listen-client-urls={state.etcd_url}",
        f"--advertise-client-urls={state.etcd_url}",
        f"--listen-peer-urls={peer_url}",
        f"--initial-advertise-peer-urls={peer_url}",
        f"--initial-cluster=gpupool={peer_url}",
        "--initial-cluster-state=new",
        "--unsafe-no-fsync",  # throw-away data in tmpfs: durability buys nothing here
        "--snapshot-count=10000",  # keeps fewer raft entries in memory than 3.5's default 100000
        "--log-level=warn",
    ]


def apiserver_argv(
    bins: ClusterBinaries, layout: ClusterLayout, state: ClusterState, *, audit: bool = False,
    real_nodes: bool = False,
) -> list[str]:
    pki = layout.pki
    argv = [
        str(bins.kube_apiserver),
        f"--etcd-servers={state.etcd_url}",
        f"--bind-address={LOOPBACK}",
        f"--advertise-address={LOOPBACK}",
        f"--secure-port={state.ports['kube-apiserver']}",
        f"--tls-cert-file={pki.serving_cert}",
        f"--tls-private-key-file={pki.serving_key}",
        f"--client-ca-file={pki.ca_cert}",
        f"--token-auth-file={pki.token_file}",
        "--authorization-mode=RBAC",
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
        f"--service-account-key-file={pki.service_account_pub}",
        f"--service-account-signing-key-file={pki.service_account_key}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        "--endpoint-reconciler-type=none",  # no kubelet-reachable endpoint to publish
        f"--disable-admission-plugins={DISABLED_ADMISSION}",
        "--allow-privileged=true",  # the device plugin DaemonSet of the chart asks for it
        "--profiling=false",
        f"--cert-dir={layout.root / 'pki' / 'generated'}",
    ]
    if real_nodes:
        argv = [a for a in argv if not a.startswith(("--authorization-mode=", "--disable-admission-plugins="))]
        argv += real_node_apiserver_args(layout)
    return argv + audit_argv(layout) if audit else argv


def real_node_apiserver_args(layout: ClusterLayout) -> list[str]:
    """What real kubelets need of kube-apiserver: the Node authorizer and NodeRestriction (a kubelet may only
    touch its own Node and pods), ServiceAccount admission (pods get their token volumes), and a client
    certificate for the calls it makes to kubelets (logs, exec), as kubeadm configures it."""
    pki = layout.pki
    return [
        "--authorization-mode=Node,RBAC",
        f"--disable-admission-plugins={DISABLED_ADMISSION.replace('ServiceAccount,', '')}",
        "--enable-admission-plugins=NodeRestriction",
        f"--kubelet-client-certificate={pki.folder / 'apiserver-kubelet-client.crt'}",
        f"--kubelet-client-key={pki.folder / 'apiserver-kubelet-client.key'}",
        "--kubelet-preferred-address-types=InternalIP",
    ]


def kwok_argv(bins: ClusterBinaries, layout: ClusterLayout, state: ClusterState, *, leases: bool) -> list[str]:
    argv = [
        str(bins.kwok),
        f"--kubeconfig={layout.component_kubeconfig('kwok')}",
        f"--config={kwok_config_file()}",
        f"--config={kwok_stages_file()}",
        "--v=WARN",  # one line per patched object at INFO: 10k pods would flood the log
        "--manage-all-nodes=false",
        f"--manage-nodes-with-annotation-selector={FAKE_NODE_SELECTOR}",
        f"--cidr={POD_CIDR}",
        f"--node-ip={LOOPBACK}",
        f"--server-address={LOOPBACK}:{state.ports['kwok']}",
    ]
    if leases:
        argv.append(f"--node-lease-duration-seconds={NODE_LEASE_SECONDS}")
    return argv


# kube-controller-manager as kubeadm runs it: each controller acts as its own ServiceAccount in kube-system
# (--use-service-account-credentials), whose token it gets from the TokenRequest API, so it has exactly the
# rights of its bootstrap role system:controller:<name> (the disruption controller may write
# poddisruptionbudgets/status, the replicaset controller create pods...). Under its own user,
# system:kube-controller-manager, a controller may only read. The higher client rate lets the ~36
# controllers fetch their tokens in about 1 s instead of 4 s at the default 20 requests/s.
CONTROLLER_CLIENT_QPS = 200
CONTROLLER_CLIENT_BURST = 400
# What the dev cluster relies on kube-controller-manager for; `up` waits until its /healthz lists them,
# which it does once every controller has its credentials and has started.
REQUIRED_CONTROLLERS = (
    "disruption-controller",
    "deployment-controller",
    "replicaset-controller",
    "garbage-collector-controller",
    "namespace-controller",
    "serviceaccount-controller",
    "node-lifecycle-controller",
)
CONTROLLERS_STARTED = tuple(f"[+]{name} ok" for name in REQUIRED_CONTROLLERS)  # in /healthz?verbose


def controller_manager_argv(bins: ClusterBinaries, layout: ClusterLayout, state: ClusterState) -> list[str]:
    kubeconfig = layout.component_kubeconfig("kube-controller-manager")
    pki = layout.pki
    return [
        str(bins.kube_controller_manager),
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        f"--bind-address={LOOPBACK}",
        f"--secure-port={state.ports['kube-controller-manager']}",
        f"--cert-dir={layout.root / 'pki' / 'kube-controller-manager'}",
        "--leader-elect=false",
        "--use-service-account-credentials=true",
        f"--kube-api-qps={CONTROLLER_CLIENT_QPS}",
        f"--kube-api-burst={CONTROLLER_CLIENT_BURST}",
        f"--service-account-private-key-file={pki.service_account_key}",
        f"--root-ca-file={pki.ca_cert}",
        f"--cluster-signing-cert-file={pki.ca_cert}",
        f"--cluster-signing-key-file={pki.ca_key}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
    ]


def scheduler_config(
    layout: ClusterLayout, scheduler_name: str, *, extra: dict[str, object] | None = None
) -> dict[str, object]:
    """A KubeSchedulerConfiguration with one profile named `scheduler_name`; `extra` merges on top."""
    document: dict[str, object] = {
        "apiVersion": "kubescheduler.config.k8s.io/v1",
        "kind": "KubeSchedulerConfiguration",
        "clientConnection": {
            "kubeconfig": str(layout.component_kubeconfig("kube-scheduler")),
            "qps": 200,
            "burst": 400,
        },
        "leaderElection": {"leaderElect": False},
        "profiles": [{"schedulerName": scheduler_name}],
    }
    document.update(extra or {})
    return document


def scheduler_argv(
    bins: ClusterBinaries, layout: ClusterLayout, config_file: Path, port: int, cert_dir: Path,
    extra_args: tuple[str, ...] = (),
) -> list[str]:
    kubeconfig = layout.component_kubeconfig("kube-scheduler")
    return [
        str(bins.kube_scheduler),
        f"--config={config_file}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        f"--bind-address={LOOPBACK}",
        f"--secure-port={port}",
        f"--cert-dir={cert_dir}",
        *extra_args,
    ]


def write_scheduler_config(path: Path, document: dict[str, object]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(document, sort_keys=False))


def wait_ready(
    process: TrackedProcess,
    url: str,
    *,
    timeout_s: float,
    ca_file: Path | None = None,
    token: str | None = None,
    insecure: bool = False,
    expect: Sequence[str] = (),
) -> None:
    """Poll `url` until it answers 200 (with every string of `expect` in the body), the process dies,
    or `timeout_s` passes; the last two raise with the tail of the process's log."""
    context: ssl.SSLContext | None = None
    if url.startswith("https"):
        context = ssl.create_default_context(cafile=str(ca_file) if ca_file else None)
        if insecure:  # a component's self-signed serving cert, on loopback
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    deadline = time.monotonic() + timeout_s
    last_error = "no answer"
    while time.monotonic() < deadline:
        if not process.alive():
            raise DevClusterError(
                f"{process.name} exited during start-up; last log lines:\n"
                f"{process.log_tail(8)}\n(full log: {process.log_file})"
            )
        try:
            with urllib.request.urlopen(request, timeout=2, context=context) as answer:
                body = answer.read().decode(errors="replace")
                if all(part in body for part in expect):
                    return
                last_error = f"answered {body[:200]!r}"
        except (urllib.error.URLError, OSError) as exc:
            last_error = str(getattr(exc, "reason", exc))
        time.sleep(0.2)
    raise DevClusterError(
        f"{process.name} not ready after {timeout_s:.0f}s at {url} ({last_error}); see {process.log_file}"
    )


def etcd_call(etcd_url: str, path: str, body: dict[str, object], timeout_s: float = 10.0) -> dict[str, Any]:
    """POST `body` to etcd's v3 JSON gateway (e.g. /v3/kv/range, /v3/kv/compaction); its JSON answer."""
    request = urllib.request.Request(
        f"{etcd_url}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            return dict(json.loads(answer.read()))
    except urllib.error.HTTPError as exc:
        raise DevClusterError(f"etcd {path}: {exc.code} {exc.read().decode(errors='replace')[:300]}") from None


def apiserver_version(server: str, ca_file: Path) -> str:
    """gitVersion reported by the apiserver's /version (readable without credentials)."""
    context = ssl.create_default_context(cafile=str(ca_file))
    with urllib.request.urlopen(f"{server}/version", timeout=5, context=context) as answer:
        return str(json.loads(answer.read())["gitVersion"])
