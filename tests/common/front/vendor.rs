//! Registries that cannot run here, as fronts over a real one: each
//! [`Vendor`] answers where its registry differs from Distribution, as its
//! vendor documents or its tracker reports (cited at each variant), and
//! passes everything else through.

use std::collections::HashSet;

use axum::body::Body;
use axum::extract::Request;
use axum::http::{HeaderValue, Method, StatusCode};
use axum::response::Response;

use super::{Ends, Shared, forward, host_of, query_param, token_page, upstream_names};

/// A registry's behaviour where it is not Distribution's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Vendor {
    /// Quay: tag lists and the catalog in token pages of 50 linked by
    /// `next_page`, `last` read as a token (quay/quay
    /// `endpoints/v2/__init__.py` `paginate`); the referrers API since 3.12
    /// (quay/quay PR 2597).
    Quay,
    /// A Harbor proxy-cache project. Its tag list names only the tags it
    /// has cached (github.com/goharbor/harbor/issues/15513 and
    /// github.com/goharbor/harbor/issues/16391), which a pull by tag adds; a manifest by tag is always answered, checked upstream
    /// with a HEAD (goharbor.io "Configure Proxy Cache";
    /// `src/controller/proxy/controller.go` `UseLocalManifest`); pushes
    /// are refused. The referrers API since 2.8 (goharbor/harbor PR 18324).
    HarborProxy,
    /// GHCR: a manifest or blob DELETE through the registry API is refused
    /// 405 `UNSUPPORTED` "The operation is unsupported."
    /// (github.com/containers/skopeo/issues/1880; packages are deleted
    /// through GitHub's REST API); lists come in pages of 100 unless `n` asks otherwise, linked by `Link`.
    Ghcr,
    /// Docker Hub: every manifest GET answered counts against a limit of
    /// this many pulls, and GET and HEAD report `ratelimit-limit` and
    /// `ratelimit-remaining` (`N;w=21600`); a HEAD is not counted; past the
    /// limit a manifest GET gets 429 `TOOMANYREQUESTS`, with no
    /// `Retry-After` (docs.docker.com "Docker Hub pull usage and limits";
    /// github.com/dependabot/cli/issues/380). The documentation does not
    /// say whether a GET answered 404 counts; here it does not.
    DockerHub(u64),
    /// ECR: lists in pages of 100 unless `n` asks otherwise, at most 1,000
    /// (`n` above is refused 400 `UNSUPPORTED`:
    /// github.com/google/go-containerregistry/issues/681); no
    /// cross-repository mount, which is an account setting off by
    /// default (docs.aws.amazon.com AmazonECR "Blob mounting"): the POST
    /// opens a plain upload, 202; a tag already in the repository is
    /// refused a second PUT, even of the same digest, 400 `TAG_INVALID`, as
    /// in a repository with immutable tags (AmazonECR "Image tag
    /// mutability"; github.com/moby/buildkit/issues/3776,
    /// github.com/aws/containers-roadmap/issues/2179), except in `pinswap-usage`, which pinswap keeps MUTABLE on
    /// ECR.
    Ecr,
    /// A registry that answers a manifest HEAD without
    /// `Docker-Content-Digest`, as registry.access.redhat.com does
    /// (github.com/containerd/containerd/issues/3238).
    NoDigestOnHead,
    /// A registry that takes blobs only whole: a chunked `PATCH` to an
    /// upload is refused 405 `UNSUPPORTED`, as Google Artifact Registry
    /// documented ("does not support Docker chunked uploads").
    MonolithicOnly,
}

impl Vendor {
    /// Whether the registry takes pushes at all.
    pub fn takes_pushes(self) -> bool {
        self != Vendor::HarborProxy
    }
}

/// What a vendor front remembers between requests.
#[derive(Default)]
pub(super) struct Memory {
    /// Harbor: (repository, tag) pulled through the cache.
    cached: HashSet<(String, String)>,
    /// Docker Hub: manifest GETs counted so far.
    pulls: u64,
}

/// What a request names, by distribution-spec's endpoints.
enum Endpoint<'a> {
    Manifest { name: &'a str, reference: &'a str },
    Tags { name: &'a str },
    Catalog,
    Upload,
    Blob,
    Other,
}

fn endpoint(path: &str) -> Endpoint<'_> {
    let base = path.split_once('?').map_or(path, |(b, _)| b);
    let Some(rest) = base.strip_prefix("/v2/") else {
        return Endpoint::Other;
    };
    if rest == "_catalog" {
        return Endpoint::Catalog;
    }
    if let Some(name) = rest.strip_suffix("/tags/list") {
        return Endpoint::Tags { name };
    }
    if rest.contains("/blobs/uploads/") {
        return Endpoint::Upload;
    }
    if rest.contains("/blobs/") {
        return Endpoint::Blob;
    }
    match rest.rsplit_once("/manifests/") {
        Some((name, reference)) => Endpoint::Manifest { name, reference },
        None => Endpoint::Other,
    }
}

fn is_tag(reference: &str) -> bool {
    !reference.contains(':')
}

/// A registry error envelope with this status, code and message.
fn error(status: u16, code: &str, message: &str) -> Response {
    let body = serde_json::json!({"errors": [{"code": code, "message": message}]});
    let mut resp = Response::new(Body::from(body.to_string()));
    *resp.status_mut() = StatusCode::from_u16(status).unwrap();
    resp.headers_mut()
        .insert("content-type", HeaderValue::from_static("application/json"));
    resp
}

pub(super) async fn respond(
    s: &Shared,
    vendor: Vendor,
    req: Request,
    path: &str,
    ends: Ends,
) -> Response {
    let method = req.method().clone();
    let host = host_of(&req);
    match (vendor, endpoint(path)) {
        (Vendor::Quay, Endpoint::Tags { .. } | Endpoint::Catalog) if method == Method::GET => {
            let base = path.split_once('?').map_or(path, |(b, _)| b);
            token_page(s, &format!("http://{host}{base}"), path, 50).await
        }
        (Vendor::HarborProxy, _)
            if !matches!(method, Method::GET | Method::HEAD)
                && !matches!(endpoint(path), Endpoint::Other) =>
        {
            error(403, "DENIED", "can not push artifact to a proxy project")
        }
        (Vendor::HarborProxy, Endpoint::Tags { name }) => {
            let cached = s.memory.lock().unwrap().cached.clone();
            let name = name.to_owned();
            list_page(s, path, usize::MAX, usize::MAX, |tag| {
                cached.contains(&(name.clone(), tag.to_owned()))
            })
            .await
        }
        (Vendor::HarborProxy, Endpoint::Manifest { name, reference }) if is_tag(reference) => {
            let key = (name.to_owned(), reference.to_owned());
            let resp = forward(s, req, path, ends, None).await;
            // Harbor caches what it pulled (a GET) in the background; a HEAD
            // is answered from upstream and caches nothing.
            if method == Method::GET && resp.status().is_success() {
                s.memory.lock().unwrap().cached.insert(key);
            }
            resp
        }
        (Vendor::Ghcr, Endpoint::Manifest { .. } | Endpoint::Blob) if method == Method::DELETE => {
            error(405, "UNSUPPORTED", "The operation is unsupported.")
        }
        (Vendor::Ghcr, Endpoint::Tags { .. } | Endpoint::Catalog) if method == Method::GET => {
            list_page(s, path, 100, usize::MAX, |_| true).await
        }
        (Vendor::Ecr, Endpoint::Tags { .. } | Endpoint::Catalog) if method == Method::GET => {
            list_page(s, path, 100, 1000, |_| true).await
        }
        (Vendor::Ecr, Endpoint::Upload) if method == Method::POST && path.contains("mount=") => {
            let base = path.split_once('?').map_or(path, |(b, _)| b).to_owned();
            forward(s, req, &base, ends, None).await
        }
        (Vendor::Ecr, Endpoint::Manifest { name, reference })
            if method == Method::PUT && is_tag(reference) && !name.ends_with("pinswap-usage") =>
        {
            let head = s
                .http
                .head(format!("http://{}{path}", s.upstream))
                .header("accept", crate::common::registry::MANIFEST_ACCEPT)
                .send()
                .await;
            match head {
                Ok(h) if h.status().is_success() => error(
                    400,
                    "TAG_INVALID",
                    &format!(
                        "The image tag '{reference}' already exists in the '{name}' repository \
                         and cannot be overwritten because the repository is immutable."
                    ),
                ),
                _ => forward(s, req, path, ends, None).await,
            }
        }
        (Vendor::DockerHub(limit), Endpoint::Manifest { .. })
            if matches!(method, Method::GET | Method::HEAD) =>
        {
            let spent = s.memory.lock().unwrap().pulls >= limit;
            let mut resp = match method == Method::GET && spent {
                true => error(
                    429,
                    "TOOMANYREQUESTS",
                    "You have reached your pull rate limit.",
                ),
                false => forward(s, req, path, ends, None).await,
            };
            let pulls = {
                let mut memory = s.memory.lock().unwrap();
                if method == Method::GET && resp.status().is_success() {
                    memory.pulls += 1;
                }
                memory.pulls
            };
            let h = resp.headers_mut();
            let window = |n: u64| HeaderValue::from_str(&format!("{n};w=21600")).unwrap();
            h.insert("ratelimit-limit", window(limit));
            h.insert("ratelimit-remaining", window(limit.saturating_sub(pulls)));
            h.insert(
                "docker-ratelimit-source",
                HeaderValue::from_static("127.0.0.1"),
            );
            resp
        }
        (Vendor::NoDigestOnHead, Endpoint::Manifest { .. }) if method == Method::HEAD => {
            let mut resp = forward(s, req, path, ends, None).await;
            resp.headers_mut().remove("docker-content-digest");
            resp
        }
        (Vendor::MonolithicOnly, Endpoint::Upload) if method == Method::PATCH => {
            // Read and dropped first, as an HTTP server (nginx, a cloud load
            // balancer) discards a body it refuses: answered mid-body, the
            // client would see a broken connection, not the refusal.
            let _ = axum::body::to_bytes(req.into_body(), usize::MAX).await;
            error(
                405,
                "UNSUPPORTED",
                "chunked uploads are not supported; PUT the whole blob",
            )
        }
        _ => forward(s, req, path, ends, None).await,
    }
}

/// One page of the upstream's tag list or catalog at `path`, of the names
/// `keep` keeps: `n` (else `default`) after `last`, linked to the next by
/// a relative `Link`, as Distribution pages; an `n` above `max` is
/// refused.
async fn list_page(
    s: &Shared,
    path: &str,
    default: usize,
    max: usize,
    keep: impl Fn(&str) -> bool,
) -> Response {
    let (base, query) = path.split_once('?').unwrap_or((path, ""));
    let (mut list, field, mut all) = match upstream_names(s, base).await {
        Ok(names) => names,
        Err(refusal) => return refusal,
    };
    all.retain(|name| keep(name));
    let param = |key: &str| query_param(query, key);
    let size = param("n")
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(default)
        .max(1);
    if size > max {
        return error(
            400,
            "UNSUPPORTED",
            &format!(
                "Invalid parameter at 'maxResults' failed to satisfy constraint: 'Member must have value less than or equal to {max}'"
            ),
        );
    }
    let after: Vec<&String> = match param("last") {
        Some(last) => all.iter().filter(|t| t.as_str() > last).collect(),
        None => all.iter().collect(),
    };
    let page: Vec<&String> = after.iter().take(size).copied().collect();
    list[field] = serde_json::json!(page);
    let mut resp = Response::new(Body::from(serde_json::to_vec(&list).unwrap()));
    resp.headers_mut()
        .insert("content-type", HeaderValue::from_static("application/json"));
    if after.len() > size
        && let Some(last) = page.last()
    {
        let link = format!("<{base}?last={last}&n={size}>; rel=\"next\"");
        resp.headers_mut()
            .insert("link", HeaderValue::from_str(&link).unwrap());
    }
    resp
}
