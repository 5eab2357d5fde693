//! Helpers of the admission tests: AdmissionReview fixtures from
//! `tests/data/admission/`, configs, and a rig of two registries and an
//! admission handler whose answers are read back as patched Pods.

use crate::common;
use std::collections::BTreeMap;
use std::sync::Arc;

use crate::common::fixtures::Image;
use crate::common::{TestRegistry, push_image};
use pinswap::admission::Admission;
use pinswap::config::Config;
use pinswap::metrics::Metrics;
use serde_json::Value;

pub fn fixture(name: &str, vars: &[(&str, &str)]) -> bytes::Bytes {
    let path = format!("{}/tests/data/admission/{name}", env!("CARGO_MANIFEST_DIR"));
    let mut text = std::fs::read_to_string(&path).unwrap();
    for (k, v) in vars {
        text = text.replace(&format!("{{{{{k}}}}}"), v);
    }
    bytes::Bytes::from(text)
}

pub fn config(src: &str, target: &str, extra: &str) -> Config {
    let yaml = format!(
        "target: {{registry: \"{target}/mirror\"}}\nsource:\n  registries: [{{registry: \"{src}\"}}]\n  filters: [{{jmespath: \"container.env[?name=='PINSWAP_SKIP'] | [0].value == 'true'\"}}]\n{extra}"
    );
    Config::from_yaml(&yaml, "test.yaml").unwrap()
}

pub struct Answer {
    pub response: Value,
    pub pod: Value,
    pub original: Value,
}

impl Answer {
    pub fn allowed(&self) -> bool {
        self.response["allowed"] == true
    }
    pub fn image(&self, kind: &str, i: usize) -> &str {
        self.pod["spec"][kind][i]["image"].as_str().unwrap()
    }
    pub fn annotation(&self, key: &str) -> BTreeMap<String, String> {
        self.pod["metadata"]["annotations"][key]
            .as_str()
            .map(|s| serde_json::from_str(s).unwrap())
            .unwrap_or_default()
    }
}

/// Reviews `body` and applies the patch to the request's Pod.
pub async fn review(adm: &Admission, body: bytes::Bytes) -> Answer {
    let request: Value = serde_json::from_slice(&body).unwrap();
    let out = adm.review(body).await.expect("a review");
    let review: Value = serde_json::from_slice(&out).unwrap();
    let response = review["response"].clone();
    assert_eq!(response["uid"], request["request"]["uid"]);
    assert_eq!(
        review["apiVersion"], request["apiVersion"],
        "answers in the request's version"
    );
    let original = request["request"]["object"].clone();
    let mut pod = original.clone();
    if let Some(patch) = common::review::apply_patch(&response, &mut pod) {
        for op in &patch.0 {
            if let json_patch::PatchOperation::Replace(r) = op {
                let path = r.path.to_string();
                assert!(
                    path.ends_with("/image")
                        || (path.starts_with("/spec/volumes/")
                            && path.ends_with("/image/reference")),
                    "only image replaces: {op:?}"
                );
            }
        }
    }
    Answer {
        response,
        pod,
        original,
    }
}

pub struct Rig {
    pub src: TestRegistry,
    pub dst: TestRegistry,
    pub app: Image,
    pub debug: Image,
}

pub async fn rig() -> Rig {
    let (src, dst) = (TestRegistry::plain().await, TestRegistry::plain().await);
    let app = Image::oci(2, 301);
    push_image(&src, "shop/app", Some("v1"), &app).await;
    let debug = Image::oci(1, 302);
    push_image(&src, "shop/debug", Some("v1"), &debug).await;
    push_image(&src, "shop/sidecar", Some("v1"), &Image::oci(1, 303)).await;
    Rig {
        src,
        dst,
        app,
        debug,
    }
}

impl Rig {
    pub fn vars(&self) -> Vec<(&'static str, String)> {
        vec![
            ("SRC", self.src.host()),
            ("TARGET", self.dst.host()),
            ("SRC_COMPONENT", format!("127.0.0.1_{}", self.src.port())),
            ("APP_DIGEST", self.app.digest.clone()),
        ]
    }
    pub fn body(&self, name: &str) -> bytes::Bytes {
        let v = self.vars();
        let vars: Vec<(&str, &str)> = v.iter().map(|(k, v)| (*k, v.as_str())).collect();
        fixture(name, &vars)
    }
    pub fn admission(&self, extra: &str) -> (Admission, Arc<Metrics>) {
        let metrics = Arc::new(Metrics::new());
        let c = config(&self.src.host(), &self.dst.host(), extra);
        (
            Admission::from_config(&c, metrics.clone()).unwrap(),
            metrics,
        )
    }
    pub fn mirrored(&self, repo: &str) -> String {
        format!(
            "{}/mirror/127.0.0.1_{}/{repo}",
            self.dst.host(),
            self.src.port()
        )
    }
}
