// registries-conf prints the registry CRI-O would use for an image, as
// containers/image's sysregistriesv2 computes it from a registries.conf and
// its drop-in directory (later drop-ins replace a [[registry]] with the
// same prefix). pinswap's tests run it on the files pinswap wrote.
//
//	registries-conf -conf FILE -dir DIR IMAGE...
//
// It prints one JSON object per image: the matching [[registry]] (prefix,
// location, blocked, insecure, mirrors) or null when none matches.
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"os"

	"go.podman.io/image/v5/pkg/sysregistriesv2"
	"go.podman.io/image/v5/types"
)

type mirror struct {
	Location       string `json:"location"`
	Insecure       bool   `json:"insecure"`
	PullFromMirror string `json:"pullFromMirror"`
}

type registry struct {
	Prefix   string   `json:"prefix"`
	Location string   `json:"location"`
	Blocked  bool     `json:"blocked"`
	Insecure bool     `json:"insecure"`
	Mirrors  []mirror `json:"mirrors"`
}

func main() {
	conf := flag.String("conf", "", "the registries.conf")
	dir := flag.String("dir", "", "its drop-in directory (registries.conf.d)")
	flag.Parse()
	if *conf == "" || *dir == "" || flag.NArg() == 0 {
		fmt.Fprintln(os.Stderr, "usage: registries-conf -conf FILE -dir DIR IMAGE...")
		os.Exit(2)
	}
	ctx := &types.SystemContext{
		SystemRegistriesConfPath:    *conf,
		SystemRegistriesConfDirPath: *dir,
	}
	// Each run reads the files afresh.
	sysregistriesv2.InvalidateCache()
	out := json.NewEncoder(os.Stdout)
	for _, image := range flag.Args() {
		r, err := sysregistriesv2.FindRegistry(ctx, image)
		if err != nil {
			fmt.Fprintf(os.Stderr, "error: %s: %v\n", image, err)
			os.Exit(1)
		}
		if r == nil {
			if err := out.Encode(nil); err != nil {
				os.Exit(1)
			}
			continue
		}
		got := registry{
			Prefix:   r.Prefix,
			Location: r.Location,
			Blocked:  r.Blocked,
			Insecure: r.Insecure,
			Mirrors:  []mirror{},
		}
		for _, m := range r.Mirrors {
			got.Mirrors = append(got.Mirrors, mirror{
				Location:       m.Location,
				Insecure:       m.Insecure,
				PullFromMirror: m.PullFromMirror,
			})
		}
		if err := out.Encode(got); err != nil {
			os.Exit(1)
		}
	}
}
