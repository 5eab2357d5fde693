// Command cluster runs a Kubernetes control plane on loopback for pinswap's
// cluster suite: embedded etcd, kube-apiserver and kube-controller-manager,
// each built from the published Kubernetes modules (see go.mod for the
// release).
//
//	cluster [-dir DIR] [-node -node-bin DIR -pause-image REF]
//
// The supervisor keeps etcd in its own process and runs the API server and
// the controller manager as children (this binary again, with the
// subcommands "apiserver" and "controller-manager"), so the API server can
// be restarted under running clients. When ready it prints
//
//	kube-apiserver vX.Y.Z
//	kubeconfig DIR/admin.kubeconfig
//	control http://127.0.0.1:PORT
//	ca DIR/pki/ca.crt
//	sidecar https://127.0.0.1:PORT/inject
//	dir DIR
//
// (the last is where the logs and the audit log are; sidecar is a second
// mutating webhook, see sidecar.go).
//
// With -node it also runs kube-scheduler and a node (node.go): containerd
// from -node-bin (scripts/build-node.sh), runc and a kubelet (this binary
// again, "scheduler" and "kubelet"), and waits until the node is Ready. It
// then prints, before "dir",
//
//	node NAME
//	node-ip IP
//	containerd unix://SOCKET
//	certs.d DIR
//
// certs.d is containerd's registry host directory: a registry's
// DIR/HOST:PORT/hosts.toml is read at each pull. The pause image's registry
// gets one at start.
// The control address answers POST /compact (compact etcd at its current
// revision), POST /apiserver/restart, POST /apiserver/stop,
// POST /apiserver/start and GET /revision; with -node also
// POST /node/expose (body HOST:PORT, a loopback registry; answers its
// address at the node IP) and POST /node/replace (body NAME or NAME TAINT,
// TAINT key=value:Effect or key:Effect): the node's Pods, kubelet,
// containerd, Node object and image store go, and a new kubelet registers
// the node NAME, tainted with TAINT; answers NAME once it is Ready. On
// SIGTERM or SIGINT everything stops and DIR is removed (unless -keep).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"

	kubeapiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	kcm "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
	kubelet "k8s.io/kubernetes/cmd/kubelet/app"

	"k8s.io/component-base/cli"
	"k8s.io/component-base/version"
)

func main() {
	if len(os.Args) > 1 {
		switch os.Args[1] {
		case "apiserver":
			cmd := kubeapiserver.NewAPIServerCommand()
			cmd.SetArgs(os.Args[2:])
			os.Exit(cli.Run(cmd))
		case "controller-manager":
			cmd := kcm.NewControllerManagerCommand()
			cmd.SetArgs(os.Args[2:])
			os.Exit(cli.Run(cmd))
		case "scheduler":
			cmd := scheduler.NewSchedulerCommand()
			cmd.SetArgs(os.Args[2:])
			os.Exit(cli.Run(cmd))
		case "kubelet":
			cmd := kubelet.NewKubeletCommand(context.Background())
			cmd.SetArgs(os.Args[2:])
			os.Exit(cli.Run(cmd))
		}
	}
	dir := flag.String("dir", "", "working directory (default: a new temporary one)")
	keep := flag.Bool("keep", false, "keep the working directory on exit")
	showVersion := flag.Bool("version", false, "print the kube-apiserver version this binary runs, and exit")
	stdinEOF := flag.Bool("exit-on-stdin-eof", false, "stop when standard input closes (a test process that started it has exited)")
	var nc nodeConfig
	flag.BoolVar(&nc.enabled, "node", false, "also run kube-scheduler and a node: containerd, runc and a kubelet")
	flag.StringVar(&nc.bin, "node-bin", "", "directory holding containerd, containerd-shim-runc-v2 and crictl (scripts/build-node.sh)")
	flag.StringVar(&nc.pause, "pause-image", "", "the sandbox image, in a loopback registry (HOST:PORT/REPO:TAG)")
	flag.Parse()
	if *showVersion {
		fmt.Printf("kube-apiserver %s\n", version.Get().GitVersion)
		return
	}
	if nc.enabled && (nc.bin == "" || nc.pause == "") {
		fmt.Fprintln(os.Stderr, "cluster: -node needs -node-bin and -pause-image")
		os.Exit(2)
	}
	if err := run(*dir, *keep, *stdinEOF, nc); err != nil {
		fmt.Fprintf(os.Stderr, "cluster: %v\n", err)
		os.Exit(1)
	}
}

type nodeConfig struct {
	enabled    bool
	bin, pause string
}

func run(dir string, keep, stdinEOF bool, nc nodeConfig) error {
	if dir == "" {
		d, err := os.MkdirTemp("", "pinswap-cluster-")
		if err != nil {
			return err
		}
		dir = d
	} else if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	dir, _ = filepath.Abs(dir)
	if !keep {
		defer os.RemoveAll(dir)
	}

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if stdinEOF {
		var cancel context.CancelFunc
		ctx, cancel = context.WithCancel(ctx)
		go func() {
			_, _ = io.Copy(io.Discard, os.Stdin)
			cancel()
		}()
	}

	pki, err := newPKI(dir)
	if err != nil {
		return fmt.Errorf("certificates: %w", err)
	}
	writes, err := writesDir(dir, keep)
	if err != nil {
		return err
	}
	if !keep && writes != dir {
		defer os.RemoveAll(writes)
	}
	store, err := startEtcd(writes)
	if err != nil {
		return fmt.Errorf("etcd: %w", err)
	}
	defer store.Close()

	cp, err := newControlPlane(dir, writes, pki, store.ClientURL())
	if err != nil {
		return err
	}
	defer cp.stopAll()
	if err := cp.startAPIServer(ctx); err != nil {
		return err
	}
	served, err := cp.version(ctx)
	if err != nil {
		return err
	}
	if err := cp.startControllerManager(); err != nil {
		return err
	}
	var nd *node
	if nc.enabled {
		if err := writeHostsToml(filepath.Join(dir, "node", "certs.d"), nc.pause); err != nil {
			return err
		}
		nd, err = startNode(ctx, dir, cp, pki, nc.bin, nc.pause)
		if err != nil {
			return fmt.Errorf("node: %w", err)
		}
		// Before the control plane stops (deferred earlier, run later).
		defer nd.stop()
	}
	control, err := serveControl(cp, store, nd)
	if err != nil {
		return err
	}
	defer control.Close()
	sidecar, sidecarServer, err := serveSidecar(pki)
	if err != nil {
		return err
	}
	defer sidecarServer.Close()

	fmt.Printf("kube-apiserver %s\n", served)
	fmt.Printf("kubeconfig %s\n", cp.adminKubeconfig)
	fmt.Printf("control http://%s\n", control.Addr)
	fmt.Printf("ca %s\n", pki.caCert)
	fmt.Printf("sidecar %s\n", sidecar)
	if nd != nil {
		fmt.Printf("node %s\n", nd.name)
		fmt.Printf("node-ip %s\n", nodeIP)
		fmt.Printf("containerd unix://%s\n", nd.sock)
		fmt.Printf("certs.d %s\n", nd.certsDir)
	}
	fmt.Printf("dir %s\n", dir)

	select {
	case <-ctx.Done():
		return nil
	case err := <-cp.failed:
		if errors.Is(err, context.Canceled) {
			return nil
		}
		return err
	case err := <-store.Err():
		return fmt.Errorf("etcd stopped: %w", err)
	}
}

// writesDir is where etcd and the API server's blocking audit log write.
// A shared disk's writeback (a cargo build's dirty pages, say) can stall
// every write for seconds, and a blocking audit log turns that into an API
// server that answers nothing: leases lapse and admission times out. On
// /dev/shm those writes never wait for the disk; DIR keeps a link to the
// audit log so readers find it where they always did.
func writesDir(dir string, keep bool) (string, error) {
	if st, err := os.Stat("/dev/shm"); err != nil || !st.IsDir() {
		return dir, nil
	}
	w, err := os.MkdirTemp("/dev/shm", "pinswap-cluster-")
	if err != nil {
		return dir, nil
	}
	if err := os.Symlink(filepath.Join(w, "audit.log"), filepath.Join(dir, "audit.log")); err != nil {
		os.RemoveAll(w)
		return "", err
	}
	if keep {
		fmt.Fprintf(os.Stderr, "cluster: etcd and the audit log are in %s\n", w)
	}
	return w, nil
}
