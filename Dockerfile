# syntax=docker/dockerfile:1
# pinswap: a glibc binary on the runtime files of Debian bookworm, running
# as non-root (65532, distroless's nonroot).
#
#   docker build -t registry.example.com/pinswap:0.1.0 .
#   docker buildx build --platform linux/amd64,linux/arm64 -t registry.example.com/pinswap:0.1.0 --push .
#
# Each platform compiles natively (under emulation with buildx), so no
# cross toolchain is needed. No OpenSSL: TLS is rustls with ring.
#
# glibc, not a static musl binary: musl's allocator made cached admissions
# 1.91x slower (10,089 against 19,307 req/s in one run) for 1.4 MiB less
# idle RSS; docs/benchmarks.md, "The release binary".
#
# The file tree is the one scripts/build-image.sh makes without a container
# engine (the test suite's image, docs/install.md "pinswap's image"): the
# same packages (libc6, libgcc-s1, ca-certificates, netbase), the same
# /etc/passwd, /etc/group and /etc/nsswitch.conf, the same entrypoint,
# user and ports; each platform's packages are its own architecture's.
# What differs: the labels come from the release workflow
# (docker/metadata-action), the layer holds the tree as one COPY (its digest
# differs from the script's), and the package versions are those bookworm
# serves on the day of the build.

FROM docker.io/library/rust:1.95-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock build.rs ./
COPY src ./src
# `pinswap version` reports it; the build context has no .git.
ARG PINSWAP_GIT_COMMIT=""
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bin pinswap \
 && cp target/release/pinswap /pinswap

FROM docker.io/library/debian:bookworm AS rootfs
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends python3 binutils >/dev/null
WORKDIR /src
COPY scripts/build-image.sh scripts/oci-image.py ./scripts/
COPY Cargo.toml ./
COPY --from=build /pinswap /pinswap
RUN PINSWAP_IMAGE_DEBS=/debs scripts/build-image.sh --rootfs /rootfs --binary /pinswap

FROM scratch
COPY --from=rootfs /rootfs/ /
USER 65532:65532
EXPOSE 8443 8080
ENTRYPOINT ["/usr/local/bin/pinswap"]
CMD ["--help"]
