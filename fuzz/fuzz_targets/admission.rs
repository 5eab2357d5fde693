//! The whole admission answer for an arbitrary body: decoding, slots,
//! filters, planning and the patch. The source and target registries are
//! 127.0.0.1:9, where nothing answers, so every lookup fails at once and
//! admission fails open; the budget is short so a run stays quick.
#![no_main]

use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use pinswap::admission::Admission;
use pinswap::config::Config;
use pinswap::metrics::Metrics;

const CONFIG: &str = "\
target: {registry: \"127.0.0.1:9/mirror\"}
source:
  registries: [{registry: \"127.0.0.1:9\"}]
  filters: [{jmespath: \"container.env[?name=='PINSWAP_SKIP'] | [0].value == 'true'\"}]
server: {admissionBudget: 200ms}
";

struct Rig {
    rt: tokio::runtime::Runtime,
    admission: Admission,
}

fn rig() -> &'static Rig {
    static RIG: OnceLock<Rig> = OnceLock::new();
    RIG.get_or_init(|| {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let config = Config::from_yaml(CONFIG, "fuzz").unwrap();
        let admission = {
            let _guard = rt.enter();
            Admission::from_config(&config, Arc::new(Metrics::new())).unwrap()
        };
        Rig { rt, admission }
    })
}

fuzz_target!(|data: &[u8]| {
    let rig = rig();
    let body = Bytes::copy_from_slice(data);
    if let Ok(answer) = rig.rt.block_on(rig.admission.review(body)) {
        let v: serde_json::Value = serde_json::from_slice(&answer).expect("the answer is JSON");
        assert_eq!(v["kind"], "AdmissionReview");
    }
});
