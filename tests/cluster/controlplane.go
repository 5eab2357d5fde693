package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"syscall"
	"time"
)

// auditPolicy records every request's metadata, so the suite can read back
// what pinswap asked of the API server and what it was answered (a 403 from
// a permission the install lacks, the resourceVersion a watch resumed from).
//
// The control plane's own requests (mostly Lease renewals) are left out:
// they are most of the volume, and tests poll this log. Pod creates are
// kept whoever makes them (ReplicaSets' Pods included): the node suite
// reads which admissions failed open from the mutating webhook's
// failed-open annotation on them.
const auditPolicy = `apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
- level: Metadata
  verbs: [create]
  resources: [{group: "", resources: [pods]}]
- level: None
  users: ["system:apiserver", "system:kube-controller-manager", "system:kube-scheduler"]
- level: None
  userGroups: ["system:serviceaccounts:kube-system"]
- level: Metadata
`

// controlPlane runs kube-apiserver and kube-controller-manager as child
// processes of this binary.
type controlPlane struct {
	dir             string
	writes          string // etcd's and the audit log's (writesDir)
	pki             *pki
	etcdURL         string
	port            int
	adminKubeconfig string
	kcmKubeconfig   string
	client          *http.Client

	mu        sync.Mutex
	apiserver *child
	kcm       *child
	failed    chan error
}

type child struct {
	name string
	cmd  *exec.Cmd
	done chan struct{}
	// stopping is set before a deliberate stop, so its exit is not a failure.
	stopping bool
}

func newControlPlane(dir, writes string, p *pki, etcdURL string) (*controlPlane, error) {
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	cp := &controlPlane{
		dir:             dir,
		writes:          writes,
		pki:             p,
		etcdURL:         etcdURL,
		port:            port,
		adminKubeconfig: filepath.Join(dir, "admin.kubeconfig"),
		kcmKubeconfig:   filepath.Join(dir, "controller-manager.kubeconfig"),
		failed:          make(chan error, 8),
	}
	if err := os.WriteFile(filepath.Join(dir, "audit-policy.yaml"), []byte(auditPolicy), 0o600); err != nil {
		return nil, err
	}
	if err := cp.writeKubeconfig(cp.adminKubeconfig, "admin", p.adminCert, p.adminKey); err != nil {
		return nil, err
	}
	if err := cp.writeKubeconfig(cp.kcmKubeconfig, "controller-manager", p.kcmCert, p.kcmKey); err != nil {
		return nil, err
	}
	cert, err := tls.LoadX509KeyPair(p.adminCert, p.adminKey)
	if err != nil {
		return nil, err
	}
	roots := x509.NewCertPool()
	roots.AddCert(p.ca)
	cp.client = &http.Client{
		Timeout: 5 * time.Second,
		Transport: &http.Transport{TLSClientConfig: &tls.Config{
			RootCAs:      roots,
			Certificates: []tls.Certificate{cert},
		}},
	}
	return cp, nil
}

func (cp *controlPlane) server() string { return fmt.Sprintf("https://127.0.0.1:%d", cp.port) }

// writeKubeconfig writes a kubeconfig with the certificates inline, so it
// stays valid wherever it is copied to.
func (cp *controlPlane) writeKubeconfig(path, user, certFile, keyFile string) error {
	ca, err := os.ReadFile(cp.pki.caCert)
	if err != nil {
		return err
	}
	cert, err := os.ReadFile(certFile)
	if err != nil {
		return err
	}
	key, err := os.ReadFile(keyFile)
	if err != nil {
		return err
	}
	b64 := base64.StdEncoding.EncodeToString
	text := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: pinswap-cluster
  cluster:
    server: %s
    certificate-authority-data: %s
users:
- name: %s
  user:
    client-certificate-data: %s
    client-key-data: %s
contexts:
- name: pinswap-cluster
  context: {cluster: pinswap-cluster, user: %s, namespace: default}
current-context: pinswap-cluster
`, cp.server(), b64(ca), user, b64(cert), b64(key), user)
	return os.WriteFile(path, []byte(text), 0o600)
}

func (cp *controlPlane) apiserverArgs() []string {
	p := cp.pki
	return []string{
		"--etcd-servers=" + cp.etcdURL,
		"--bind-address=127.0.0.1",
		"--advertise-address=127.0.0.1",
		fmt.Sprintf("--secure-port=%d", cp.port),
		"--tls-cert-file=" + p.servCert,
		"--tls-private-key-file=" + p.servKey,
		"--client-ca-file=" + p.caCert,
		"--service-account-issuer=https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file=" + p.saPub,
		"--service-account-signing-key-file=" + p.saKey,
		"--authorization-mode=Node,RBAC",
		"--service-cluster-ip-range=10.96.0.0/16",
		"--allow-privileged=true",
		// The kubernetes Service's Endpoints may not hold a loopback address.
		"--endpoint-reconciler-type=none",
		"--audit-policy-file=" + filepath.Join(cp.dir, "audit-policy.yaml"),
		"--audit-log-path=" + filepath.Join(cp.writes, "audit.log"),
		"--audit-log-mode=blocking",
		"--profiling=false",
		// A webhook's Service is reached at its endpoints' addresses: the
		// harness runs no kube-proxy, so no ClusterIP answers.
		"--enable-aggregator-routing=true",
		// The API server reaches the node's kubelet (logs, exec) at its
		// InternalIP with a client certificate the kubelet checks.
		"--kubelet-preferred-address-types=InternalIP,Hostname",
		"--kubelet-client-certificate=" + p.kubeletClientCert,
		"--kubelet-client-key=" + p.kubeletClientKey,
	}
}

func (cp *controlPlane) controllerManagerArgs() []string {
	p := cp.pki
	return []string{
		"--kubeconfig=" + cp.kcmKubeconfig,
		"--authentication-kubeconfig=" + cp.kcmKubeconfig,
		"--authorization-kubeconfig=" + cp.kcmKubeconfig,
		// No serving endpoint: two suites on one machine would share 10257.
		"--secure-port=0",
		"--leader-elect=false",
		"--use-service-account-credentials=true",
		"--service-account-private-key-file=" + p.saKey,
		"--root-ca-file=" + p.caCert,
		"--controllers=*",
		"--profiling=false",
	}
}

func (cp *controlPlane) spawn(name string, args []string) (*child, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	return cp.spawnBinary(name, self, append([]string{name}, args...), nil)
}

// spawnBinary starts bin with args as a child logging to DIR/NAME.log;
// env, when given, is added to this process's environment.
func (cp *controlPlane) spawnBinary(name, bin string, args, env []string) (*child, error) {
	log, err := os.OpenFile(filepath.Join(cp.dir, name+".log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(bin, args...)
	if env != nil {
		cmd.Env = append(os.Environ(), env...)
	}
	cmd.Stdout, cmd.Stderr = log, log
	// A child dies with the supervisor, even on SIGKILL.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		log.Close()
		return nil, err
	}
	c := &child{name: name, cmd: cmd, done: make(chan struct{})}
	go func() {
		err := cmd.Wait()
		log.Close()
		cp.mu.Lock()
		stopping := c.stopping
		cp.mu.Unlock()
		close(c.done)
		if !stopping {
			cp.failed <- fmt.Errorf("%s exited: %v (see %s)", name, err, filepath.Join(cp.dir, name+".log"))
		}
	}()
	return c, nil
}

func (cp *controlPlane) startAPIServer(ctx context.Context) error {
	cp.mu.Lock()
	running := cp.apiserver != nil
	cp.mu.Unlock()
	if running {
		return fmt.Errorf("kube-apiserver is already running")
	}
	c, err := cp.spawn("apiserver", cp.apiserverArgs())
	if err != nil {
		return err
	}
	cp.mu.Lock()
	cp.apiserver = c
	cp.mu.Unlock()
	return cp.waitReady(ctx, c)
}

func (cp *controlPlane) startControllerManager() error {
	c, err := cp.spawn("controller-manager", cp.controllerManagerArgs())
	if err != nil {
		return err
	}
	cp.mu.Lock()
	cp.kcm = c
	cp.mu.Unlock()
	return nil
}

// waitReady polls /readyz until it answers 200, the child exits or two
// minutes pass.
func (cp *controlPlane) waitReady(ctx context.Context, c *child) error {
	deadline := time.Now().Add(2 * time.Minute)
	for time.Now().Before(deadline) {
		resp, err := cp.client.Get(cp.server() + "/readyz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-c.done:
			return fmt.Errorf("kube-apiserver exited before it was ready (see %s)", filepath.Join(cp.dir, "apiserver.log"))
		case <-time.After(200 * time.Millisecond):
		}
	}
	return fmt.Errorf("kube-apiserver not ready after 2 minutes (see %s)", filepath.Join(cp.dir, "apiserver.log"))
}

func (cp *controlPlane) version(ctx context.Context) (string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, cp.server()+"/version", nil)
	if err != nil {
		return "", err
	}
	resp, err := cp.client.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	var v struct {
		GitVersion string `json:"gitVersion"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&v); err != nil {
		return "", fmt.Errorf("/version: %w", err)
	}
	return v.GitVersion, nil
}

// stop ends a child with SIGTERM, then SIGKILL after 20 s.
func (cp *controlPlane) stop(c *child) {
	if c == nil {
		return
	}
	cp.mu.Lock()
	c.stopping = true
	cp.mu.Unlock()
	_ = c.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-c.done:
	case <-time.After(20 * time.Second):
		_ = c.cmd.Process.Kill()
		<-c.done
	}
}

func (cp *controlPlane) stopAPIServer() {
	cp.mu.Lock()
	c := cp.apiserver
	cp.apiserver = nil
	cp.mu.Unlock()
	cp.stop(c)
}

func (cp *controlPlane) restartAPIServer(ctx context.Context) error {
	cp.stopAPIServer()
	return cp.startAPIServer(ctx)
}

func (cp *controlPlane) stopAll() {
	cp.mu.Lock()
	kcm := cp.kcm
	cp.mu.Unlock()
	cp.stop(kcm)
	cp.stopAPIServer()
}
