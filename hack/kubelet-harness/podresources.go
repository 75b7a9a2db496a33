package main

import (
	"fmt"
	"net"
	"os"
	"path/filepath"

	"google.golang.org/grpc"
	v1 "k8s.io/api/core/v1"
	podresourcesapi "k8s.io/kubelet/pkg/apis/podresources/v1"
	apisgrpc "k8s.io/kubernetes/pkg/kubelet/apis/grpc"
	"k8s.io/kubernetes/pkg/kubelet/apis/podresources"
	"k8s.io/kubernetes/pkg/kubelet/cm/devicemanager"
)

// The kubelet's PodResources API (pod-resources/kubelet.sock), served by the kubelet's own v1 server
// (pkg/kubelet/apis/podresources) with the kubelet's rate limit, over the harness's pod manager and the
// running device manager. CPUs, memory and DRA resources are not managed here: empty.
type podResourcesProviders struct{ h *harness }

func (p podResourcesProviders) GetPods() []*v1.Pod { return p.h.knownPods() }

func (p podResourcesProviders) GetPodByName(namespace, name string) (*v1.Pod, bool) {
	for _, pod := range p.h.knownPods() {
		if pod.Namespace == namespace && pod.Name == name {
			return pod, true
		}
	}
	return nil, false
}

func (p podResourcesProviders) UpdateAllocatedDevices() {
	if m := p.h.current(); m != nil {
		m.UpdateAllocatedDevices()
	}
}

func (p podResourcesProviders) GetDevices(podUID, containerName string) []*podresourcesapi.ContainerDevices {
	if m := p.h.current(); m != nil {
		return containerDevices(m.GetDevices(podUID, containerName))
	}
	return nil
}

func (p podResourcesProviders) GetAllocatableDevices() []*podresourcesapi.ContainerDevices {
	if m := p.h.current(); m != nil {
		return containerDevices(m.GetAllocatableDevices())
	}
	return nil
}

func (podResourcesProviders) GetCPUs(string, string) []int64 { return nil }
func (podResourcesProviders) GetAllocatableCPUs() []int64    { return nil }
func (podResourcesProviders) GetMemory(string, string) []*podresourcesapi.ContainerMemory {
	return nil
}
func (podResourcesProviders) GetAllocatableMemory() []*podresourcesapi.ContainerMemory { return nil }
func (podResourcesProviders) GetDynamicResources(*v1.Pod, *v1.Container) []*podresourcesapi.DynamicResource {
	return nil
}

// containerDevices is the container manager's containerDevicesFromResourceDeviceInstances (unexported in
// pkg/kubelet/cm/container_manager.go): one entry per device and NUMA node, none without topology.
func containerDevices(devs devicemanager.ResourceDeviceInstances) []*podresourcesapi.ContainerDevices {
	var out []*podresourcesapi.ContainerDevices
	for resource, instances := range devs {
		for id, dev := range instances {
			topo := dev.GetTopology()
			if topo == nil {
				out = append(out, &podresourcesapi.ContainerDevices{ResourceName: resource, DeviceIds: []string{id}})
				continue
			}
			for _, node := range topo.GetNodes() {
				out = append(out, &podresourcesapi.ContainerDevices{ResourceName: resource, DeviceIds: []string{id},
					Topology: &podresourcesapi.TopologyInfo{Nodes: []*podresourcesapi.NUMANode{{ID: node.GetID()}}}})
			}
		}
	}
	return out
}

// servePodResources listens on socket (a stale file is replaced, as the kubelet's util.CreateListener does).
func servePodResources(socket string, h *harness) (*grpc.Server, error) {
	if err := os.MkdirAll(filepath.Dir(socket), 0o750); err != nil {
		return nil, err
	}
	if err := os.Remove(socket); err != nil && !os.IsNotExist(err) {
		return nil, fmt.Errorf("removing stale %s: %w", socket, err)
	}
	ln, err := net.Listen("unix", socket)
	if err != nil {
		return nil, err
	}
	providers := podResourcesProviders{h}
	server := grpc.NewServer(apisgrpc.WithRateLimiter("podresources", podresources.DefaultQPS,
		podresources.DefaultBurstTokens))
	podresourcesapi.RegisterPodResourcesListerServer(server, podresources.NewV1PodResourcesServer(
		podresources.PodResourcesProviders{Pods: providers, Devices: providers, Cpus: providers, Memory: providers,
			DynamicResources: providers}))
	go func() { _ = server.Serve(ln) }()
	return server, nil
}
