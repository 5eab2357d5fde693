//! The ceiling for `scripts/bench-admission.sh`: an HTTPS endpoint that does
//! what the webhook's transport does (rustls with ring, axum, axum-server, a
//! multi-threaded tokio runtime, the request body read whole) and nothing
//! else. `POST /mutate` answers 200 with a fixed AdmissionReview response.
//!
//! ```sh
//! cargo run --release --example ceiling -- --listen 127.0.0.1:9443 \
//!     --cert tls.crt --key tls.key [--body response.json]
//! ```
//!
//! `--body FILE` serves that file instead of the built-in response, so the
//! benchmark can answer with exactly the bytes pinswap returns. `--nodelay`
//! sets `TCP_NODELAY` on accepted connections; like `pinswap serve` today,
//! the ceiling leaves it off by default, so both run on the same transport.

use std::net::SocketAddr;
use std::path::PathBuf;

use axum::Router;
use axum::body::Bytes;
use axum::http::header;
use axum::routing::post;
use axum_server::accept::NoDelayAcceptor;
use axum_server::tls_rustls::RustlsConfig;
use clap::Parser;

/// An allowed review with one JSONPatch op (base64), like a webhook's answer.
const RESPONSE: &str = r#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","response":{"uid":"7d1c2a4e-5b3f-4e7a-9c1d-0a2b3c4d5e01","allowed":true,"patchType":"JSONPatch","patch":"W3sib3AiOiJyZXBsYWNlIiwicGF0aCI6Ii9zcGVjL2NvbnRhaW5lcnMvMC9pbWFnZSIsInZhbHVlIjoibWlycm9yLmV4YW1wbGUuY29tL2NhY2hlL2RvY2tlci5pby9saWJyYXJ5L25naW54OjEuMjcifV0="}}"#;

/// A fixed-response HTTPS endpoint: the ceiling for the admission benchmark.
#[derive(Parser)]
struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:9443")]
    listen: SocketAddr,
    /// PEM certificate chain (leaf first).
    #[arg(long)]
    cert: PathBuf,
    /// PEM private key.
    #[arg(long)]
    key: PathBuf,
    /// Serve this file's bytes instead of the built-in response.
    #[arg(long, value_name = "FILE")]
    body: Option<PathBuf>,
    /// Set TCP_NODELAY on accepted connections.
    #[arg(long)]
    nodelay: bool,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let args = Args::parse();
    let body = match &args.body {
        Some(path) => Bytes::from(std::fs::read(path)?),
        None => Bytes::from_static(RESPONSE.as_bytes()),
    };
    let tls = RustlsConfig::from_pem_file(&args.cert, &args.key).await?;
    let app = Router::new().route(
        "/mutate",
        post(async move |request: Bytes| {
            // Read the request whole, as the webhook does, then drop it.
            drop(request);
            ([(header::CONTENT_TYPE, "application/json")], body.clone())
        }),
    );
    eprintln!("ceiling: serving https://{}/mutate", args.listen);
    let server = axum_server::bind_rustls(args.listen, tls);
    if args.nodelay {
        server
            .map(|tls| tls.acceptor(NoDelayAcceptor::new()))
            .serve(app.into_make_service())
            .await?;
    } else {
        server.serve(app.into_make_service()).await?;
    }
    Ok(())
}
