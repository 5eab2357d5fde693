//! Identity assessment of arbitrary image configs, and the repair that
//! follows: a repaired config is content-bearing.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pinswap::identity::{assess, repair_config};
use pinswap::registry::manifest::Descriptor;

fuzz_target!(|data: &[u8]| {
    // The first line lists layer digests separated by spaces.
    let (head, config) = match data.iter().position(|b| *b == b'\n') {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (&b""[..], data),
    };
    let layers: Vec<Descriptor> = String::from_utf8_lossy(head)
        .split(' ')
        .filter(|s| !s.is_empty())
        .map(|d| Descriptor {
            media_type: "application/vnd.oci.image.layer.v1.tar+gzip".into(),
            digest: d.to_owned(),
            size: 1,
            platform: None,
            urls: None,
        })
        .collect();
    let desc = Descriptor {
        media_type: "application/vnd.oci.image.config.v1+json".into(),
        digest: pinswap::registry::check::sha256_digest(config).to_string(),
        size: config.len() as u64,
        platform: None,
        urls: None,
    };
    let facts = assess("sha256:00", &desc, &layers, config);
    if let Ok(repaired) = repair_config(config, &desc, &facts.layers) {
        let again = assess("sha256:00", &desc, &layers, &repaired);
        assert!(
            again.content_bearing,
            "a repaired config carries its layers"
        );
    }
});
