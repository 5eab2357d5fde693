package main

import (
	"context"
	"fmt"
	"net"
	"net/url"
	"path/filepath"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/server/v3/embed"
)

// etcdStore is an embedded single-member etcd on loopback ports.
type etcdStore struct {
	e         *embed.Etcd
	clientURL string
}

func startEtcd(dir string) (*etcdStore, error) {
	cfg := embed.NewConfig()
	cfg.Name = "pinswap-cluster"
	cfg.Dir = filepath.Join(dir, "etcd")
	cfg.LogLevel = "error"
	cfg.LogOutputs = []string{filepath.Join(dir, "etcd.log")}
	// A test store: losing it on a crash costs nothing, and fsync is most of
	// etcd's latency on a shared disk.
	cfg.UnsafeNoFsync = true
	client, err := loopbackURL()
	if err != nil {
		return nil, err
	}
	peer, err := loopbackURL()
	if err != nil {
		return nil, err
	}
	cfg.ListenClientUrls, cfg.AdvertiseClientUrls = []url.URL{*client}, []url.URL{*client}
	cfg.ListenPeerUrls, cfg.AdvertisePeerUrls = []url.URL{*peer}, []url.URL{*peer}
	cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)
	e, err := embed.StartEtcd(cfg)
	if err != nil {
		return nil, err
	}
	select {
	case <-e.Server.ReadyNotify():
	case <-time.After(60 * time.Second):
		e.Close()
		return nil, fmt.Errorf("not ready after 60s")
	}
	return &etcdStore{e: e, clientURL: client.String()}, nil
}

func (s *etcdStore) ClientURL() string { return s.clientURL }

func (s *etcdStore) Err() <-chan error { return s.e.Err() }

func (s *etcdStore) Close() { s.e.Close() }

// Revision is the store's current revision.
func (s *etcdStore) Revision() int64 { return s.e.Server.KV().Rev() }

// Compact discards every revision before the current one, as a cluster's
// periodic compaction does; watches from an older resourceVersion then get
// 410 Gone.
func (s *etcdStore) Compact(ctx context.Context) (int64, error) {
	rev := s.Revision()
	_, err := s.e.Server.Compact(ctx, &pb.CompactionRequest{Revision: rev, Physical: true})
	return rev, err
}

// loopbackURL is http://127.0.0.1:PORT on a port that was free a moment ago.
func loopbackURL() (*url.URL, error) {
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	return url.Parse(fmt.Sprintf("http://127.0.0.1:%d", port))
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}
