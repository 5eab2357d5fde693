//! Images, indexes and artifacts built in-process.
//!
//! Every fixture keeps the exact bytes of its manifest and blobs; digests are
//! of those bytes. Manifests are built with serde_json, some compact and some
//! pretty-printed (Docker's 3-space style), so a copy that re-serialises them
//! changes their digest and fails the test. Push them with [`super::push`].
//!
//! All fixtures are deterministic: same arguments, same bytes.

use std::io::Write;

use serde_json::{Map, Value, json};
use sha2::{Digest, Sha256};

use super::sha256_digest;

pub const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
pub const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
pub const OCI_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
pub const OCI_LAYER_TAR: &str = "application/vnd.oci.image.layer.v1.tar";
pub const OCI_LAYER_GZIP: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
pub const OCI_EMPTY: &str = "application/vnd.oci.empty.v1+json";
pub const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
pub const DOCKER_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";
pub const DOCKER_CONFIG: &str = "application/vnd.docker.container.image.v1+json";
pub const DOCKER_LAYER_GZIP: &str = "application/vnd.docker.image.rootfs.diff.tar.gzip";
pub const SPIN_LOCKED_APP: &str = "application/vnd.fermyon.spin.application.v1+config";
pub const WASM_LAYER: &str = "application/vnd.wasm.content.layer.v1+wasm";
pub const HELM_CONFIG: &str = "application/vnd.cncf.helm.config.v1+json";
pub const HELM_CHART: &str = "application/vnd.cncf.helm.chart.content.v1.tar+gzip";
pub const IN_TOTO: &str = "application/vnd.in-toto+json";

/// The config every Spin app shares (so all Spin apps share one image ID).
pub const SPIN_CONFIG: &[u8] =
    br#"{"architecture":"wasm","os":"wasip1","rootfs":{"type":"layers","diff_ids":[]}}"#;
pub const SPIN_CONFIG_DIGEST: &str =
    "sha256:aabedf0b094944b344cecbffcfa0a9172e905a5d156bdf67c4c6cbb6d27d1d92";
/// The OCI empty descriptor's content, `{}`.
pub const EMPTY_CONFIG: &[u8] = b"{}";
pub const EMPTY_CONFIG_DIGEST: &str =
    "sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a";

/// Content with its digest and the media type its descriptor will carry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Blob {
    pub bytes: Vec<u8>,
    pub digest: String,
    pub media_type: String,
}

impl Blob {
    pub fn new(media_type: &str, bytes: Vec<u8>) -> Blob {
        Blob {
            digest: sha256_digest(&bytes),
            bytes,
            media_type: media_type.to_owned(),
        }
    }

    pub fn size(&self) -> u64 {
        self.bytes.len() as u64
    }

    /// `{"mediaType","digest","size"}`
    pub fn descriptor(&self) -> Value {
        descriptor(&self.media_type, &self.digest, self.size())
    }
}

/// A single-manifest image or artifact.
#[derive(Clone, Debug)]
pub struct Image {
    pub manifest: Vec<u8>,
    pub media_type: String,
    pub digest: String,
    pub config: Blob,
    pub layers: Vec<Blob>,
}

/// A multi-platform index (OCI) or manifest list (Docker).
#[derive(Clone, Debug)]
pub struct Index {
    pub manifest: Vec<u8>,
    pub media_type: String,
    pub digest: String,
    pub children: Vec<Image>,
}

impl Image {
    /// An OCI linux/amd64 image with `layers` gzip'd tar layers.
    pub fn oci(layers: usize, seed: u64) -> Image {
        Self::oci_for("amd64", None, layers, seed)
    }

    /// An OCI image for `linux/<arch>[/<variant>]`. Compact JSON manifest.
    pub fn oci_for(arch: &str, variant: Option<&str>, layers: usize, seed: u64) -> Image {
        let tars: Vec<Vec<u8>> = (0..layers).map(|i| layer_tar(seed, i)).collect();
        let config = Blob::new(OCI_CONFIG, image_config(arch, variant, &tars, false));
        let layers = tars
            .iter()
            .map(|t| Blob::new(OCI_LAYER_GZIP, gzip(t)))
            .collect();
        Self::assemble(OCI_MANIFEST, config, layers, Map::new(), false)
    }

    /// A Docker schema2 linux/amd64 image, manifest pretty-printed Docker-style.
    pub fn docker(layers: usize, seed: u64) -> Image {
        Self::docker_for("amd64", None, layers, seed)
    }

    pub fn docker_for(arch: &str, variant: Option<&str>, layers: usize, seed: u64) -> Image {
        let tars: Vec<Vec<u8>> = (0..layers).map(|i| layer_tar(seed, i)).collect();
        let config = Blob::new(DOCKER_CONFIG, image_config(arch, variant, &tars, true));
        let layers = tars
            .iter()
            .map(|t| Blob::new(DOCKER_LAYER_GZIP, gzip(t)))
            .collect();
        Self::assemble(DOCKER_MANIFEST, config, layers, Map::new(), true)
    }

    /// A Spin app as `spin registry push` makes it: the shared wasm config,
    /// a locked-app layer naming `app`, and `wasm_layers` wasm modules.
    /// Different `app` names give different layers but the same config.
    pub fn spin(app: &str, wasm_layers: usize, artifact_type: Option<&str>) -> Image {
        let config = Blob::new(OCI_CONFIG, SPIN_CONFIG.to_vec());
        let wasm: Vec<Blob> = (0..wasm_layers)
            .map(|i| Blob::new(WASM_LAYER, wasm_module(&format!("{app}-component-{i}"))))
            .collect();
        let components: Vec<Value> = wasm
            .iter()
            .enumerate()
            .map(|(i, w)| {
                json!({
                    "id": format!("component-{i}"),
                    "source": {"content": {"digest": w.digest}},
                    "metadata": {"allowed_outbound_hosts": []}
                })
            })
            .collect();
        let locked = json!({
            "spin_lock_version": 1,
            "metadata": {"name": app, "version": "0.1.0", "origin": format!("file:///apps/{app}/spin.toml")},
            "triggers": [{"id": "trigger-0", "trigger_type": "http",
                          "trigger_config": {"component": "component-0", "route": "/..."}}],
            "components": components,
        });
        let mut layers = vec![Blob::new(
            SPIN_LOCKED_APP,
            serde_json::to_vec(&locked).unwrap(),
        )];
        layers.extend(wasm);
        let mut extra = Map::new();
        if let Some(t) = artifact_type {
            extra.insert("artifactType".into(), t.into());
        }
        Self::assemble(OCI_MANIFEST, config, layers, extra, false)
    }

    /// An ORAS-style artifact: empty `{}` config, `artifactType`, one file.
    pub fn oras(artifact_type: &str, file_name: &str, payload: &[u8]) -> Image {
        Self::artifact(artifact_type, file_name, payload, None)
    }

    /// An artifact whose `subject` is `subject` (a referrer, e.g. a signature).
    pub fn referrer(subject: &Value, artifact_type: &str, payload: &[u8]) -> Image {
        Self::artifact(
            artifact_type,
            "signature.json",
            payload,
            Some(subject.clone()),
        )
    }

    fn artifact(artifact_type: &str, file: &str, payload: &[u8], subject: Option<Value>) -> Image {
        let config = Blob::new(OCI_EMPTY, EMPTY_CONFIG.to_vec());
        let layer = Blob::new(OCI_LAYER_TAR, payload.to_vec());
        let mut layer_desc = layer.descriptor();
        layer_desc["annotations"] = json!({"org.opencontainers.image.title": file});
        let mut m = Map::new();
        m.insert("schemaVersion".into(), 2.into());
        m.insert("mediaType".into(), OCI_MANIFEST.into());
        m.insert("artifactType".into(), artifact_type.into());
        m.insert("config".into(), config.descriptor());
        m.insert("layers".into(), json!([layer_desc]));
        if let Some(s) = subject {
            m.insert("subject".into(), s);
        }
        m.insert(
            "annotations".into(),
            json!({"org.opencontainers.image.created": "2024-01-01T00:00:00Z"}),
        );
        let manifest = serde_json::to_vec(&Value::Object(m)).unwrap();
        Image {
            digest: sha256_digest(&manifest),
            manifest,
            media_type: OCI_MANIFEST.into(),
            config,
            layers: vec![layer],
        }
    }

    /// A Helm chart as `helm push` stores it.
    pub fn helm(chart: &str, version: &str) -> Image {
        let meta = json!({"name": chart, "version": version, "apiVersion": "v2",
                          "description": "pinswap test chart", "type": "application"});
        let config = Blob::new(HELM_CONFIG, serde_json::to_vec(&meta).unwrap());
        let chart_yaml = format!("apiVersion: v2\nname: {chart}\nversion: {version}\n");
        let tar = tar(&[(format!("{chart}/Chart.yaml"), chart_yaml.into_bytes())]);
        let layer = Blob::new(HELM_CHART, gzip(&tar));
        Self::assemble(OCI_MANIFEST, config, vec![layer], Map::new(), false)
    }

    /// An OCI image of `count` layers of `size` seeded random bytes each
    /// (uncompressed media type; the bytes are not a real tar). Holds every
    /// layer in memory: for big layers use [`StreamedImage::random`], which
    /// yields the same manifest and digests.
    pub fn random_layers(count: usize, size: u64, seed: u64) -> Image {
        let s = StreamedImage::random(count, size, seed);
        Image {
            manifest: s.manifest,
            media_type: s.media_type,
            digest: s.digest,
            config: s.config,
            layers: s.layers.iter().map(RandomBlob::materialize).collect(),
        }
    }

    /// `{"mediaType","digest","size"}` of this manifest (e.g. for `subject`).
    pub fn descriptor(&self) -> Value {
        descriptor(&self.media_type, &self.digest, self.manifest.len() as u64)
    }

    /// Config first, then layers.
    pub fn blobs(&self) -> impl Iterator<Item = &Blob> {
        std::iter::once(&self.config).chain(&self.layers)
    }

    /// A manifest of `media_type` over exactly this config and these layers
    /// (any number, none included).
    pub fn with_parts(media_type: &str, config: Blob, layers: Vec<Blob>) -> Image {
        Self::assemble(media_type, config, layers, Map::new(), false)
    }

    /// The same image with every gzip layer recompressed at another level:
    /// other layer digests, the same uncompressed content (so the same
    /// config and `rootfs.diff_ids`). Legitimately one image ID.
    pub fn recompressed(&self) -> Image {
        let layers = self
            .layers
            .iter()
            .map(|l| {
                let mut raw = Vec::new();
                std::io::Read::read_to_end(
                    &mut flate2::read::GzDecoder::new(&l.bytes[..]),
                    &mut raw,
                )
                .unwrap();
                let mut enc = flate2::GzBuilder::new()
                    .mtime(0)
                    .write(Vec::new(), flate2::Compression::fast());
                enc.write_all(&raw).unwrap();
                Blob::new(&l.media_type, enc.finish().unwrap())
            })
            .collect();
        Self::assemble(
            &self.media_type,
            self.config.clone(),
            layers,
            Map::new(),
            false,
        )
    }

    fn assemble(
        media_type: &str,
        config: Blob,
        layers: Vec<Blob>,
        extra: Map<String, Value>,
        pretty: bool,
    ) -> Image {
        let mut m = Map::new();
        m.insert("schemaVersion".into(), 2.into());
        m.insert("mediaType".into(), media_type.into());
        m.extend(extra);
        m.insert("config".into(), config.descriptor());
        m.insert(
            "layers".into(),
            layers
                .iter()
                .map(Blob::descriptor)
                .collect::<Vec<_>>()
                .into(),
        );
        let manifest = to_json(&Value::Object(m), pretty);
        Image {
            digest: sha256_digest(&manifest),
            manifest,
            media_type: media_type.into(),
            config,
            layers,
        }
    }
}

impl Index {
    /// OCI index: linux/amd64 and linux/arm64/v8, plus, with `attestation`,
    /// a buildx-style attestation manifest (platform unknown/unknown).
    pub fn oci(seed: u64, attestation: bool) -> Index {
        let amd64 = Image::oci_for("amd64", None, 2, seed);
        let arm64 = Image::oci_for("arm64", Some("v8"), 2, seed.wrapping_add(1));
        let mut descs = vec![
            platform_descriptor(&amd64, "amd64", None),
            platform_descriptor(&arm64, "arm64", Some("v8")),
        ];
        let mut children = vec![amd64, arm64];
        if attestation {
            let att = attestation_manifest(&children[0], seed);
            let mut d = platform_descriptor(&att, "unknown", None);
            d["platform"]["os"] = "unknown".into();
            d["annotations"] = json!({
                "vnd.docker.reference.digest": children[0].digest,
                "vnd.docker.reference.type": "attestation-manifest",
            });
            descs.push(d);
            children.push(att);
        }
        let manifest = to_json(
            &json!({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": descs}),
            false,
        );
        Index {
            digest: sha256_digest(&manifest),
            manifest,
            media_type: OCI_INDEX.into(),
            children,
        }
    }

    /// Docker manifest list (linux/amd64, linux/arm64/v8), pretty-printed.
    pub fn docker(seed: u64) -> Index {
        let children = vec![
            Image::docker_for("amd64", None, 2, seed),
            Image::docker_for("arm64", Some("v8"), 2, seed.wrapping_add(1)),
        ];
        let descs = vec![
            platform_descriptor(&children[0], "amd64", None),
            platform_descriptor(&children[1], "arm64", Some("v8")),
        ];
        let manifest = to_json(
            &json!({"schemaVersion": 2, "mediaType": DOCKER_LIST, "manifests": descs}),
            true,
        );
        Index {
            digest: sha256_digest(&manifest),
            manifest,
            media_type: DOCKER_LIST.into(),
            children,
        }
    }

    pub fn descriptor(&self) -> Value {
        descriptor(&self.media_type, &self.digest, self.manifest.len() as u64)
    }
}

/// A blob of `size` bytes from a seeded RNG, generated on demand in
/// [`RANDOM_CHUNK`] pieces, so it never needs to be in memory whole.
#[derive(Clone, Debug)]
pub struct RandomBlob {
    pub seed: u64,
    pub size: u64,
    pub digest: String,
    pub media_type: String,
}

pub const RANDOM_CHUNK: usize = 1 << 20;

impl RandomBlob {
    /// Generates the content once to compute the digest.
    pub fn new(media_type: &str, size: u64, seed: u64) -> RandomBlob {
        let mut blob = RandomBlob {
            seed,
            size,
            digest: String::new(),
            media_type: media_type.to_owned(),
        };
        let mut h = Sha256::new();
        for chunk in blob.chunks() {
            h.update(&chunk);
        }
        blob.digest = format!("sha256:{}", hex::encode(h.finalize()));
        blob
    }

    /// The content, chunk by chunk; the same every time.
    pub fn chunks(&self) -> impl Iterator<Item = Vec<u8>> + Send + 'static {
        let mut rng = SplitMix64(self.seed);
        let mut left = self.size;
        std::iter::from_fn(move || {
            if left == 0 {
                return None;
            }
            let n = left.min(RANDOM_CHUNK as u64) as usize;
            left -= n as u64;
            let mut buf = vec![0u8; n];
            rng.fill(&mut buf);
            Some(buf)
        })
    }

    pub fn materialize(&self) -> Blob {
        let bytes = self.chunks().flatten().collect();
        Blob {
            bytes,
            digest: self.digest.clone(),
            media_type: self.media_type.clone(),
        }
    }

    pub fn descriptor(&self) -> Value {
        descriptor(&self.media_type, &self.digest, self.size)
    }
}

/// An OCI image whose layers are [`RandomBlob`]s, for benchmarks and fault
/// tests with big layers (≥ 100 MiB). Push with
/// [`super::push::push_streamed_image`].
#[derive(Clone, Debug)]
pub struct StreamedImage {
    pub manifest: Vec<u8>,
    pub media_type: String,
    pub digest: String,
    pub config: Blob,
    pub layers: Vec<RandomBlob>,
}

impl StreamedImage {
    pub fn random(count: usize, size: u64, seed: u64) -> StreamedImage {
        let layers: Vec<RandomBlob> = (0..count as u64)
            .map(|i| {
                let layer_seed = seed ^ (i + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                RandomBlob::new(OCI_LAYER_TAR, size, layer_seed)
            })
            .collect();
        // Uncompressed layers: diff_id == digest.
        let config = json!({
            "architecture": "amd64", "os": "linux",
            "config": {"Labels": {"pinswap.test/seed": seed.to_string()}},
            "rootfs": {"type": "layers",
                       "diff_ids": layers.iter().map(|l| l.digest.clone()).collect::<Vec<_>>()},
        });
        let config = Blob::new(OCI_CONFIG, serde_json::to_vec(&config).unwrap());
        let manifest = to_json(
            &json!({
                "schemaVersion": 2,
                "mediaType": OCI_MANIFEST,
                "config": config.descriptor(),
                "layers": layers.iter().map(RandomBlob::descriptor).collect::<Vec<_>>(),
            }),
            false,
        );
        StreamedImage {
            digest: sha256_digest(&manifest),
            manifest,
            media_type: OCI_MANIFEST.into(),
            config,
            layers,
        }
    }
}

// ---- building blocks ---------------------------------------------------

pub fn descriptor(media_type: &str, digest: &str, size: u64) -> Value {
    json!({"mediaType": media_type, "digest": digest, "size": size})
}

fn platform_descriptor(img: &Image, arch: &str, variant: Option<&str>) -> Value {
    let mut d = img.descriptor();
    d["platform"] = json!({"architecture": arch, "os": "linux"});
    if let Some(v) = variant {
        d["platform"]["variant"] = v.into();
    }
    d
}

/// Compact JSON, or pretty with Docker's 3-space indent.
fn to_json(v: &Value, pretty: bool) -> Vec<u8> {
    if !pretty {
        return serde_json::to_vec(v).unwrap();
    }
    let mut out = Vec::new();
    let fmt = serde_json::ser::PrettyFormatter::with_indent(b"   ");
    let mut ser = serde_json::Serializer::with_formatter(&mut out, fmt);
    serde::Serialize::serialize(v, &mut ser).unwrap();
    out
}

/// An image config with correct `rootfs.diff_ids` (sha256 of each tar).
fn image_config(arch: &str, variant: Option<&str>, tars: &[Vec<u8>], docker: bool) -> Vec<u8> {
    let mut c = json!({
        "architecture": arch,
        "os": "linux",
        "created": "2024-01-01T00:00:00Z",
        "config": {"Env": ["PATH=/usr/local/bin:/usr/bin:/bin"], "Cmd": ["/bin/app"]},
        "rootfs": {"type": "layers",
                   "diff_ids": tars.iter().map(|t| sha256_digest(t)).collect::<Vec<_>>()},
        "history": (0..tars.len())
            .map(|i| json!({"created": "2024-01-01T00:00:00Z",
                            "created_by": format!("pinswap fixture layer {i}")}))
            .collect::<Vec<_>>(),
    });
    if let Some(v) = variant {
        c["variant"] = v.into();
    }
    to_json(&c, docker)
}

/// Layer `i` of the image made from `seed`: a text file and some random bytes.
fn layer_tar(seed: u64, i: usize) -> Vec<u8> {
    let mut rng = SplitMix64(seed.wrapping_mul(1000).wrapping_add(i as u64));
    let mut noise = vec![0u8; 512 + (rng.next() % 1024) as usize];
    rng.fill(&mut noise);
    tar(&[
        (
            format!("etc/pinswap/layer-{i}.txt"),
            format!("pinswap fixture: seed {seed}, layer {i}\n").into_bytes(),
        ),
        (format!("usr/share/pinswap/noise-{i}.bin"), noise),
    ])
}

fn attestation_manifest(subject: &Image, seed: u64) -> Image {
    let statement = json!({
        "_type": "https://in-toto.io/Statement/v0.1",
        "predicateType": "https://spdx.dev/Document",
        "subject": [{"name": "pinswap-fixture", "digest": {"sha256": &subject.digest[7..]}}],
        "predicate": {"spdxVersion": "SPDX-2.3", "name": format!("sbom-{seed}")},
    });
    let layer = Blob::new(IN_TOTO, serde_json::to_vec(&statement).unwrap());
    let config = json!({
        "architecture": "unknown", "os": "unknown", "config": {},
        "rootfs": {"type": "layers", "diff_ids": [layer.digest]},
    });
    let config = Blob::new(OCI_CONFIG, serde_json::to_vec(&config).unwrap());
    let mut layer_desc = layer.descriptor();
    layer_desc["annotations"] = json!({"in-toto.io/predicate-type": "https://spdx.dev/Document"});
    let manifest = to_json(
        &json!({"schemaVersion": 2, "mediaType": OCI_MANIFEST,
                "config": config.descriptor(), "layers": [layer_desc]}),
        false,
    );
    Image {
        digest: sha256_digest(&manifest),
        manifest,
        media_type: OCI_MANIFEST.into(),
        config,
        layers: vec![layer],
    }
}

/// SplitMix64: a tiny seeded generator, fast even in unoptimised test builds
/// (rand's StdRng manages ~20 MB/s there) and defined here, so fixture bytes
/// never change with a dependency's version.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Fills `buf`; consecutive calls continue one stream when every `buf`
    /// but the last has a length divisible by 8.
    fn fill(&mut self, buf: &mut [u8]) {
        let mut words = buf.chunks_exact_mut(8);
        for w in &mut words {
            w.copy_from_slice(&self.next().to_le_bytes());
        }
        let tail = words.into_remainder();
        if !tail.is_empty() {
            let n = tail.len();
            tail.copy_from_slice(&self.next().to_le_bytes()[..n]);
        }
    }
}

/// A minimal valid wasm module: magic, version 1, one custom section `name`.
fn wasm_module(name: &str) -> Vec<u8> {
    let mut section = leb128(name.len() as u64);
    section.extend_from_slice(name.as_bytes());
    section.extend_from_slice(b"pinswap test component");
    let mut m = b"\0asm\x01\0\0\0".to_vec();
    m.push(0); // custom section id
    m.extend(leb128(section.len() as u64));
    m.extend(section);
    m
}

fn leb128(mut v: u64) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let byte = (v & 0x7f) as u8;
        v >>= 7;
        if v == 0 {
            out.push(byte);
            return out;
        }
        out.push(byte | 0x80);
    }
}

/// gzip with a fixed header (mtime 0), so output is deterministic.
pub fn gzip(data: &[u8]) -> Vec<u8> {
    let mut enc = flate2::GzBuilder::new()
        .mtime(0)
        .write(Vec::new(), flate2::Compression::default());
    enc.write_all(data).unwrap();
    enc.finish().unwrap()
}

/// A ustar archive of regular files (mode 0644, uid/gid 0, mtime 0).
pub fn tar(files: &[(String, Vec<u8>)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (name, data) in files {
        assert!(name.len() < 100, "tar name too long: {name}");
        let mut h = [0u8; 512];
        h[..name.len()].copy_from_slice(name.as_bytes());
        let mut field = |off: usize, len: usize, val: u64| {
            let s = format!("{val:0width$o}\0", width = len - 1);
            h[off..off + len].copy_from_slice(s.as_bytes());
        };
        field(100, 8, 0o644); // mode
        field(108, 8, 0); // uid
        field(116, 8, 0); // gid
        field(124, 12, data.len() as u64); // size
        field(136, 12, 0); // mtime
        h[156] = b'0'; // regular file
        h[257..263].copy_from_slice(b"ustar\0");
        h[263..265].copy_from_slice(b"00");
        // Checksum: sum of the header with the checksum field as spaces.
        h[148..156].copy_from_slice(b"        ");
        let sum: u32 = h.iter().map(|&b| b as u32).sum();
        h[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
        out.extend_from_slice(&h);
        out.extend_from_slice(data);
        out.resize(out.len().div_ceil(512) * 512, 0);
    }
    out.resize(out.len() + 1024, 0); // end-of-archive: two zero blocks
    out
}
