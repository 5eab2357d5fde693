module pinswap.dev/tests/tools/registries-conf

go 1.26.0

require go.podman.io/image/v5 v5.42.1

require (
	github.com/BurntSushi/toml v1.6.0 // indirect
	github.com/docker/go-units v0.5.0 // indirect
	github.com/moby/sys/capability v0.4.0 // indirect
	github.com/moby/sys/mountinfo v0.7.2 // indirect
	github.com/moby/sys/user v0.4.1 // indirect
	github.com/opencontainers/go-digest v1.0.0 // indirect
	github.com/opencontainers/image-spec v1.1.1 // indirect
	github.com/opencontainers/runtime-spec v1.3.0 // indirect
	github.com/sirupsen/logrus v1.10.2 // indirect
	go.podman.io/storage v1.65.1 // indirect
	golang.org/x/sys v0.49.0 // indirect
)
