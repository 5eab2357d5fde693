//! An HTTP front for a registry: it passes every request through, or
//! answers all of them with one status (429 with `Retry-After`, 503), as a
//! rate-limited or failing registry does, and counts the requests that
//! reached it by method and path. The registry behind it is a real
//! Distribution process; only the refusals are the front's own.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::response::Response;

/// What the front does with each request.
#[derive(Debug, Clone, PartialEq)]
pub enum Mode {
    /// Forward to the registry.
    Pass,
    /// Answer with this status and, when given, `Retry-After` seconds.
    Refuse(u16, Option<u64>),
}

struct Shared {
    upstream: String,
    http: reqwest::Client,
    mode: Mutex<Mode>,
    /// (method, path) → count, over every mode.
    seen: Mutex<HashMap<(String, String), u64>>,
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
            .filter(|((_, p), _)| p.contains(part))
            .map(|(_, n)| n)
            .sum()
    }

    /// Every request seen so far.
    pub fn total(&self) -> u64 {
        self.shared.seen.lock().unwrap().values().sum()
    }

    /// Forgets the counts.
    pub fn reset(&self) {
        self.shared.seen.lock().unwrap().clear();
    }
}

impl Drop for Front {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn handle(State(s): State<Arc<Shared>>, req: Request) -> Response {
    let path = req
        .uri()
        .path_and_query()
        .map(|p| p.as_str().to_owned())
        .unwrap_or_default();
    *s.seen
        .lock()
        .unwrap()
        .entry((req.method().to_string(), req.uri().path().to_owned()))
        .or_default() += 1;
    let mode = s.mode.lock().unwrap().clone();
    if let Mode::Refuse(status, retry_after) = mode {
        let code = match status {
            429 => "TOOMANYREQUESTS",
            _ => "UNAVAILABLE",
        };
        let mut resp = Response::new(Body::from(format!(
            r#"{{"errors":[{{"code":"{code}","message":"refused by the test front"}}]}}"#
        )));
        *resp.status_mut() = StatusCode::from_u16(status).unwrap();
        resp.headers_mut()
            .insert("content-type", HeaderValue::from_static("application/json"));
        if let Some(secs) = retry_after {
            resp.headers_mut()
                .insert("retry-after", HeaderValue::from(secs));
        }
        return resp;
    }
    let (parts, body) = req.into_parts();
    let mut fwd = s
        .http
        .request(parts.method, format!("http://{}{path}", s.upstream))
        .body(reqwest::Body::wrap_stream(body.into_data_stream()));
    for (k, v) in &parts.headers {
        if k != "host" {
            fwd = fwd.header(k, v);
        }
    }
    match fwd.send().await {
        Ok(up) => {
            let mut resp = Response::builder().status(up.status().as_u16());
            for (k, v) in up.headers() {
                resp = resp.header(k, v);
            }
            resp.body(Body::from_stream(up.bytes_stream())).unwrap()
        }
        Err(_) => {
            let mut r = Response::new(Body::empty());
            *r.status_mut() = StatusCode::BAD_GATEWAY;
            r
        }
    }
}
