//! An HTTP front for a registry: it passes every request through, or
//! answers all of them with one status (429 with `Retry-After`, 503), as a
//! rate-limited or failing registry does, and records the method and path
//! of each request that reached it, in order, with its `Authorization`
//! header and the status it was answered with. The registry behind it is a
//! real Distribution process; only the refusals are the front's own.
//!
//! Passing through is transparent: the client's `Host` goes upstream
//! unchanged, so the upload `Location`s the registry writes point at the
//! front and every request of an upload is seen too.
//!
//! Each request is also timed from its arrival until its response body has
//! been sent (or dropped), so [`Front::max_concurrent`] tells how many were
//! in flight at once.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::response::Response;

mod vendor;
pub use vendor::Vendor;

/// What the front does with each request.
#[derive(Debug, Clone, PartialEq)]
pub enum Mode {
    /// Forward to the registry.
    Pass,
    /// Answer with this status and, when given, `Retry-After` seconds.
    Refuse(u16, Option<u64>),
    /// Refuse the first request with this method whose path, or one of
    /// whose header values (an AWS API's `X-Amz-Target`), contains this
    /// part, as [`Mode::Refuse`], then pass everything through.
    RefuseFirst(&'static str, &'static str, u16, Option<u64>),
    /// Refuse every request matched as by [`Mode::RefuseFirst`] with this
    /// status; pass everything else through.
    RefuseEvery(&'static str, &'static str, u16),
    /// Answer every request 401 with this `WWW-Authenticate` value (a
    /// token realm of the test's choosing).
    Challenge(String),
    /// Pass through, but answer each upload opened (a 202 with a
    /// `Location`) with this `Location` instead.
    Relocate(String),
    /// Pass everything through, but serve each referrers list (`GET
    /// /v2/<name>/referrers/<digest>`, which the registry behind must
    /// serve) in pages of this many descriptors, linked by `Link: <...>;
    /// rel="next"` as distribution-spec §Listing Referrers allows.
    PageReferrers(usize),
    /// Serve repositories only to requests whose `Authorization` is this
    /// value, answering others 404 `NAME_UNKNOWN`, as GHCR and Docker Hub
    /// hide private repositories; `/v2/` asks for Basic auth when none is
    /// sent and passes any.
    HideWithout(String),
    /// Every request with this method (`*`: any) whose path contains this
    /// part meets this fault; others pass.
    Fault(&'static str, &'static str, Fault),
    /// Serve tag lists and the catalog in pages of at most this many
    /// (whatever `n` asks for more), each linked to the next by an absolute
    /// `Link` carrying an opaque `next_page` token, and read `last` as such
    /// a token: a name there is no token, so it gets the first page again.
    /// As Quay's `paginate` (quay/quay `endpoints/v2/__init__.py`: pages of
    /// `max(V2_PAGINATION_SIZE, 100)`, `next_page` falling back to `last`,
    /// an encrypted `start_id`), which its catalog uses. Links are absolute
    /// on the `Host` asked, or start with the given text instead of
    /// `http://HOST/v2/...` (Quay writes its configured
    /// `PREFERRED_URL_SCHEME` and `SERVER_HOSTNAME`).
    TokenPages(usize, Option<&'static str>),
    /// Behave as this registry does where it differs from Distribution
    /// (`front/vendor.rs`).
    Vendor(Vendor),
}

/// A fault of [`Mode::Fault`]: the classes of error a registry or the
/// network between shows.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Fault {
    /// An error status, with the registry's error envelope.
    Status(u16),
    /// No answer, ever: the caller's deadline ends it.
    Hang,
    /// The connection closes before any answer.
    Reset,
    /// The registry's status and headers, then half its body and a closed
    /// connection (its `Content-Length` promised more).
    CutBody,
    /// A list (`tags/list`, `_catalog`) whose first page holds half of the
    /// entries and links a next page, and whose next page fails with 503.
    EndEarly,
}

struct Shared {
    upstream: String,
    http: reqwest::Client,
    mode: Mutex<Mode>,
    /// (method, path with query) of every request, in arrival order, over
    /// every mode.
    seen: Mutex<Vec<(String, String)>>,
    /// (method, path with query, `Authorization` value) of every request,
    /// in arrival order.
    authorizations: Mutex<Vec<(String, String, Option<String>)>>,
    /// (method, path with query, arrival, end of the response body) of
    /// every request, in arrival order; no end while the body streams.
    spans: Mutex<Vec<Span>>,
    /// (method, path with query, status) of every answer, in the order
    /// the answers were made.
    answered: Mutex<Vec<(String, String, u16)>>,
    /// What a [`Mode::Vendor`] front remembers between requests.
    memory: Mutex<vendor::Memory>,
}

type Span = (String, String, Instant, Option<Instant>);

/// Marks its request's span ended when dropped: with the response body.
struct Ends {
    shared: Arc<Shared>,
    index: usize,
}

impl Drop for Ends {
    fn drop(&mut self) {
        if let Some(span) = self.shared.spans.lock().unwrap().get_mut(self.index) {
            span.3 = Some(Instant::now());
        }
    }
}

/// The running front; stops when dropped.
pub struct Front {
    addr: SocketAddr,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl Front {
    /// Listens on 127.0.0.1:0 in front of `upstream` (`host:port`, plain
    /// HTTP), passing requests through.
    pub async fn start(upstream: &str) -> Front {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shared = Arc::new(Shared {
            upstream: upstream.to_owned(),
            http: reqwest::Client::builder()
                .redirect(reqwest::redirect::Policy::none())
                .build()
                .unwrap(),
            mode: Mutex::new(Mode::Pass),
            seen: Mutex::default(),
            authorizations: Mutex::default(),
            spans: Mutex::default(),
            answered: Mutex::default(),
            memory: Mutex::default(),
        });
        let app = axum::Router::new()
            .fallback(handle)
            .with_state(shared.clone());
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Front { addr, shared, task }
    }

    /// `127.0.0.1:PORT`: the registry name clients use.
    pub fn host(&self) -> String {
        self.addr.to_string()
    }

    /// Switches what the front does from the next request on.
    pub fn set(&self, mode: Mode) {
        *self.shared.mode.lock().unwrap() = mode;
    }

    /// Requests seen so far whose path contains `part` (any method).
    pub fn count(&self, part: &str) -> u64 {
        self.shared
            .seen
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, p)| p.contains(part))
            .count() as u64
    }

    /// Requests seen so far with this method whose path contains `part`.
    pub fn count_method(&self, method: &str, part: &str) -> u64 {
        self.shared
            .seen
            .lock()
            .unwrap()
            .iter()
            .filter(|(m, p)| m == method && p.contains(part))
            .count() as u64
    }

    /// Requests seen so far with this method whose path (with its query) is
    /// exactly `path`.
    pub fn count_exact(&self, method: &str, path: &str) -> u64 {
        self.shared
            .seen
            .lock()
            .unwrap()
            .iter()
            .filter(|(m, p)| m == method && p == path)
            .count() as u64
    }

    /// Every (method, path with query) seen so far, in order.
    pub fn requests(&self) -> Vec<(String, String)> {
        self.shared.seen.lock().unwrap().clone()
    }

    /// The path (with query) of every request with this method seen so
    /// far, in order.
    pub fn paths(&self, method: &str) -> Vec<String> {
        self.requests()
            .into_iter()
            .filter(|(m, _)| m == method)
            .map(|(_, p)| p)
            .collect()
    }

    /// (method, path with query, status) of every request answered so
    /// far, in the order of the answers.
    pub fn answered(&self) -> Vec<(String, String, u16)> {
        self.shared.answered.lock().unwrap().clone()
    }

    /// (method, path with query, `Authorization` header) of every request
    /// seen so far, in order; `None` for a request without one.
    pub fn authorizations(&self) -> Vec<(String, String, Option<String>)> {
        self.shared.authorizations.lock().unwrap().clone()
    }

    /// Every distinct `Authorization` value sent so far, sorted.
    pub fn credentials_sent(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .authorizations()
            .into_iter()
            .filter_map(|(_, _, a)| a)
            .collect();
        v.sort();
        v.dedup();
        v
    }

    /// Every request seen so far.
    pub fn total(&self) -> u64 {
        self.shared.seen.lock().unwrap().len() as u64
    }

    /// The arrival of every request with this method whose path contains
    /// `part`, in order.
    pub fn arrivals(&self, method: &str, part: &str) -> Vec<Instant> {
        self.shared
            .spans
            .lock()
            .unwrap()
            .iter()
            .filter(|(m, p, _, _)| m == method && p.contains(part))
            .map(|(_, _, start, _)| *start)
            .collect()
    }

    /// Forgets the counts.
    pub fn reset(&self) {
        self.shared.seen.lock().unwrap().clear();
        self.shared.authorizations.lock().unwrap().clear();
        self.shared.spans.lock().unwrap().clear();
        self.shared.answered.lock().unwrap().clear();
    }

    /// The most requests with this method (`*`: any) whose path contains
    /// `part` that were in flight at once (from arrival to the end of the
    /// response body), over every request so far.
    pub fn max_concurrent(&self, method: &str, part: &str) -> usize {
        let spans = self.shared.spans.lock().unwrap();
        let mut edges: Vec<(Instant, i32)> = Vec::new();
        for (m, p, start, end) in spans.iter() {
            if (method == "*" || m == method) && p.contains(part) {
                edges.push((*start, 1));
                // Still streaming: in flight until now.
                edges.push((end.unwrap_or_else(Instant::now), -1));
            }
        }
        // At one instant, ends before starts: back-to-back is not overlap.
        edges.sort();
        let (mut now, mut most) = (0i32, 0i32);
        for (_, delta) in edges {
            now += delta;
            most = most.max(now);
        }
        most as usize
    }
}

impl Drop for Front {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn handle(State(s): State<Arc<Shared>>, req: Request) -> Response {
    let (method, path) = (
        req.method().to_string(),
        req.uri()
            .path_and_query()
            .map(|p| p.as_str().to_owned())
            .unwrap_or_default(),
    );
    let resp = respond(s.clone(), req).await;
    s.answered
        .lock()
        .unwrap()
        .push((method, path, resp.status().as_u16()));
    resp
}

async fn respond(s: Arc<Shared>, req: Request) -> Response {
    let path = req
        .uri()
        .path_and_query()
        .map(|p| p.as_str().to_owned())
        .unwrap_or_default();
    s.seen
        .lock()
        .unwrap()
        .push((req.method().to_string(), path.clone()));
    let authorization = req
        .headers()
        .get("authorization")
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
    s.authorizations
        .lock()
        .unwrap()
        .push((req.method().to_string(), path.clone(), authorization));
    let ends = {
        let mut spans = s.spans.lock().unwrap();
        spans.push((req.method().to_string(), path.clone(), Instant::now(), None));
        Ends {
            shared: s.clone(),
            index: spans.len() - 1,
        }
    };
    let mode = s.mode.lock().unwrap().clone();
    if let Mode::Fault(method, part, fault) = mode
        && (method == "*" || req.method().as_str() == method)
        && path.contains(part)
    {
        match fault {
            Fault::Status(status) => return refused(status, None),
            Fault::Hang => std::future::pending::<()>().await,
            // Unwinding the connection's task drops its socket unanswered;
            // resume_unwind runs no panic hook, so nothing is printed.
            Fault::Reset => std::panic::resume_unwind(Box::new("reset by the test front")),
            Fault::CutBody => return cut_body(&s, req, &path).await,
            Fault::EndEarly if path.contains("last=") => return refused(503, None),
            Fault::EndEarly => return first_half(&s, &path).await,
        }
    }
    if let Mode::Vendor(vendor) = mode {
        return vendor::respond(&s, vendor, req, &path, ends).await;
    }
    if let Mode::Challenge(challenge) = &mode {
        let mut resp = Response::new(Body::from(
            r#"{"errors":[{"code":"UNAUTHORIZED","message":"challenged by the test front"}]}"#,
        ));
        *resp.status_mut() = StatusCode::UNAUTHORIZED;
        resp.headers_mut().insert(
            "www-authenticate",
            HeaderValue::from_str(challenge).unwrap(),
        );
        return resp;
    }
    if let Mode::HideWithout(wanted) = &mode {
        let sent = req.headers().get("authorization");
        let status = match (path.as_str(), sent) {
            ("/v2/", None) => Some(StatusCode::UNAUTHORIZED),
            ("/v2/", Some(_)) => None,
            (_, Some(v)) if v.as_bytes() == wanted.as_bytes() => None,
            _ => Some(StatusCode::NOT_FOUND),
        };
        if let Some(status) = status {
            let code = match status {
                StatusCode::NOT_FOUND => "NAME_UNKNOWN",
                _ => "UNAUTHORIZED",
            };
            let mut resp = Response::new(Body::from(format!(
                r#"{{"errors":[{{"code":"{code}","message":"hidden by the test front"}}]}}"#
            )));
            *resp.status_mut() = status;
            if status == StatusCode::UNAUTHORIZED {
                resp.headers_mut().insert(
                    "www-authenticate",
                    HeaderValue::from_static("Basic realm=\"test\""),
                );
            }
            return resp;
        }
    }
    let relocate = match &mode {
        Mode::Relocate(to) => Some(HeaderValue::from_str(to).unwrap()),
        _ => None,
    };
    let (asked, header_values) = (
        req.method().to_string(),
        req.headers()
            .values()
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
            .collect::<Vec<_>>(),
    );
    let matches = |method: &str, part: &str| {
        asked == method && (path.contains(part) || header_values.iter().any(|v| v.contains(part)))
    };
    let refusal = {
        let mut mode = s.mode.lock().unwrap();
        match *mode {
            Mode::Pass
            | Mode::Challenge(_)
            | Mode::Relocate(_)
            | Mode::HideWithout(_)
            | Mode::TokenPages(..)
            | Mode::Vendor(_)
            | Mode::Fault(..) => None,
            Mode::Refuse(status, retry_after) => Some((status, retry_after)),
            Mode::RefuseFirst(method, part, status, retry_after) if matches(method, part) => {
                *mode = Mode::Pass;
                Some((status, retry_after))
            }
            Mode::RefuseEvery(method, part, status) if matches(method, part) => {
                Some((status, None))
            }
            Mode::RefuseFirst(..) | Mode::RefuseEvery(..) | Mode::PageReferrers(_) => None,
        }
    };
    if let Mode::TokenPages(n, link_to) = mode
        && req.method() == axum::http::Method::GET
        && (path.contains("/tags/list") || path.contains("/_catalog"))
    {
        let host = host_of(&req);
        let link_to = link_to.map_or_else(
            || {
                let base = path.split_once('?').map_or(path.as_str(), |(b, _)| b);
                format!("http://{host}{base}")
            },
            str::to_owned,
        );
        return token_page(&s, &link_to, &path, n).await;
    }
    let page_size = match *s.mode.lock().unwrap() {
        Mode::PageReferrers(n) => Some(n),
        _ => None,
    };
    if let Some(n) = page_size
        && req.method() == axum::http::Method::GET
        && path.contains("/referrers/")
    {
        return page_referrers(&s, &path, n).await;
    }
    if let Some((status, retry_after)) = refusal {
        return refused(status, retry_after);
    }
    forward(&s, req, &path, ends, relocate).await
}

/// Passes `req` to the registry behind as `path`, and streams its answer
/// back; with `relocate`, an opened upload's `Location` is that instead.
async fn forward(
    s: &Shared,
    req: Request,
    path: &str,
    ends: Ends,
    relocate: Option<HeaderValue>,
) -> Response {
    let (parts, body) = req.into_parts();
    let mut fwd = s
        .http
        .request(parts.method, format!("http://{}{path}", s.upstream))
        .body(reqwest::Body::wrap_stream(body.into_data_stream()));
    // Every header, `Host` included: the registry then writes URLs (upload
    // `Location`s) that lead back through the front.
    for (k, v) in &parts.headers {
        fwd = fwd.header(k, v);
    }
    match fwd.send().await {
        Ok(up) => {
            let mut resp = Response::builder().status(up.status().as_u16());
            let opened = up.status() == reqwest::StatusCode::ACCEPTED;
            for (k, v) in up.headers() {
                match &relocate {
                    Some(to) if opened && k == "location" => resp = resp.header(k, to),
                    _ => resp = resp.header(k, v),
                }
            }
            // `ends` goes with the body: dropped once it is sent or dropped.
            let body = futures::stream::unfold(
                (Box::pin(up.bytes_stream()), ends),
                |(mut chunks, ends)| async move {
                    use futures::StreamExt as _;
                    let chunk = chunks.next().await?;
                    Some((chunk, (chunks, ends)))
                },
            );
            resp.body(Body::from_stream(body)).unwrap()
        }
        Err(_) => {
            let mut r = Response::new(Body::empty());
            *r.status_mut() = StatusCode::BAD_GATEWAY;
            r
        }
    }
}

/// One page of the upstream's referrers list at `path` (`?page=K`, from 0).
async fn page_referrers(s: &Shared, path: &str, n: usize) -> Response {
    let (base, query) = path.split_once('?').unwrap_or((path, ""));
    let page: usize = query
        .split('&')
        .find_map(|kv| kv.strip_prefix("page="))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let up = s
        .http
        .get(format!("http://{}{base}", s.upstream))
        .send()
        .await
        .unwrap();
    let status = up.status().as_u16();
    let mut index: serde_json::Value = match status {
        200 => up.json().await.unwrap(),
        _ => {
            let mut r = Response::new(Body::from(up.bytes().await.unwrap()));
            *r.status_mut() = StatusCode::from_u16(status).unwrap();
            return r;
        }
    };
    // In digest order: the registry behind may answer in any order, and
    // pages of a list that reorders would repeat or miss descriptors.
    let mut all = index["manifests"].as_array().cloned().unwrap_or_default();
    all.sort_by(|a, b| a["digest"].as_str().cmp(&b["digest"].as_str()));
    let slice: Vec<_> = all.iter().skip(page * n).take(n).cloned().collect();
    index["manifests"] = serde_json::Value::Array(slice);
    let mut resp = Response::new(Body::from(serde_json::to_vec(&index).unwrap()));
    resp.headers_mut().insert(
        "content-type",
        HeaderValue::from_static("application/vnd.oci.image.index.v1+json"),
    );
    if (page + 1) * n < all.len() {
        let link = format!("<{base}?page={}>; rel=\"next\"", page + 1);
        resp.headers_mut()
            .insert("link", HeaderValue::from_str(&link).unwrap());
    }
    resp
}

/// One page of the upstream's tag list or catalog at `path`, as
/// [`Mode::TokenPages`] serves it, its next page linked at `link_to`.
async fn token_page(s: &Shared, link_to: &str, path: &str, n: usize) -> Response {
    let (base, query) = path.split_once('?').unwrap_or((path, ""));
    let (mut list, field, all) = match upstream_names(s, base).await {
        Ok(names) => names,
        Err(refusal) => return refusal,
    };
    // `next_page`, else `last`, read as a token; anything else starts over.
    let param = |key: &str| query_param(query, key);
    let start = param("next_page")
        .or_else(|| param("last"))
        .and_then(|t| t.strip_prefix("opaque-"))
        .and_then(|t| usize::from_str_radix(t, 16).ok())
        .unwrap_or(0);
    let asked = param("n").and_then(|v| v.parse().ok()).unwrap_or(n);
    let size = asked.clamp(1, n);
    let page: Vec<String> = all.iter().skip(start).take(size).cloned().collect();
    list[field] = serde_json::json!(page);
    let mut resp = Response::new(Body::from(serde_json::to_vec(&list).unwrap()));
    resp.headers_mut()
        .insert("content-type", HeaderValue::from_static("application/json"));
    if start + size < all.len() {
        let link = format!(
            "<{link_to}?n={size}&next_page=opaque-{:x}>; rel=\"next\"",
            start + size
        );
        resp.headers_mut()
            .insert("link", HeaderValue::from_str(&link).unwrap());
    }
    resp
}

/// The whole tag list or catalog at `base` of the registry behind, as
/// its JSON, the field that holds the names, and the names sorted; or the
/// refusal to answer with.
async fn upstream_names(
    s: &Shared,
    base: &str,
) -> Result<(serde_json::Value, &'static str, Vec<String>), Response> {
    // Distribution refuses a catalog page past 1,000.
    let field = match base.ends_with("/_catalog") {
        true => "repositories",
        false => "tags",
    };
    let url = format!("http://{}{base}?n=1000", s.upstream);
    let Ok(up) = s.http.get(url).send().await else {
        return Err(refused(502, None));
    };
    if !up.status().is_success() {
        return Err(refused(up.status().as_u16(), None));
    }
    let list: serde_json::Value = up.json().await.unwrap();
    let mut all: Vec<String> = list[field]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| v.as_str().map(str::to_owned))
        .collect();
    all.sort();
    Ok((list, field, all))
}

/// The `Host` a request was sent to.
fn host_of(req: &Request) -> String {
    req.headers()
        .get("host")
        .and_then(|h| h.to_str().ok())
        .unwrap_or_default()
        .to_owned()
}

/// The value of `key` in a URL query.
fn query_param<'q>(query: &'q str, key: &str) -> Option<&'q str> {
    query
        .split('&')
        .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
}

/// `status` with the registry's error envelope, and `Retry-After` seconds
/// when given.
fn refused(status: u16, retry_after: Option<u64>) -> Response {
    let code = match status {
        401 => "UNAUTHORIZED",
        403 => "DENIED",
        404 => "NAME_UNKNOWN",
        429 => "TOOMANYREQUESTS",
        // What Distribution answers a manifest PUT whose blob it
        // cannot read at that moment.
        400 => "MANIFEST_BLOB_UNKNOWN",
        _ => "UNAVAILABLE",
    };
    let mut resp = Response::new(Body::from(format!(
        r#"{{"errors":[{{"code":"{code}","message":"refused by the test front"}}]}}"#
    )));
    *resp.status_mut() = StatusCode::from_u16(status).unwrap();
    resp.headers_mut()
        .insert("content-type", HeaderValue::from_static("application/json"));
    if status == 401 {
        resp.headers_mut().insert(
            "www-authenticate",
            HeaderValue::from_static("Basic realm=\"test\""),
        );
    }
    if let Some(secs) = retry_after {
        resp.headers_mut()
            .insert("retry-after", HeaderValue::from(secs));
    }
    resp
}

/// The upstream's answer to `req` with half of its body, then an error
/// that closes the connection.
async fn cut_body(s: &Shared, req: Request, path: &str) -> Response {
    let mut fwd = s
        .http
        .request(req.method().clone(), format!("http://{}{path}", s.upstream));
    for (k, v) in req.headers() {
        fwd = fwd.header(k, v);
    }
    let Ok(up) = fwd.send().await else {
        return refused(502, None);
    };
    let mut resp = Response::builder().status(up.status().as_u16());
    for (k, v) in up.headers() {
        resp = resp.header(k, v);
    }
    let body = up.bytes().await.unwrap_or_default();
    let half = body.slice(..body.len() / 2);
    let chunks: Vec<Result<bytes::Bytes, std::io::Error>> = vec![
        Ok(half),
        Err(std::io::Error::other("body cut by the test front")),
    ];
    resp.body(Body::from_stream(futures::stream::iter(chunks)))
        .unwrap()
}

/// The first half of the upstream's list at `path`, linking a next page.
async fn first_half(s: &Shared, path: &str) -> Response {
    let Ok(up) = s
        .http
        .get(format!("http://{}{path}", s.upstream))
        .send()
        .await
    else {
        return refused(502, None);
    };
    if !up.status().is_success() {
        return refused(up.status().as_u16(), None);
    }
    let mut list: serde_json::Value = up.json().await.unwrap();
    let field = if path.contains("_catalog") {
        "repositories"
    } else {
        "tags"
    };
    let all = list[field].as_array().cloned().unwrap_or_default();
    let kept: Vec<_> = all.iter().take(all.len().div_ceil(2)).cloned().collect();
    let last = kept
        .last()
        .and_then(|v| v.as_str())
        .unwrap_or_default()
        .to_owned();
    list[field] = serde_json::Value::Array(kept);
    let base = path.split_once('?').map_or(path, |(b, _)| b);
    let mut resp = Response::new(Body::from(serde_json::to_vec(&list).unwrap()));
    resp.headers_mut()
        .insert("content-type", HeaderValue::from_static("application/json"));
    let link = format!("<{base}?n={}&last={last}>; rel=\"next\"", all.len());
    resp.headers_mut()
        .insert("link", HeaderValue::from_str(&link).unwrap());
    resp
}
