#!/usr/bin/env bash
# Builds pinswap's container image without a container engine, as an OCI
# image layout: the release binary on the files it needs at run time, taken
# from Debian's packages the way distroless images are made (each package's
# data extracted, docs dropped, its control file kept in
# /var/lib/dpkg/status.d/ for scanners).
#
#   scripts/build-image.sh [--binary FILE] [--out DIR]   # layout, prints the manifest digest
#   scripts/build-image.sh --rootfs DIR [--binary FILE]  # only the file tree (the Dockerfile's stage)
#   scripts/build-image.sh --fetch                       # only download the packages
#
# The packages are downloaded once into target/image/debs (apt-get download)
# and reused, so later builds need no network and give the same bytes; with
# PINSWAP_IMAGE_OFFLINE=1 a missing package is an error (the tests set it).
#
# Defaults: --binary target/release/pinswap (built when missing), --out
# target/image/layout. The image runs /usr/local/bin/pinswap as 65532:65532
# (distroless's nonroot), carries the OCI labels, and is reproducible: the
# same binary and packages give the same digest, every timestamp being the
# commit's (SOURCE_DATE_EPOCH). Push it with
#   pinswap copy oci:target/image/layout:VERSION docker://REGISTRY/pinswap:VERSION
set -euo pipefail
cd "$(dirname "$0")/.."
binary=target/release/pinswap
out=target/image/layout
rootfs_only=""
fetch_only=""
debs=${PINSWAP_IMAGE_DEBS:-target/image/debs}
while (($#)); do
  case $1 in
  --binary) binary=$2; shift 2 ;;
  --out) out=$2; shift 2 ;;
  --rootfs) rootfs_only=$2; shift 2 ;;
  --fetch) fetch_only=1; shift ;;
  *) echo "usage: $0 [--binary FILE] [--out DIR] | --rootfs DIR [--binary FILE] | --fetch" >&2; exit 2 ;;
  esac
done
# The runtime files of distroless/cc-debian12 that the binary uses: glibc,
# libgcc_s (unwinding), CA certificates (rustls-native-certs reads
# /etc/ssl/certs), and netbase (/etc/services, /etc/protocols). Not taken:
# libssl3 (TLS is rustls), libstdc++6 and libgomp1 (nothing links them), and
# tzdata (logs are UTC).
packages=(libc6 libgcc-s1 ca-certificates netbase)

mkdir -p "$debs"
missing=()
for p in "${packages[@]}"; do
  compgen -G "$debs/${p}_*.deb" >/dev/null || missing+=("$p")
done
if ((${#missing[@]})); then
  [ -z "${PINSWAP_IMAGE_OFFLINE:-}" ] || {
    echo "error: $debs lacks ${missing[*]}: run scripts/build-image.sh --fetch" >&2
    exit 1
  }
  # apt's sandbox user must be able to write there.
  chmod 0777 "$debs"
  (cd "$debs" && apt-get download -q "${missing[@]}" >/dev/null) || {
    echo "error: apt-get download ${missing[*]} failed (run apt-get update first)" >&2
    exit 1
  }
  chmod 0755 "$debs"
fi
[ -z "$fetch_only" ] || { echo "$debs"; exit 0; }

if [ ! -x "$binary" ]; then
  [ "$binary" = target/release/pinswap ] || { echo "error: $binary is not an executable" >&2; exit 1; }
  cargo build --release --locked --bin pinswap >&2
fi
for tool in apt-get dpkg-deb python3 strip; do
  command -v "$tool" >/dev/null || { echo "error: $tool is needed to build the image" >&2; exit 1; }
done

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
rootfs=${rootfs_only:-$work/rootfs}
rm -rf "$rootfs"
mkdir -p "$rootfs"

mkdir -p "$rootfs/var/lib/dpkg/status.d"
for p in "${packages[@]}"; do
  deb=$(compgen -G "$debs/${p}_*.deb" | LC_ALL=C sort | tail -1)
  name=$(dpkg-deb -f "$deb" Package)
  dpkg-deb -x "$deb" "$rootfs"
  dpkg-deb -f "$deb" >"$rootfs/var/lib/dpkg/status.d/$name"
done
rm -rf "$rootfs"/usr/share/{doc,man,info,lintian,locale,bug} "$rootfs"/etc/ca-certificates.conf.d
# The bundle update-ca-certificates would write at install time.
mkdir -p "$rootfs/etc/ssl/certs"
find "$rootfs/usr/share/ca-certificates" -name '*.crt' | LC_ALL=C sort | xargs cat >"$rootfs/etc/ssl/certs/ca-certificates.crt"

mkdir -p "$rootfs/usr/local/bin" "$rootfs/home/nonroot" "$rootfs/tmp" "$rootfs/etc"
install -m 0755 "$binary" "$rootfs/usr/local/bin/pinswap"
strip "$rootfs/usr/local/bin/pinswap"
chmod 1777 "$rootfs/tmp"
chmod 0700 "$rootfs/home/nonroot"
cat >"$rootfs/etc/passwd" <<'EOF'
root:x:0:0:root:/root:/sbin/nologin
nobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin
nonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin
EOF
cat >"$rootfs/etc/group" <<'EOF'
root:x:0:
nogroup:x:65534:
nonroot:x:65532:
EOF
chmod 0644 "$rootfs/etc/passwd" "$rootfs/etc/group"
printf 'home/nonroot 65532:65532\n' >"$rootfs.owners"
if [ -n "$rootfs_only" ]; then
  chown 65532:65532 "$rootfs/home/nonroot" 2>/dev/null || true
  rm -f "$rootfs.owners"
  echo "$rootfs"
  exit 0
fi

version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
revision=$(git rev-parse HEAD 2>/dev/null || echo unknown)
epoch=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || echo 0)}
created=$(date -u -d "@$epoch" +%Y-%m-%dT%H:%M:%SZ)
mkdir -p "$(dirname "$out")"
SOURCE_DATE_EPOCH=$epoch python3 scripts/oci-image.py --out "$out" --rootfs "$rootfs" \
  --entrypoint /usr/local/bin/pinswap --cmd=--help --user 65532:65532 \
  --expose 8443/tcp --expose 8080/tcp --ref "$version" \
  --label "org.opencontainers.image.title=pinswap" \
  --label "org.opencontainers.image.description=Mirrors the images a cluster uses into a registry you own and pins Pods to them by digest" \
  --label "org.opencontainers.image.source=https://github.com/pinswap/pinswap" \
  --label "org.opencontainers.image.version=$version" \
  --label "org.opencontainers.image.revision=$revision" \
  --label "org.opencontainers.image.created=$created" \
  --label "org.opencontainers.image.licenses=Apache-2.0" \
  --label "org.opencontainers.image.base.name=debian:bookworm (packages: ${packages[*]})"
