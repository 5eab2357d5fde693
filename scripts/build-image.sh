#!/usr/bin/env bash
# Builds pinswap's container image without a container engine, as an OCI
# image layout: the release binary on the files it needs at run time, taken
# from Debian's packages the way distroless images are made (each package's
# data extracted, docs dropped, its control file kept in
# /var/lib/dpkg/status.d/ for scanners).
#
#   scripts/build-image.sh [--binary FILE] [--out DIR]   # layout, prints the manifest digest
#   scripts/build-image.sh --rootfs DIR [--binary FILE]  # only the file tree (the Dockerfile's stage)
#   scripts/build-image.sh --fetch [--arch ARCH]         # only download the packages
#
# The architecture is the binary's (its ELF header); --arch names it when
# only fetching (default: dpkg --print-architecture), and must agree with
# the binary otherwise. The image's config says it, and the packages are
# that architecture's (apt-get download PACKAGE:ARCH; another architecture
# than the machine's needs dpkg --add-architecture ARCH and apt-get update).
#
# The packages are the versions apt gives as candidates, downloaded into
# target/image/debs and recorded in its ARCH.manifest (package, version,
# file, sha256). A build reuses what the manifest names while apt's
# candidate is the same, and downloads again when it changed (apt-get
# update brought a new version); the file it replaces goes. With
# PINSWAP_IMAGE_OFFLINE=1 (the tests set it) apt is not asked: the build
# uses what the manifest names, and fails when it names nothing or a file
# is missing or altered.
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
binary_given=""
arch=""
out=target/image/layout
rootfs_only=""
fetch_only=""
debs=${PINSWAP_IMAGE_DEBS:-target/image/debs}
usage="usage: $0 [--binary FILE] [--arch ARCH] [--out DIR] | --rootfs DIR [--binary FILE] | --fetch [--arch ARCH]"
while (($#)); do
  case $1 in
  --binary) binary=$2; binary_given=1; shift 2 ;;
  --arch) arch=$2; shift 2 ;;
  --out) out=$2; shift 2 ;;
  --rootfs) rootfs_only=$2; shift 2 ;;
  --fetch) fetch_only=1; shift ;;
  *) echo "$usage" >&2; exit 2 ;;
  esac
done
# The runtime files of distroless/cc-debian12 that the binary uses: glibc,
# libgcc_s (unwinding), CA certificates (rustls-native-certs reads
# /etc/ssl/certs), and netbase (/etc/services, /etc/protocols). Not taken:
# libssl3 (TLS is rustls), libstdc++6 and libgomp1 (nothing links them), and
# tzdata (logs are UTC).
packages=(libc6 libgcc-s1 ca-certificates netbase)

die() { echo "error: $*" >&2; exit 1; }
cleanup=()
trap 'rm -rf "${cleanup[@]}"' EXIT

# --rootfs and --out are replaced whole: only when empty, or an earlier
# run's (a file tree with its packages' records, a layout).
ours_or_empty() { [ ! -e "$1" ] || { [ -d "$1" ] && { [ -z "$(ls -A "$1")" ] || [ -e "$1/$2" ]; }; }; }
[ -z "$rootfs_only" ] || ours_or_empty "$rootfs_only" var/lib/dpkg/status.d ||
  die "--rootfs $rootfs_only holds files this script did not write: remove them or name another directory"
[ -n "$rootfs_only" ] || [ -n "$fetch_only" ] || ours_or_empty "$out" oci-layout ||
  die "--out $out holds files this script did not write: remove them or name another directory"

# Debian's name and the GNU triplet of an ELF file's machine.
elf_arch() {
  local -a b
  read -r -a b <<<"$(od -An -tu1 -N20 -v "$1" | tr '\n' ' ')"
  ((${#b[@]} == 20)) && [ "${b[*]:0:4}" = "127 69 76 70" ] || die "$1 is not an ELF binary"
  local class=${b[4]} machine
  if [ "${b[5]}" = 2 ]; then machine=$((b[18] * 256 + b[19])); else machine=$((b[19] * 256 + b[18])); fi
  case "$class:${b[5]}:$machine" in
  2:1:62) echo "amd64 x86_64-linux-gnu" ;;
  2:1:183) echo "arm64 aarch64-linux-gnu" ;;
  2:1:21) echo "ppc64el powerpc64le-linux-gnu" ;;
  2:2:22) echo "s390x s390x-linux-gnu" ;;
  2:1:243) echo "riscv64 riscv64-linux-gnu" ;;
  1:1:3) echo "i386 i686-linux-gnu" ;;
  *) die "$1: ELF machine $machine (class $class) is not one this script knows" ;;
  esac
}

command -v dpkg >/dev/null || die "dpkg is needed to build the image"
host_arch=$(dpkg --print-architecture)
if [ -n "$fetch_only" ] && [ -z "$binary_given" ]; then
  arch=${arch:-$host_arch}
else
  if [ ! -x "$binary" ]; then
    [ "$binary" = target/release/pinswap ] || die "$binary is not an executable"
    cargo build --release --locked --bin pinswap >&2
  fi
  elf=$(elf_arch "$binary")
  read -r bin_arch triplet <<<"$elf"
  [ -z "$arch" ] || [ "$arch" = "$bin_arch" ] || die "--arch $arch, but $binary is $bin_arch"
  arch=$bin_arch
fi
[[ $arch =~ ^[a-z0-9]+$ ]] || die "--arch $arch: not a Debian architecture name"

# The cache: never writable by others (apt-get download's sandbox user
# writes into a private directory of its own, below).
mkdir -p "$debs"
[ -O "$debs" ] || die "$debs is not the current user's"
chmod go-w "$debs"
manifest=$debs/$arch.manifest

# One field of a Debian control record on stdin.
field() { awk -v f="$1" 'index($0, f ": ") == 1 { print substr($0, length(f) + 3); exit }'; }
sha256() { sha256sum "$1" | cut -d' ' -f1; }
valid_name() { [[ $1 =~ ^[A-Za-z0-9.+~%_-]+\.deb$ ]]; }

# PACKAGE VERSION FILE SHA256, one line per package, for this build.
chosen=()
if [ -n "${PINSWAP_IMAGE_OFFLINE:-}" ]; then
  [ -f "$manifest" ] || die "$manifest is missing: run scripts/build-image.sh --fetch --arch $arch"
  for p in "${packages[@]}"; do
    line=$(awk -v p="$p" '$1 == p' "$manifest")
    read -r _ version file sum <<<"$line"
    [ -n "$line" ] && valid_name "$file" || die "$manifest names no $p: run scripts/build-image.sh --fetch --arch $arch"
    [ -f "$debs/$file" ] || die "$debs/$file is missing: run scripts/build-image.sh --fetch --arch $arch"
    [ "$(sha256 "$debs/$file")" = "$sum" ] || die "$debs/$file is not the file $manifest names (sha256 differs)"
    chosen+=("$p $version $file $sum")
  done
else
  command -v apt-get >/dev/null || die "apt-get is needed to fetch the packages"
  fetch=$(mktemp -d "$debs/.fetch.XXXXXX")
  cleanup+=("$fetch")
  # apt-get download drops to _apt when run as root: let it write only here.
  if [ "$(id -u)" = 0 ] && id _apt >/dev/null 2>&1; then chown _apt "$fetch"; fi
  for p in "${packages[@]}"; do
    # The candidate's record: this architecture's, or the one for all.
    record=$(apt-cache show --no-all-versions "$p:$arch" 2>/dev/null) ||
      record=$(apt-cache show --no-all-versions "$p:all" 2>/dev/null) ||
      die "apt has no $p for $arch: run apt-get update (for another architecture than the machine's, dpkg --add-architecture $arch first)"
    version=$(field Version <<<"$record")
    parch=$(field Architecture <<<"$record")
    file=$(basename "$(field Filename <<<"$record")")
    sum=$(field SHA256 <<<"$record")
    [ -n "$version" ] && [ -n "$parch" ] && [ -n "$sum" ] && valid_name "$file" ||
      die "apt's record of $p:$arch lacks a version, architecture, file name or sha256"
    if ! [ -f "$debs/$file" ] || [ "$(sha256 "$debs/$file")" != "$sum" ]; then
      (cd "$fetch" && apt-get download -q "$p:$parch=$version" >/dev/null) ||
        die "apt-get download $p:$parch=$version failed"
      got=("$fetch"/*.deb)
      ((${#got[@]} == 1)) && [ -f "${got[0]}" ] || die "apt-get download $p:$parch=$version gave no single .deb"
      # Out of the sandbox user's reach first, then checked and put in place.
      staged=$(mktemp "$debs/.incoming.XXXXXX")
      cleanup+=("$staged")
      mv -f "${got[0]}" "$staged"
      chown "$(id -u):$(id -g)" "$staged"
      chmod 0644 "$staged"
      [ "$(sha256 "$staged")" = "$sum" ] || die "$p $version: the download's sha256 is not apt's"
      mv -f "$staged" "$debs/$file"
    fi
    chosen+=("$p $version $file $sum")
  done
  previous=()
  [ ! -f "$manifest" ] || mapfile -t previous < <(awk '!/^#/ { print $3 }' "$manifest")
  next=$(mktemp "$debs/.manifest.XXXXXX")
  cleanup+=("$next")
  {
    echo "# scripts/build-image.sh: PACKAGE VERSION FILE SHA256, apt's candidates for $arch"
    printf '%s\n' "${chosen[@]}"
  } >"$next"
  chmod 0644 "$next"
  mv -f "$next" "$manifest"
  # A file the previous manifest named and no manifest names now was
  # replaced: it goes. Files no manifest ever named are not this script's.
  for old in "${previous[@]}"; do
    valid_name "$old" || continue
    awk -v f="$old" '!/^#/ && $3 == f { found = 1 } END { exit !found }' "$debs"/*.manifest ||
      rm -f "$debs/$old"
  done
fi
[ -z "$fetch_only" ] || { echo "$debs"; exit 0; }

# strip for the binary's architecture.
if [ "$arch" = "$host_arch" ]; then
  strip=strip
elif command -v "$triplet-strip" >/dev/null; then
  strip=$triplet-strip
else
  strip=llvm-strip
fi
for tool in dpkg-deb python3 "$strip"; do
  command -v "$tool" >/dev/null || die "$tool is needed to build the image for $arch"
done

work=$(mktemp -d)
cleanup+=("$work")
rootfs=${rootfs_only:-$work/rootfs}
rm -rf "$rootfs"
mkdir -p "$rootfs"

mkdir -p "$rootfs/var/lib/dpkg/status.d"
for c in "${chosen[@]}"; do
  read -r _ _ file _ <<<"$c"
  deb=$debs/$file
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
"$strip" "$rootfs/usr/local/bin/pinswap"
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
# The lookup order stated, as distroless's base-files does: /etc/hosts
# (where the kubelet writes hostAliases) before DNS, whatever the C
# library's built-in order for a missing file.
cat >"$rootfs/etc/nsswitch.conf" <<'EOF'
passwd:         files
group:          files
shadow:         files
gshadow:        files

hosts:          files dns
networks:       files

protocols:      files
services:       files
ethers:         files
rpc:            files
EOF
chmod 0644 "$rootfs/etc/passwd" "$rootfs/etc/group" "$rootfs/etc/nsswitch.conf"
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
  --expose 8443/tcp --expose 8080/tcp --ref "$version" --arch "$arch" \
  --label "org.opencontainers.image.title=pinswap" \
  --label "org.opencontainers.image.description=Mirrors the images a cluster uses into a registry you own and pins Pods to them by digest" \
  --label "org.opencontainers.image.source=https://github.com/pinswap/pinswap" \
  --label "org.opencontainers.image.version=$version" \
  --label "org.opencontainers.image.revision=$revision" \
  --label "org.opencontainers.image.created=$created" \
  --label "org.opencontainers.image.licenses=Apache-2.0" \
  --label "org.opencontainers.image.base.name=debian:bookworm (packages: ${packages[*]})"
