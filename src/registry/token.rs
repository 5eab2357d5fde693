//! Registry tokens for several scopes at once (Docker token authentication
//! spec: `GET realm?service=...&scope=...&scope=...` with basic credentials,
//! answered with `{"token": ...}` or `{"access_token": ...}`).
//!
//! oci-client runs this flow too, but asks for one repository per token. A
//! cross-repository mount needs `pull` on the source repository as well as
//! `push` on the target (distribution-spec §Mounting a blob), and our own
//! upload requests need a header we can set per request; both come from here.

use oci_client::secrets::RegistryAuth;

/// A `WWW-Authenticate: Bearer` challenge.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Challenge {
    /// Token endpoint URL.
    pub realm: String,
    /// The `service` parameter, if any.
    pub service: Option<String>,
}

/// What a registry's `GET /v2/` asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Scheme {
    /// No challenge: send nothing.
    None,
    /// `Basic`: send credentials on every request.
    Basic,
    /// `Bearer`: fetch a token.
    Bearer(Challenge),
}

/// Parses a `WWW-Authenticate` header value (RFC 7235 auth-params, quoted or
/// bare). Unknown schemes count as Basic, as oci-client treats them.
pub(crate) fn parse_challenge(header: &str) -> Scheme {
    let header = header.trim();
    let (scheme, rest) = header.split_once(' ').unwrap_or((header, ""));
    if !scheme.eq_ignore_ascii_case("bearer") {
        return Scheme::Basic;
    }
    let mut realm = None;
    let mut service = None;
    let mut rest = rest.trim();
    while !rest.is_empty() {
        let Some((key, after)) = rest.split_once('=') else {
            break;
        };
        let key = key
            .trim()
            .trim_start_matches(',')
            .trim()
            .to_ascii_lowercase();
        let after = after.trim_start();
        let (value, tail) = if let Some(q) = after.strip_prefix('"') {
            match q.find('"') {
                Some(end) => (&q[..end], &q[end + 1..]),
                None => (q, ""),
            }
        } else {
            match after.find(',') {
                Some(end) => (&after[..end], &after[end..]),
                None => (after, ""),
            }
        };
        match key.as_str() {
            "realm" => realm = Some(value.to_owned()),
            "service" => service = Some(value.to_owned()),
            _ => {}
        }
        rest = tail.trim_start().trim_start_matches(',').trim_start();
    }
    match realm {
        Some(realm) => Scheme::Bearer(Challenge { realm, service }),
        None => Scheme::Basic,
    }
}

#[derive(serde::Deserialize)]
struct TokenResponse {
    #[serde(default)]
    token: Option<String>,
    #[serde(default)]
    access_token: Option<String>,
    /// Seconds the token is valid; the token spec's default is 60.
    #[serde(default)]
    expires_in: Option<u64>,
}

/// A token and how long it may be reused.
#[derive(Debug, Clone)]
pub(crate) struct Token {
    /// The bearer token.
    pub token: String,
    /// Its lifetime as the endpoint stated it (60 s when it did not).
    pub lifetime: std::time::Duration,
}

/// Fetches a token for `scopes` (e.g. `repository:app:pull,push`).
///
/// # Errors
/// A message with the HTTP status (401 means the credentials were refused)
/// or the transport error; it never contains the credentials.
pub(crate) async fn fetch(
    http: &reqwest::Client,
    guard: &super::guard::Guard,
    challenge: &Challenge,
    scopes: &[String],
    auth: &RegistryAuth,
) -> Result<Token, (Option<u16>, String)> {
    let mut query: Vec<(&str, &str)> = scopes.iter().map(|s| ("scope", s.as_str())).collect();
    if let Some(s) = &challenge.service {
        query.push(("service", s));
    }
    // The realm comes from the registry: a literal address is checked here,
    // a name when it is resolved.
    guard
        .check_str(&challenge.realm)
        .map_err(|e| (None, format!("token endpoint {}: {e}", challenge.realm)))?;
    let mut req = http.get(&challenge.realm).query(&query);
    if let RegistryAuth::Basic(u, p) = auth {
        req = req.basic_auth(u, Some(p));
    }
    let resp = req.send().await.map_err(|e| (None, super::chain(&e)))?;
    let status = resp.status();
    if !status.is_success() {
        return Err((
            Some(status.as_u16()),
            format!("token endpoint {} answered {status}", challenge.realm),
        ));
    }
    let body: TokenResponse = resp
        .json()
        .await
        .map_err(|e| (None, format!("token endpoint {}: {e}", challenge.realm)))?;
    let lifetime = std::time::Duration::from_secs(body.expires_in.unwrap_or(60));
    body.token
        .or(body.access_token)
        .filter(|t| !t.is_empty())
        .map(|token| Token { token, lifetime })
        .ok_or_else(|| {
            (
                None,
                format!("token endpoint {} sent no token", challenge.realm),
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn challenges() {
        assert_eq!(
            parse_challenge(
                r#"Bearer realm="https://auth.docker.io/token",service="registry.docker.io",scope="repository:library/nginx:pull""#
            ),
            Scheme::Bearer(Challenge {
                realm: "https://auth.docker.io/token".into(),
                service: Some("registry.docker.io".into())
            })
        );
        assert_eq!(
            parse_challenge(r#"bearer service=reg, realm="http://127.0.0.1:1/t""#),
            Scheme::Bearer(Challenge {
                realm: "http://127.0.0.1:1/t".into(),
                service: Some("reg".into())
            })
        );
        assert_eq!(
            parse_challenge(r#"Basic realm="Registry Realm""#),
            Scheme::Basic
        );
        assert_eq!(parse_challenge("Bearer"), Scheme::Basic);
    }
}
