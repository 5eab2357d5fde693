#!/usr/bin/env python3
"""Build benchmark fixtures as an OCI image layout (python3 stdlib only).

usage: make-layout.py DIR REF=LAYER[,LAYER...] [REF=LAYER...]

LAYER is SIZE[@SEED]. SIZE is bytes or has a binary suffix K, M or G
(e.g. 512M). Each layer is an uncompressed tar
(application/vnd.oci.image.layer.v1.tar) holding one file of SIZE
pseudo-random bytes drawn from random.Random(SEED), so layers with the
same SIZE@SEED are byte-identical and stored once: that is how images
share a base layer. SEED defaults to "REF/INDEX" (unique per image).
Every image gets a config with rootfs.diff_ids, an OCI manifest, and an
entry in index.json annotated with org.opencontainers.image.ref.name=REF.
Running it again on the same DIR adds images to the existing index.
"""
import hashlib
import json
import os
import random
import sys
import tarfile

CHUNK = 1 << 20
SUFFIX = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
MT_LAYER = "application/vnd.oci.image.layer.v1.tar"
MT_CONFIG = "application/vnd.oci.image.config.v1+json"
MT_MANIFEST = "application/vnd.oci.image.manifest.v1+json"


def parse_size(text):
    text = text.strip().upper()
    if text and text[-1] in SUFFIX:
        return int(float(text[:-1]) * SUFFIX[text[-1]])
    return int(text)


class Blobs:
    def __init__(self, root):
        self.dir = os.path.join(root, "blobs", "sha256")
        os.makedirs(self.dir, exist_ok=True)
        self.layers = {}  # (size, seed) -> descriptor, for shared layers

    def put_bytes(self, data, media_type):
        digest = hashlib.sha256(data).hexdigest()
        path = os.path.join(self.dir, digest)
        if not os.path.exists(path):
            with open(path + ".tmp", "wb") as f:
                f.write(data)
            os.replace(path + ".tmp", path)
        return {"mediaType": media_type, "digest": "sha256:" + digest, "size": len(data)}

    def put_layer(self, size, seed):
        key = (size, seed)
        if key in self.layers:
            return self.layers[key]
        rng = random.Random(seed)
        info = tarfile.TarInfo("data.bin")
        info.size, info.mode, info.mtime = size, 0o644, 0
        sha = hashlib.sha256()
        tmp = os.path.join(self.dir, "layer.tmp")
        total = 0
        with open(tmp, "wb") as f:
            def emit(chunk):
                nonlocal total
                sha.update(chunk)
                f.write(chunk)
                total += len(chunk)

            emit(info.tobuf(format=tarfile.GNU_FORMAT))
            left = size
            while left:
                n = min(CHUNK, left)
                emit(rng.randbytes(n))
                left -= n
            pad = (-size) % 512
            emit(b"\0" * (pad + 1024))  # pad the file, then two zero blocks
        digest = sha.hexdigest()
        os.replace(tmp, os.path.join(self.dir, digest))
        desc = {"mediaType": MT_LAYER, "digest": "sha256:" + digest, "size": total}
        self.layers[key] = desc
        return desc


def main(argv):
    if len(argv) < 3:
        sys.exit(__doc__)
    root = argv[1]
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, "oci-layout"), "w") as f:
        json.dump({"imageLayoutVersion": "1.0.0"}, f)
    index_path = os.path.join(root, "index.json")
    index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
             "manifests": []}
    if os.path.exists(index_path):
        with open(index_path) as f:
            index = json.load(f)
    blobs = Blobs(root)
    for spec in argv[2:]:
        ref, _, layer_specs = spec.partition("=")
        if not ref or not layer_specs:
            sys.exit(f"bad image spec {spec!r}: want REF=SIZE[@SEED][,...]")
        layers = []
        for i, item in enumerate(layer_specs.split(",")):
            size, _, seed = item.partition("@")
            layers.append(blobs.put_layer(parse_size(size), seed or f"{ref}/{i}"))
        # Uncompressed layers: the diff_id is the layer digest itself.
        config = {"architecture": "amd64", "os": "linux",
                  "config": {"Labels": {"bench.ref": ref}},
                  "rootfs": {"type": "layers", "diff_ids": [l["digest"] for l in layers]}}
        config_desc = blobs.put_bytes(json.dumps(config, sort_keys=True).encode(), MT_CONFIG)
        manifest = {"schemaVersion": 2, "mediaType": MT_MANIFEST,
                    "config": config_desc, "layers": layers}
        desc = blobs.put_bytes(json.dumps(manifest, sort_keys=True).encode(), MT_MANIFEST)
        desc["annotations"] = {"org.opencontainers.image.ref.name": ref}
        index["manifests"] = [m for m in index["manifests"]
                              if m.get("annotations", {}).get(
                                  "org.opencontainers.image.ref.name") != ref] + [desc]
        print(f"{root}:{ref} {desc['digest']} ({len(layers)} layers)", file=sys.stderr)
    with open(index_path + ".tmp", "w") as f:
        json.dump(index, f, indent=2)
    os.replace(index_path + ".tmp", index_path)


if __name__ == "__main__":
    main(sys.argv)
