//! Reference, digest and mirror-target parsing, and the mirror-path map.
//! Properties: no panic; a parsed reference prints and parses back to
//! itself; a mapped reference parses back to itself and stays under the
//! target.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pinswap::reference::{Digest, MirrorTarget, Reference};

fuzz_target!(|data: &[u8]| {
    let Ok(s) = std::str::from_utf8(data) else {
        return;
    };
    let _ = Digest::parse(s);
    // The input is split once at a newline: a target, then a reference.
    let (target, source) = s.split_once('\n').unwrap_or(("127.0.0.1:5002/mirror", s));
    if let Ok(r) = Reference::parse(source) {
        let again = Reference::parse(&r.to_string()).expect("a printed reference parses");
        if r.tag().is_some() || r.digest().is_some() {
            assert_eq!(again, r, "round trip of {source:?}");
        }
        let _ = r.to_oci();
        let _ = r.is_loopback();
        for t in [target, "127.0.0.1:5002", "mirror.example.com/a/b"] {
            let Ok(t) = MirrorTarget::parse(t) else {
                continue;
            };
            if let Ok(m) = t.map(&r) {
                assert!(t.contains(&m), "{m} not under {t:?}");
                let back = Reference::parse(&m.to_string()).expect("a mirror path parses");
                assert_eq!(back.repository(), m.repository());
            }
        }
    }
    let _ = MirrorTarget::parse(s);
});
