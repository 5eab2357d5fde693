//! The distribution-spec reads we make ourselves rather than through
//! oci-client: manifest HEAD and GET, blob HEAD and GET, the tag, catalog
//! and referrers lists (docs/architecture.md §8 "Our own resolution HEAD");
//! the pushes are in `upload.rs`.
//!
//! Why: oci-client authenticates each request through its token cache, and
//! on a registry that sends no challenge (most plain and loopback ones) it
//! caches nothing, so it sends `GET /v2/` again before every request; it
//! also answers a HEAD without a digest header (a 404 among them) with a
//! GET. Against a real registry each of those is a round trip. Here every
//! request carries the header [`Registry::auth_header`] chose from the
//! pool's one `/v2/` probe, with bearer tokens reused for their lifetime.
//! And every connection goes through the outbound guard, which oci-client's
//! own HTTP client cannot (it takes no resolver, connector or client).

use bytes::Bytes;
use futures::StreamExt;
use reqwest::header::{ACCEPT as ACCEPT_HEADER, CONTENT_TYPE};

use super::check::{DigestCheck, Hasher, checked};
use super::client::Registry;
use super::manifest::{ACCEPT, Descriptor, RawManifest};
use super::session::BlobStream;
use super::{RegistryError, Result};
use crate::reference::{Digest, Reference};

/// The largest manifest read (bytes); Distribution refuses larger ones on
/// PUT (4 MiB), so anything bigger is not a manifest we could copy.
const MAX_MANIFEST_BYTES: usize = 4 * 1024 * 1024;

fn pull(r: &Reference) -> [String; 1] {
    [format!("repository:{}:pull", r.repository())]
}

pub(super) fn push(r: &Reference) -> [String; 1] {
    [format!("repository:{}:pull,push", r.repository())]
}

/// The largest page of a tag or catalog list read (bytes): 1000 names of
/// the longest length a registry allows are about 256 KiB, and Distribution
/// ignores `n` on `tags/list` and answers every tag at once.
const MAX_LIST_BYTES: usize = 16 * 1024 * 1024;
/// The most names one listing (tags, catalog) gathers over all its pages:
/// a registry that keeps linking pages of new names stops there, with an
/// error, so whatever depends on the whole list does nothing.
const MAX_LIST_NAMES: usize = 1_000_000;

/// The path component naming `r` in a manifest URL: its digest when it has
/// one, else its tag (`latest` by default).
pub(super) fn manifest_ref(r: &Reference) -> String {
    match r.digest() {
        Some(d) => d.to_string(),
        None => r.tag().unwrap_or("latest").to_owned(),
    }
}

/// A pull taken from a quota for a GET in flight: given back when dropped
/// still held.
struct Taken<'a> {
    quotas: &'a super::quota::Quotas,
    key: &'a super::quota::QuotaKey,
    held: bool,
}

impl Drop for Taken<'_> {
    fn drop(&mut self) {
        if self.held {
            self.quotas.give_back(self.key);
        }
    }
}

impl Registry {
    /// Sends the request `build` makes ([`super::session::Session::send`]).
    ///
    /// # Errors
    /// As [`super::session::Session::send`].
    pub(crate) async fn send(
        &self,
        scopes: &[String],
        name: &str,
        build: impl Fn() -> reqwest::RequestBuilder,
    ) -> Result<reqwest::Response> {
        self.session().send(scopes, name, build).await
    }

    /// A transport error ([`super::session::Session::transport`]).
    pub(crate) fn transport(&self, e: reqwest::Error) -> RegistryError {
        self.session().transport(e)
    }

    /// The error for an unexpected answer ([`super::session::Session::refusal`]).
    pub(crate) async fn refusal(
        &self,
        resp: reqwest::Response,
        name: &str,
        operation: &'static str,
    ) -> RegistryError {
        self.session().refusal(resp, name, operation).await
    }

    /// The manifest digest `r` resolves to, or `None` when the registry has
    /// no such manifest or repository (404): one `HEAD`.
    ///
    /// # Errors
    /// As [`Registry::head_manifest`].
    pub async fn manifest_digest(&self, r: &Reference) -> Result<Option<Digest>> {
        self.head_manifest(r).await
    }

    /// The manifest digest `r` resolves to, by one `HEAD`, or `None` when
    /// the registry has no such manifest or repository (404).
    ///
    /// # Errors
    /// [`RegistryError::Unavailable`] for 429 and 5xx (with `Retry-After`
    /// in seconds when the registry sent one); [`RegistryError::Unreachable`]
    /// for transport failures; the auth errors of
    /// [`RegistryError::unauthorized`] for 401; for other statuses, what a
    /// `GET` of the manifest answers.
    pub async fn head_manifest(&self, r: &Reference) -> Result<Option<Digest>> {
        Ok(self.head_manifest_typed(r).await?.map(|(d, _)| d))
    }

    /// `method` (HEAD or GET) of manifest `r` with the full Accept list.
    async fn manifest_request(
        &self,
        r: &Reference,
        method: reqwest::Method,
    ) -> Result<reqwest::Response> {
        let url = format!(
            "{}/v2/{}/manifests/{}",
            self.base(),
            r.repository(),
            manifest_ref(r)
        );
        let accept = ACCEPT.join(", ");
        let resp = self
            .send(&pull(r), &r.to_string(), || {
                self.http()
                    .request(method.clone(), &url)
                    .header(ACCEPT_HEADER, &accept)
            })
            .await?;
        if let Some((quotas, key)) = &self.quota
            && let Some(said) = super::quota::RateLimit::from_headers(resp.headers())
        {
            quotas.observe(key, said, false);
            if resp.status() == reqwest::StatusCode::TOO_MANY_REQUESTS && said.remaining == 0 {
                return Err(RegistryError::Quota {
                    registry: self.host().to_owned(),
                    reference: r.to_string(),
                    why: format!(
                        "{} at {} ({}): it answered 429, 0 of {} pulls per {} remain",
                        super::quota::EXHAUSTED,
                        key.registry,
                        key.credential,
                        said.limit,
                        humantime::format_duration(said.window)
                    ),
                    retry_after: std::time::Duration::from_secs(60),
                });
            }
        }
        Ok(resp)
    }

    /// A manifest GET from this source, counted against its pull quota
    /// ([`super::quota`]): refused here when none remain (asking again with
    /// an uncounted HEAD when the registry said so a while ago), and
    /// counted when the registry answered it.
    ///
    /// # Errors
    /// [`RegistryError::Quota`] when none remain; the request's own.
    async fn counted_get(&self, r: &Reference) -> Result<reqwest::Response> {
        use super::quota::Gate;
        let Some((quotas, key)) = &self.quota else {
            return self.manifest_request(r, reqwest::Method::GET).await;
        };
        let mut gate = quotas.take(key);
        if gate == Gate::Ask {
            // The answer's headers update the quota; its status does not matter.
            let _ = self.manifest_request(r, reqwest::Method::HEAD).await;
            gate = match quotas.take(key) {
                Gate::Ask => Gate::Go { taken: false },
                g => g,
            };
        }
        let taken = match gate {
            Gate::Go { taken } => taken,
            Gate::Ask => false,
            Gate::Exhausted(why, retry_after) => {
                return Err(RegistryError::Quota {
                    registry: self.host().to_owned(),
                    reference: r.to_string(),
                    why,
                    retry_after,
                });
            }
        };
        // Given back unless the registry counted it, also when this future
        // is dropped mid-request (a deadline, a cancelled admission).
        let mut held = Taken {
            quotas,
            key,
            held: taken,
        };
        let resp = self.manifest_request(r, reqwest::Method::GET).await;
        if resp.as_ref().is_ok_and(|r| r.status().is_success()) {
            if held.held {
                held.held = false;
            } else if let Some(said) = resp
                .as_ref()
                .ok()
                .and_then(|r| super::quota::RateLimit::from_headers(r.headers()))
            {
                quotas.observe(key, said, true);
            }
        }
        resp
    }

    /// As [`Registry::head_manifest`], with the manifest's mediaType (the
    /// `Content-Type` answered, `None` when the registry sent none).
    ///
    /// # Errors
    /// As [`Registry::head_manifest`].
    pub async fn head_manifest_typed(
        &self,
        r: &Reference,
    ) -> Result<Option<(Digest, Option<String>)>> {
        let name = r.to_string();
        let resp = self.manifest_request(r, reqwest::Method::HEAD).await?;
        match resp.status().as_u16() {
            200..=299 => {}
            404 => return Ok(None),
            401 | 429 | 500..=599 => return Err(self.refusal(resp, &name, "HEAD manifest").await),
            // Some registries refuse HEAD (405) or answer it oddly; a GET
            // gives the digest, or the registry's own error code.
            _ => return self.get_manifest(r).await.map(typed),
        }
        let media_type = resp
            .headers()
            .get(CONTENT_TYPE)
            .and_then(|h| h.to_str().ok())
            .filter(|m| !m.is_empty())
            .map(str::to_owned);
        let digest = resp
            .headers()
            .get("docker-content-digest")
            .and_then(|h| h.to_str().ok())
            .map(str::to_owned);
        let Some(digest) = digest else {
            // Registries must send it (distribution-spec §Pulling manifests);
            // without it, GET the bytes and hash them.
            return self.get_manifest(r).await.map(typed);
        };
        let digest = Digest::parse(&digest).map_err(|e| RegistryError::Manifest {
            registry: self.host().to_owned(),
            reference: name.clone(),
            reason: format!("registry returned an invalid digest: {e}"),
        })?;
        if let Some(want) = r.digest()
            && *want != digest
        {
            return Err(RegistryError::DigestMismatch {
                registry: self.host().to_owned(),
                what: "manifest",
                reference: name,
                expected: want.to_string(),
                actual: digest.to_string(),
            });
        }
        Ok(Some((digest, media_type)))
    }

    /// `GET` the manifest `r` as raw bytes with the full Accept list; the
    /// bytes are hashed here and checked against `r`'s digest when it has
    /// one (else against the `Docker-Content-Digest` the registry sent).
    ///
    /// # Errors
    /// [`RegistryError::Http`] (404 `MANIFEST_UNKNOWN` for a missing one),
    /// [`RegistryError::DigestMismatch`], [`RegistryError::Manifest`] for a
    /// manifest that is not a supported type or larger than 4 MiB.
    pub async fn get_manifest(&self, r: &Reference) -> Result<RawManifest> {
        let name = r.to_string();
        let resp = self.counted_get(r).await?;
        if !resp.status().is_success() {
            return Err(self.refusal(resp, &name, "GET manifest").await);
        }
        let sent = resp
            .headers()
            .get("docker-content-digest")
            .and_then(|h| h.to_str().ok())
            .and_then(|d| Digest::parse(d).ok());
        let bad = |reason: String| RegistryError::Manifest {
            registry: self.host().to_owned(),
            reference: name.clone(),
            reason,
        };
        let body = self
            .read_bounded(resp, MAX_MANIFEST_BYTES)
            .await?
            .ok_or_else(|| {
                bad(format!(
                    "larger than {MAX_MANIFEST_BYTES} bytes, more than a registry accepts"
                ))
            })?;
        // The digest the bytes must hash to, in its algorithm: the
        // reference's, else the registry's, else sha256.
        let want = r.digest().cloned().or(sent);
        let mut h = Hasher::new(
            want.as_ref()
                .map(Digest::algorithm)
                .unwrap_or(crate::reference::DigestAlgorithm::Sha256),
        );
        h.update(&body);
        let actual = Digest::parse(&h.finish()).expect("a hasher's output is a valid digest");
        if let Some(want) = want
            && want != actual
        {
            return Err(RegistryError::DigestMismatch {
                registry: self.host().to_owned(),
                what: "manifest",
                reference: name,
                expected: want.to_string(),
                actual: actual.to_string(),
            });
        }
        RawManifest::parse(Bytes::from(body), actual, None).map_err(|e| bad(e.to_string()))
    }

    /// Whether the repository of `r` has blob `digest` (`HEAD`).
    ///
    /// # Errors
    /// Registry errors other than 404.
    pub async fn blob_exists(&self, r: &Reference, digest: &str) -> Result<bool> {
        let name = format!("{}@{digest}", r.name());
        let url = format!("{}/v2/{}/blobs/{digest}", self.base(), r.repository());
        // Distribution answers 500 to a HEAD of a blob that another writer
        // (another replica copying the same image) is committing; the HEAD
        // is idempotent, so it is asked again, briefly, before that counts.
        let mut waits = [100, 300].into_iter();
        loop {
            let resp = self
                .send(&pull(r), &name, || self.http().head(&url))
                .await?;
            match resp.status().as_u16() {
                200..=299 => return Ok(true),
                404 => return Ok(false),
                500 => {
                    if let Some(ms) = waits.next() {
                        tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
                        continue;
                    }
                }
                _ => {}
            }
            return Err(self.refusal(resp, &name, "HEAD blob").await);
        }
    }

    /// Streams blob `desc` of `r`'s repository, following the registry's
    /// redirect (reqwest drops the Authorization header when it leaves the
    /// registry's host). The bytes are hashed as they pass: the stream fails
    /// unless they match `desc`'s size and digest, and the last chunk comes
    /// only after that verdict.
    ///
    /// # Errors
    /// Registry errors on the initial request.
    pub async fn pull_blob(&self, r: &Reference, desc: &Descriptor) -> Result<BlobStream> {
        let name = format!("{}@{}", r.name(), desc.digest);
        let url = format!(
            "{}/v2/{}/blobs/{}",
            self.base(),
            r.repository(),
            desc.digest
        );
        let resp = self.send(&pull(r), &name, || self.http().get(&url)).await?;
        if !resp.status().is_success() {
            return Err(self.refusal(resp, &name, "GET blob").await);
        }
        let stream = resp
            .bytes_stream()
            .map(|r| r.map_err(std::io::Error::other))
            .boxed();
        Ok(checked(stream, desc.clone(), DigestCheck::Here))
    }
}

/// A fetched manifest as `head_manifest_typed` answers.
fn typed(m: RawManifest) -> Option<(Digest, Option<String>)> {
    Some((m.digest, Some(m.media_type).filter(|t| !t.is_empty())))
}

impl Registry {
    /// Every tag of `r`'s repository (`GET /v2/<name>/tags/list`, pages of
    /// up to 1000 followed by their `Link`, else with `last`; see
    /// [`extend_page`]), in the
    /// registry's order; empty for an unknown repository (404).
    ///
    /// # Errors
    /// As [`Registry::refusal`] for other statuses; [`RegistryError::Other`]
    /// for a body that is not a tag list or is larger than 16 MiB.
    ///
    /// [`extend_page`]: extend_page
    pub async fn tags(&self, r: &Reference) -> Result<Vec<String>> {
        let path = format!("/v2/{}/tags/list", r.repository());
        let name = r.name();
        let scopes = pull(r);
        let page = self.list(&scopes, &path, &name, "list tags of", "tags");
        Ok(page.await?.unwrap_or_default())
    }

    /// The first page of `r`'s tags, in one request (`GET
    /// /v2/<name>/tags/list?n=<n>`), with whether it holds every tag: no
    /// `Link: rel="next"` and not exactly `n` long (Distribution 2.8
    /// ignores `n` and answers everything; a registry that honours it and
    /// stops at `n` may have more). `None` for an unknown repository (404).
    ///
    /// # Errors
    /// As [`Registry::tags`].
    pub async fn tags_page(&self, r: &Reference, n: usize) -> Result<Option<(Vec<String>, bool)>> {
        let name = r.name();
        let url = format!("{}/v2/{}/tags/list?n={n}", self.base(), r.repository());
        let resp = self.send(&pull(r), &name, || self.http().get(&url)).await?;
        if resp.status() == reqwest::StatusCode::NOT_FOUND {
            return Ok(None);
        }
        if !resp.status().is_success() {
            return Err(self.refusal(resp, &name, "list tags of").await);
        }
        let more = next_link(resp.headers()).is_some();
        let bad = |message: String| RegistryError::Other {
            registry: self.host().to_owned(),
            reference: name.clone(),
            operation: "list tags of",
            message,
        };
        let body = self
            .read_bounded(resp, MAX_LIST_BYTES)
            .await?
            .ok_or_else(|| bad(format!("a page larger than {MAX_LIST_BYTES} bytes")))?;
        let tags = list_names(&body, "tags").map_err(bad)?;
        let complete = !more && tags.len() != n;
        Ok(Some((tags, complete)))
    }

    /// Every repository of the registry (`GET /v2/_catalog`, pages of up to
    /// 1000 followed by their `Link`, else with `last`), with a token for
    /// `registry:catalog:*`.
    ///
    /// # Errors
    /// As [`Registry::tags`]; 404 (a registry that does not serve the
    /// catalog) and 401/403 (credentials that may not list it) are errors.
    pub async fn catalog(&self) -> Result<Vec<String>> {
        let scopes = ["registry:catalog:*".to_owned()];
        let page = self.list(
            &scopes,
            "/v2/_catalog",
            "/v2/_catalog",
            "list the repositories of",
            "repositories",
        );
        match page.await? {
            Some(all) => Ok(all),
            None => Err(RegistryError::Http {
                registry: self.host().to_owned(),
                reference: "/v2/_catalog".into(),
                operation: "list the repositories of",
                status: 404,
                code: None,
                message: "the registry does not serve its catalog".into(),
            }),
        }
    }

    /// The names under `key` of every page of the list at `path`; `None`
    /// when the first page is 404.
    ///
    /// Each next page is the one `Link: <...>; rel="next"` names
    /// (distribution-spec: the link may carry state a registry keeps its own
    /// way, as Quay's `next_page` token, which ignores `last`), for the same
    /// list, always asked of this registry: a link to another origin (a
    /// registry that writes its public name while pinswap reaches it by
    /// another) gives its path and query only. Only a page without `Link`
    /// is followed with `last`. At most [`MAX_LIST_NAMES`] names.
    async fn list(
        &self,
        scopes: &[String],
        path: &str,
        name: &str,
        operation: &'static str,
        key: &str,
    ) -> Result<Option<Vec<String>>> {
        let bad = |message: String| RegistryError::Other {
            registry: self.host().to_owned(),
            reference: name.to_owned(),
            operation,
            message,
        };
        let mut out: Vec<String> = Vec::new();
        let mut url = format!("{}{path}?n=1000", self.base());
        loop {
            let resp = self.send(scopes, name, || self.http().get(&url)).await?;
            if resp.status() == reqwest::StatusCode::NOT_FOUND && out.is_empty() {
                return Ok(None);
            }
            if !resp.status().is_success() {
                return Err(self.refusal(resp, name, operation).await);
            }
            let next = next_link(resp.headers())
                .map(|next| self.next_list_page(&url, path, &next))
                .transpose()
                .map_err(bad)?;
            let body = self
                .read_bounded(resp, MAX_LIST_BYTES)
                .await?
                .ok_or_else(|| bad(format!("a page larger than {MAX_LIST_BYTES} bytes")))?;
            let names = list_names(&body, key).map_err(bad)?;
            let short = names.len() < SHORT_PAGE;
            if !extend_page(&mut out, names) || (short && next.is_none()) {
                return Ok(Some(out));
            }
            if out.len() > MAX_LIST_NAMES {
                return Err(bad(format!("more than {MAX_LIST_NAMES} names")));
            }
            url = match next {
                Some(next) => next,
                None => {
                    let last = out.last().map_or("", String::as_str);
                    let mut url = format!("{}{path}?n=1000&last=", self.base());
                    url.extend(url::form_urlencoded::byte_serialize(last.as_bytes()));
                    url
                }
            };
        }
    }

    /// `next`, the `Link` target of the page at `page` of the list at
    /// `path`, as a URL of this registry: resolved against the page, its
    /// path and query taken alone when it names another origin.
    fn next_list_page(
        &self,
        page: &str,
        path: &str,
        next: &str,
    ) -> std::result::Result<String, String> {
        let url = reqwest::Url::parse(page)
            .and_then(|p| p.join(next))
            .map_err(|e| format!("a next page that is no URL ({next}: {e})"))?;
        if url.path() != path {
            return Err(format!("a next page of another list ({next})"));
        }
        let own = match url.query() {
            Some(q) => format!("{}{path}?{q}", self.base()),
            None => format!("{}{path}", self.base()),
        };
        if !self.session().is_own(url.as_str()) {
            tracing::debug!(link = next, asked = %own, "a next page on another origin, asked of this registry");
        }
        Ok(own)
    }

    /// `next`, the `Link` target of the page at `page`, resolved against it
    /// (RFC 8288 §3.2) on this registry's origin: pages stay on the
    /// registry, so its token goes nowhere else.
    fn own_next_page(&self, page: &str, next: &str) -> std::result::Result<String, String> {
        let next = reqwest::Url::parse(page)
            .and_then(|p| p.join(next))
            .map_err(|e| format!("a next page that is no URL ({next}: {e})"))?
            .to_string();
        if self.session().is_own(&next) {
            Ok(next)
        } else {
            Err(format!("a next page on another origin ({next})"))
        }
    }
}

impl Registry {
    /// The body of `resp`, or `None` once it grows past `max` bytes.
    ///
    /// # Errors
    /// [`RegistryError::Unreachable`] when the body breaks off.
    pub(crate) async fn read_bounded(
        &self,
        resp: reqwest::Response,
        max: usize,
    ) -> Result<Option<Vec<u8>>> {
        let mut body = Vec::new();
        let mut stream = resp.bytes_stream();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| self.transport(e))?;
            if body.len() + chunk.len() > max {
                return Ok(None);
            }
            body.extend_from_slice(&chunk);
        }
        Ok(Some(body))
    }

    /// The referrers of `subject` in `r`'s repository (distribution-spec
    /// §Listing Referrers): the descriptors of every page, following
    /// `Link: <...>; rel="next"` on the registry's own origin, at most
    /// `max_pages` pages and `max` descriptors. `None` when the registry
    /// answers 404: it does not serve the API (Distribution 2.8 among
    /// them), or does not know the repository.
    ///
    /// # Errors
    /// As [`Registry::refusal`] for other statuses; [`RegistryError::Other`]
    /// for a page that is not an image index, larger than 4 MiB, or a
    /// `next` link to another origin.
    pub async fn referrers(
        &self,
        r: &Reference,
        subject: &Digest,
        max_pages: usize,
        max: usize,
    ) -> Result<Option<Vec<serde_json::Value>>> {
        let name = format!("{}@{subject}", r.name());
        let bad = |message: String| RegistryError::Other {
            registry: self.host().to_owned(),
            reference: name.clone(),
            operation: "list referrers of",
            message,
        };
        let mut url = format!("{}/v2/{}/referrers/{subject}", self.base(), r.repository());
        let mut out = Vec::new();
        for page in 0..max_pages {
            let resp = self
                .send(&pull(r), &name, || {
                    self.http()
                        .get(&url)
                        .header(ACCEPT_HEADER, super::manifest::OCI_INDEX)
                })
                .await?;
            if resp.status() == reqwest::StatusCode::NOT_FOUND && page == 0 {
                return Ok(None);
            }
            if !resp.status().is_success() {
                return Err(self.refusal(resp, &name, "list referrers of").await);
            }
            let next = next_link(resp.headers());
            let body = self
                .read_bounded(resp, MAX_MANIFEST_BYTES)
                .await?
                .ok_or_else(|| bad(format!("a page larger than {MAX_MANIFEST_BYTES} bytes")))?;
            let index: serde_json::Value = serde_json::from_slice(&body)
                .map_err(|e| bad(format!("the answer is not JSON: {e}")))?;
            let Some(manifests) = index.get("manifests").and_then(|m| m.as_array()) else {
                return Err(bad(
                    "the answer is not an image index (no `manifests` list)".into(),
                ));
            };
            out.extend(manifests.iter().cloned());
            if out.len() > max {
                out.truncate(max);
                return Ok(Some(out));
            }
            let Some(next) = next else {
                return Ok(Some(out));
            };
            url = self.own_next_page(&url, &next).map_err(bad)?;
        }
        Ok(Some(out))
    }

    /// `GET` the manifest `r` names, as the registry serves it (no shape
    /// check), with its `ETag`; `None` for 404. For index tags pinswap
    /// reads to merge into.
    ///
    /// # Errors
    /// As [`Registry::refusal`]; [`RegistryError::Manifest`] past 4 MiB.
    pub async fn get_manifest_raw(&self, r: &Reference) -> Result<Option<FetchedManifest>> {
        let name = r.to_string();
        let resp = self.counted_get(r).await?;
        if resp.status() == reqwest::StatusCode::NOT_FOUND {
            return Ok(None);
        }
        if !resp.status().is_success() {
            return Err(self.refusal(resp, &name, "GET manifest").await);
        }
        let header = |h: reqwest::header::HeaderName| {
            resp.headers()
                .get(h)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        let etag = header(reqwest::header::ETAG);
        let content_type = header(CONTENT_TYPE);
        let bytes = self
            .read_bounded(resp, MAX_MANIFEST_BYTES)
            .await?
            .ok_or_else(|| RegistryError::Manifest {
                registry: self.host().to_owned(),
                reference: name,
                reason: format!("larger than {MAX_MANIFEST_BYTES} bytes"),
            })?;
        let digest = super::check::sha256_digest(&bytes);
        Ok(Some(FetchedManifest {
            bytes: Bytes::from(bytes),
            digest,
            content_type,
            etag,
        }))
    }
}

/// A manifest as [`Registry::get_manifest_raw`] read it.
#[derive(Debug, Clone)]
pub struct FetchedManifest {
    /// The bytes as served.
    pub bytes: Bytes,
    /// Their sha256.
    pub digest: Digest,
    /// The `Content-Type` answered.
    pub content_type: Option<String>,
    /// The `ETag` answered.
    pub etag: Option<String>,
}

/// The condition of [`Registry::put_manifest_if`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Precondition {
    /// `If-Match`: the tag still holds what this ETag named.
    Match(String),
    /// `If-None-Match: *`: the tag is still absent.
    Absent,
    /// No condition (the registry sent no ETag).
    None,
}

/// The names under `key` of a list page (`tags/list`, `_catalog`), or why
/// it is not one.
fn list_names(body: &[u8], key: &str) -> std::result::Result<Vec<String>, String> {
    let page: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| format!("the answer is not JSON: {e}"))?;
    // `"tags": null` is how Distribution answers a repository whose tags
    // were all deleted.
    match &page[key] {
        serde_json::Value::Null => Ok(Vec::new()),
        serde_json::Value::Array(a) => a
            .iter()
            .map(|v| v.as_str().map(str::to_owned))
            .collect::<Option<Vec<String>>>()
            .ok_or_else(|| format!("`{key}` holds something other than strings")),
        _ => Err(format!("`{key}` is not a list")),
    }
}

/// The target of a `Link: <url>; rel="next"` header (RFC 8288), if any.
fn next_link(headers: &reqwest::header::HeaderMap) -> Option<String> {
    headers
        .get_all(reqwest::header::LINK)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .find_map(|link| {
            let (target, params) = link.trim().split_once(';')?;
            let rel_next = params.split(';').any(|p| {
                let p = p.trim().to_ascii_lowercase();
                p == "rel=\"next\"" || p == "rel=next"
            });
            let target = target.trim().strip_prefix('<')?.strip_suffix('>')?;
            rel_next.then(|| target.to_owned())
        })
}

/// A page shorter than this without `Link: rel="next"` is the last, so a
/// retention pass costs one tag list per repository, not two. distribution-
/// spec has a registry with more to list send the `Link`; longer pages are
/// still followed without one, for registries that cap pages silently.
const SHORT_PAGE: usize = 100;

/// Adds a page of a paginated list to `out`; returns whether to ask for the
/// next page. Registries differ: some cap pages below `n`, and Distribution
/// 2.8 ignores `last` on `tags/list` and answers the whole list again. So
/// paging goes on while pages bring entries not seen yet, and stops at an
/// empty page or one that repeats.
pub(crate) fn extend_page(out: &mut Vec<String>, page: Vec<String>) -> bool {
    let seen: std::collections::HashSet<&String> = out.iter().collect();
    let fresh: Vec<String> = page.into_iter().filter(|p| !seen.contains(p)).collect();
    if fresh.is_empty() {
        return false;
    }
    out.extend(fresh);
    true
}

impl Registry {
    /// Reads blob `desc` of `r`'s repository whole, for small blobs such as
    /// configs; the digest is checked as it streams.
    ///
    /// # Errors
    /// Registry errors; [`RegistryError::Other`] when the blob is larger than
    /// `max` bytes (by its descriptor or as it streams).
    pub async fn blob_bytes(&self, r: &Reference, desc: &Descriptor, max: u64) -> Result<Bytes> {
        let name = format!("{}@{}", r.name(), desc.digest);
        let too_big = || RegistryError::Other {
            registry: self.host().to_owned(),
            reference: name.clone(),
            operation: "read",
            message: format!("blob is larger than {max} bytes"),
        };
        if desc.size > max {
            return Err(too_big());
        }
        let mut stream = self.pull_blob(r, desc).await?;
        let mut out = bytes::BytesMut::with_capacity(desc.size as usize);
        while let Some(chunk) = futures::StreamExt::next(&mut stream).await {
            let chunk = chunk.map_err(|e| RegistryError::Other {
                registry: self.host().to_owned(),
                reference: name.clone(),
                operation: "read",
                message: e.to_string(),
            })?;
            if (out.len() + chunk.len()) as u64 > max {
                return Err(too_big());
            }
            out.extend_from_slice(&chunk);
        }
        Ok(out.freeze())
    }
}

#[cfg(test)]
mod link_tests {
    use super::next_link;

    #[test]
    fn next_links() {
        let mut h = reqwest::header::HeaderMap::new();
        assert_eq!(next_link(&h), None);
        h.insert(
            reqwest::header::LINK,
            "</v2/a/referrers/sha256:1?n=1&last=x>; rel=\"next\""
                .parse()
                .unwrap(),
        );
        assert_eq!(
            next_link(&h).as_deref(),
            Some("/v2/a/referrers/sha256:1?n=1&last=x")
        );
        h.insert(
            reqwest::header::LINK,
            "<https://r/x>; rel=\"prev\", <https://r/y>; rel=next"
                .parse()
                .unwrap(),
        );
        assert_eq!(next_link(&h).as_deref(), Some("https://r/y"));
    }
}
