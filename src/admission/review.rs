//! The AdmissionReview wire format (`admission.k8s.io/v1` and `v1beta1`):
//! the request as pinswap reads it, and the response as it writes it.
//!
//! Why not kube-core's `AdmissionReview<DynamicObject>` for decoding: its
//! envelope and `DynamicObject` both use `#[serde(flatten)]`, which makes
//! serde buffer the whole body into an intermediate tree and decode it a
//! second time, and the Pod a third time through `ObjectMeta`. That was
//! the largest cost of a cached admission in the profile. Here the body is
//! decoded once, the Pod straight into a `serde_json::Value` (the form the
//! rest of admission works on). kube-core's `AdmissionResponse` is kept for
//! the answer.

use kube::core::admission::{AdmissionResponse, Operation};
use kube::core::{GroupVersionKind, Status, TypeMeta};
use serde::Deserialize;

use crate::logsafe::clip;

/// The AdmissionReview versions the API server sends.
const REVIEW_VERSIONS: [&str; 2] = ["admission.k8s.io/v1", "admission.k8s.io/v1beta1"];

/// Why a request body is not an AdmissionReview; the server answers 400.
#[derive(Debug, thiserror::Error)]
pub enum ReviewError {
    /// Not JSON, or not an AdmissionReview with a request.
    #[error("malformed AdmissionReview: {0}")]
    Malformed(String),
}

/// The review's `apiVersion` and its request, checked: an AdmissionReview
/// of a version the API server sends, with a request whose `object`, if
/// any, is a JSON object.
///
/// # Errors
/// [`ReviewError::Malformed`], naming what is wrong.
pub(crate) fn decode(body: &[u8]) -> Result<(String, Request), ReviewError> {
    let review: ReviewIn =
        serde_json::from_slice(body).map_err(|e| ReviewError::Malformed(e.to_string()))?;
    if !REVIEW_VERSIONS.contains(&review.api_version.as_str()) || review.kind != "AdmissionReview" {
        return Err(ReviewError::Malformed(format!(
            "found apiVersion {:?} kind {:?}, expected an AdmissionReview of admission.k8s.io/v1 or admission.k8s.io/v1beta1",
            clip(&review.api_version, 64),
            clip(&review.kind, 64),
        )));
    }
    let Some(req) = review.request else {
        return Err(ReviewError::Malformed(
            "the AdmissionReview has no request".into(),
        ));
    };
    if req.object.as_ref().is_some_and(|o| !o.is_object()) {
        return Err(ReviewError::Malformed(
            "request.object is not a JSON object".into(),
        ));
    }
    Ok((review.api_version, req))
}

/// The envelope: `apiVersion`, `kind` and `request`; a `response` in the
/// body is ignored.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ReviewIn {
    /// `admission.k8s.io/v1` or `admission.k8s.io/v1beta1` (checked by [`decode`]).
    pub api_version: String,
    /// `AdmissionReview` (checked by [`decode`]).
    pub kind: String,
    /// Absent in a malformed review.
    #[serde(default)]
    pub request: Option<Request>,
}

/// The fields of `request` that admission reads. Required as in the API:
/// `uid`, `kind` and `operation`; the rest may be absent or null.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Request {
    /// Echoed in the response.
    pub uid: String,
    /// The object's kind, e.g. `{"group":"","version":"v1","kind":"Pod"}`.
    pub kind: GroupVersionKind,
    /// `ephemeralcontainers`, `status`, …; absent for the object itself.
    #[serde(default)]
    pub sub_resource: Option<String>,
    /// The request's namespace; may be empty.
    #[serde(default)]
    pub namespace: Option<String>,
    /// `CREATE`, `UPDATE`, `DELETE` or `CONNECT`.
    pub operation: Operation,
    /// The object as admitted, when the operation has one.
    #[serde(default)]
    pub object: Option<serde_json::Value>,
    /// The stored object, on UPDATE.
    #[serde(default)]
    pub old_object: Option<serde_json::Value>,
    /// Whether the request has no side effects.
    #[serde(default)]
    pub dry_run: Option<bool>,
}

impl Request {
    /// An allowing, unpatched response to this request, of the review's
    /// `apiVersion`.
    pub fn allow(&self, api_version: &str) -> AdmissionResponse {
        // kube-core builds a response only from its own request type, or
        // as `invalid`; the fields it sets are public, so `invalid` is
        // turned into the allowing response `From<&AdmissionRequest>` gives.
        let mut r = AdmissionResponse::invalid("");
        r.types = TypeMeta {
            api_version: api_version.to_owned(),
            kind: "AdmissionReview".to_owned(),
        };
        r.uid.clone_from(&self.uid);
        r.allowed = true;
        r.result = Status::default();
        r
    }

    /// Whether the request is a dry run (`dryRun: true`).
    pub fn is_dry_run(&self) -> bool {
        self.dry_run.unwrap_or(false)
    }
}

/// The response AdmissionReview's JSON, its `patch` as base64: the API's
/// documented form for a `[]byte` field. kube-core writes it as an array of
/// numbers, which the API server's decoder also takes, but which is about
/// three times larger and which tools that follow the API docs cannot read.
///
/// # Errors
/// Only serde_json's, which a response of strings and maps does not raise.
pub(crate) fn encode(mut resp: AdmissionResponse) -> Result<Vec<u8>, serde_json::Error> {
    use base64::Engine as _;

    #[derive(serde::Serialize)]
    struct Review<'a> {
        #[serde(flatten)]
        types: &'a TypeMeta,
        response: Response<'a>,
    }
    #[derive(serde::Serialize)]
    struct Response<'a> {
        #[serde(flatten)]
        response: &'a AdmissionResponse,
        #[serde(skip_serializing_if = "Option::is_none")]
        patch: Option<String>,
    }
    // Taken out so kube-core's own form is not written too; `patchType`
    // stays as `with_patch` set it.
    let patch = resp
        .patch
        .take()
        .map(|p| base64::engine::general_purpose::STANDARD.encode(p));
    serde_json::to_vec(&Review {
        types: &resp.types,
        response: Response {
            response: &resp,
            patch,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const POD: &str = r#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{
        "uid":"u-1","kind":{"group":"","version":"v1","kind":"Pod"},
        "resource":{"group":"","version":"v1","resource":"pods"},
        "namespace":"shop","operation":"UPDATE","userInfo":{"username":"x"},
        "object":{"apiVersion":"v1","kind":"Pod","metadata":{"name":"p"},"spec":{"containers":[{"name":"a","image":"nginx"}]}},
        "oldObject":null,"dryRun":true}}"#;

    #[test]
    fn decodes_the_fields_admission_reads() {
        let r: ReviewIn = serde_json::from_str(POD).unwrap();
        assert_eq!(r.api_version, "admission.k8s.io/v1");
        let req = r.request.unwrap();
        assert_eq!(req.uid, "u-1");
        assert_eq!(req.kind.kind, "Pod");
        assert_eq!(req.operation, Operation::Update);
        assert_eq!(req.namespace.as_deref(), Some("shop"));
        assert!(req.old_object.is_none(), "null is no object");
        assert!(req.is_dry_run());
        assert_eq!(
            req.object.unwrap()["spec"]["containers"][0]["image"],
            "nginx"
        );
    }

    #[test]
    fn the_allowing_response_matches_kube_cores() {
        let req: ReviewIn = serde_json::from_str(POD).unwrap();
        let ours = req.request.unwrap().allow("admission.k8s.io/v1");
        let theirs: kube::core::admission::AdmissionReview<kube::core::DynamicObject> =
            serde_json::from_str(POD).unwrap();
        let theirs: kube::core::admission::AdmissionRequest<_> = theirs.try_into().unwrap();
        assert_eq!(ours, AdmissionResponse::from(&theirs));
    }

    #[test]
    fn required_fields_are_named() {
        for (field, body) in [
            ("uid", POD.replace(r#""uid":"u-1","#, "")),
            ("operation", POD.replace(r#""operation":"UPDATE","#, "")),
            (
                "apiVersion",
                POD.replace(r#""apiVersion":"admission.k8s.io/v1","#, ""),
            ),
        ] {
            let e = serde_json::from_str::<ReviewIn>(&body).unwrap_err();
            assert!(
                e.to_string().contains(&format!("`{field}`")),
                "{field}: {e}"
            );
        }
        let e = serde_json::from_str::<ReviewIn>(&POD.replace("UPDATE", "MERGE")).unwrap_err();
        assert!(e.to_string().contains("MERGE"), "{e}");
    }
}
