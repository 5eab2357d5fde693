//! `config convert` input (a k8s-image-swapper config): the output of a
//! successful conversion loads as a pinswap config.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pinswap::config::Config;
use pinswap::convert::convert;

fuzz_target!(|data: &[u8]| {
    let Ok(s) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(c) = convert(s, "fuzz.yaml") {
        Config::from_yaml(&c.yaml, "converted").expect("converted config loads");
    }
});
