//! AdmissionReview in, AdmissionReview out (being written; this is the
//! interface the server calls).

use bytes::Bytes;

/// Why a request body is not an AdmissionReview; the server answers 400.
#[derive(Debug, thiserror::Error)]
pub enum ReviewError {
    /// Not JSON, or not an AdmissionReview with a request.
    #[error("malformed AdmissionReview: {0}")]
    Malformed(String),
}

/// Answers AdmissionReviews.
pub struct Admission {}

impl Admission {
    /// Answers one AdmissionReview body with the response AdmissionReview's
    /// JSON.
    ///
    /// # Errors
    /// [`ReviewError::Malformed`] when the body is not an AdmissionReview.
    pub async fn review(&self, body: Bytes) -> Result<Vec<u8>, ReviewError> {
        let review: kube::core::admission::AdmissionReview<kube::core::DynamicObject> =
            serde_json::from_slice(&body).map_err(|e| ReviewError::Malformed(e.to_string()))?;
        let req: kube::core::admission::AdmissionRequest<kube::core::DynamicObject> = review
            .try_into()
            .map_err(|_| ReviewError::Malformed("no request".into()))?;
        let resp = kube::core::admission::AdmissionResponse::from(&req).into_review();
        serde_json::to_vec(&resp).map_err(|e| ReviewError::Malformed(e.to_string()))
    }

    /// Whether the webhook can serve: config loaded and the target answers.
    pub async fn ready(&self) -> bool {
        true
    }
}
