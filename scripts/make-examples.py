#!/usr/bin/env python3
"""Writes the small, deterministic OCI layouts under examples/oci/ that the
demo seeds its source registry from. Run from the repo root; the output is
committed, so this only needs re-running when the examples change."""
import gzip, hashlib, io, json, os, shutil, tarfile

ROOT = os.path.join(os.path.dirname(__file__), "..", "examples", "oci")

def sha(b):
    return "sha256:" + hashlib.sha256(b).hexdigest()

class Layout:
    def __init__(self, name):
        self.dir = os.path.join(ROOT, name)
        shutil.rmtree(self.dir, ignore_errors=True)
        os.makedirs(os.path.join(self.dir, "blobs", "sha256"))
        self.entries = []

    def blob(self, data, media_type):
        d = sha(data)
        with open(os.path.join(self.dir, "blobs", "sha256", d[7:]), "wb") as f:
            f.write(data)
        return {"mediaType": media_type, "digest": d, "size": len(data)}

    def tag(self, desc, ref):
        e = dict(desc)
        e["annotations"] = {"org.opencontainers.image.ref.name": ref}
        self.entries.append(e)

    def close(self):
        with open(os.path.join(self.dir, "oci-layout"), "w") as f:
            f.write('{"imageLayoutVersion":"1.0.0"}')
        with open(os.path.join(self.dir, "index.json"), "w") as f:
            json.dump({"schemaVersion": 2, "manifests": self.entries}, f)

def tar_of(files):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as t:
        for name, data in files:
            ti = tarfile.TarInfo(name)
            ti.size, ti.mtime, ti.mode = len(data), 1700000000, 0o644
            t.addfile(ti, io.BytesIO(data))
    return buf.getvalue()

def gz(data):
    return gzip.compress(data, mtime=0)

def image(lay, arch, text, docker=False, variant=None):
    raw = tar_of([("hello.txt", text.encode())])
    lt = "application/vnd.docker.image.rootfs.diff.tar.gzip" if docker else "application/vnd.oci.image.layer.v1.tar+gzip"
    layer = lay.blob(gz(raw), lt)
    cfg = {"architecture": arch, "os": "linux", "config": {"Cmd": ["cat", "/hello.txt"]},
           "rootfs": {"type": "layers", "diff_ids": [sha(raw)]}}
    if variant:
        cfg["variant"] = variant
    ct = "application/vnd.docker.container.image.v1+json" if docker else "application/vnd.oci.image.config.v1+json"
    config = lay.blob(json.dumps(cfg, separators=(",", ":")).encode(), ct)
    mt = "application/vnd.docker.distribution.manifest.v2+json" if docker else "application/vnd.oci.image.manifest.v1+json"
    m = {"schemaVersion": 2, "mediaType": mt, "config": config, "layers": [layer]}
    # Docker-style pretty printing: a copy that re-serialised would change the digest.
    body = json.dumps(m, indent=3).encode() if docker else json.dumps(m, separators=(",", ":")).encode()
    return lay.blob(body, mt)

# A multi-platform OCI index.
lay = Layout("hello")
children = []
for arch, variant in [("amd64", None), ("arm64", "v8")]:
    d = image(lay, arch, f"hello from linux/{arch}\n", variant=variant)
    d["platform"] = {"architecture": arch, "os": "linux", **({"variant": variant} if variant else {})}
    children.append(d)
idx = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": children}
lay.tag(lay.blob(json.dumps(idx, separators=(",", ":")).encode(), idx["mediaType"]), "v1")
lay.close()

# A Docker schema2 image.
lay = Layout("web")
lay.tag(image(lay, "amd64", "web 1.0\n", docker=True), "1.0")
lay.close()

# Two Spin apps as Spin < 2.4 pushed them: one shared 78-byte config.
SPIN_CONFIG = b'{"architecture":"wasm","os":"wasip1","rootfs":{"type":"layers","diff_ids":[]}}'
assert len(SPIN_CONFIG) == 78
lay = Layout("spin")
for app in ["hello", "goodbye"]:
    wasm = lay.blob(b"\0asm\x01\0\0\0" + f"component {app}".encode(), "application/vnd.wasm.content.layer.v1+wasm")
    locked = {"spin_lock_version": 1, "metadata": {"name": app},
              "components": [{"id": app, "source": {"content": {"digest": wasm["digest"]}}}]}
    lk = lay.blob(json.dumps(locked, separators=(",", ":")).encode(), "application/vnd.fermyon.spin.application.v1+config")
    config = lay.blob(SPIN_CONFIG, "application/vnd.oci.image.config.v1+json")
    m = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
         "config": config, "layers": [lk, wasm]}
    lay.tag(lay.blob(json.dumps(m, separators=(",", ":")).encode(), m["mediaType"]), app)
lay.close()
print("wrote", os.path.normpath(ROOT))
