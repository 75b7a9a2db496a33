"""The committed stubs match proto/, and the gRPC method paths are the kubelet's."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gpupool_deviceplugin.api.podresources.v1 import api_pb2 as pr_pb2
from gpupool_deviceplugin.api.podresources.v1 import api_pb2_grpc as pr_grpc
from gpupool_deviceplugin.api.v1beta1 import api_pb2, api_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "hack" / "gen_proto.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_stubs_match_the_proto() -> None:
    result = subprocess.run([sys.executable, str(ROOT / "hack" / "gen_proto.py"), "--check"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("api", ["v1beta1", "podresources/v1"])
def test_drift_check_detects_a_changed_proto(api: str) -> None:
    gen = _generator()
    fresh = gen.generate()
    assert set(fresh) == {f"{a}/{n}" for a in ("v1beta1", "podresources/v1")
                          for n in ("api_pb2.py", "api_pb2.pyi", "api_pb2_grpc.py")}
    assert gen.check(fresh) == []
    stubs, grpc_stubs = f"{api}/api_pb2.py", f"{api}/api_pb2_grpc.py"
    fresh[stubs] = fresh[stubs].replace("_globals = globals()", "_globals = dict(globals())")
    problems = gen.check(fresh)
    assert len(problems) == 1 and problems[0].startswith(f"{api}/api_pb2.py is out of date")
    # another grpcio-tools patch release only changes the version stamps: not drift
    restamped = {**gen.generate()}
    restamped[grpc_stubs] = re.sub(r"GRPC_GENERATED_VERSION = '[^']*'", "GRPC_GENERATED_VERSION = '1.99.0'",
                                   restamped[grpc_stubs])
    restamped[stubs] = re.sub(r"(_runtime_version\.Domain\.PUBLIC,\n\s*)\d+", r"\g<1>99", restamped[stubs])
    assert gen.check(restamped) == []


def test_service_and_method_names_are_the_kubelets() -> None:
    services = api_pb2.DESCRIPTOR.services_by_name
    assert services["Registration"].full_name == "v1beta1.Registration"
    assert [m.name for m in services["DevicePlugin"].methods] == [
        "GetDevicePluginOptions", "ListAndWatch", "GetPreferredAllocation", "Allocate", "PreStartContainer"]
    source = Path(api_pb2_grpc.__file__).read_text()
    for path in ("/v1beta1.Registration/Register", "/v1beta1.DevicePlugin/Allocate",
                 "/v1beta1.DevicePlugin/ListAndWatch", "/v1beta1.DevicePlugin/GetPreferredAllocation"):
        assert f"'{path}'" in source


def test_field_numbers_match_upstream() -> None:
    fields = {m.name: {f.name: f.number for f in m.fields} for m in api_pb2.DESCRIPTOR.message_types_by_name.values()}
    assert fields["Device"] == {"ID": 1, "health": 2, "topology": 3}
    assert fields["ContainerPreferredAllocationRequest"] == {
        "available_deviceIDs": 1, "must_include_deviceIDs": 2, "allocation_size": 3}
    assert fields["ContainerAllocateResponse"] == {"envs": 1, "mounts": 2, "devices": 3, "annotations": 4,
                                                   "cdi_devices": 5}
    assert fields["RegisterRequest"] == {"version": 1, "endpoint": 2, "resource_name": 3, "options": 4}


def test_pod_resources_names_and_field_numbers_are_the_kubelets() -> None:
    service = pr_pb2.DESCRIPTOR.services_by_name["PodResourcesLister"]
    assert service.full_name == "v1.PodResourcesLister"
    assert [m.name for m in service.methods] == ["List", "GetAllocatableResources", "Get"]
    source = Path(pr_grpc.__file__).read_text()
    for path in ("/v1.PodResourcesLister/List", "/v1.PodResourcesLister/GetAllocatableResources"):
        assert f"'{path}'" in source
    fields = {m.name: {f.name: f.number for f in m.fields} for m in pr_pb2.DESCRIPTOR.message_types_by_name.values()}
    assert fields["PodResources"] == {"name": 1, "namespace": 2, "containers": 3}
    assert fields["ContainerResources"] == {"name": 1, "devices": 2, "cpu_ids": 3, "memory": 4, "dynamic_resources": 5}
    assert fields["ContainerDevices"] == {"resource_name": 1, "device_ids": 2, "topology": 3}
    assert fields["AllocatableResourcesResponse"] == {"devices": 1, "cpu_ids": 2, "memory": 3}
    assert fields["DynamicResource"] == {"claim_name": 2, "claim_namespace": 3, "claim_resources": 4}
