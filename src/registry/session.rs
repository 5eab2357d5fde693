//! What the requests we make ourselves (not through oci-client) share for
//! one registry: its base URL, the HTTP client, and the Authorization
//! header, with bearer tokens cached by scope. The client (`client.rs`) and
//! the chunked upload (`upload.rs`) both use it, so neither depends on the
//! other's internals (docs/architecture.md §4).

use std::collections::HashMap;
use std::time::Duration;

use bytes::Bytes;
use oci_client::secrets::RegistryAuth;

use super::token::{self, Scheme};
use super::{Ctx, RegistryError, Result};

/// A blob's bytes as they stream, each item checked by the producer.
pub type BlobStream = futures::stream::BoxStream<'static, std::io::Result<Bytes>>;

/// One registry, as our own requests see it.
pub(crate) struct Session {
    /// `host[:port]` as given to the pool.
    pub(crate) host: String,
    /// `https` or `http`, as chosen by the `/v2/` probe.
    pub(crate) scheme: &'static str,
    /// `scheme://host[:port]` of the registry's API.
    pub(crate) base: String,
    /// The HTTP client for requests oci-client does not make for us.
    pub(crate) http: reqwest::Client,
    pub(crate) auth: RegistryAuth,
    /// What `GET /v2/` asked for.
    pub(crate) challenge: Scheme,
    /// Checks the URLs the registry hands us (token realms, locations).
    pub(crate) guard: super::guard::Guard,
    /// Bearer tokens by scope set, with when to stop using them: one token
    /// per scope and lifetime, not one per request.
    tokens: std::sync::Mutex<HashMap<String, (http::HeaderValue, std::time::Instant)>>,
    /// Held while a token is fetched.
    token_fetch: tokio::sync::Mutex<()>,
}

impl Session {
    /// A session for `registry`, whose API is at `scheme://api_host`.
    pub(crate) fn new(
        registry: &str,
        scheme: &'static str,
        api_host: &str,
        http: reqwest::Client,
        auth: RegistryAuth,
        challenge: Scheme,
        guard: super::guard::Guard,
    ) -> Self {
        Self {
            host: registry.to_owned(),
            scheme,
            base: format!("{scheme}://{api_host}"),
            http,
            auth,
            challenge,
            guard,
            tokens: std::sync::Mutex::default(),
            token_fetch: tokio::sync::Mutex::default(),
        }
    }

    /// `host[:port]` as given to the pool.
    pub(crate) fn host(&self) -> &str {
        &self.host
    }

    /// Whether no credentials are configured for this registry.
    pub(crate) fn is_anonymous(&self) -> bool {
        self.auth == RegistryAuth::Anonymous
    }

    /// `scheme://host[:port]` of the registry's API.
    pub(crate) fn base(&self) -> &str {
        &self.base
    }

    /// The HTTP client for requests oci-client does not make for us.
    pub(crate) fn http(&self) -> &reqwest::Client {
        &self.http
    }

    /// Whether `url` is on the registry's own origin (scheme, host and
    /// port of [`Session::base`]): the only place its credentials go.
    pub(crate) fn is_own(&self, url: &str) -> bool {
        match (reqwest::Url::parse(url), reqwest::Url::parse(&self.base)) {
            (Ok(u), Ok(b)) => u.origin() == b.origin(),
            _ => false,
        }
    }

    /// The outbound guard our requests go through.
    pub(crate) fn guard(&self) -> &super::guard::Guard {
        &self.guard
    }

    /// The context an error about `reference` and `operation` names.
    pub(crate) fn ctx<'a>(&'a self, reference: &'a str, operation: &'static str) -> Ctx<'a> {
        Ctx {
            registry: &self.host,
            reference,
            operation,
            anonymous: self.is_anonymous(),
        }
    }

    /// The Authorization header for our own requests with these token
    /// `scopes`: a fresh bearer token when the registry challenged with
    /// Bearer, basic credentials when it asked for Basic, else none.
    ///
    /// # Errors
    /// [`RegistryError::Unauthorized`] when the token endpoint refuses the
    /// credentials; [`RegistryError::Other`] when it cannot be reached.
    pub(crate) async fn auth_header(
        &self,
        scopes: &[String],
        reference: &str,
    ) -> Result<Option<http::HeaderValue>> {
        let key = scopes.join(" ");
        let cached = || {
            let tokens = self.tokens.lock().unwrap_or_else(|e| e.into_inner());
            tokens
                .get(&key)
                .filter(|(_, until)| std::time::Instant::now() < *until)
                .map(|(h, _)| h.clone())
        };
        // One fetch at a time: blobs copied in parallel all want the same
        // token, and the first one fetched serves them all.
        let _fetching = match &self.challenge {
            Scheme::Bearer(_) => {
                if let Some(h) = cached() {
                    return Ok(Some(h));
                }
                let guard = self.token_fetch.lock().await;
                if let Some(h) = cached() {
                    return Ok(Some(h));
                }
                Some(guard)
            }
            _ => None,
        };
        let mut lifetime = None;
        let value = match (&self.challenge, &self.auth) {
            (Scheme::Bearer(c), auth) => {
                match token::fetch(&self.http, &self.guard, c, scopes, auth).await {
                    Ok(t) => {
                        lifetime = Some(t.lifetime);
                        format!("Bearer {}", t.token)
                    }
                    Err((Some(401 | 403), _)) => {
                        return Err(RegistryError::unauthorized(
                            self.ctx(reference, "get a token for"),
                        ));
                    }
                    Err((_, message)) => {
                        return Err(RegistryError::Other {
                            registry: self.host.clone(),
                            reference: reference.to_owned(),
                            operation: "get a token for",
                            message,
                        });
                    }
                }
            }
            (_, RegistryAuth::Basic(u, p)) => {
                use base64::Engine as _;
                let b = base64::engine::general_purpose::STANDARD.encode(format!("{u}:{p}"));
                format!("Basic {b}")
            }
            _ => return Ok(None),
        };
        let mut h = http::HeaderValue::from_str(&value).map_err(|_| RegistryError::Other {
            registry: self.host.clone(),
            reference: reference.to_owned(),
            operation: "authenticate to",
            message: "credentials contain characters not allowed in a header".into(),
        })?;
        h.set_sensitive(true);
        // Reused until 10 s before it expires, so a request never carries a
        // token that lapses on the way.
        if let Some(l) = lifetime.and_then(|l| l.checked_sub(Duration::from_secs(10))) {
            let mut tokens = self.tokens.lock().unwrap_or_else(|e| e.into_inner());
            if tokens.len() > 1000 {
                tokens.clear();
            }
            tokens.insert(key, (h.clone(), std::time::Instant::now() + l));
        }
        Ok(Some(h))
    }

    /// Sends the request `build` makes, with the Authorization header for
    /// `scopes` when it goes to the registry's own origin. A 401 to a bearer
    /// token is retried once with a fresh token (the registry may have
    /// revoked it early). `build` is called once per attempt, so its body
    /// must be replayable (none, or bytes). Every request of ours but a
    /// streamed body goes through here, so all map errors alike.
    ///
    /// # Errors
    /// [`RegistryError::Unreachable`] for transport failures; auth errors.
    pub(crate) async fn send(
        &self,
        scopes: &[String],
        name: &str,
        build: impl Fn() -> reqwest::RequestBuilder,
    ) -> Result<reqwest::Response> {
        let mut retried = false;
        loop {
            let mut req = build().build().map_err(|e| self.transport(e))?;
            if self.is_own(req.url().as_str())
                && let Some(h) = self.auth_header(scopes, name).await?
            {
                req.headers_mut().insert(reqwest::header::AUTHORIZATION, h);
            }
            let resp = self
                .http
                .execute(req)
                .await
                .map_err(|e| self.transport(e))?;
            if resp.status() == reqwest::StatusCode::UNAUTHORIZED
                && !retried
                && matches!(self.challenge, Scheme::Bearer(_))
            {
                self.forget_token(scopes);
                retried = true;
                continue;
            }
            return Ok(resp);
        }
    }

    /// A transport error, without the URL: upload URLs carry session state.
    /// An outage to the breakers (docs/architecture.md §3 "Source health").
    pub(crate) fn transport(&self, e: reqwest::Error) -> RegistryError {
        RegistryError::Unreachable {
            registry: self.host.clone(),
            reason: super::chain(&e.without_url()),
        }
    }

    /// The error for an answer that is not the one expected: 401 as an auth
    /// error, 429 and 5xx as [`RegistryError::Unavailable`] with their
    /// `Retry-After`, anything else as [`RegistryError::Http`] with the
    /// registry's error code and message.
    pub(crate) async fn refusal(
        &self,
        resp: reqwest::Response,
        name: &str,
        operation: &'static str,
    ) -> RegistryError {
        let status = resp.status().as_u16();
        match status {
            401 => RegistryError::unauthorized(self.ctx(name, operation)),
            429 | 500..=599 => RegistryError::Unavailable {
                registry: self.host.clone(),
                reference: name.to_owned(),
                operation,
                status,
                retry_after: super::retry_after(resp.headers()),
            },
            _ => {
                let body = resp.text().await.unwrap_or_default();
                let (code, message) = super::describe_body(&body);
                RegistryError::Http {
                    registry: self.host.clone(),
                    reference: name.to_owned(),
                    operation,
                    status,
                    code,
                    message,
                }
            }
        }
    }

    /// The absolute upload URL a `Location` header names.
    pub(crate) fn upload_location(&self, resp: &reqwest::Response, name: &str) -> Result<String> {
        let loc = resp
            .headers()
            .get(reqwest::header::LOCATION)
            .and_then(|v| v.to_str().ok())
            .ok_or_else(|| RegistryError::Other {
                registry: self.host.clone(),
                reference: name.to_owned(),
                operation: "blob upload",
                message: "the registry sent no Location header".into(),
            })?;
        let location = match loc.starts_with('/') {
            true => format!("{}{loc}", self.base()),
            false => loc.to_owned(),
        };
        // From the registry: a literal address is checked here, a name when
        // it is resolved.
        self.guard()
            .check_str(&location)
            .map_err(|e| RegistryError::Other {
                registry: self.host.clone(),
                reference: name.to_owned(),
                operation: "blob upload",
                message: format!("Location {location}: {e}"),
            })?;
        Ok(location)
    }

    /// Drops the cached token for `scopes` (a registry refused it early).
    pub(crate) fn forget_token(&self, scopes: &[String]) {
        self.tokens
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&scopes.join(" "));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn session(base_host: &str, scheme: &'static str) -> Session {
        let _ = rustls::crypto::ring::default_provider().install_default();
        Session::new(
            base_host,
            scheme,
            base_host,
            reqwest::Client::new(),
            RegistryAuth::Basic("u".into(), "p".into()),
            Scheme::Basic,
            super::super::guard::Guard::default(),
        )
    }

    #[test]
    fn credentials_go_to_the_registrys_own_origin_only() {
        let s = session("127.0.0.1:5000", "http");
        assert!(s.is_own("http://127.0.0.1:5000/v2/a/blobs/uploads/x?state=1"));
        // Another port, scheme or host is another origin.
        assert!(!s.is_own("http://127.0.0.1:5001/v2/a/blobs/uploads/x"));
        assert!(!s.is_own("https://127.0.0.1:5000/v2/a/blobs/uploads/x"));
        assert!(!s.is_own("http://storage.example/upload/x"));
        assert!(!s.is_own("not a url"));
        let s = session("registry.example", "https");
        assert!(s.is_own("https://registry.example:443/v2/"), "default port");
        assert!(!s.is_own("https://registry.example.evil/v2/"));
    }
}
