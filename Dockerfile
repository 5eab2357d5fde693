# syntax=docker/dockerfile:1
# pinswap: a static (musl) binary on distroless/static, running as non-root.
#
#   docker build -t registry.example.com/pinswap:0.1.0 .
#   docker buildx build --platform linux/amd64,linux/arm64 -t registry.example.com/pinswap:0.1.0 --push .
#
# Each platform compiles natively (under emulation with buildx), so no
# cross toolchain is needed. No OpenSSL: TLS is rustls with ring.

FROM docker.io/library/rust:1.95-bookworm AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends musl-tools \
 && rm -rf /var/lib/apt/lists/*
RUN rustup target add "$(uname -m)-unknown-linux-musl"
WORKDIR /src
COPY Cargo.toml Cargo.lock build.rs ./
COPY src ./src
# `pinswap version` reports it; the build context has no .git.
ARG PINSWAP_GIT_COMMIT=""
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    target="$(uname -m)-unknown-linux-musl" \
 && cargo build --release --locked --target "$target" --bin pinswap \
 && cp "target/$target/release/pinswap" /pinswap \
 && strip /pinswap

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /pinswap /usr/local/bin/pinswap
# distroless's nonroot user; the manifests' runAsNonRoot needs a numeric UID.
USER 65532:65532
EXPOSE 8443 8080
ENTRYPOINT ["/usr/local/bin/pinswap"]
CMD ["--help"]
