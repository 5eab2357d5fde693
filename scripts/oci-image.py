#!/usr/bin/env python3
"""Build a container image as an OCI image layout, reproducibly, without a
container engine (python3 stdlib only).

usage: oci-image.py --out DIR --rootfs DIR [--rootfs DIR ...]
                    [--entrypoint ARG ...] [--cmd ARG ...] [--user UID:GID]
                    [--env K=V ...] [--label K=V ...] [--expose PORT/tcp ...]
                    [--workdir DIR] [--ref NAME] [--epoch SECONDS]

Each --rootfs is one layer, in order: a gzip'd tar of the directory with
entries sorted by path, owned by 0:0 (or by the numeric owner given in a
`.owners` file next to the tree's top, see below), every mtime set to
--epoch (default: SOURCE_DATE_EPOCH, else 0), and gzip's own header time 0.
The same trees and options therefore give the same digests, whoever builds
them and whenever.

A file ROOTFS.owners (beside the directory, not in it) may list
"PATH UID:GID" lines, PATH relative to the tree, for entries that must not
be root's (a home directory, say).

The layout gets `oci-layout`, `index.json` with one manifest annotated
`org.opencontainers.image.ref.name=NAME` (default `latest`), and the blobs.
Prints the manifest digest.
"""
import argparse
import gzip
import hashlib
import io
import json
import os
import shutil
import stat
import sys
import tarfile

MT_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
MT_CONFIG = "application/vnd.oci.image.config.v1+json"
MT_MANIFEST = "application/vnd.oci.image.manifest.v1+json"


def canonical(obj):
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


class Layout:
    def __init__(self, root):
        self.root = root
        self.blobs = os.path.join(root, "blobs", "sha256")
        os.makedirs(self.blobs, exist_ok=True)

    def put(self, data, media_type, **extra):
        digest = hashlib.sha256(data).hexdigest()
        with open(os.path.join(self.blobs, digest), "wb") as f:
            f.write(data)
        return {"mediaType": media_type, "digest": "sha256:" + digest, "size": len(data), **extra}


def read_owners(rootfs):
    owners = {}
    path = rootfs.rstrip("/") + ".owners"
    if os.path.exists(path):
        with open(path) as f:
            for n, line in enumerate(f, 1):
                line = line.strip()
                if not line or line.startswith("#"):
                    continue
                try:
                    name, ids = line.split()
                    uid, gid = (int(x) for x in ids.split(":"))
                except ValueError:
                    sys.exit(f"{path}:{n}: expected 'PATH UID:GID', got {line!r}")
                owners[name.strip("/")] = (uid, gid)
    return owners


def layer_tar(rootfs, epoch):
    """The tree as an uncompressed tar (bytes), deterministic."""
    owners = read_owners(rootfs)
    entries = []
    for top, dirs, files in os.walk(rootfs):
        dirs.sort()
        for name in dirs + sorted(files):
            full = os.path.join(top, name)
            entries.append(os.path.relpath(full, rootfs))
    entries.sort()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for rel in entries:
            full = os.path.join(rootfs, rel)
            st = os.lstat(full)
            info = tarfile.TarInfo(rel)
            info.mtime = epoch
            info.uid, info.gid = owners.get(rel, (0, 0))
            info.uname = info.gname = ""
            info.mode = stat.S_IMODE(st.st_mode)
            if stat.S_ISLNK(st.st_mode):
                info.type = tarfile.SYMTYPE
                info.linkname = os.readlink(full)
                tar.addfile(info)
            elif stat.S_ISDIR(st.st_mode):
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            elif stat.S_ISREG(st.st_mode):
                info.size = st.st_size
                with open(full, "rb") as f:
                    tar.addfile(info, f)
            else:
                sys.exit(f"{full}: only files, directories and symlinks go into a layer")
    return buf.getvalue()


def gzipped(data):
    out = io.BytesIO()
    # mtime=0 and no file name: gzip's header is then the same every time.
    with gzip.GzipFile(fileobj=out, mode="wb", compresslevel=9, mtime=0, filename="") as z:
        z.write(data)
    return out.getvalue()


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--rootfs", action="append", required=True)
    p.add_argument("--entrypoint", nargs="+", default=None)
    p.add_argument("--cmd", nargs="+", default=None)
    p.add_argument("--user", default=None)
    p.add_argument("--env", action="append", default=[])
    p.add_argument("--label", action="append", default=[])
    p.add_argument("--expose", action="append", default=[])
    p.add_argument("--workdir", default=None)
    p.add_argument("--ref", default="latest")
    p.add_argument("--arch", default="amd64")
    p.add_argument("--epoch", type=int, default=int(os.environ.get("SOURCE_DATE_EPOCH", "0")))
    args = p.parse_args(argv)

    if os.path.exists(args.out):
        shutil.rmtree(args.out)
    layout = Layout(args.out)
    layers, diff_ids = [], []
    for rootfs in args.rootfs:
        if not os.path.isdir(rootfs):
            sys.exit(f"--rootfs {rootfs}: not a directory")
        tar = layer_tar(rootfs, args.epoch)
        diff_ids.append("sha256:" + hashlib.sha256(tar).hexdigest())
        layers.append(layout.put(gzipped(tar), MT_LAYER))

    labels = {}
    for kv in args.label:
        k, sep, v = kv.partition("=")
        if not sep or not k:
            sys.exit(f"--label {kv!r}: expected KEY=VALUE")
        labels[k] = v
    env = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"] + args.env
    config = {"Env": env}
    if args.entrypoint:
        config["Entrypoint"] = args.entrypoint
    if args.cmd:
        config["Cmd"] = args.cmd
    if args.user:
        config["User"] = args.user
    if labels:
        config["Labels"] = labels
    if args.expose:
        config["ExposedPorts"] = {port: {} for port in args.expose}
    if args.workdir:
        config["WorkingDir"] = args.workdir
    created = __import__("datetime").datetime.fromtimestamp(args.epoch, __import__("datetime").timezone.utc)
    image_config = {
        "architecture": args.arch,
        "os": "linux",
        "created": created.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
        "history": [{"created": created.strftime("%Y-%m-%dT%H:%M:%SZ"), "created_by": "scripts/oci-image.py"}
                    for _ in layers],
    }
    config_desc = layout.put(canonical(image_config), MT_CONFIG)
    manifest = {
        "schemaVersion": 2,
        "mediaType": MT_MANIFEST,
        "config": config_desc,
        "layers": layers,
    }
    if labels:
        manifest["annotations"] = labels
    manifest_desc = layout.put(
        canonical(manifest), MT_MANIFEST,
        annotations={"org.opencontainers.image.ref.name": args.ref},
        platform={"architecture": args.arch, "os": "linux"},
    )
    with open(os.path.join(args.out, "oci-layout"), "wb") as f:
        f.write(canonical({"imageLayoutVersion": "1.0.0"}))
    with open(os.path.join(args.out, "index.json"), "wb") as f:
        f.write(canonical({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
                           "manifests": [manifest_desc]}))
    print(manifest_desc["digest"])


if __name__ == "__main__":
    main(sys.argv[1:])
