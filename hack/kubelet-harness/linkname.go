package main

import (
	_ "unsafe" // go:linkname

	cadvisorapi "github.com/google/cadvisor/info/v1"
	"k8s.io/kubernetes/pkg/kubelet/cm/devicemanager"
	"k8s.io/kubernetes/pkg/kubelet/cm/topologymanager"
)

// newManagerImpl is devicemanager.newManagerImpl, the constructor the package's own tests use to serve
// kubelet.sock in a directory of their choice (manager_test.go: newManagerImpl(socketName, nil,
// topologymanager.NewFakeManager())). The exported NewManagerImpl only calls it with the fixed
// /var/lib/kubelet/device-plugins/kubelet.sock.
//
// A pull linkname is not type-checked against the target: the declaration below must match the pinned
// release's signature. Go 1.23+ restricts such linknames only for the standard library's internals, not
// for other modules. Guards: the harness is built only against the pinned k8s.io/kubernetes (go.mod,
// -mod=readonly); the exported twin below fails to compile if the public constructor's shape changes; and
// start() checks that the manager really serves the socket it was given.
//
//go:linkname newManagerImpl k8s.io/kubernetes/pkg/kubelet/cm/devicemanager.newManagerImpl
func newManagerImpl(socketPath string, topology []cadvisorapi.Node,
	topologyAffinityStore topologymanager.Store) (*devicemanager.ManagerImpl, error)

// The exported constructor is newManagerImpl minus the socket path; if its parameters change, the
// unexported one has most likely changed too, and this line stops the build.
var _ func([]cadvisorapi.Node, topologymanager.Store) (*devicemanager.ManagerImpl, error) = devicemanager.NewManagerImpl
