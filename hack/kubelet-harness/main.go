// kubelet-harness runs the real kubelet device manager (k8s.io/kubernetes/pkg/kubelet/cm/devicemanager, the
// release pinned in go.mod) on a directory of its own, so that tests can drive gpupool's device plugin
// through the kubelet's own code: registration, capacity, admission (devicesToAllocate ->
// GetPreferredAllocation -> Allocate), the runtime options a container gets, the checkpoint file and a
// kubelet restart (a new manager on the same directory).
//
// Usage: kubelet-harness --dir DIR [--pod-resources SOCKET] [--v N]
//
// It serves DIR/kubelet.sock (and, with --pod-resources, the kubelet's PodResources v1 API), reads one JSON command per line on stdin and answers each with one JSON line
// on stdout ({"ok": true, ...} or {"ok": false, "error": "..."}); klog goes to stderr. Commands:
//
//	{"op":"start","sources_ready":true}       new manager on DIR, Start() (reads the checkpoint)
//	{"op":"capacity"}                         GetCapacity + GetAllocatableDevices + registration counts
//	{"op":"wait","capacity":{"r":n},"registrations":{"r":n},"timeout_s":10}
//	{"op":"admit","pod":{<v1.Pod>}}           Allocate per container as the kubelet's admission does,
//	                                          then GetDeviceRunContainerOptions + GetDevices per container
//	{"op":"remove","uid":"..."}               the pod is deleted: it leaves the pod manager (its devices are
//	                                          freed lazily, at the next allocation or PodResources List)
//	{"op":"checkpoint"}                       the checkpoint file, read and checksum-verified by the kubelet's code
//	{"op":"restart","sources_ready":false}    Stop(), then a new manager on DIR whose containerMap holds the
//	                                          admitted containers as running (a kubelet restart); the
//	                                          PodResources server restarts with it
//	{"op":"sources_ready"}                    the config sources become ready (after a restart)
//	{"op":"stop"} / {"op":"quit"}
//
// The device manager's constructor for a chosen socket path, newManagerImpl, is unexported; the exported
// NewManagerImpl hard-codes /var/lib/kubelet/device-plugins/kubelet.sock. The package's own tests call
// newManagerImpl(socketPath, topology, store); this program reaches the same function with go:linkname
// (see linkname.go and docs/deviceplugin.md for why, and for the guard against a signature change).
package main

import (
	"bufio"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	dto "github.com/prometheus/client_model/go"
	"google.golang.org/grpc"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/component-base/metrics"
	"k8s.io/klog/v2"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
	"k8s.io/kubernetes/pkg/kubelet/checkpointmanager"
	"k8s.io/kubernetes/pkg/kubelet/cm/containermap"
	"k8s.io/kubernetes/pkg/kubelet/cm/devicemanager"
	"k8s.io/kubernetes/pkg/kubelet/cm/devicemanager/checkpoint"
	"k8s.io/kubernetes/pkg/kubelet/cm/topologymanager"
	kubeletmetrics "k8s.io/kubernetes/pkg/kubelet/metrics"
)

// checkpointName is the device manager's checkpoint file in its directory (devicemanager/types.go).
const checkpointName = "kubelet_internal_checkpoint"

// request is one command line; fields are used by the ops that need them.
type request struct {
	Op            string         `json:"op"`
	SourcesReady  *bool          `json:"sources_ready,omitempty"`
	Pod           *v1.Pod        `json:"pod,omitempty"`
	UID           string         `json:"uid,omitempty"`
	Capacity      map[string]int `json:"capacity,omitempty"`
	Registrations map[string]int `json:"registrations,omitempty"`
	Timeout       float64        `json:"timeout_s,omitempty"`
}

type reply map[string]any

// sourcesReady is the kubelet's config.SourcesReady: false right after a restart until the API server
// source has been seen; the harness flips it on command.
type sourcesReady struct{ ready atomic.Bool }

func (s *sourcesReady) AddSource(string) {}
func (s *sourcesReady) AllReady() bool   { return s.ready.Load() }

// harness owns one manager at a time and the kubelet-side state that outlives it (the pod manager).
type harness struct {
	dir          string
	podResources string // PodResources socket; "" serves none
	sources      *sourcesReady
	registry     metrics.KubeRegistry
	prServer     *grpc.Server

	mu      sync.Mutex
	manager *devicemanager.ManagerImpl
	pods    []*v1.Pod          // the pod manager: every pod handed to admit and not removed, in that order
	refused map[types.UID]bool // pods whose admission failed: Failed, so not active (filterOutInactivePods)
}

func newHarness(dir, podResources string) *harness {
	registry := metrics.NewKubeRegistry()
	registry.MustRegister(kubeletmetrics.DevicePluginRegistrationCount, kubeletmetrics.DevicePluginAllocationDuration)
	return &harness{dir: dir, podResources: podResources, registry: registry, refused: map[types.UID]bool{}}
}

func (h *harness) current() *devicemanager.ManagerImpl {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.manager
}

func (h *harness) knownPods() []*v1.Pod {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]*v1.Pod(nil), h.pods...)
}

// activePods is the kubelet's GetActivePods: the pod manager's pods minus those that failed admission.
func (h *harness) activePods() []*v1.Pod {
	h.mu.Lock()
	defer h.mu.Unlock()
	var out []*v1.Pod
	for _, p := range h.pods {
		if !h.refused[p.UID] {
			out = append(out, p)
		}
	}
	return out
}

// addPod is podManager.AddPod: a pod seen again (a re-admission after a restart) is updated in place.
func (h *harness) addPod(pod *v1.Pod) {
	h.mu.Lock()
	defer h.mu.Unlock()
	delete(h.refused, pod.UID)
	for i, p := range h.pods {
		if p.UID == pod.UID {
			h.pods[i] = pod
			return
		}
	}
	h.pods = append(h.pods, pod)
}

func (h *harness) refuse(uid types.UID) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.refused[uid] = true
}

func (h *harness) removePod(uid string) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	delete(h.refused, types.UID(uid))
	for i, p := range h.pods {
		if string(p.UID) == uid {
			h.pods = append(h.pods[:i], h.pods[i+1:]...)
			return true
		}
	}
	return false
}

// start builds a manager on h.dir and starts it. running: containers the runtime reports running, as the
// kubelet passes them after a restart (containerMap + containerRunningSet).
func (h *harness) start(ready bool, running [][2]string) error {
	if h.current() != nil {
		return fmt.Errorf("a manager is already running; stop or restart it")
	}
	socket := filepath.Join(h.dir, filepath.Base(pluginapi.KubeletSocket))
	m, err := newManagerImpl(socket, nil, topologymanager.NewFakeManager())
	if err != nil {
		return err
	}
	containers, runningSet := containermap.NewContainerMap(), sets.New[string]()
	for _, ref := range running {
		id := "harness-" + ref[0] + "-" + ref[1]
		containers.Add(ref[0], ref[1], id)
		runningSet.Insert(id)
	}
	h.sources = &sourcesReady{}
	h.sources.ready.Store(ready)
	if err := m.Start(h.activePods, h.sources, containers, runningSet); err != nil {
		return fmt.Errorf("starting the device manager: %w", err)
	}
	// guard for the linkname: the manager must serve exactly the socket asked for
	if st, err := os.Stat(socket); err != nil || st.Mode()&os.ModeSocket == 0 {
		_ = m.Stop()
		return fmt.Errorf("the device manager did not create %s (newManagerImpl changed?): %v", socket, err)
	}
	h.mu.Lock()
	h.manager = m
	h.mu.Unlock()
	if h.podResources != "" {
		if h.prServer, err = servePodResources(h.podResources, h); err != nil {
			_ = h.stop()
			return fmt.Errorf("serving PodResources on %s: %w", h.podResources, err)
		}
	}
	return nil
}

func (h *harness) stop() error {
	if h.prServer != nil {
		h.prServer.Stop() // closes the listener, which removes the socket
		h.prServer = nil
	}
	h.mu.Lock()
	m := h.manager
	h.manager = nil
	h.mu.Unlock()
	if m == nil {
		return nil
	}
	return m.Stop()
}

func (h *harness) need() error {
	if h.current() == nil {
		return fmt.Errorf("no device manager running; send {\"op\":\"start\"} first")
	}
	return nil
}

func (h *harness) registrations() map[string]int {
	out := map[string]int{}
	families, err := h.registry.Gather()
	if err != nil {
		return out
	}
	for _, f := range families {
		if !strings.HasSuffix(f.GetName(), kubeletmetrics.DevicePluginRegistrationCountKey) {
			continue
		}
		for _, m := range f.GetMetric() {
			out[label(m, "resource_name")] = int(m.GetCounter().GetValue())
		}
	}
	return out
}

func label(m *dto.Metric, name string) string {
	for _, l := range m.GetLabel() {
		if l.GetName() == name {
			return l.GetValue()
		}
	}
	return ""
}

func (h *harness) capacity() reply {
	capacity, allocatable, inactive := h.manager.GetCapacity()
	toInts := func(list v1.ResourceList) map[string]int64 {
		out := map[string]int64{}
		for name, q := range list {
			out[string(name)] = q.Value()
		}
		return out
	}
	devices := map[string][]string{}
	for resource, instances := range h.manager.GetAllocatableDevices() {
		devices[resource] = sortedKeys(instances)
	}
	sort.Strings(inactive)
	return reply{"ok": true, "capacity": toInts(capacity), "allocatable": toInts(allocatable),
		"inactive": inactive, "healthy_devices": devices, "registrations": h.registrations()}
}

func (h *harness) wait(req request) reply {
	timeout := time.Duration(req.Timeout * float64(time.Second))
	if timeout <= 0 {
		timeout = 10 * time.Second
	}
	deadline := time.Now().Add(timeout)
	for {
		got := h.capacity()
		capacity := got["capacity"].(map[string]int64)
		registrations := got["registrations"].(map[string]int)
		var missing []string
		for r, n := range req.Capacity {
			if capacity[r] != int64(n) {
				missing = append(missing, fmt.Sprintf("capacity %s=%d (want %d)", r, capacity[r], n))
			}
		}
		for r, n := range req.Registrations {
			if registrations[r] < n {
				missing = append(missing, fmt.Sprintf("registrations %s=%d (want >= %d)", r, registrations[r], n))
			}
		}
		if len(missing) == 0 {
			return got
		}
		if time.Now().After(deadline) {
			sort.Strings(missing)
			return reply{"ok": false, "error": fmt.Sprintf("not within %s: %s", timeout, strings.Join(missing, ", ")),
				"capacity": capacity, "registrations": registrations}
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// admit is the device part of kubelet admission: the pod becomes active (podManager.AddPod comes first in
// HandlePodAdditions), then the topology manager's admit handler (policy none) calls the device manager's
// Allocate for every init container, then every app container, in spec order, stopping at the first error.
// A rejected pod is no longer active. Then, per container, what the runtime would be given.
func (h *harness) admit(pod *v1.Pod) reply {
	if pod == nil || pod.UID == "" {
		return reply{"ok": false, "error": "admit needs a pod with metadata.uid"}
	}
	h.addPod(pod)
	all := append(append([]v1.Container(nil), pod.Spec.InitContainers...), pod.Spec.Containers...)
	for i := range all {
		if err := h.manager.Allocate(pod, &all[i]); err != nil {
			h.refuse(pod.UID)
			return reply{"ok": false, "error": err.Error(), "container": all[i].Name}
		}
	}
	containers := map[string]any{}
	for i := range all {
		c := &all[i]
		opts, err := h.manager.GetDeviceRunContainerOptions(pod, c)
		if err != nil {
			return reply{"ok": false, "error": err.Error(), "container": c.Name, "stage": "run_options"}
		}
		containers[c.Name] = containerView(h.manager.GetDevices(string(pod.UID), c.Name), opts)
	}
	return reply{"ok": true, "containers": containers}
}

func containerView(devices devicemanager.ResourceDeviceInstances, opts *devicemanager.DeviceRunContainerOptions) reply {
	ids := map[string][]string{}
	for resource, instances := range devices {
		ids[resource] = sortedKeys(instances)
	}
	view := reply{"devices": ids, "envs": map[string]string{}, "mounts": []reply{}, "device_specs": []reply{},
		"annotations": map[string]string{}, "cdi_devices": []string{}}
	if opts == nil {
		return view
	}
	envs := view["envs"].(map[string]string)
	for _, e := range opts.Envs {
		envs[e.Name] = e.Value
	}
	var mounts, specs []reply
	for _, m := range opts.Mounts {
		mounts = append(mounts, reply{"container_path": m.ContainerPath, "host_path": m.HostPath, "read_only": m.ReadOnly})
	}
	for _, d := range opts.Devices {
		specs = append(specs, reply{"container_path": d.PathInContainer, "host_path": d.PathOnHost,
			"permissions": d.Permissions})
	}
	if mounts != nil {
		view["mounts"] = mounts
	}
	if specs != nil {
		view["device_specs"] = specs
	}
	annotations := view["annotations"].(map[string]string)
	for _, a := range opts.Annotations {
		annotations[a.Name] = a.Value
	}
	cdi := []string{}
	for _, d := range opts.CDIDevices {
		cdi = append(cdi, d.Name)
	}
	view["cdi_devices"] = cdi
	return view
}

// readCheckpoint reads the file with the kubelet's checkpoint manager (which verifies its checksum).
func (h *harness) readCheckpoint() reply {
	cm, err := checkpointmanager.NewCheckpointManager(h.dir)
	if err != nil {
		return reply{"ok": false, "error": err.Error()}
	}
	cp := checkpoint.New(make([]checkpoint.PodDevicesEntry, 0), make(map[string][]string))
	if err := cm.GetCheckpoint(checkpointName, cp); err != nil {
		return reply{"ok": false, "error": fmt.Sprintf("reading %s: %v", filepath.Join(h.dir, checkpointName), err)}
	}
	entries, registered := cp.GetData()
	out := make([]reply, 0, len(entries))
	for _, e := range entries {
		var resp pluginapi.ContainerAllocateResponse
		if err := resp.Unmarshal(e.AllocResp); err != nil {
			return reply{"ok": false, "error": fmt.Sprintf("allocation response of %s/%s: %v", e.PodUID, e.ContainerName, err)}
		}
		numa := map[string][]string{}
		for node, ids := range e.DeviceIDs {
			sorted := append([]string(nil), ids...)
			sort.Strings(sorted)
			numa[fmt.Sprint(node)] = sorted
		}
		envs := resp.Envs
		if envs == nil {
			envs = map[string]string{}
		}
		out = append(out, reply{"pod_uid": e.PodUID, "container": e.ContainerName, "resource": e.ResourceName,
			"devices": sets.List(e.DeviceIDs.Devices()), "devices_by_numa": numa, "envs": envs})
	}
	sort.Slice(out, func(i, j int) bool {
		a, b := out[i], out[j]
		return fmt.Sprint(a["pod_uid"], a["container"], a["resource"]) < fmt.Sprint(b["pod_uid"], b["container"], b["resource"])
	})
	for r := range registered {
		sort.Strings(registered[r])
	}
	return reply{"ok": true, "entries": out, "registered_devices": registered}
}

// restart is a kubelet restart: the old manager stops (its registration server and plugin connections go),
// a new one starts on the same directory. The runtime still runs every admitted container.
func (h *harness) restart(ready bool) error {
	if err := h.stop(); err != nil {
		return err
	}
	var running [][2]string
	for _, pod := range h.activePods() {
		for _, c := range append(append([]v1.Container(nil), pod.Spec.InitContainers...), pod.Spec.Containers...) {
			running = append(running, [2]string{string(pod.UID), c.Name})
		}
	}
	return h.start(ready, running)
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

func (h *harness) handle(req request) (reply, bool) {
	ready := func(def bool) bool {
		if req.SourcesReady != nil {
			return *req.SourcesReady
		}
		return def
	}
	okOrErr := func(err error) reply {
		if err != nil {
			return reply{"ok": false, "error": err.Error()}
		}
		return reply{"ok": true}
	}
	switch req.Op {
	case "start":
		return okOrErr(h.start(ready(true), nil)), false
	case "restart":
		return okOrErr(h.restart(ready(false))), false
	case "stop":
		return okOrErr(h.stop()), false
	case "quit":
		return okOrErr(h.stop()), true
	case "checkpoint":
		return h.readCheckpoint(), false
	case "remove":
		return reply{"ok": h.removePod(req.UID)}, false
	}
	if err := h.need(); err != nil {
		return reply{"ok": false, "error": err.Error()}, false
	}
	switch req.Op {
	case "capacity":
		return h.capacity(), false
	case "wait":
		return h.wait(req), false
	case "admit":
		return h.admit(req.Pod), false
	case "sources_ready":
		h.sources.ready.Store(true)
		return reply{"ok": true}, false
	}
	return reply{"ok": false, "error": fmt.Sprintf("unknown op %q", req.Op)}, false
}

func main() {
	dir := flag.String("dir", "", "directory for kubelet.sock and the checkpoint (the kubelet's device-plugins dir)")
	podResources := flag.String("pod-resources", "", "serve the PodResources v1 API on this unix socket")
	klog.InitFlags(nil)
	flag.Parse()
	if *dir == "" {
		fmt.Fprintln(os.Stderr, "kubelet-harness: error: --dir is required")
		os.Exit(2)
	}
	if st, err := os.Stat(*dir); err != nil || !st.IsDir() {
		fmt.Fprintf(os.Stderr, "kubelet-harness: error: --dir %s is not a directory\n", *dir)
		os.Exit(2)
	}
	h := newHarness(*dir, *podResources)
	out := json.NewEncoder(os.Stdout)
	in := bufio.NewScanner(os.Stdin)
	in.Buffer(make([]byte, 1<<20), 16<<20)
	for in.Scan() {
		line := strings.TrimSpace(in.Text())
		if line == "" {
			continue
		}
		var req request
		var resp reply
		quit := false
		if err := json.Unmarshal([]byte(line), &req); err != nil {
			resp = reply{"ok": false, "error": "bad command: " + err.Error()}
		} else {
			resp, quit = h.handle(req)
		}
		resp["op"] = req.Op
		if err := out.Encode(resp); err != nil {
			klog.ErrorS(err, "writing a reply")
			os.Exit(1)
		}
		if quit {
			return
		}
	}
	_ = h.stop()
}
