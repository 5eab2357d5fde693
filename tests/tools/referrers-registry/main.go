// Command referrers-registry serves an in-memory OCI registry that
// implements the OCI 1.1 referrers API, for tests/referrers.rs. The test
// rig's Distribution 2.8 answers that API with 404; this one answers it.
// It listens on the loopback address given by -addr and prints
// "listening <addr>" once it accepts connections.
package main

import (
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"strings"

	"github.com/google/go-containerregistry/pkg/registry"
)

func main() {
	addr := flag.String("addr", "127.0.0.1:0", "loopback address to listen on")
	flag.Parse()
	if host, _, err := net.SplitHostPort(*addr); err != nil || !strings.HasPrefix(host, "127.") {
		fmt.Fprintln(os.Stderr, "referrers-registry: -addr must be a 127.0.0.0/8 host:port")
		os.Exit(2)
	}
	ln, err := net.Listen("tcp", *addr)
	if err != nil {
		fmt.Fprintln(os.Stderr, "referrers-registry:", err)
		os.Exit(1)
	}
	h := registry.New(registry.Logger(log.New(io.Discard, "", 0)), registry.WithReferrersSupport(true))
	fmt.Printf("listening %s\n", ln.Addr())
	if err := http.Serve(ln, h); err != nil {
		fmt.Fprintln(os.Stderr, "referrers-registry:", err)
		os.Exit(1)
	}
}
