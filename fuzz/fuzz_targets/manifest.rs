//! Manifest and index parsing, blob lists and platform filtering.
//! The first line is a Content-Type and a platform list (`;`-separated
//! `os/arch[/variant]`), the rest the manifest bytes.
#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use pinswap::reference::Digest;
use pinswap::platform::PlatformSpec;
use pinswap::registry::manifest::{RawManifest, filter_index};

const DIGEST: &str = "sha256:0000000000000000000000000000000000000000000000000000000000000000";

fuzz_target!(|data: &[u8]| {
    let (head, body) = match data.iter().position(|b| *b == b'\n') {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (&b""[..], data),
    };
    let head = String::from_utf8_lossy(head);
    let (content_type, platforms) = head.split_once(' ').unwrap_or((&head, "linux/amd64"));
    let content_type = (!content_type.is_empty()).then_some(content_type);
    let platforms: Vec<PlatformSpec> = platforms
        .split(';')
        .filter_map(|p| p.parse().ok())
        .collect();
    let digest = Digest::parse(DIGEST).unwrap();
    let Ok(m) = RawManifest::parse(Bytes::copy_from_slice(body), digest, content_type) else {
        return;
    };
    let _ = m.blobs();
    if let Ok((bytes, kept)) = filter_index(&m, &platforms) {
        assert!(!kept.is_empty());
        let again = RawManifest::parse(bytes, Digest::parse(DIGEST).unwrap(), None)
            .expect("a filtered index parses");
        let _ = again.blobs();
    }
});
