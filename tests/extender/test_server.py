"""The extender's HTTP verbs over a real socket on 127.0.0.1, on a state fed with the Node and Pod
JSON the API server would send: answers in kube-scheduler's spelling, and bad requests (malformed,
oversized, slow, wrong shape, too early) answered with an HTTP error while the server keeps serving."""

from __future__ import annotations

import asyncio
import http.client
import itertools
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp import web
from kubernetes import client

from gpupool_devcluster.fake_nodes import fake_node_manifest, publication_for_profile
from gpupool_sched.extender.core import Extender, ExtenderConfig
from gpupool_sched.extender.server import bound_port, build_app, serve
from gpupool_sched.kube.kubeapi import KubeApi

MAX_BODY = 64 * 1024
READ_TIMEOUT = 0.5
_uids = itertools.count()


def node(name: str, profile: str = "l40s-pcie") -> dict[str, Any]:
    obj = fake_node_manifest(name, profile, publication_for_profile(profile, name))
    obj["metadata"]["resourceVersion"] = "1"
    return obj


def pod(name: str, *, gpus: int = 0, units: int = 0, node_name: str | None = None, uid: str | None = None,
        model: str | None = None) -> dict[str, Any]:
    limits = {}
    if gpus:
        limits["nvidia.com/gpu"] = str(gpus)
    if units:
        limits["nvidia.com/gpu-memory"] = str(units)
    spec: dict[str, Any] = {"schedulerName": "default-scheduler", "containers": [
        {"name": "main", "resources": {"limits": limits, "requests": {"cpu": "1", "memory": "1Gi", **limits}}}]}
    if node_name:
        spec["nodeName"] = node_name
    if model:
        spec["nodeSelector"] = {"nvidia.com/gpu.product": model}
    return {"metadata": {"name": name, "namespace": "ns", "uid": uid or f"uid-{next(_uids)}",
                         "resourceVersion": "5", "creationTimestamp": "2026-11-30T10:00:00Z"},
            "spec": spec, "status": {"phase": "Running" if node_name else "Pending"}}


@dataclass
class Server:
    extender: Extender
    loop: asyncio.AbstractEventLoop
    port: int
    runner: web.AppRunner

    def request(self, method: str, path: str, body: bytes | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, Any]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            answer = conn.getresponse()
            data = answer.read()
        finally:
            conn.close()
        try:
            return answer.status, json.loads(data)
        except ValueError:
            return answer.status, data.decode()

    def post(self, verb: str, payload: Any) -> tuple[int, Any]:
        return self.request("POST", f"/{verb}", json.dumps(payload).encode(), {"Content-Type": "application/json"})

    def on_loop(self, fn: Any, *args: Any) -> Any:
        async def call() -> Any:
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(call(), self.loop).result(10)


def start_server(synced: bool = True) -> tuple[Server, threading.Thread, asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    ready: dict[str, Any] = {}
    started = threading.Event()

    async def setup() -> None:
        # no API server is reached: filter and prioritize read the state only
        extender = Extender(ExtenderConfig(), KubeApi(client.ApiClient(client.Configuration())))
        for i in range(3):
            extender.on_node("ADDED", node(f"l40s-{i}"))
        extender.on_node("ADDED", node("h100-0", "dgx-h100"))
        # l40s-0: 3 of its 4 GPUs held whole by a running pod
        extender.on_pod("ADDED", pod("busy", gpus=3, node_name="l40s-0"))
        if synced:
            extender.synced.set()
        runner = await serve(build_app(extender, max_body_bytes=MAX_BODY, read_timeout_s=READ_TIMEOUT),
                             "127.0.0.1", 0)
        ready.update(extender=extender, runner=runner, port=bound_port(runner))

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(setup())
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(30)
    return Server(ready["extender"], loop, ready["port"], ready["runner"]), thread, loop


def stop_server(server: Server, thread: threading.Thread) -> None:
    asyncio.run_coroutine_threadsafe(server.runner.cleanup(), server.loop).result(10)
    server.loop.call_soon_threadsafe(server.loop.stop)
    thread.join(10)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    srv, thread, _ = start_server()
    yield srv
    stop_server(srv, thread)


NODES = ["l40s-0", "l40s-1", "l40s-2", "h100-0"]


def test_filter_keeps_feasible_nodes_and_says_why_the_others_fail(server: Server) -> None:
    status, answer = server.post("filter", {"Pod": pod("p", gpus=2), "NodeNames": [*NODES, "ghost"]})
    assert status == 200, answer
    assert answer["NodeNames"] == ["l40s-1", "l40s-2", "h100-0"]
    assert set(answer["FailedNodes"]) == {"l40s-0", "ghost"}
    assert "nvidia.com/gpu" in answer["FailedNodes"]["l40s-0"] or "GPU" in answer["FailedNodes"]["l40s-0"]
    assert "unknown" in answer["FailedNodes"]["ghost"]
    assert answer["FailedAndUnresolvableNodes"] == {}
    assert answer["Error"] == ""


def test_filter_with_full_nodes_answers_nodes(server: Server) -> None:
    items = [node("l40s-0"), node("l40s-1")]
    status, answer = server.post("filter", {"Pod": pod("p", gpus=2), "Nodes": {"items": items}})
    assert status == 200, answer
    assert [n["metadata"]["name"] for n in answer["Nodes"]["items"]] == ["l40s-1"]
    assert "NodeNames" not in answer


def test_filter_of_an_invalid_pod_fails_every_node_with_the_reason(server: Server) -> None:
    bad = pod("p", gpus=1)
    bad["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = "lots"
    bad["spec"]["containers"][0]["resources"]["requests"]["nvidia.com/gpu"] = "lots"
    status, answer = server.post("filter", {"Pod": bad, "NodeNames": NODES})
    assert status == 200, answer
    assert answer["NodeNames"] == []
    failed = answer["FailedNodes"] or answer["FailedAndUnresolvableNodes"]
    assert set(failed) == set(NODES) and all(failed.values())


def test_prioritize_gives_the_cores_pick_ten_and_the_rest_less(server: Server) -> None:
    status, answer = server.post("prioritize", {"Pod": pod("p", units=4), "NodeNames": NODES})
    assert status == 200, answer
    scores = {e["Host"]: e["Score"] for e in answer}
    assert set(scores) == set(NODES)
    assert all(0 <= s <= 10 for s in scores.values())
    assert sorted(scores.values()).count(10) == 1, scores
    status, answer = server.post("prioritize", {"Pod": pod("p", gpus=2), "NodeNames": NODES})
    scores = {e["Host"]: e["Score"] for e in answer}
    assert scores["l40s-0"] == 0  # infeasible: 1 GPU free


def test_preempt_returns_the_victims_as_uids(server: Server) -> None:
    victims = {"l40s-0": {"Pods": [{"UID": "a"}, {"UID": "b"}], "NumPDBViolations": 1}}
    status, answer = server.post("preempt", {"Pod": pod("p", gpus=2), "NodeNameToMetaVictims": victims})
    assert status == 200, answer
    assert answer == {"NodeNameToMetaVictims": victims}
    full = {"l40s-1": {"Pods": [pod("v", uid="v1")], "NumPDBViolations": 0}}
    status, answer = server.post("preempt", {"Pod": pod("p", gpus=2), "NodeNameToVictims": full})
    assert answer == {"NodeNameToMetaVictims": {"l40s-1": {"Pods": [{"UID": "v1"}], "NumPDBViolations": 0}}}


def test_bind_to_a_node_the_pod_no_longer_fits_is_an_error_and_assumes_nothing(server: Server) -> None:
    p = pod("p", gpus=2)
    server.post("filter", {"Pod": p, "NodeNames": NODES})  # caches the pod object
    status, answer = server.post("bind", {"PodName": "p", "PodNamespace": "ns", "PodUID": p["metadata"]["uid"],
                                          "Node": "l40s-0"})
    assert status == 200
    assert "does not fit on l40s-0" in answer["Error"]
    status, answer = server.post("bind", {"PodName": "p", "PodNamespace": "ns", "PodUID": p["metadata"]["uid"],
                                          "Node": "ghost"})
    assert "unknown" in answer["Error"]
    assert server.on_loop(lambda: p["metadata"]["uid"] in server.extender.state.pods) is False


@pytest.mark.parametrize(("verb", "body", "expect"), [
    ("filter", b"{not json", "not JSON"),
    ("filter", b"\xff\xfe", "not JSON"),
    ("filter", b"[1, 2]", "must be a JSON object"),
    ("filter", b'{"NodeNames": ["a"]}', "`Pod`"),
    ("filter", json.dumps({"Pod": {"metadata": {"name": "x"}}, "NodeNames": []}).encode(), "`name` and `uid`"),
    ("prioritize", json.dumps({"Pod": pod("x")}).encode(), "neither `NodeNames`"),
    ("filter", json.dumps({"Pod": pod("x"), "NodeNames": [1]}).encode(), "list of strings"),
    ("bind", b'{"PodName": "p", "PodNamespace": "ns"}', "`PodUID`"),
    ("preempt", json.dumps({"Pod": pod("x"), "NodeNameToMetaVictims": {"n": {"Pods": [{}]}}}).encode(), "no UID"),
])
def test_bad_requests_get_400_with_the_reason(server: Server, verb: str, body: bytes, expect: str) -> None:
    status, answer = server.request("POST", f"/{verb}", body)
    assert status == 400, answer
    assert expect in answer["Error"]


def test_oversized_body_gets_413_declared_or_chunked(server: Server) -> None:
    big = json.dumps({"Pod": pod("x"), "NodeNames": ["n" * 100] * (MAX_BODY // 50)}).encode()
    status, answer = server.request("POST", "/filter", big)
    assert status == 413 and "limit" in answer["Error"]

    def chunks() -> Iterator[bytes]:
        for i in range(0, len(big), 8192):
            yield big[i:i + 8192]

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    conn.request("POST", "/filter", body=chunks(), encode_chunked=True)
    answer = conn.getresponse()
    assert answer.status == 413
    conn.close()
    assert server.request("GET", "/healthz")[0] == 200


def test_slow_client_gets_408_and_others_are_served_meanwhile(server: Server) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as slow:
        slow.sendall(b"POST /filter HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"Pod\":")
        status, _ = server.post("filter", {"Pod": pod("p", gpus=1), "NodeNames": NODES})  # not blocked
        assert status == 200
        began = time.monotonic()
        reply = slow.recv(4096).decode()
        assert reply.startswith("HTTP/1.1 408"), reply
        assert "not received within" in reply
        assert time.monotonic() - began < 5


def test_unknown_paths_and_methods_are_http_errors(server: Server) -> None:
    assert server.request("POST", "/nope", b"{}")[0] == 404
    assert server.request("GET", "/filter")[0] == 405


def test_errors_and_latency_are_in_the_metrics(server: Server) -> None:
    server.request("POST", "/bind", b"{oops")
    status, text = server.request("GET", "/metrics")
    assert status == 200
    assert 'gpupool_extender_request_errors_total{reason="malformed",verb="bind"}' in text
    assert 'gpupool_extender_request_duration_seconds_count{verb="filter"}' in text


def test_requests_before_the_state_is_built_get_503() -> None:
    srv, thread, _ = start_server(synced=False)
    try:
        status, answer = srv.post("filter", {"Pod": pod("p", gpus=1), "NodeNames": NODES})
        assert status == 503 and "not synced" in answer["Error"]
        assert srv.request("GET", "/readyz")[0] == 503
        assert srv.request("GET", "/healthz")[0] == 200
    finally:
        stop_server(srv, thread)


def test_a_bind_cut_off_while_its_binding_is_on_the_wire_keeps_the_gpus_until_read() -> None:
    """kube-scheduler's bind call times out (the extender's --bind-timeout) while the Binding is held
    by a slow API server: the pod keeps its GPUs, marked uncertain, and a read settles it once the
    Binding lands (issue 16 A2). Before, the cancelled bind forgot the pod at once."""
    from gpupool_sched.cache.entries import Phase
    from gpupool_sched.extender.protocol import BindingArgs
    from tests.support.apiserver import PODS, serving

    async def run() -> None:
        async with serving() as (api_server, api):
            extender = Extender(ExtenderConfig(bind_timeout_s=0.3), api)
            extender.synced.set()
            extender.on_node("ADDED", node("n1"))
            obj = api_server.put(PODS, pod("a", gpus=4))
            extender.on_pod("ADDED", obj)
            api_server.hold = asyncio.Event()  # the Binding is on the wire, unanswered
            answer = await extender.bind(BindingArgs("a", "ns", obj["metadata"]["uid"], "n1"))
            assert "no Binding within" in answer["Error"]
            entry = extender.state.pods.get(obj["metadata"]["uid"])
            assert entry is not None and entry.uncertain, "the cut-off bind freed GPUs its Binding may take"
            api_server.hold.set()  # it lands
            for _ in range(100):
                await asyncio.sleep(0.05)
                entry = extender.state.pods.get(obj["metadata"]["uid"])
                if entry is not None and entry.phase is Phase.CONFIRMED:
                    break
            assert entry is not None and entry.phase is Phase.CONFIRMED and not entry.uncertain
            assert api_server.bindings == [("ns/a", "n1")]
            await extender.binder.drain()

    asyncio.run(run())
