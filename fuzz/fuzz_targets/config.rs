//! Config parsing and validation: bad input is an error naming the key,
//! never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pinswap::config::Config;

fuzz_target!(|data: &[u8]| {
    let Ok(s) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(c) = Config::from_yaml(s, "fuzz.yaml") {
        let _ = c.copy_deadline_exceeds_budget();
    }
});
