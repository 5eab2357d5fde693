#![forbid(unsafe_code)]

fn main() -> std::process::ExitCode {
    // reqwest (via oci-client) panics when no rustls provider is installed.
    let _ = rustls::crypto::ring::default_provider().install_default();
    pinswap::cli::main()
}
