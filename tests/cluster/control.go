package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"time"
)

// serveControl answers the suite's requests for faults a real cluster has
// but a client cannot cause: compaction, an API server restart, and a node
// replaced by a new one (as an autoscaler does).
func serveControl(cp *controlPlane, store *etcdStore, nd *node) (*http.Server, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	mux := http.NewServeMux()
	post := func(path string, f func(ctx context.Context) (string, error)) {
		mux.HandleFunc(path, func(w http.ResponseWriter, r *http.Request) {
			if r.Method != http.MethodPost {
				http.Error(w, "POST only", http.StatusMethodNotAllowed)
				return
			}
			ctx, cancel := context.WithTimeout(r.Context(), 3*time.Minute)
			defer cancel()
			out, err := f(ctx)
			if err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
			fmt.Fprintln(w, out)
		})
	}
	post("/compact", func(ctx context.Context) (string, error) {
		rev, err := store.Compact(ctx)
		return fmt.Sprint(rev), err
	})
	post("/apiserver/restart", func(ctx context.Context) (string, error) {
		return "restarted", cp.restartAPIServer(ctx)
	})
	post("/apiserver/stop", func(context.Context) (string, error) {
		cp.stopAPIServer()
		return "stopped", nil
	})
	post("/apiserver/start", func(ctx context.Context) (string, error) {
		return "started", cp.startAPIServer(ctx)
	})
	// POST /node/expose with body HOST:PORT (a loopback registry): the
	// address at the node IP that reaches it from Pods, and containerd too.
	mux.HandleFunc("/node/expose", func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost || nd == nil {
			http.Error(w, "POST, on a harness started with -node", http.StatusMethodNotAllowed)
			return
		}
		body, _ := io.ReadAll(io.LimitReader(r.Body, 256))
		addr, err := nd.expose(strings.TrimSpace(string(body)))
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		fmt.Fprintln(w, addr)
	})
	// POST /node/replace with body NAME or NAME TAINT (key=value:Effect
	// or key:Effect): the node is replaced by a new, cold one named NAME,
	// registered with TAINT (see node.replace). Answers NAME once it is
	// Ready.
	mux.HandleFunc("/node/replace", func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost || nd == nil {
			http.Error(w, "POST, on a harness started with -node", http.StatusMethodNotAllowed)
			return
		}
		body, _ := io.ReadAll(io.LimitReader(r.Body, 1024))
		name, taint, err := parseReplace(string(body))
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		ctx, cancel := context.WithTimeout(r.Context(), 4*time.Minute)
		defer cancel()
		if err := nd.replace(ctx, name, taint); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		fmt.Fprintln(w, name)
	})
	mux.HandleFunc("/revision", func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprintln(w, store.Revision())
	})
	srv := &http.Server{Addr: l.Addr().String(), Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(l) }()
	return srv, nil
}
