package main

import (
	"context"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	"k8s.io/apimachinery/pkg/util/validation"
)

// The node: containerd 2.x and runc, kube-scheduler and a kubelet, all on
// this machine. Its address sits on a bridge the harness creates (the
// kubelet refuses a loopback node IP); the Pods' network is that bridge,
// with no route off the machine and no masquerading.
const (
	// The first node's name; /node/replace registers others.
	firstNodeName = "pinswap-node"
	bridgeName    = "pinswap0"
	// bridgeMAC is locally administered and unicast (the 02 first octet).
	bridgeMAC = "02:70:69:6e:73:77"
	nodeIP    = "10.244.0.1"
	podSubnet = "10.244.0.0/24"
	// The kubernetes Service's ClusterIP (--service-cluster-ip-range):
	// in-cluster clients (pinswap's Pods) connect to it. With no kube-proxy,
	// the harness holds it on the bridge and forwards it to the API server.
	apiClusterIP = "10.96.0.1"
	// The record of what a running node changed on the machine, so that a
	// harness killed before its cleanup is undone by the next one.
	nodeRecord = "/run/pinswap-node.json"
	nodeLock   = "/run/pinswap-node.lock"
)

// Sysctls the kubelet sets (kernel.panic, kernel.panic_on_oops,
// vm.overcommit_memory) and ones CNI plugins may set: saved before the node
// starts and written back after it stops.
var nodeSysctls = []string{
	"kernel.panic", "kernel.panic_on_oops", "vm.overcommit_memory",
	"net.ipv4.ip_forward", "net.ipv4.conf.all.forwarding",
}

// Paths the kubelet uses whatever its root directory is. Removed at
// cleanup when the node created them; when they existed, only what the
// node added inside them goes.
var nodeFixedPaths = []string{
	"/var/lib/kubelet", "/var/log/containers", "/var/log/pods", "/run/containerd",
	"/var/lib/cni", "/usr/libexec/kubernetes", "/etc/cni/net.d", "/opt/cni",
}

type nodeState struct {
	Dir     string            `json:"dir"`
	Sysctls map[string]string `json:"sysctls"`
	// Fixed paths that did not exist before the node started.
	Created []string `json:"created"`
	// Entries of fixed paths that did exist, as they were.
	Existing map[string][]string `json:"existing"`
}

type node struct {
	dir        string
	name       string
	taint      *nodeTaint // registered with the Node (registerWithTaints)
	cp         *controlPlane
	pki        *pki
	bin        string // containerd, its shim, ctr and crictl
	pause      string
	state      nodeState
	lock       *os.File
	sock       string
	certsDir   string
	containerd *child
	scheduler  *child
	kubelet    *child
	forwarders []net.Listener
	mu         sync.Mutex
	exposed    map[string]string
}

// startNode brings the node up and waits until it is Ready. pause is the
// sandbox image's reference (a loopback registry the caller wrote a
// hosts.toml for under certs.d, see certsDirOf).
func startNode(ctx context.Context, dir string, cp *controlPlane, p *pki, bin, pause string) (*node, error) {
	n := &node{dir: filepath.Join(dir, "node"), name: firstNodeName, cp: cp, pki: p, bin: bin, pause: pause, exposed: map[string]string{}}
	n.sock = filepath.Join(n.dir, "containerd", "containerd.sock")
	n.certsDir = filepath.Join(n.dir, "certs.d")
	for _, tool := range []string{"containerd", "containerd-shim-runc-v2", "crictl"} {
		if _, err := os.Stat(filepath.Join(bin, tool)); err != nil {
			return nil, fmt.Errorf("%s is missing from %s: run scripts/build-node.sh", tool, bin)
		}
	}
	for _, tool := range []string{"runc", "ip", "mount"} {
		if _, err := exec.LookPath(tool); err != nil {
			return nil, fmt.Errorf("%s is not installed (apt-get install runc iproute2)", tool)
		}
	}
	if _, err := os.Stat("/usr/lib/cni/bridge"); err != nil {
		return nil, errors.New("/usr/lib/cni/bridge is missing (apt-get install containernetworking-plugins)")
	}
	if os.Geteuid() != 0 {
		return nil, errors.New("the node needs root (mounts, a bridge, sysctls)")
	}
	lock, err := os.OpenFile(nodeLock, os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return nil, err
	}
	// One node per machine: the kubelet's fixed paths would collide.
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		fmt.Fprintln(os.Stderr, "cluster: another node is running on this machine; waiting for it")
		if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX); err != nil {
			lock.Close()
			return nil, err
		}
	}
	n.lock = lock
	if err := undoStaleNode(); err != nil {
		n.release()
		return nil, fmt.Errorf("undoing a previous node: %w", err)
	}
	if err := n.record(); err != nil {
		n.release()
		return nil, err
	}
	if err := n.start(ctx); err != nil {
		n.stop()
		return nil, err
	}
	return n, nil
}

// record saves what the node is about to change, before changing it.
func (n *node) record() error {
	n.state = nodeState{Dir: n.dir, Sysctls: map[string]string{}, Existing: map[string][]string{}}
	for _, key := range nodeSysctls {
		b, err := os.ReadFile(sysctlPath(key))
		if err != nil {
			continue
		}
		n.state.Sysctls[key] = strings.TrimSpace(string(b))
	}
	for _, p := range nodeFixedPaths {
		entries, err := os.ReadDir(p)
		if errors.Is(err, os.ErrNotExist) {
			n.state.Created = append(n.state.Created, p)
			continue
		}
		var names []string
		for _, e := range entries {
			names = append(names, e.Name())
		}
		n.state.Existing[p] = names
	}
	b, _ := json.Marshal(n.state)
	return os.WriteFile(nodeRecord, b, 0o600)
}

func sysctlPath(key string) string {
	return filepath.Join("/proc/sys", strings.ReplaceAll(key, ".", "/"))
}

func (n *node) start(ctx context.Context) error {
	if err := n.bridge(); err != nil {
		return fmt.Errorf("bridge %s: %w", bridgeName, err)
	}
	if _, err := n.forward(apiClusterIP+":443", fmt.Sprintf("127.0.0.1:%d", n.cp.port)); err != nil {
		return fmt.Errorf("the kubernetes Service's address: %w", err)
	}
	schedCert, schedKey, err := n.pki.leaf("scheduler", "system:kube-scheduler", nil, nil, nil, x509.ExtKeyUsageClientAuth)
	if err != nil {
		return err
	}
	if err := n.cp.writeKubeconfig(filepath.Join(n.cp.dir, "scheduler.kubeconfig"), "scheduler", schedCert, schedKey); err != nil {
		return err
	}
	n.scheduler, err = n.cp.spawn("scheduler", []string{
		"--kubeconfig=" + filepath.Join(n.cp.dir, "scheduler.kubeconfig"),
		"--authentication-kubeconfig=" + filepath.Join(n.cp.dir, "scheduler.kubeconfig"),
		"--authorization-kubeconfig=" + filepath.Join(n.cp.dir, "scheduler.kubeconfig"),
		"--leader-elect=false",
		"--secure-port=0",
		"--profiling=false",
	})
	if err != nil {
		return err
	}
	return n.boot(ctx)
}

// boot writes the configs for n.name, starts containerd and the kubelet,
// and waits until the Node is Ready: the part of start that replace runs
// again.
func (n *node) boot(ctx context.Context) error {
	for _, d := range []string{"containerd", "cni/net.d", "cni/ipam", "kubelet", "pod-logs", "certs.d", "volume-plugins"} {
		if err := os.MkdirAll(filepath.Join(n.dir, d), 0o755); err != nil {
			return err
		}
	}
	if err := n.writeConfigs(); err != nil {
		return err
	}
	var err error
	n.containerd, err = n.cp.spawnBinary("containerd", filepath.Join(n.bin, "containerd"),
		[]string{"--config", filepath.Join(n.dir, "containerd", "config.toml")},
		[]string{"PATH=" + n.bin + ":/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"})
	if err != nil {
		return err
	}
	if err := waitFor(ctx, n.containerd, 60*time.Second, "containerd", func() bool {
		c, err := net.Dial("unix", n.sock)
		if err == nil {
			c.Close()
		}
		return err == nil
	}); err != nil {
		return err
	}
	n.kubelet, err = n.cp.spawn("kubelet", []string{
		"--config=" + filepath.Join(n.dir, "kubelet.yaml"),
		"--kubeconfig=" + filepath.Join(n.cp.dir, "kubelet.kubeconfig"),
		"--root-dir=" + filepath.Join(n.dir, "kubelet"),
		"--cert-dir=" + filepath.Join(n.dir, "kubelet", "pki"),
		"--hostname-override=" + n.name,
		"--node-ip=" + nodeIP,
		"--v=2",
	})
	if err != nil {
		return err
	}
	return waitFor(ctx, n.kubelet, 120*time.Second, "the node "+n.name, n.ready)
}

// waitFor polls ok every 100 ms until it holds, c exits or d passes.
func waitFor(ctx context.Context, c *child, d time.Duration, what string, ok func() bool) error {
	deadline := time.Now().Add(d)
	for time.Now().Before(deadline) {
		if ok() {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-c.done:
			return fmt.Errorf("%s exited before it was ready (see %s.log)", c.name, c.name)
		case <-time.After(100 * time.Millisecond):
		}
	}
	return fmt.Errorf("%s not ready after %s (see %s.log)", what, d, c.name)
}

// ready reports whether the Node's Ready condition is True.
func (n *node) ready() bool {
	resp, err := n.cp.client.Get(n.cp.server() + "/api/v1/nodes/" + n.name)
	if err != nil {
		return false
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return false
	}
	var obj struct {
		Status struct {
			Conditions []struct{ Type, Status string }
		}
	}
	if json.NewDecoder(resp.Body).Decode(&obj) != nil {
		return false
	}
	for _, c := range obj.Status.Conditions {
		if c.Type == "Ready" {
			return c.Status == "True"
		}
	}
	return false
}

// bridge creates the node's interface: a bridge with no ports holding the
// node IP, which the CNI bridge plugin then attaches the Pods to.
//
// Its MAC address is set, not left to the kernel: a bridge whose address
// was never set takes the lowest of its ports' and changes it as Pods come
// and go. A Pod's ARP entry for the node IP then names a MAC that no
// longer answers, and the Pod reaches neither the API server nor the
// registries until the entry expires, some 5 to 10 s (pinswap's lease
// lapsed and its admissions timed out so).
func (n *node) bridge() error {
	_ = sh("ip", "link", "del", bridgeName)
	if err := sh("ip", "link", "add", bridgeName, "address", bridgeMAC, "type", "bridge"); err != nil {
		return err
	}
	if err := sh("ip", "addr", "add", nodeIP+"/24", "dev", bridgeName); err != nil {
		return err
	}
	if err := sh("ip", "addr", "add", apiClusterIP+"/32", "dev", bridgeName); err != nil {
		return err
	}
	return sh("ip", "link", "set", bridgeName, "up")
}

func sh(name string, args ...string) error {
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s %s: %v: %s", name, strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}

func (n *node) writeConfigs() error {
	d := n.dir
	// containerd 2.x, config schema v3. Everything it keeps is under d,
	// but for the shims' sockets (/run/containerd/s, fixed in containerd).
	containerd := fmt.Sprintf(`version = 3
root = %[1]q
state = %[2]q
temp = %[3]q
oom_score = 0
disabled_plugins = [
  "io.containerd.nri.v1.nri",
  "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.snapshotter.v1.blockfile",
  "io.containerd.snapshotter.v1.erofs",
  "io.containerd.tracing.processor.v1.otlp",
  "io.containerd.internal.v1.tracing",
]

[grpc]
  address = %[4]q

[ttrpc]
  address = %[5]q

[plugins.'io.containerd.internal.v1.opt']
  path = %[6]q

[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"

[plugins.'io.containerd.cri.v1.runtime']
  # Without CAP_SYS_RESOURCE nothing may lower an oom_score_adj; runc
  # would fail every container.
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["/usr/lib/cni"]
    conf_dir = %[7]q
    max_conf_num = 1
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = "runc"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = %[8]q

[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = %[9]q
  [plugins.'io.containerd.cri.v1.images'.registry]
    config_path = %[10]q
`,
		filepath.Join(d, "containerd", "root"),
		filepath.Join(d, "containerd", "state"),
		filepath.Join(d, "containerd", "tmp"),
		n.sock,
		n.sock+".ttrpc",
		filepath.Join(d, "containerd", "opt"),
		filepath.Join(d, "cni", "net.d"),
		filepath.Join(d, "containerd", "runc"),
		n.pause,
		n.certsDir,
	)
	if err := os.WriteFile(filepath.Join(d, "containerd", "config.toml"), []byte(containerd), 0o600); err != nil {
		return err
	}
	// No default route for Pods and no masquerading: Pods reach the node's
	// addresses (the node IP, the kubernetes Service's) and each other,
	// nothing off the machine. isGateway would turn on IP forwarding; the
	// node IP is on the bridge already.
	cni := fmt.Sprintf(`{
  "cniVersion": "1.0.0",
  "name": "pinswap",
  "plugins": [{
    "type": "bridge",
    "bridge": %q,
    "isGateway": false,
    "ipMasq": false,
    "hairpinMode": true,
    "ipam": {
      "type": "host-local",
      "ranges": [[{"subnet": %q, "rangeStart": "10.244.0.10"}]],
      "routes": [{"dst": "10.96.0.0/16", "gw": %q}],
      "dataDir": %q
    }
  }]
}
`, bridgeName, podSubnet, nodeIP, filepath.Join(d, "cni", "ipam"))
	if err := os.WriteFile(filepath.Join(d, "cni", "net.d", "10-pinswap.conflist"), []byte(cni), 0o600); err != nil {
		return err
	}
	kubeletCert, kubeletKey, err := n.pki.leaf("kubelet-serving", n.name, nil,
		[]string{n.name, "localhost"}, []net.IP{net.ParseIP(nodeIP), net.ParseIP("127.0.0.1")}, x509.ExtKeyUsageServerAuth)
	if err != nil {
		return err
	}
	kubeletPort, err := freePort()
	if err != nil {
		return err
	}
	healthzPort, err := freePort()
	if err != nil {
		return err
	}
	// The settings these machines need (no CAP_SYS_RESOURCE, cgroup v1, no
	// systemd, no iptables chains) and the kubelet's own files under d.
	// Eviction floors are absolute: a percentage of a large shared disk
	// (1% of 250 GB) is crossed while a build fills it, and the
	// disk-pressure taint then keeps every Pod Pending.
	kubelet := fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: %[1]s
port: %[2]d
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: %[3]d
tlsCertFile: %[4]s
tlsPrivateKeyFile: %[5]s
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: false}
  x509: {clientCAFile: %[6]s}
authorization: {mode: AlwaysAllow}
containerRuntimeEndpoint: unix://%[7]s
cgroupDriver: cgroupfs
cgroupsPerQOS: false
enforceNodeAllocatable: []
failCgroupV1: false
failSwapOn: false
oomScoreAdj: 0
makeIPTablesUtilChains: false
protectKernelDefaults: false
podLogsDir: %[8]s
volumePluginDir: %[9]s
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: "1Mi", nodefs.available: "256Mi", imagefs.available: "256Mi", nodefs.inodesFree: "1%%"}
serializeImagePulls: false
maxPods: 110
resolvConf: /etc/resolv.conf
syncFrequency: 5s
fileCheckFrequency: 5s
nodeStatusUpdateFrequency: 5s
shutdownGracePeriod: 0s
registerNode: true
`,
		nodeIP, kubeletPort, healthzPort, kubeletCert, kubeletKey, n.pki.caCert, n.sock,
		filepath.Join(d, "pod-logs"), filepath.Join(d, "volume-plugins"))
	if t := n.taint; t != nil {
		// Validated by parseTaint: no character needs escaping beyond %q's.
		kubelet += fmt.Sprintf("registerWithTaints: [{key: %q, value: %q, effect: %q}]\n", t.key, t.value, t.effect)
	}
	if err := os.WriteFile(filepath.Join(d, "kubelet.yaml"), []byte(kubelet), 0o600); err != nil {
		return err
	}
	nodeCert, nodeKey, err := n.pki.leaf("node", "system:node:"+n.name, []string{"system:nodes"}, nil, nil, x509.ExtKeyUsageClientAuth)
	if err != nil {
		return err
	}
	return n.cp.writeKubeconfig(filepath.Join(n.cp.dir, "kubelet.kubeconfig"), "kubelet", nodeCert, nodeKey)
}

// stop ends the node and undoes what it changed on the machine: the Pods'
// sandboxes and containers, the kubelet, the scheduler and containerd, their
// mounts, the bridge, the sysctls and the kubelet's fixed paths.
func (n *node) stop() {
	// A replace under way finishes (or fails) first: it starts children.
	n.mu.Lock()
	defer n.mu.Unlock()
	defer n.release()
	for _, l := range n.forwarders {
		l.Close()
	}
	n.cp.stop(n.scheduler)
	n.stopRuntime()
	if err := cleanupNode(n.state); err != nil {
		fmt.Fprintf(os.Stderr, "cluster: node cleanup: %v\n", err)
	}
}

// stopRuntime stops the kubelet, removes the Pods' sandboxes and stops
// containerd. The kubelet goes first, or it would start the sandboxes
// again.
func (n *node) stopRuntime() {
	n.cp.stop(n.kubelet)
	n.kubelet = nil
	if n.containerd != nil {
		// Sandboxes first, while containerd runs: the shims and the
		// containers' processes go with them.
		crictl := exec.Command(filepath.Join(n.bin, "crictl"), "--runtime-endpoint", "unix://"+n.sock, "--timeout", "20s", "rmp", "--all", "--force")
		if out, err := crictl.CombinedOutput(); err != nil {
			fmt.Fprintf(os.Stderr, "cluster: removing the node's Pods: %v: %s\n", err, out)
		}
	}
	n.cp.stop(n.containerd)
	n.containerd = nil
}

func (n *node) release() {
	if n.lock != nil {
		_ = syscall.Flock(int(n.lock.Fd()), syscall.LOCK_UN)
		n.lock.Close()
		n.lock = nil
	}
}

// undoStaleNode cleans up after a node whose harness died before its own
// cleanup (the record is removed by a clean stop).
func undoStaleNode() error {
	b, err := os.ReadFile(nodeRecord)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	var st nodeState
	if err := json.Unmarshal(b, &st); err != nil {
		return os.Remove(nodeRecord)
	}
	fmt.Fprintf(os.Stderr, "cluster: undoing what a previous node (%s) left\n", st.Dir)
	killUnder(st.Dir)
	return cleanupNode(st)
}

// killUnder kills the processes whose executable or working directory is
// under dir, and the shims and containers (runc's children) of a node.
func killUnder(dir string) {
	procs, _ := os.ReadDir("/proc")
	for _, p := range procs {
		var pid int
		if _, err := fmt.Sscan(p.Name(), &pid); err != nil || pid == os.Getpid() {
			continue
		}
		cmdline, _ := os.ReadFile(filepath.Join("/proc", p.Name(), "cmdline"))
		if strings.Contains(string(cmdline), dir) {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	}
}

func cleanupNode(st nodeState) error {
	var errs []error
	// Mounts under the node's directory (the kubelet's bind mount of its
	// root, containerd's overlays, shm and netns), deepest first.
	if err := unmountUnder(st.Dir); err != nil {
		errs = append(errs, err)
	}
	for _, p := range nodeFixedPaths {
		if err := unmountUnder(p); err != nil {
			errs = append(errs, err)
		}
	}
	if err := exec.Command("ip", "link", "show", bridgeName).Run(); err == nil {
		if err := sh("ip", "link", "del", bridgeName); err != nil {
			errs = append(errs, err)
		}
	}
	for key, v := range st.Sysctls {
		if err := os.WriteFile(sysctlPath(key), []byte(v), 0o644); err != nil {
			errs = append(errs, fmt.Errorf("sysctl %s=%s: %w", key, v, err))
		}
	}
	for _, p := range st.Created {
		if err := os.RemoveAll(p); err != nil {
			errs = append(errs, err)
		}
	}
	for p, had := range st.Existing {
		keep := map[string]bool{}
		for _, name := range had {
			keep[name] = true
		}
		entries, _ := os.ReadDir(p)
		for _, e := range entries {
			if !keep[e.Name()] {
				if err := os.RemoveAll(filepath.Join(p, e.Name())); err != nil {
					errs = append(errs, err)
				}
			}
		}
	}
	if st.Dir != "" {
		if err := os.RemoveAll(st.Dir); err != nil {
			errs = append(errs, err)
		}
	}
	if len(errs) == 0 {
		_ = os.Remove(nodeRecord)
	}
	return errors.Join(errs...)
}

// unmountUnder detaches every mount point at or under dir, deepest first.
func unmountUnder(dir string) error {
	if dir == "" {
		return nil
	}
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return err
	}
	var points []string
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) < 5 {
			continue
		}
		mp := unescapeMount(f[4])
		if mp == dir || strings.HasPrefix(mp, dir+"/") {
			points = append(points, mp)
		}
	}
	sort.Slice(points, func(i, j int) bool { return len(points[i]) > len(points[j]) })
	var errs []error
	for _, mp := range points {
		if err := syscall.Unmount(mp, syscall.MNT_DETACH); err != nil && !errors.Is(err, syscall.EINVAL) && !errors.Is(err, syscall.ENOENT) {
			errs = append(errs, fmt.Errorf("umount %s: %w", mp, err))
		}
	}
	return errors.Join(errs...)
}

// unescapeMount undoes mountinfo's octal escapes (\040 for a space).
func unescapeMount(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			var v int
			if _, err := fmt.Sscanf(s[i+1:i+4], "%o", &v); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// writeHostsToml lets containerd pull from ref's registry over plain HTTP:
// DIR/HOST:PORT/hosts.toml. Tests write the same for their registries.
func writeHostsToml(certsDir, ref string) error {
	host, _, ok := strings.Cut(ref, "/")
	if !ok {
		return fmt.Errorf("-pause-image %q: expected HOST:PORT/REPOSITORY:TAG", ref)
	}
	if err := os.MkdirAll(filepath.Join(certsDir, host), 0o755); err != nil {
		return err
	}
	text := fmt.Sprintf("server = \"http://%[1]s\"\n\n[host.\"http://%[1]s\"]\n  capabilities = [\"pull\", \"resolve\"]\n", host)
	return os.WriteFile(filepath.Join(certsDir, host, "hosts.toml"), []byte(text), 0o644)
}

// forward listens on addr and relays each connection to upstream, both
// ways, until the node stops: the kubernetes Service's address, and loopback
// registries exposed to the Pods' network (see expose).
func (n *node) forward(addr, upstream string) (string, error) {
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return "", err
	}
	n.forwarders = append(n.forwarders, l)
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				u, err := net.DialTimeout("tcp", upstream, 5*time.Second)
				if err != nil {
					return
				}
				defer u.Close()
				done := make(chan struct{}, 2)
				relay := func(dst, src net.Conn) {
					_, _ = io.Copy(dst, src)
					if tc, ok := dst.(*net.TCPConn); ok {
						_ = tc.CloseWrite()
					}
					done <- struct{}{}
				}
				go relay(u, c)
				go relay(c, u)
				<-done
				<-done
			}()
		}
	}()
	return l.Addr().String(), nil
}

// expose makes a loopback address (a registry) reachable from the Pods'
// network at the node IP, and lets containerd pull from it: the address's
// hosts.toml is written too. Returns the node-IP address.
func (n *node) expose(upstream string) (string, error) {
	host, _, err := net.SplitHostPort(upstream)
	if err != nil {
		return "", err
	}
	if ip := net.ParseIP(host); ip == nil || !ip.IsLoopback() {
		return "", fmt.Errorf("%s: only loopback addresses are exposed", upstream)
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if a, ok := n.exposed[upstream]; ok {
		return a, nil
	}
	addr, err := n.forward(nodeIP+":0", upstream)
	if err != nil {
		return "", err
	}
	if err := writeHostsToml(n.certsDir, addr+"/"); err != nil {
		return "", err
	}
	n.exposed[upstream] = addr
	return addr, nil
}

// nodeTaint is a taint the kubelet registers its Node with.
type nodeTaint struct{ key, value, effect string }

// parseReplace reads /node/replace's body: NAME, or NAME TAINT with TAINT
// key=value:Effect or key:Effect.
func parseReplace(body string) (string, *nodeTaint, error) {
	f := strings.Fields(body)
	if len(f) < 1 || len(f) > 2 {
		return "", nil, errors.New("expected NAME or NAME TAINT (key=value:Effect or key:Effect)")
	}
	if errs := validation.IsDNS1123Subdomain(f[0]); len(errs) > 0 {
		return "", nil, fmt.Errorf("node name %q: %s", f[0], strings.Join(errs, "; "))
	}
	if len(f) == 1 {
		return f[0], nil, nil
	}
	t, err := parseTaint(f[1])
	if err != nil {
		return "", nil, fmt.Errorf("taint %q: %w", f[1], err)
	}
	return f[0], t, nil
}

// parseTaint checks what the API server would, so that a bad taint is a
// 400 here rather than a kubelet that never registers.
func parseTaint(s string) (*nodeTaint, error) {
	kv, effect, ok := strings.Cut(s, ":")
	if !ok {
		return nil, errors.New("expected key=value:Effect or key:Effect")
	}
	switch effect {
	case "NoSchedule", "PreferNoSchedule", "NoExecute":
	default:
		return nil, fmt.Errorf("effect %q: expected NoSchedule, PreferNoSchedule or NoExecute", effect)
	}
	key, value, _ := strings.Cut(kv, "=")
	if errs := validation.IsQualifiedName(key); len(errs) > 0 {
		return nil, fmt.Errorf("key %q: %s", key, strings.Join(errs, "; "))
	}
	if errs := validation.IsValidLabelValue(value); len(errs) > 0 {
		return nil, fmt.Errorf("value %q: %s", value, strings.Join(errs, "; "))
	}
	return &nodeTaint{key: key, value: value, effect: effect}, nil
}

// replace swaps the node for a new one named name, registered with taint
// (nil for none), on the same machine: the old Node's Pods, kubelet and
// containerd go, its Node object is deleted, and the new node starts with
// an empty image store. The bridge, the forwarders (exposed registries),
// certs.d and the scheduler stay. Returns once the new Node is Ready.
func (n *node) replace(ctx context.Context, name string, taint *nodeTaint) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.lock == nil {
		return errors.New("the node has stopped")
	}
	n.stopRuntime()
	// Gone before the new one registers: the scheduler must not bind a
	// Pod to a Node that no kubelet serves.
	if err := n.deleteNode(ctx, n.name); err != nil {
		return err
	}
	kubeletDir := filepath.Join(n.dir, "kubelet")
	var errs []error
	for _, d := range []string{kubeletDir, filepath.Join(n.dir, "containerd")} {
		if err := unmountUnder(d); err != nil {
			errs = append(errs, err)
		}
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}
	// The socket's directory (n.dir/containerd) and certs.d stay: tests
	// hold both paths.
	for _, d := range []string{
		filepath.Join(n.dir, "containerd", "root"), filepath.Join(n.dir, "containerd", "state"),
		filepath.Join(n.dir, "containerd", "tmp"), filepath.Join(n.dir, "containerd", "opt"),
		filepath.Join(n.dir, "containerd", "runc"), kubeletDir, filepath.Join(n.dir, "pod-logs"),
	} {
		if err := os.RemoveAll(d); err != nil {
			return err
		}
	}
	n.name, n.taint = name, taint
	return n.boot(ctx)
}

// deleteNode deletes the Node object and waits until the API server
// answers 404 for it.
func (n *node) deleteNode(ctx context.Context, name string) error {
	url := n.cp.server() + "/api/v1/nodes/" + name
	req, err := http.NewRequestWithContext(ctx, http.MethodDelete, url, nil)
	if err != nil {
		return err
	}
	resp, err := n.cp.client.Do(req)
	if err != nil {
		return fmt.Errorf("deleting node %s: %w", name, err)
	}
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK && resp.StatusCode != http.StatusAccepted && resp.StatusCode != http.StatusNotFound {
		return fmt.Errorf("deleting node %s: %s: %s", name, resp.Status, strings.TrimSpace(string(body)))
	}
	deadline := time.Now().Add(60 * time.Second)
	for time.Now().Before(deadline) {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if err != nil {
			return err
		}
		if resp, err := n.cp.client.Do(req); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusNotFound {
				return nil
			}
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
	return fmt.Errorf("node %s still there 60 s after its deletion", name)
}
