//! Every push: manifests (plain, and conditional for the tags pinswap
//! merges into), the monolithic blob upload, and the streamed chunked one
//! (distribution-spec §Pushing a blob in chunks: `POST` to open a session,
//! one `PATCH` per chunk with `Content-Range`, then `PUT ?digest=` to close
//! it). All of them send through [`Session`] and read the upload
//! `Location` there, once.
//!
//! Why not oci-client's: its chunked upload buffers every chunk (4 MiB) in
//! memory and waits for each PATCH before reading the next, so a 512 MiB
//! layer took twice as long as skopeo's upload and memory grew with the
//! chunk pipeline. Here each PATCH body streams straight from the source, so
//! memory stays flat whatever the blob or chunk size. Each request asks
//! for its Authorization header, which comes from the token cache (one
//! token per scope set, reused until shortly before it expires), so a
//! token cannot expire in the middle of a long upload and no chunk costs
//! a token fetch.

use std::sync::Arc;

use bytes::Bytes;
use futures::StreamExt;
use reqwest::header::{AUTHORIZATION, CONTENT_LENGTH, CONTENT_RANGE, CONTENT_TYPE};
use tokio::sync::Mutex;
use tracing::debug;

use super::client::Registry;
use super::manifest::{Descriptor, RawManifest};
use super::requests::{Precondition, manifest_ref, push};
use super::session::{BlobStream, Session};
use super::{RegistryError, Result, chain};
use crate::reference::Reference;

/// Where and how to upload.
pub(crate) struct Upload<'a> {
    pub session: &'a Session,
    pub reference: &'a Reference,
    /// Bytes per PATCH.
    pub chunk: u64,
}

/// The source stream plus a slice of an item that straddled a chunk edge.
type Shared = Arc<Mutex<(BlobStream, Option<Bytes>)>>;

/// At most `len` bytes from `shared`, as a `'static` stream for one PATCH
/// body; bytes past `len` are put back for the next chunk.
fn take(shared: Shared, len: u64) -> impl futures::Stream<Item = std::io::Result<Bytes>> {
    futures::stream::unfold((shared, len), |(shared, left)| async move {
        if left == 0 {
            return None;
        }
        let item = {
            let mut guard = shared.lock().await;
            let (stream, carry) = &mut *guard;
            let next = match carry.take() {
                Some(b) => Some(Ok(b)),
                None => stream.next().await,
            };
            match next {
                Some(Ok(mut b)) => {
                    if b.len() as u64 > left {
                        *carry = Some(b.split_off(left as usize));
                    }
                    Ok(b)
                }
                Some(Err(e)) => Err(e),
                None => Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "source ended before the blob's size",
                )),
            }
        };
        match item {
            Ok(b) => {
                let n = b.len() as u64;
                Some((Ok(b), (shared, left - n)))
            }
            Err(e) => Some((Err(e), (shared, 0))),
        }
    })
}

impl Upload<'_> {
    fn name(&self, desc: &Descriptor) -> String {
        format!("{}@{}", self.reference.name(), desc.digest)
    }

    fn scopes(&self) -> [String; 1] {
        [format!(
            "repository:{}:pull,push",
            self.reference.repository()
        )]
    }

    /// The answer to one request of the upload, mapped as every other
    /// request of ours is ([`Session::transport`], [`Session::refusal`]):
    /// an outage stays an outage, with its `Retry-After`.
    async fn check(
        &self,
        resp: std::result::Result<reqwest::Response, RegistryError>,
        desc: &Descriptor,
        operation: &'static str,
        expected: u16,
    ) -> Result<reqwest::Response> {
        let resp = resp?;
        if resp.status().as_u16() == expected {
            return Ok(resp);
        }
        if resp.status() == reqwest::StatusCode::UNAUTHORIZED {
            // A streamed PATCH cannot be sent again; the next attempt of
            // the copy gets a fresh token.
            self.session.forget_token(&self.scopes());
        }
        Err(self
            .session
            .refusal(resp, &self.name(desc), operation)
            .await)
    }

    /// Uploads `stream` as `desc` in chunks of `self.chunk` bytes.
    ///
    /// # Errors
    /// As every request of ours: [`RegistryError::Unreachable`],
    /// [`RegistryError::Unavailable`] (with `Retry-After`),
    /// [`RegistryError::Http`] or an auth error, with the step that failed; a source stream error aborts the PATCH in flight,
    /// so the session is never closed and no blob is committed.
    pub(crate) async fn run(&self, desc: &Descriptor, stream: BlobStream) -> Result<()> {
        let http = self.session.http();
        let (scopes, name) = (self.scopes(), self.name(desc));
        let start = format!(
            "{}/v2/{}/blobs/uploads/",
            self.session.base(),
            self.reference.repository()
        );
        let resp = self
            .session
            .send(&scopes, &name, || {
                http.post(&start).header(CONTENT_LENGTH, 0)
            })
            .await;
        let resp = self.check(resp, desc, "POST blob upload", 202).await?;
        let mut location = self.session.upload_location(&resp, &self.name(desc))?;
        let shared: Shared = Arc::new(Mutex::new((stream, None)));
        let mut offset = 0u64;
        while offset < desc.size {
            let len = self.chunk.min(desc.size - offset);
            let body = reqwest::Body::wrap_stream(take(shared.clone(), len));
            let mut req = http
                .patch(&location)
                .header(CONTENT_TYPE, "application/octet-stream")
                .header(CONTENT_LENGTH, len)
                .header(CONTENT_RANGE, format!("{offset}-{}", offset + len - 1))
                .body(body);
            // The body streams once, so this one goes out as it is (no
            // retry); credentials only to the registry's own origin.
            if self.session.is_own(&location)
                && let Some(h) = self.session.auth_header(&scopes, &name).await?
            {
                req = req.header(reqwest::header::AUTHORIZATION, h);
            }
            let resp = req.send().await.map_err(|e| self.session.transport(e));
            let resp = self.check(resp, desc, "PATCH blob upload", 202).await?;
            location = self.session.upload_location(&resp, &self.name(desc))?;
            offset += len;
        }
        // The stream's end carries the digest verdict: drain it before
        // committing, so a mismatch never reaches the PUT.
        {
            let mut guard = shared.lock().await;
            if let Some(Err(e)) = guard.0.next().await {
                return Err(RegistryError::Other {
                    registry: self.session.host().to_owned(),
                    reference: self.name(desc),
                    operation: "read source blob for",
                    message: chain(&e),
                });
            }
        }
        let mut url = reqwest::Url::parse(&location).map_err(|e| RegistryError::Other {
            registry: self.session.host().to_owned(),
            reference: self.name(desc),
            operation: "blob upload",
            message: format!("bad Location {location:?}: {e}"),
        })?;
        url.query_pairs_mut().append_pair("digest", &desc.digest);
        let resp = self
            .session
            .send(&scopes, &name, || {
                http.put(url.clone()).header(CONTENT_LENGTH, 0)
            })
            .await;
        self.check(resp, desc, "PUT blob upload", 201).await?;
        Ok(())
    }
}

/// The pushes of `Registry`: manifests (plain and conditional) and the
/// monolithic blob upload; the chunked one is [`Upload`].
impl Registry {
    /// `PUT` the manifest bytes unchanged, with their mediaType as
    /// Content-Type, under `r`'s tag (or digest when it has none).
    ///
    /// # Errors
    /// Registry errors (e.g. 400 `MANIFEST_BLOB_UNKNOWN` when a blob is missing).
    pub async fn push_manifest(&self, r: &Reference, manifest: &RawManifest) -> Result<()> {
        let name = r.to_string();
        let reference = match r.tag() {
            Some(t) => t.to_owned(),
            None => manifest.digest.to_string(),
        };
        let content_type = http::HeaderValue::from_str(&manifest.media_type).map_err(|e| {
            RegistryError::Manifest {
                registry: self.host().to_owned(),
                reference: name.clone(),
                reason: format!("mediaType is not a valid header value: {e}"),
            }
        })?;
        let url = format!(
            "{}/v2/{}/manifests/{reference}",
            self.base(),
            r.repository()
        );
        let pushed = match r.tag() {
            Some(_) => r.without_digest(),
            None => r.without_tag().with_digest(manifest.digest.clone()),
        };
        // Distribution refuses a manifest PUT while another writer (another
        // replica copying the same image) is rewriting the link files of
        // its blobs or children: it truncates a link before it writes it,
        // so for a moment the blob reads as unknown. The refusal names
        // DIGEST_INVALID or a *_UNKNOWN code. If the registry then answers
        // with this very manifest, the push is done; otherwise the PUT,
        // which is idempotent, is asked again, briefly.
        let mut waits = [50u64, 200, 800].into_iter();
        loop {
            let resp = self
                .send(&push(r), &name, || {
                    self.http()
                        .put(&url)
                        .header(CONTENT_TYPE, content_type.clone())
                        .body(manifest.bytes.clone())
                })
                .await?;
            match resp.status().as_u16() {
                200..=299 => return Ok(()),
                400 => {
                    let refused = self.refusal(resp, &name, "PUT manifest").await;
                    if let Ok(Some(d)) = self.head_manifest(&pushed).await
                        && d == manifest.digest
                    {
                        return Ok(());
                    }
                    match waits.next() {
                        Some(ms) if racing_refusal(&refused) => {
                            tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
                        }
                        _ => return Err(refused),
                    }
                }
                _ => return Err(self.refusal(resp, &name, "PUT manifest").await),
            }
        }
    }

    /// One streamed upload of `stream` as blob `desc` (distribution-spec
    /// §Pushing a blob monolithically: `POST` to open a session, then `PUT
    /// ?digest=` with the bytes). The registry verifies the digest on the
    /// PUT; a stream error aborts the body, so nothing is committed.
    ///
    /// # Errors
    /// Registry errors, or the stream's own error.
    pub(crate) async fn push_blob_whole(
        &self,
        r: &Reference,
        desc: &Descriptor,
        stream: BlobStream,
    ) -> Result<()> {
        let name = format!("{}@{}", r.name(), desc.digest);
        let start = format!("{}/v2/{}/blobs/uploads/", self.base(), r.repository());
        let resp = self
            .send(&push(r), &name, || {
                self.http().post(&start).header(CONTENT_LENGTH, 0)
            })
            .await?;
        if resp.status() != reqwest::StatusCode::ACCEPTED {
            return Err(self.refusal(resp, &name, "POST blob upload").await);
        }
        let location = self.session().upload_location(&resp, &name)?;
        let mut url = reqwest::Url::parse(&location).map_err(|e| RegistryError::Other {
            registry: self.host().to_owned(),
            reference: name.clone(),
            operation: "blob upload",
            message: format!("bad Location: {e}"),
        })?;
        url.query_pairs_mut().append_pair("digest", &desc.digest);
        // The body streams once, so no retry: the token was just used.
        let mut req = self
            .http()
            .put(url)
            .header(CONTENT_TYPE, "application/octet-stream")
            .header(CONTENT_LENGTH, desc.size)
            .body(reqwest::Body::wrap_stream(stream));
        // Credentials only to the registry's own origin.
        if self.session().is_own(&location)
            && let Some(h) = self.auth_header(&push(r), &name).await?
        {
            req = req.header(AUTHORIZATION, h);
        }
        let resp = req.send().await.map_err(|e| self.transport(e))?;
        match resp.status().as_u16() {
            201 => Ok(()),
            _ => Err(self.refusal(resp, &name, "PUT blob").await),
        }
    }

    /// `PUT` `bytes` as manifest `r` (its tag) with Content-Type
    /// `media_type`, on condition `when` (`If-Match` an ETag read before,
    /// or `If-None-Match: *` for a tag that was absent). `Ok(false)` when
    /// the registry answers 412: someone else wrote the tag meanwhile.
    /// Registries that keep no ETags ignore the condition.
    ///
    /// # Errors
    /// As [`Registry::refusal`].
    pub async fn put_manifest_if(
        &self,
        r: &Reference,
        bytes: Bytes,
        media_type: &'static str,
        when: Precondition,
    ) -> Result<bool> {
        let name = r.to_string();
        let url = format!(
            "{}/v2/{}/manifests/{}",
            self.base(),
            r.repository(),
            manifest_ref(r)
        );
        let resp = self
            .send(&push(r), &name, || {
                let req = self
                    .http()
                    .put(&url)
                    .header(CONTENT_TYPE, media_type)
                    .body(bytes.clone());
                match &when {
                    Precondition::Match(etag) => req.header(reqwest::header::IF_MATCH, etag),
                    Precondition::Absent => req.header(reqwest::header::IF_NONE_MATCH, "*"),
                    Precondition::None => req,
                }
            })
            .await?;
        match resp.status().as_u16() {
            200..=299 => Ok(true),
            412 => Ok(false),
            _ => Err(self.refusal(resp, &name, "PUT manifest").await),
        }
    }
}

/// Whether a refused manifest PUT reads as one that raced another writer
/// of the same repository (see [`Registry::push_manifest`]).
fn racing_refusal(e: &RegistryError) -> bool {
    matches!(
        e,
        RegistryError::Http { code: Some(code), .. }
            if matches!(
                code.as_str(),
                "DIGEST_INVALID" | "MANIFEST_BLOB_UNKNOWN" | "BLOB_UNKNOWN" | "MANIFEST_UNKNOWN"
            )
    )
}

/// What a cross-repository mount did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mount {
    /// 201: the blob is now in the repository.
    Done,
    /// 202: the registry does not hold the blob in the repository mounted
    /// from (a location that went stale).
    Absent,
    /// Any other answer, or no answer.
    Failed,
}

impl Registry {
    /// Best-effort cross-repository mount of `digest` from `from_repository`
    /// into `r`'s repository (distribution-spec §Mounting a blob). A 202
    /// (mount refused, upload opened; the session is cancelled) is
    /// [`Mount::Absent`]: the registry does not hold the blob there. Any
    /// other answer or error is [`Mount::Failed`]; either way the caller
    /// streams instead. Own request rather than oci-client's `mount_blob`:
    /// the token must carry pull on the source repository too.
    pub async fn mount(&self, r: &Reference, from_repository: &str, digest: &str) -> Mount {
        let scopes = [
            format!("repository:{}:pull,push", r.repository()),
            format!("repository:{from_repository}:pull"),
        ];
        let name = format!("{}@{digest}", r.name());
        let auth = match self.auth_header(&scopes, &name).await {
            Ok(a) => a,
            Err(e) => {
                debug!(error = %e, "no token for mount; streaming instead");
                return Mount::Failed;
            }
        };
        let with_auth = |req: reqwest::RequestBuilder| match &auth {
            Some(h) => req.header(reqwest::header::AUTHORIZATION, h.clone()),
            None => req,
        };
        let url = format!("{}/v2/{}/blobs/uploads/", self.base(), r.repository());
        let req = self
            .http()
            .post(url)
            .query(&[("mount", digest), ("from", from_repository)])
            .header(reqwest::header::CONTENT_LENGTH, 0);
        match with_auth(req).send().await {
            Ok(resp) if resp.status() == reqwest::StatusCode::CREATED => Mount::Done,
            Ok(resp) => {
                debug!(registry = %self.host(), digest, from = from_repository, status = resp.status().as_u16(), "mount not done; streaming instead");
                if resp.status() != reqwest::StatusCode::ACCEPTED {
                    return Mount::Failed;
                }
                if let Some(loc) = resp
                    .headers()
                    .get(reqwest::header::LOCATION)
                    .and_then(|l| l.to_str().ok())
                {
                    let loc = match loc.starts_with('/') {
                        true => format!("{}{loc}", self.base()),
                        false => loc.to_owned(),
                    };
                    // Credentials only to the registry's own origin.
                    if self.session().guard.check_str(&loc).is_ok() {
                        let req = self.http().delete(&loc);
                        let req = match self.session().is_own(&loc) {
                            true => with_auth(req),
                            false => req,
                        };
                        let _ = req.send().await;
                    }
                }
                Mount::Absent
            }
            Err(e) => {
                debug!(registry = %self.host(), error = %chain(&e), "mount failed; streaming instead");
                Mount::Failed
            }
        }
    }

    /// Uploads `stream` as blob `desc` into `r`'s repository: one streamed
    /// PUT up to the chunked threshold, else streamed PATCH chunks of that
    /// size and a closing PUT (see `upload.rs`). The registry verifies the
    /// digest on the closing PUT; a stream error aborts the upload before it,
    /// so nothing is committed.
    ///
    /// # Errors
    /// Registry errors, or the stream's own error.
    pub async fn push_blob(
        &self,
        r: &Reference,
        desc: &Descriptor,
        stream: BlobStream,
    ) -> Result<()> {
        if self.chunks(desc.size) {
            let res = Upload {
                session: self.session(),
                reference: r,
                chunk: self.chunked_threshold().max(1),
            }
            .run(desc, stream)
            .await;
            if let Err(e) = &res
                && refuses_chunks(e)
            {
                self.refuses_chunks();
            }
            return res;
        }
        self.push_blob_whole(r, desc, stream).await
    }
}

/// A refusal of a chunk that says the registry takes no chunks at all:
/// 405, or `UNSUPPORTED`, answering the `PATCH`.
pub(crate) fn refuses_chunks(e: &RegistryError) -> bool {
    matches!(
        e,
        RegistryError::Http { operation: "PATCH blob upload", status, code, .. }
            if *status == 405 || code.as_deref() == Some("UNSUPPORTED")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_refusals_of_unknown_parts_read_as_racing() {
        let refused = |code: Option<&str>| RegistryError::Http {
            registry: "r".into(),
            reference: "r/a:v1".into(),
            operation: "PUT manifest",
            status: 400,
            code: code.map(str::to_owned),
            message: "m".into(),
        };
        for code in [
            "MANIFEST_BLOB_UNKNOWN",
            "DIGEST_INVALID",
            "BLOB_UNKNOWN",
            "MANIFEST_UNKNOWN",
        ] {
            assert!(racing_refusal(&refused(Some(code))), "{code}");
        }
        for code in [Some("MANIFEST_INVALID"), Some("TAG_INVALID"), None] {
            assert!(!racing_refusal(&refused(code)), "{code:?}");
        }
    }

    #[tokio::test]
    async fn take_splits_items_across_chunks() {
        let items: Vec<std::io::Result<Bytes>> = vec![
            Ok(Bytes::from_static(b"abcde")),
            Ok(Bytes::from_static(b"fgh")),
        ];
        let shared: Shared = Arc::new(Mutex::new((futures::stream::iter(items).boxed(), None)));
        let mut got = Vec::new();
        for len in [3u64, 3, 2] {
            let part: Vec<u8> = take(shared.clone(), len)
                .map(|r| r.unwrap().to_vec())
                .concat()
                .await;
            got.push(String::from_utf8(part).unwrap());
        }
        assert_eq!(got, ["abc", "def", "gh"]);
        let short: Vec<_> = take(shared, 1).collect().await;
        assert_eq!(
            short[0].as_ref().unwrap_err().kind(),
            std::io::ErrorKind::UnexpectedEof
        );
    }
}
