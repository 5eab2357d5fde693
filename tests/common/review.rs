//! AdmissionReviews for tests: wrap a Pod in a request, send it through
//! `Admission::review`, and apply the answer's JSONPatch the way the API
//! server does.

use pinswap::admission::Admission;
use serde_json::{Value, json};

/// Decodes `response.patch`, which must be a base64 string (the API's
/// documented form for `[]byte`), and applies it to `pod` as the API server
/// does. Returns the patch, or `None` when there is none.
pub fn apply_patch(response: &Value, pod: &mut Value) -> Option<json_patch::Patch> {
    let bytes: Vec<u8> = match &response["patch"] {
        Value::String(p) => {
            use base64::Engine as _;
            base64::engine::general_purpose::STANDARD
                .decode(p)
                .expect("patch is standard base64")
        }
        Value::Null => return None,
        other => panic!("patch is not a base64 string: {other}"),
    };
    let patch: json_patch::Patch = serde_json::from_slice(&bytes).unwrap();
    json_patch::patch(pod, &patch).unwrap();
    assert_eq!(response["patchType"], "JSONPatch");
    Some(patch)
}

/// A CREATE AdmissionReview (v1) for `pod`.
pub fn create_review(pod: &Value) -> Value {
    json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "11111111-2222-3333-4444-555555555555",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "name": pod["metadata"]["name"],
            "namespace": pod["metadata"]["namespace"],
            "operation": "CREATE",
            "userInfo": {"username": "test"},
            "object": pod,
            "dryRun": false
        }
    })
}

/// Admits `pod` on CREATE and returns it as the API server would store it
/// (patched), with the response.
pub async fn admit(adm: &Admission, pod: &Value) -> (Value, Value) {
    let body = serde_json::to_vec(&create_review(pod)).unwrap();
    let out = adm.review(body.into()).await.expect("a review");
    let review: Value = serde_json::from_slice(&out).unwrap();
    let response = review["response"].clone();
    assert_eq!(response["allowed"], true, "{response}");
    let mut patched = pod.clone();
    apply_patch(&response, &mut patched);
    (patched, response)
}

/// A Pod with one container per `(name, image)`.
pub fn pod(ns: &str, name: &str, containers: &[(&str, &str)]) -> Value {
    let containers: Vec<Value> = containers
        .iter()
        .map(|(n, i)| json!({"name": n, "image": i}))
        .collect();
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "uid": format!("uid-{ns}-{name}")},
        "spec": {"containers": containers}
    })
}

/// `pod` with the status a kubelet reports when it cannot pull
/// `container`'s image: `waiting.reason` = `reason` (`ErrImagePull` or
/// `ImagePullBackOff`).
pub fn pull_failing(pod: &Value, container: &str, reason: &str) -> Value {
    let mut pod = pod.clone();
    let image = pod["spec"]["containers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == container)
        .unwrap()["image"]
        .clone();
    let message = format!(
        "rpc error: code = NotFound desc = failed to pull and unpack image {image}: not found"
    );
    pod["status"] = json!({
        "phase": "Pending",
        "containerStatuses": [{
            "name": container, "image": image, "imageID": "", "ready": false, "restartCount": 0,
            "started": false,
            "state": {"waiting": {"reason": reason, "message": message}}
        }]
    });
    pod
}

/// `pod` running its container `app` (the kubelet pulled the image).
pub fn running(pod: &Value) -> Value {
    let mut pod = pod.clone();
    let image = pod["spec"]["containers"][0]["image"].clone();
    pod["status"] = json!({
        "phase": "Running",
        "containerStatuses": [{
            "name": "app", "image": image, "imageID": "", "ready": true, "restartCount": 0,
            "started": true, "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}}
        }]
    });
    pod
}
