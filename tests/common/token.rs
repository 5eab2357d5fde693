//! An in-process token server for registries configured with `auth: token:`
//! (Docker token authentication spec).
//!
//! A client that gets `401` with `WWW-Authenticate: Bearer realm=...,
//! service=...,scope=...` from the registry GETs the realm with `service` and
//! one or more `scope=TYPE:NAME:ACTIONS` parameters and HTTP basic
//! credentials; this server answers `{"token": JWT, ...}` where the JWT
//! grants exactly the requested actions, or `401` when the credentials are
//! missing or wrong. The JWT is ES256-signed, with the self-signed signing
//! certificate in the `x5c` header; Distribution verifies that chain against
//! its `rootcertbundle` ([`TokenServer::cert_pem`]).
//!
//! HTTP handling is deliberately minimal: one GET per connection, answered
//! with `Connection: close`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
use reqwest::Method;
use ring::signature::{ECDSA_P256_SHA256_FIXED_SIGNING, EcdsaKeyPair};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// The `service` the registry names in its challenge and expects as `aud`.
pub const SERVICE: &str = "pinswap-test";
/// The `iss` the registry trusts.
pub const ISSUER: &str = "pinswap-test-issuer";
/// How long issued tokens are valid, in seconds.
pub const TOKEN_TTL: u64 = 300;

/// One requested (and granted) access: `TYPE:NAME:ACTIONS`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Access {
    pub kind: String,
    pub name: String,
    pub actions: Vec<String>,
}

impl Access {
    /// Parses `repository:NAME:pull,push`. NAME may hold ':' (a registry
    /// host with a port), so the type ends at the first ':' and the actions
    /// start after the last.
    pub fn parse(scope: &str) -> Option<Access> {
        let (kind, rest) = scope.split_once(':')?;
        let (name, actions) = rest.rsplit_once(':')?;
        if kind.is_empty() || name.is_empty() {
            return None;
        }
        Some(Access {
            kind: kind.to_owned(),
            name: name.to_owned(),
            actions: actions
                .split(',')
                .filter(|a| !a.is_empty())
                .map(str::to_owned)
                .collect(),
        })
    }

    pub fn repository(name: &str, actions: &[&str]) -> Access {
        Access {
            kind: "repository".into(),
            name: name.into(),
            actions: actions.iter().map(|a| (*a).to_owned()).collect(),
        }
    }

    fn to_json(&self) -> Value {
        json!({ "type": self.kind, "name": self.name, "actions": self.actions })
    }
}

/// What the server saw: one entry per token request.
#[derive(Clone, Debug)]
pub struct TokenRequest {
    /// The basic-auth user name, if any (never the password).
    pub user: Option<String>,
    /// Whether a token was issued.
    pub granted: bool,
    /// The `service` parameter.
    pub service: Option<String>,
    /// The raw `scope` parameters, in order.
    pub scopes: Vec<String>,
}

struct Inner {
    user: String,
    /// Replaceable: [`TokenServer::set_password`] rotates it.
    password: Mutex<String>,
    key: EcdsaKeyPair,
    /// base64 (standard, padded) DER of the signing certificate.
    cert_b64: String,
    cert_pem: String,
    jti: AtomicU64,
    log: Mutex<Vec<TokenRequest>>,
}

/// A running token server; stops when dropped.
pub struct TokenServer {
    port: u16,
    inner: Arc<Inner>,
    task: JoinHandle<()>,
}

impl TokenServer {
    /// Listens on 127.0.0.1 and a free port; issues tokens to `user` with
    /// `password`. Call inside a tokio runtime.
    pub async fn start(user: &str, password: &str) -> TokenServer {
        let (cert_pem, cert_der, pkcs8) = signing_material();
        let key = EcdsaKeyPair::from_pkcs8(
            &ECDSA_P256_SHA256_FIXED_SIGNING,
            &pkcs8,
            &ring::rand::SystemRandom::new(),
        )
        .expect("rcgen's P-256 key as a ring key pair");
        let inner = Arc::new(Inner {
            user: user.to_owned(),
            password: Mutex::new(password.to_owned()),
            key,
            cert_b64: STANDARD.encode(cert_der),
            cert_pem,
            jti: AtomicU64::new(0),
            log: Mutex::default(),
        });
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind token server");
        let port = listener.local_addr().unwrap().port();
        let state = inner.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((conn, _)) = listener.accept().await else {
                    continue;
                };
                let state = state.clone();
                tokio::spawn(async move {
                    // A client that hangs up mid-request is its own problem.
                    let _ = serve(conn, &state).await;
                });
            }
        });
        TokenServer { port, inner, task }
    }

    /// Accepts only `password` from now on (a rotated secret, an expired
    /// cloud token).
    pub fn set_password(&self, password: &str) {
        *self.inner.password.lock().unwrap() = password.to_owned();
    }

    /// `http://127.0.0.1:PORT/token`, the registry's `realm`.
    pub fn realm(&self) -> String {
        format!("http://127.0.0.1:{}/token", self.port)
    }

    /// PEM of the self-signed signing certificate (the registry's
    /// `rootcertbundle`).
    pub fn cert_pem(&self) -> &str {
        &self.inner.cert_pem
    }

    /// Every token request so far (granted or not).
    pub fn log(&self) -> Vec<TokenRequest> {
        self.inner.log.lock().unwrap().clone()
    }

    /// Number of token requests so far (granted or not).
    pub fn requests(&self) -> usize {
        self.inner.log.lock().unwrap().len()
    }

    /// Number of token requests refused for bad or missing credentials.
    pub fn denied(&self) -> usize {
        self.log().iter().filter(|r| !r.granted).count()
    }

    /// Every `scope` requested in a granted request, in order.
    pub fn granted_scopes(&self) -> Vec<String> {
        self.log()
            .into_iter()
            .filter(|r| r.granted)
            .flat_map(|r| r.scopes)
            .collect()
    }

    /// A token for `access`, signed like the ones served but minted without
    /// a request (not counted): for test helpers reading the registry.
    pub fn mint(&self, subject: &str, access: &[Access]) -> String {
        self.inner.mint(subject, access)
    }

    /// A token for everything a harness request by `method` to `url` needs
    /// (Distribution's access records: pull for GET/HEAD, pull and push for
    /// writes, delete for DELETE, `registry:catalog:*` for the catalog).
    pub fn mint_for_request(&self, method: &Method, url: &str) -> String {
        let path = reqwest::Url::parse(url)
            .map(|u| u.path().to_owned())
            .unwrap_or_default();
        let rest = path.strip_prefix("/v2/").unwrap_or("");
        let access = if rest == "_catalog" {
            vec![Access {
                kind: "registry".into(),
                name: "catalog".into(),
                actions: vec!["*".into()],
            }]
        } else {
            let name = ["/manifests/", "/blobs/", "/tags/"]
                .iter()
                .find_map(|m| rest.find(m).map(|i| &rest[..i]));
            let actions: &[&str] = match *method {
                Method::GET | Method::HEAD => &["pull"],
                Method::DELETE => &["delete"],
                _ => &["pull", "push"],
            };
            name.map(|n| vec![Access::repository(n, actions)])
                .unwrap_or_default()
        };
        self.mint("harness", &access)
    }
}

impl Drop for TokenServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Inner {
    fn mint(&self, subject: &str, access: &[Access]) -> String {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs();
        let header = json!({ "typ": "JWT", "alg": "ES256", "x5c": [self.cert_b64] });
        let claims = json!({
            "iss": ISSUER,
            "sub": subject,
            "aud": SERVICE,
            "exp": now + TOKEN_TTL,
            "nbf": now,
            "iat": now,
            "jti": format!("pinswap-test-{}", self.jti.fetch_add(1, Ordering::Relaxed)),
            "access": access.iter().map(Access::to_json).collect::<Vec<_>>(),
        });
        let signing_input = format!(
            "{}.{}",
            URL_SAFE_NO_PAD.encode(header.to_string()),
            URL_SAFE_NO_PAD.encode(claims.to_string())
        );
        let sig = self
            .key
            .sign(&ring::rand::SystemRandom::new(), signing_input.as_bytes())
            .expect("ES256 sign");
        format!("{signing_input}.{}", URL_SAFE_NO_PAD.encode(sig.as_ref()))
    }

    /// The basic-auth user when the credentials are right, `Err(user)` when
    /// they are missing (`None`) or wrong.
    fn check_basic(&self, header: Option<&str>) -> Result<String, Option<String>> {
        let encoded = header
            .and_then(|h| {
                h.strip_prefix("Basic ")
                    .or_else(|| h.strip_prefix("basic "))
            })
            .ok_or(None)?;
        let decoded = STANDARD
            .decode(encoded.trim())
            .ok()
            .and_then(|b| String::from_utf8(b).ok())
            .ok_or(None)?;
        let (user, password) = decoded.split_once(':').ok_or(None)?;
        if user == self.user && password == *self.password.lock().unwrap() {
            Ok(user.to_owned())
        } else {
            Err(Some(user.to_owned()))
        }
    }
}

/// A fresh P-256 key and a self-signed certificate for it:
/// `(cert PEM, cert DER, key PKCS#8 DER)`.
fn signing_material() -> (String, Vec<u8>, Vec<u8>) {
    use rcgen::{CertificateParams, DnType, KeyPair};
    let key = KeyPair::generate().expect("generate P-256 key");
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params
        .distinguished_name
        .push(DnType::CommonName, "pinswap test token issuer");
    let cert = params.self_signed(&key).expect("self-sign token cert");
    (cert.pem(), cert.der().to_vec(), key.serialize_der())
}

/// Reads one request head, answers it, closes.
async fn serve(mut conn: TcpStream, state: &Inner) -> std::io::Result<()> {
    let mut head = Vec::new();
    let mut buf = [0u8; 4096];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = conn.read(&mut buf).await?;
        if n == 0 || head.len() > 64 * 1024 {
            return Ok(());
        }
        head.extend_from_slice(&buf[..n]);
    }
    let head = String::from_utf8_lossy(&head);
    let mut lines = head.split("\r\n");
    let mut request_line = lines.next().unwrap_or("").split(' ');
    let (method, target) = (request_line.next(), request_line.next());
    let authorization = lines
        .take_while(|l| !l.is_empty())
        .filter_map(|l| l.split_once(':'))
        .find(|(k, _)| k.trim().eq_ignore_ascii_case("authorization"))
        .map(|(_, v)| v.trim().to_owned());

    let url = target.and_then(|t| reqwest::Url::parse(&format!("http://token{t}")).ok());
    let (status, extra, body) = match (method, url) {
        (Some("GET"), Some(url)) if url.path() == "/token" => {
            let mut service = None;
            let mut scopes = Vec::new();
            for (k, v) in url.query_pairs() {
                match &*k {
                    "service" => service = Some(v.into_owned()),
                    // The spec allows several scopes in one parameter, space-separated.
                    "scope" => scopes.extend(v.split_whitespace().map(str::to_owned)),
                    _ => {}
                }
            }
            let checked = state.check_basic(authorization.as_deref());
            let granted = checked.is_ok();
            let user = match &checked {
                Ok(u) => Some(u.clone()),
                Err(u) => u.clone(),
            };
            state.log.lock().unwrap().push(TokenRequest {
                user: user.clone(),
                granted,
                service: service.clone(),
                scopes: scopes.clone(),
            });
            if !granted {
                (
                    "401 Unauthorized",
                    "WWW-Authenticate: Basic realm=\"pinswap-test-token\"\r\n",
                    json!({"errors": [{"code": "UNAUTHORIZED", "message": "authentication required"}]}),
                )
            } else if service.as_deref() != Some(SERVICE) {
                let msg = format!("unknown service {service:?}");
                ("400 Bad Request", "", json!({ "details": msg }))
            } else {
                let access: Option<Vec<Access>> = scopes.iter().map(|s| Access::parse(s)).collect();
                match access {
                    Some(access) => {
                        let token = state.mint(user.as_deref().unwrap_or(""), &access);
                        (
                            "200 OK",
                            "",
                            json!({ "token": token, "access_token": token, "expires_in": TOKEN_TTL }),
                        )
                    }
                    None => (
                        "400 Bad Request",
                        "",
                        json!({ "details": format!("bad scope in {scopes:?}") }),
                    ),
                }
            }
        }
        _ => ("404 Not Found", "", json!({ "details": "not found" })),
    };
    let body = body.to_string();
    let resp = format!(
        "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
         {extra}Connection: close\r\n\r\n{body}",
        body.len()
    );
    conn.write_all(resp.as_bytes()).await?;
    conn.shutdown().await
}
