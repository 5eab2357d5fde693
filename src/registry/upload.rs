//! Streamed chunked blob upload (distribution-spec §Pushing a blob in chunks:
//! `POST` to open a session, one `PATCH` per chunk with `Content-Range`, then
//! `PUT ?digest=` to close it).
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
use reqwest::header::{CONTENT_LENGTH, CONTENT_RANGE, CONTENT_TYPE, LOCATION};
use tokio::sync::Mutex;

use super::manifest::Descriptor;
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
    fn absolute(&self, location: &str) -> String {
        if location.starts_with('/') {
            format!("{}{location}", self.session.base())
        } else {
            location.to_owned()
        }
    }

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

    fn location(&self, resp: &reqwest::Response, desc: &Descriptor) -> Result<String> {
        let location = resp
            .headers()
            .get(LOCATION)
            .and_then(|v| v.to_str().ok())
            .map(|l| self.absolute(l))
            .ok_or_else(|| RegistryError::Other {
                registry: self.session.host().to_owned(),
                reference: self.name(desc),
                operation: "blob upload",
                message: "the registry sent no Location header".into(),
            })?;
        // From the registry: a literal address is checked here, a name when
        // it is resolved.
        self.session
            .guard()
            .check_str(&location)
            .map_err(|e| RegistryError::Other {
                registry: self.session.host().to_owned(),
                reference: self.name(desc),
                operation: "blob upload",
                message: format!("Location {location}: {e}"),
            })?;
        Ok(location)
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
        let mut location = self.location(&resp, desc)?;
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
            location = self.location(&resp, desc)?;
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

#[cfg(test)]
mod tests {
    use super::*;

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
