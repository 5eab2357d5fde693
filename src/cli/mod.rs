//! The `pinswap` command line (clap derive). Exit codes: 0 success, 1 a copy
//! failed or a config is invalid, 2 usage error (bad flag, reference or list
//! file, a file named on the command line that cannot be read), 3 `pinswap
//! check` flagged an identity problem.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

mod airgap;
mod check;
mod clusters;
pub(crate) mod install;
mod meta;
mod mutate;
mod retention;

pub use meta::{CompletionsArgs, ManArgs, VersionArgs};
pub use mutate::MutateArgs;

use anyhow::Context;
use clap::{Args, Parser, Subcommand, ValueEnum};
use serde::Serialize;

use crate::platform::PlatformSpec;
use crate::reference::{Digest, MirrorTarget, Reference};
use crate::registry::auth::{CredentialSources, Credentials};
use crate::registry::copy::{Copier, CopyOptions, CopyReport, Endpoint};
use crate::registry::locations::BlobLocations;
use crate::registry::referrers::{ReferrerCopier, ReferrerOptions, ReferrersReport};
use crate::registry::{ClientPool, PoolOptions};

/// Mirror container images into a registry you own, pinned by digest.
#[derive(Debug, Parser)]
#[command(name = "pinswap", version, about, propagate_version = true)]
pub struct Cli {
    /// Log format on stderr.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text, help_heading = LOGGING)]
    pub log_format: LogFormat,
    /// Log filter (tracing EnvFilter syntax), e.g. `info`, `pinswap=debug`.
    /// Default: `info` for `serve` (one line per admission; each decision at
    /// `debug`), `cache` and `node-agent`, `warn` otherwise.
    #[arg(long, global = true, env = "PINSWAP_LOG", help_heading = LOGGING)]
    pub log_level: Option<String>,
    /// The command.
    #[command(subcommand)]
    pub command: Command,
}

/// The `--help` section of the logging options, apart from each command's own.
const LOGGING: &str = "Logging";

/// Log output format.
#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Copy an image (manifest, index or artifact) byte-exact between registries and OCI layouts.
    Copy(Box<CopyArgs>),
    /// Run the mutating admission webhook (HTTPS) and its health/metrics server.
    Serve(ServeArgs),
    /// Rewrite Pods and pod templates in Kubernetes YAML/JSON files, mirroring as configured (GitOps).
    Mutate(MutateArgs),
    /// Check or print the webhook's YAML config.
    #[command(subcommand)]
    Config(ConfigCommand),
    /// Act on a running `pinswap serve`'s caches.
    #[command(subcommand)]
    Cache(CacheCommand),
    /// List or forget the usage records of the clusters sharing the target.
    #[command(subcommand)]
    Clusters(clusters::ClustersCommand),
    /// Write what the clusters' usage records list (every platform, tags, referrers) into an OCI layout, for an air gap.
    Export(airgap::ExportArgs),
    /// Push an export into another registry, digests unchanged.
    Import(Box<airgap::ImportArgs>),
    /// What retention would remove from the target, and what it keeps, and why.
    #[command(subcommand)]
    Retention(retention::RetentionCommand),
    /// Print the Kubernetes objects that install pinswap (`| kubectl apply -f -`).
    Manifests(install::ManifestsArgs),
    /// Render the container runtime's mirror configuration (containerd hosts.toml, CRI-O registries.conf.d) so nodes pull from the target.
    NodeConfig(NodeConfigArgs),
    /// Keep node-config's files true on this node until stopped (run by the node agent DaemonSet).
    NodeAgent(NodeAgentArgs),
    /// Print each manifest's config digest (image ID) and flag identity collisions and non-unique configs; exit 3 when anything is flagged.
    Check(CheckArgs),
    /// Print the version, the git commit and the target it was built for.
    Version(VersionArgs),
    /// Print shell completions (bash, zsh, fish, elvish, powershell) on stdout.
    Completions(CompletionsArgs),
    /// Print the man page (roff), or write one per command with --dir.
    Man(ManArgs),
}

/// `pinswap check REF...` or `pinswap check --repository REGISTRY/REPO`.
#[derive(Debug, Args)]
#[command(
    after_help = "Exit codes: 0 nothing flagged; 3 a collision or non-unique config was flagged; \
1 a reference could not be read (and nothing was flagged); 2 usage error.\n\nExamples:\n  \
    pinswap check ghcr.io/acme/app:v1 ghcr.io/acme/app:v2\n  \
    pinswap check --repository 127.0.0.1:5000/spin/hello --json"
)]
pub struct CheckArgs {
    /// References to check, `[docker://][registry/]repository[:tag][@digest]`.
    #[arg(required_unless_present = "repository")]
    pub references: Vec<String>,
    /// Check every tag of this repository (repeatable).
    #[arg(long, value_name = "REGISTRY/REPOSITORY")]
    pub repository: Vec<String>,
    /// Print a machine-readable report on stdout.
    #[arg(long)]
    pub json: bool,
    /// Registry access (`--src-creds` authenticates the reads).
    #[command(flatten)]
    pub registry: RegistryArgs,
}

/// The runtime and mode of `node-config` and `node-agent`.
#[derive(Debug, Args)]
pub struct NodeRuntimeArgs {
    /// The node's container runtime.
    #[arg(long, value_enum, default_value = "containerd")]
    pub runtime: crate::nodeconfig::Runtime,
    /// `resolve`: tags resolve at the mirror too (Pods start while the source is down); `digest-only`: tags resolve at the source, content comes from the mirror.
    #[arg(long, value_enum, default_value = "resolve")]
    pub mode: crate::nodeconfig::Mode,
}

/// `pinswap node-config --config FILE [--runtime R] [--mode M] [--out DIR]`.
#[derive(Debug, Args)]
#[command(after_help = "Examples:\n  \
    pinswap node-config -c pinswap.yaml --out /etc/containerd/certs.d\n  \
    pinswap node-config -c pinswap.yaml --runtime cri-o --mode digest-only --out /etc/containers/registries.conf.d")]
pub struct NodeConfigArgs {
    /// The webhook's config file.
    #[arg(short, long)]
    pub config: std::path::PathBuf,
    /// The runtime and mode.
    #[command(flatten)]
    pub node: NodeRuntimeArgs,
    /// Write the files under this directory (containerd's config_path, CRI-O's registries.conf.d), each atomically, never over a file pinswap did not write nor over what the node configures itself for a source; without it they are printed.
    #[arg(long)]
    pub out: Option<std::path::PathBuf>,
    /// With --out and CRI-O: the node's registries.conf (default: beside --out); a source it configures gets no [[registry]] of pinswap's.
    #[arg(long)]
    pub registries_conf: Option<std::path::PathBuf>,
}

/// `pinswap node-agent --config FILE --dir DIR [...]`.
#[derive(Debug, Args)]
#[command(after_help = "Examples:\n  \
    pinswap node-agent -c /etc/pinswap/pinswap.yaml --dir /host/etc/containerd/certs.d --daemonset pinswap-node-agent")]
pub struct NodeAgentArgs {
    /// The webhook's config file, read again every round.
    #[arg(short, long)]
    pub config: std::path::PathBuf,
    /// The runtime and mode.
    #[command(flatten)]
    pub node: NodeRuntimeArgs,
    /// The runtime's directory (containerd's config_path, CRI-O's registries.conf.d), as mounted.
    #[arg(long)]
    pub dir: std::path::PathBuf,
    /// CRI-O's registries.conf, as mounted (default: beside --dir): a source it configures gets no [[registry]] of pinswap's.
    #[arg(long)]
    pub registries_conf: Option<std::path::PathBuf>,
    /// Between rounds (the config is read and, with a "*" allowlist, the target listed again).
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    pub interval: std::time::Duration,
    /// The agent's DaemonSet, in $POD_NAMESPACE: at SIGTERM the files are removed when it is gone (an uninstall), kept otherwise (a rolling update).
    #[arg(long)]
    pub daemonset: Option<String>,
    /// A Docker config.json with read-only credentials for the target, to list it for a "*" allowlist. Without it the target is listed anonymously: the config's auth blocks are never read.
    #[arg(long, value_name = "FILE")]
    pub target_auth: Option<std::path::PathBuf>,
    /// The registries the leader lists at the target for a "*" allowlist, as the ConfigMap pinswap-registries mounts them: read instead of listing the target, so its requests do not grow with the nodes. Until the leader has listed, the files are kept as they are.
    #[arg(long, value_name = "FILE", conflicts_with = "target_auth")]
    pub registries_file: Option<std::path::PathBuf>,
    /// With prewarm.enabled: the runtime's CRI socket the warm set is pulled through [default: unix:///run/containerd/containerd.sock, or unix:///var/run/crio/crio.sock for cri-o].
    #[arg(long, value_name = "URL")]
    pub cri_endpoint: Option<String>,
    /// With prewarm.enabled: this node's name (the downward API's spec.nodeName), labelled pinswap.dev/warm once the warm set is pulled.
    #[arg(long, env = "NODE_NAME", value_name = "NAME")]
    pub node_name: Option<String>,
    /// With prewarm.enabled: the install's namespace, where the leader publishes the warm set [default: $POD_NAMESPACE].
    #[arg(long, value_name = "NAMESPACE")]
    pub namespace: Option<String>,
    /// With prewarm.enabled: where free space is measured [default: the mountpoint the runtime reports for its image filesystem].
    #[arg(long, value_name = "DIR")]
    pub image_fs: Option<std::path::PathBuf>,
    /// Serve the pre-warm's metrics (GET /metrics) at this address, such as 0.0.0.0:9091.
    #[arg(long, value_name = "ADDR")]
    pub metrics_address: Option<std::net::SocketAddr>,
}

/// `pinswap cache ...`.
#[derive(Debug, Subcommand)]
pub enum CacheCommand {
    /// Purge existence and resolution cache entries through the health port's
    /// `POST /cache/purge` (served when the config has `cache.purgeEndpoint: true`).
    #[command(after_help = "Examples:\n  \
        pinswap cache purge --all --server http://pinswap.pinswap.svc:8080\n  \
        pinswap cache purge docker.io/library/nginx:1.27   # a source: its resolution and its mirror\n  \
        pinswap cache purge mirror.example.com/cache/docker.io/library/nginx   # every digest of a target repository")]
    Purge(PurgeArgs),
}

/// `pinswap cache purge [--all|REF] --server URL`.
#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("what").required(true).args(["all", "reference"])))]
pub struct PurgeArgs {
    /// Purge every entry (or give a REFERENCE).
    #[arg(long)]
    pub all: bool,
    /// A source or target reference; without a tag or digest, the whole repository.
    pub reference: Option<String>,
    /// The server's health address.
    #[arg(long, value_name = "URL", default_value = "http://127.0.0.1:8080")]
    pub server: String,
}

/// `pinswap serve --config FILE`. Flags override the config's `server` keys.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// The YAML config (`pinswap config default` prints one).
    #[arg(long, short = 'c', value_name = "FILE")]
    pub config: PathBuf,
    /// HTTPS webhook address (config: server.listen; default 0.0.0.0:8443).
    #[arg(long, value_name = "ADDR")]
    pub listen: Option<std::net::SocketAddr>,
    /// Plain-HTTP /healthz, /readyz and /metrics address (config: server.healthListen; default 0.0.0.0:8080).
    #[arg(long, value_name = "ADDR")]
    pub health_listen: Option<std::net::SocketAddr>,
    /// PEM certificate chain (config: server.tlsCert); reloaded when the file changes.
    #[arg(long, value_name = "FILE")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key (config: server.tlsKey); reloaded when the file changes.
    #[arg(long, value_name = "FILE")]
    pub tls_key: Option<PathBuf>,
    /// Self-signed TLS bootstrap.
    #[command(flatten)]
    pub self_signed: install::SelfSignedArgs,
}

/// `pinswap config ...`.
#[derive(Debug, Subcommand)]
pub enum ConfigCommand {
    /// Check a config file: exit 0 when valid; else 1 with the first schema problem or every semantic one (key path, found, accepted). Warnings (`warning: ...` on stderr) name what `serve` or `manifests` would warn about or refuse.
    Validate {
        /// The YAML file.
        file: PathBuf,
        /// Exit 1 when there is any warning, after printing them all.
        #[arg(long)]
        strict: bool,
    },
    /// Print the default config, commented.
    Default,
    /// Convert a k8s-image-swapper config (or its Helm chart's values) to a pinswap config on stdout.
    #[command(
        after_help = "The converted YAML starts with comment lines listing every k8s-image-swapper key that \
was not carried over, every changed value and every decision taken; the same list goes to stderr.\n\n\
Exit codes: 0 converted (also when keys were reported); 1 the file cannot be read or converted \
(not YAML, a wrong type, an unknown policy, no usable target), with the key named on stderr \
and nothing on stdout; 2 usage error.\n\nExamples:\n  \
    pinswap config convert .k8s-image-swapper.yaml > pinswap.yaml\n  \
    kubectl get configmap k8s-image-swapper -o jsonpath='{.data.config\\.yaml}' | pinswap config convert -"
    )]
    Convert {
        /// The k8s-image-swapper YAML config, or Helm values with a `config:` block; `-` for stdin.
        file: PathBuf,
    },
}

/// `pinswap copy SRC DST`, or `pinswap copy --from-file LIST --to [docker://]TARGET[/prefix]`.
#[derive(Debug, Args)]
#[command(after_help = "Examples:\n  \
    pinswap copy docker://127.0.0.1:5001/app:v1 docker://127.0.0.1:5002/mirror/app:v1\n  \
    pinswap copy oci:./layout:v1 docker://127.0.0.1:5002/app:v1\n  \
    pinswap copy --from-file images.txt --to 127.0.0.1:5002/mirror")]
pub struct CopyArgs {
    /// Source: `docker://REFERENCE`, `oci:DIR[:REF]`, or a bare REFERENCE (as `docker://`).
    #[arg(required_unless_present = "from_file")]
    pub source: Option<String>,
    /// Destination: `docker://REFERENCE`, `oci:DIR[:REF]`, or a bare REFERENCE (as `docker://`).
    #[arg(required_unless_present = "from_file")]
    pub destination: Option<String>,
    /// File with one source reference per line (`#` comments; `-` for stdin);
    /// each is mirrored under --to by the mirror-path rule.
    #[arg(long, value_name = "LIST", requires = "to", conflicts_with_all = ["source", "destination"])]
    pub from_file: Option<PathBuf>,
    /// Mirror target for --from-file: `REGISTRY[/prefix]`, bare or with `docker://`.
    #[arg(long, value_name = "[docker://]TARGET", requires = "from_file")]
    pub to: Option<String>,
    /// Copy only these platforms of an index (`os/arch[/variant]`, repeatable).
    /// The destination then gets a filtered index whose digest differs from the source's.
    #[arg(long = "platform", value_name = "OS/ARCH[/VARIANT]")]
    pub platforms: Vec<PlatformSpec>,
    /// Blobs transferred in parallel.
    #[arg(long, short = 'j', default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub jobs: u16,
    /// Do not trust the destination's tag: HEAD every child manifest and blob
    /// and restore what is missing, even when the tag already has the source's digest.
    #[arg(long)]
    pub verify_target: bool,
    /// Do not copy the image's referrers (cosign signatures, attestations
    /// and SBOMs, OCI 1.1 referrers); by default they travel with it.
    #[arg(long)]
    pub no_referrers: bool,
    /// Print a machine-readable summary on stdout.
    #[arg(long)]
    pub json: bool,
    /// Registry access.
    #[command(flatten)]
    pub registry: RegistryArgs,
}

/// How to reach and authenticate to registries.
#[derive(Debug, Args)]
pub struct RegistryArgs {
    /// USER:PASSWORD for the source registry.
    #[arg(
        long,
        env = "PINSWAP_SRC_CREDS",
        hide_env_values = true,
        value_name = "USER:PASSWORD"
    )]
    pub src_creds: Option<String>,
    /// USER:PASSWORD for the destination registry.
    #[arg(
        long,
        env = "PINSWAP_DEST_CREDS",
        hide_env_values = true,
        value_name = "USER:PASSWORD"
    )]
    pub dest_creds: Option<String>,
    /// Docker-format auth file (config.json / auth.json), read before ~/.docker/config.json.
    #[arg(long, env = "REGISTRY_AUTH_FILE", value_name = "FILE")]
    pub authfile: Option<PathBuf>,
    /// Allow plain HTTP for `HOST[:PORT]` (repeatable). Loopback registries always may.
    #[arg(long = "insecure-registry", value_name = "HOST[:PORT]")]
    pub insecure: Vec<String>,
    /// Trust this PEM CA certificate in addition to the system roots (repeatable).
    #[arg(long = "ca-cert", value_name = "FILE")]
    pub ca_certs: Vec<PathBuf>,
    /// Blobs larger than this many bytes are uploaded in chunks of this size
    /// (streamed PATCH requests). At least 1 MiB.
    #[arg(
        long,
        value_name = "BYTES",
        default_value_t = crate::registry::client::DEFAULT_CHUNKED_THRESHOLD,
        value_parser = clap::value_parser!(u64).range(1024 * 1024..)
    )]
    pub chunked_threshold: u64,
}

/// A usage error: exit code 2.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct Usage(String);

/// A file named on the command line that cannot be read: a usage error
/// worded alike in every command, `FLAG PATH: cannot read: REASON` (only
/// `PATH: ...` for an argument without a flag).
fn unreadable(flag: &str, path: &std::path::Path, reason: impl std::fmt::Display) -> Usage {
    match flag {
        "" => Usage(format!("{}: cannot read: {reason}", path.display())),
        flag => Usage(format!("{flag} {}: cannot read: {reason}", path.display())),
    }
}

/// The config `--config` names; one that cannot be read is worded as any
/// other unreadable file, every other problem as the config says it.
fn load_config(path: &std::path::Path) -> Result<crate::config::Config, Usage> {
    crate::config::Config::load(path).map_err(|e| match e {
        crate::config::ConfigError::Read { reason, .. } => unreadable("--config", path, reason),
        e => Usage(e.to_string()),
    })
}

impl RegistryArgs {
    fn pool_options(&self) -> anyhow::Result<PoolOptions> {
        let creds = |v: &Option<String>, flag| {
            v.as_deref()
                .map(|s| Credentials::parse(s, flag))
                .transpose()
                .map_err(|e| Usage(e.to_string()))
        };
        let mut ca_certs = Vec::new();
        for p in &self.ca_certs {
            let pem = std::fs::read(p).map_err(|e| unreadable("--ca-cert", p, e))?;
            let certs = reqwest::Certificate::from_pem_bundle(&pem).unwrap_or_default();
            if certs.is_empty() || !pem.windows(27).any(|w| w == b"-----BEGIN CERTIFICATE-----") {
                return Err(Usage(format!(
                    "--ca-cert {}: no PEM certificate (-----BEGIN CERTIFICATE-----) in the file",
                    p.display()
                ))
                .into());
            }
            ca_certs.push(pem);
        }
        for h in &self.insecure {
            let ok = !h.is_empty()
                && !h.contains('/')
                && h.chars()
                    .all(|c| c.is_ascii_alphanumeric() || ".-:[]".contains(c));
            if !ok {
                return Err(Usage(format!(
                    "--insecure-registry {h:?}: expected HOST[:PORT], without scheme or path"
                ))
                .into());
            }
        }
        if let Some(path) = &self.authfile {
            let bytes = std::fs::read(path).map_err(|e| unreadable("--authfile", path, e))?;
            serde_json::from_slice::<serde_json::Value>(&bytes).map_err(|e| {
                Usage(format!(
                    "--authfile {}: not valid JSON: {e}",
                    path.display()
                ))
            })?;
        }
        let proxies =
            crate::registry::proxy::Proxies::from_env().map_err(|e| Usage(e.to_string()))?;
        proxies
            .guard(&Default::default())
            .map_err(|e| Usage(e.to_string()))?;
        Ok(PoolOptions {
            quotas: Default::default(),
            insecure: self.insecure.clone(),
            ca_certs,
            source_creds: creds(&self.src_creds, "--src-creds")?,
            target_creds: creds(&self.dest_creds, "--dest-creds")?,
            per_registry: Default::default(),
            sources: CredentialSources {
                authfile: self.authfile.clone(),
                docker_config: true,
            },
            chunked_threshold: Some(self.chunked_threshold),
            // Every registry is named by the user: private addresses are
            // allowed, link-local and metadata ones never.
            guard: Default::default(),
            proxies,
        })
    }
}

/// Parses arguments, runs the command and returns the process exit code.
pub fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(e.exit_code().clamp(0, 255) as u8);
        }
    };
    if let Err(e) = init_logging(&cli) {
        eprintln!("error: {e}");
        return ExitCode::from(2);
    }
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match rt.block_on(run(cli)) {
        Ok(code) => code,
        Err(e) => {
            // Errors whose message already embeds their source would repeat
            // it under `{:#}`; `chain` adds only what is not yet said.
            eprintln!("error: {}", crate::registry::chain(&*e));
            if e.downcast_ref::<Usage>().is_some() {
                ExitCode::from(2)
            } else {
                ExitCode::from(1)
            }
        }
    }
}

fn init_logging(cli: &Cli) -> anyhow::Result<()> {
    let level = cli.log_level.clone().unwrap_or_else(|| {
        match cli.command {
            Command::Serve(_) | Command::Cache(_) | Command::NodeAgent(_) => "info",
            _ => "warn",
        }
        .to_owned()
    });
    let filter = tracing_subscriber::EnvFilter::try_new(&level)
        .map_err(|e| Usage(format!("--log-level {level:?}: {e}")))?;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    let res = match cli.log_format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
    res.map_err(|e| anyhow::anyhow!("cannot set up logging: {e}"))
}

async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Copy(args) => copy(*args).await,
        Command::Serve(args) => serve(args).await,
        Command::Mutate(args) => mutate::run(args).await,
        Command::Cache(CacheCommand::Purge(args)) => purge(args).await,
        Command::Clusters(c) => clusters::run(c).await,
        Command::Export(args) => airgap::run_export(args).await,
        Command::Import(args) => airgap::run_import(*args).await,
        Command::Retention(c) => retention::run(c).await,
        Command::Check(args) => check::check(args).await,
        Command::Manifests(args) => install::manifests(args),
        Command::NodeConfig(args) => node_config(&args),
        Command::NodeAgent(args) => node_agent(args).await,
        Command::Version(args) => meta::version(&args),
        Command::Completions(args) => meta::completions(&args),
        Command::Man(args) => meta::man(&args),
        Command::Config(ConfigCommand::Default) => {
            print!("{}", crate::config::DEFAULT_YAML);
            Ok(ExitCode::SUCCESS)
        }
        Command::Config(ConfigCommand::Convert { file }) => Ok(crate::convert::run(&file)),
        Command::Config(ConfigCommand::Validate { file, strict }) => {
            Ok(validate_config(&file, strict))
        }
    }
}

/// `pinswap config validate [--strict] FILE`: the config's problems, else
/// `FILE: ok` with a warning for each setting `serve` or `manifests`
/// would warn about or refuse (with the defaults of their flags).
fn validate_config(file: &std::path::Path, strict: bool) -> ExitCode {
    let config = match crate::config::Config::load(file) {
        Ok(c) => c,
        Err(crate::config::ConfigError::Read { reason, .. }) => {
            eprintln!("error: {}", unreadable("", file, reason));
            return ExitCode::from(2);
        }
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(1);
        }
    };
    let shown = file.display().to_string();
    let mut warnings: Vec<String> = config
        .warnings(&shown)
        .iter()
        .map(ToString::to_string)
        .collect();
    let manifests = |m: &str| format!("{shown}: {m} (`pinswap manifests` refuses this)");
    if let Some(w) = crate::install::manifests::loopback_target(&config) {
        warnings.push(format!("{shown}: {w} (`pinswap manifests` warns)"));
    }
    // What `pinswap manifests --config FILE` refuses: the same check, then
    // again with a budget that passes, as the in-cluster checks come after.
    let mut probe = config.clone();
    for _ in 0..2 {
        let opts = crate::install::manifests::Options {
            namespace: crate::install::NAME.into(),
            replicas: 2,
            tls: crate::install::manifests::Tls::SelfSigned,
            image: install::DEFAULT_IMAGE.into(),
            image_pull_secrets: Vec::new(),
            config_text: String::new(),
            config: probe.clone(),
            node_agent: None,
        };
        match crate::install::manifests::objects(&opts) {
            Err(e @ crate::install::manifests::InstallError::Budget { .. }) => {
                warnings.push(manifests(&e.to_string()));
                probe.server.admission_budget = std::time::Duration::from_secs(2);
            }
            Err(crate::install::manifests::InstallError::InCluster(problems)) => {
                warnings.extend(problems.iter().map(|p| manifests(p)));
                break;
            }
            _ => break,
        }
    }
    let tls_key = if config.server.tls_cert.is_some() {
        Some("tlsCert")
    } else {
        config.server.tls_key.as_ref().map(|_| "tlsKey")
    };
    if let Some(key) = tls_key {
        warnings.push(format!(
            "{shown}: server.{key}: read by `pinswap serve` alone; an install from `pinswap manifests` or the Helm chart passes its own --tls-cert and --tls-key instead (`pinswap manifests` warns)"
        ));
    }
    for w in &warnings {
        eprintln!("warning: {w}");
    }
    if strict && !warnings.is_empty() {
        eprintln!(
            "{shown}: {} warning(s), refused with --strict",
            warnings.len()
        );
        return ExitCode::from(1);
    }
    println!("{shown}: ok");
    ExitCode::SUCCESS
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Summary {
    images: Vec<ImageResult>,
    succeeded: usize,
    failed: usize,
}

#[derive(Serialize)]
#[serde(untagged)]
enum ImageResult {
    Ok(CopyReport),
    Failed {
        source: String,
        destination: String,
        error: String,
    },
}

fn read_list(path: &PathBuf) -> anyhow::Result<Vec<Reference>> {
    let text = if path.as_os_str() == "-" {
        std::io::read_to_string(std::io::stdin()).context("reading the list from stdin")?
    } else {
        std::fs::read_to_string(path).map_err(|e| unreadable("--from-file", path, e))?
    };
    let mut out: Vec<Reference> = Vec::new();
    for (i, line) in text.lines().enumerate() {
        // `#` starts a comment anywhere: no reference contains one.
        let line = line.split('#').next().unwrap_or_default().trim();
        if line.is_empty() {
            continue;
        }
        let line = line.strip_prefix("docker://").unwrap_or(line);
        let r = Reference::parse(line)
            .map_err(|e| Usage(format!("{}:{}: {e}", path.display(), i + 1)))?;
        if !out.contains(&r) {
            out.push(r);
        }
    }
    if out.is_empty() {
        return Err(Usage(format!(
            "--from-file {}: no references in the list",
            path.display()
        ))
        .into());
    }
    Ok(out)
}

/// Copies the referrers of a finished copy `r` of `src` to `dst`.
async fn follow_referrers(
    follow: &ReferrerCopier,
    src: &Reference,
    dst: &Reference,
    r: &CopyReport,
) -> ReferrersReport {
    match (Digest::parse(&r.source_digest), Digest::parse(&r.digest)) {
        (Ok(source_digest), Ok(digest)) => {
            follow
                .follow(
                    src,
                    &source_digest,
                    dst,
                    (&digest, r.media_type.as_deref()),
                    None,
                    !r.up_to_date,
                )
                .await
        }
        _ => ReferrersReport::default(),
    }
}

async fn copy(args: CopyArgs) -> anyhow::Result<ExitCode> {
    let pairs: Vec<(Endpoint, Endpoint)> = match (&args.from_file, &args.to) {
        (Some(list), Some(to)) => {
            // Bare or `docker://`, as SOURCE and DESTINATION; a mirror
            // target is a registry, never a layout.
            let target = to.strip_prefix("docker://").unwrap_or(to);
            if target.starts_with("oci:") {
                return Err(Usage(format!(
                    "--to {to:?}: a mirror target is a registry: expected [docker://]REGISTRY[/prefix]"
                ))
                .into());
            }
            let target =
                MirrorTarget::parse(target).map_err(|e| Usage(format!("--to {to:?}: {e}")))?;
            read_list(list)?
                .into_iter()
                .map(|src| {
                    let dst = target.map(&src).map_err(|e| Usage(e.to_string()))?;
                    Ok((Endpoint::Registry(src), Endpoint::Registry(dst)))
                })
                .collect::<Result<_, Usage>>()?
        }
        _ => {
            let parse = |s: &Option<String>, what: &str| -> Result<Endpoint, Usage> {
                let s = s
                    .as_deref()
                    .ok_or_else(|| Usage(format!("missing {what}")))?;
                s.parse().map_err(|e| Usage(format!("{what}: {e}")))
            };
            let (src, dst) = (
                parse(&args.source, "SOURCE")?,
                parse(&args.destination, "DESTINATION")?,
            );
            if src == dst && !args.platforms.is_empty() {
                return Err(Usage(format!(
                    "--platform with the same source and destination ({src}) would replace the index with a filtered one; copy to another tag"
                ))
                .into());
            }
            vec![(src, dst)]
        }
    };
    let pool = Arc::new(ClientPool::new(args.registry.pool_options()?));
    let progress = !args.json && std::io::stdout().is_terminal();
    // Where blobs live at each registry, remembered across runs so a copy
    // into a new repository mounts what the registry already holds.
    let locations = Arc::new(match BlobLocations::default_file() {
        Some(file) => BlobLocations::load(file),
        None => BlobLocations::in_memory(),
    });
    let copier = Arc::new(
        Copier::new(
            pool,
            CopyOptions {
                jobs: usize::from(args.jobs),
                platforms: args.platforms.clone(),
                progress,
                verify_target: args.verify_target,
                // One source per run: every slot is its own, and a copy
                // the operator started runs until they stop it.
                ..CopyOptions::default()
            },
        )
        .with_locations(locations.clone()),
    );

    let referrers = (!args.no_referrers).then(|| {
        Arc::new(ReferrerCopier::new(
            copier.clone(),
            ReferrerOptions::default(),
        ))
    });

    // Images run concurrently; blob transfers across all of them share the
    // --jobs bound inside the copier.
    let images = usize::from(args.jobs);
    let results: Vec<ImageResult> = futures::StreamExt::collect(futures::StreamExt::buffered(
        futures::stream::iter(pairs.into_iter().map(|(src, dst)| {
            let (copier, referrers) = (copier.clone(), referrers.clone());
            async move {
                match copier.copy(&src, &dst).await {
                    Ok(mut r) => {
                        if let (Some(follow), Endpoint::Registry(s), Endpoint::Registry(d)) =
                            (&referrers, &src, &dst)
                        {
                            r.referrers = Some(follow_referrers(follow, s, d, &r).await);
                        }
                        ImageResult::Ok(r)
                    }
                    Err(e) => ImageResult::Failed {
                        source: src.to_string(),
                        destination: dst.to_string(),
                        error: e.to_string(),
                    },
                }
            }
        })),
        images,
    ))
    .await;

    if let Err(e) = locations.save() {
        // Only a cache: the copies are done either way.
        tracing::warn!(error = %e, "blob locations not saved");
    }
    let failed = results
        .iter()
        .filter(|r| matches!(r, ImageResult::Failed { .. }))
        .count();
    let summary = Summary {
        succeeded: results.len() - failed,
        failed,
        images: results,
    };
    let mut out = std::io::stdout().lock();
    if args.json {
        serde_json::to_writer_pretty(&mut out, &summary)?;
        writeln!(out)?;
    } else {
        for r in &summary.images {
            match r {
                ImageResult::Ok(r) if r.up_to_date => writeln!(
                    out,
                    "up to date  {} -> {} {}",
                    r.source, r.destination, r.digest
                )?,
                ImageResult::Ok(r) => writeln!(
                    out,
                    "copied      {} -> {} {} ({} blobs copied, {} skipped, {} mounted, {}, {:.2}s)",
                    r.source,
                    r.destination,
                    r.digest,
                    r.blobs_copied,
                    r.blobs_skipped,
                    r.blobs_mounted,
                    human_bytes(r.bytes_copied),
                    r.duration_seconds
                )?,
                ImageResult::Failed { .. } => {}
            }
            if let ImageResult::Ok(CopyReport {
                referrers: Some(f), ..
            }) = r
                && (f.copied + f.present + f.failed + f.skipped > 0 || f.truncated)
            {
                writeln!(
                    out,
                    "referrers   {} copied, {} present, {} skipped, {} failed{}",
                    f.copied,
                    f.present,
                    f.skipped,
                    f.failed,
                    if f.truncated { " (bound reached)" } else { "" }
                )?;
                for e in &f.errors {
                    eprintln!("warning: referrer not copied: {e}");
                }
            }
        }
        for r in &summary.images {
            if let ImageResult::Failed {
                source,
                destination,
                error,
            } = r
            {
                eprintln!("error: copy {source} -> {destination}: {error}");
            }
        }
        if args.from_file.is_some() {
            writeln!(out, "{}", summary_line(&summary.images))?;
        }
    }
    Ok(if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// `N images: X copied, Y up to date, Z failed`.
fn summary_line(images: &[ImageResult]) -> String {
    let (mut copied, mut current, mut failed) = (0, 0, 0);
    for r in images {
        match r {
            ImageResult::Ok(r) if r.up_to_date => current += 1,
            ImageResult::Ok(_) => copied += 1,
            ImageResult::Failed { .. } => failed += 1,
        }
    }
    format!(
        "{} images: {copied} copied, {current} up to date, {failed} failed",
        images.len()
    )
}

/// Bytes in binary units with one decimal (`512 B`, `1.5 KiB`, `2.0 GiB`).
fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut v = n as f64 / 1024.0;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    format!("{v:.1} {}", UNITS[unit])
}

async fn serve(args: ServeArgs) -> anyhow::Result<ExitCode> {
    // A bad config fails here, at startup, never at the first request.
    let config = load_config(&args.config)?;
    let self_signed = args.self_signed.self_signed;
    // With --self-signed the files are ours to write; default to a private
    // temporary directory when no path is given.
    let written = std::env::temp_dir().join("pinswap-tls");
    let tls_cert = args.tls_cert.clone().or(config.server.tls_cert.clone());
    let tls_key = args.tls_key.clone().or(config.server.tls_key.clone());
    let (tls_cert, tls_key) = if self_signed {
        (
            tls_cert.unwrap_or_else(|| written.join("tls.crt")),
            tls_key.unwrap_or_else(|| written.join("tls.key")),
        )
    } else {
        (
            tls_cert.ok_or_else(|| {
                Usage(
                    "no TLS certificate: pass --tls-cert, set server.tlsCert, or use --self-signed"
                        .into(),
                )
            })?,
            tls_key.ok_or_else(|| {
                Usage("no TLS key: pass --tls-key, set server.tlsKey, or use --self-signed".into())
            })?,
        )
    };
    if !self_signed {
        for (flag, path) in [("--tls-cert", &tls_cert), ("--tls-key", &tls_key)] {
            std::fs::File::open(path).map_err(|e| unreadable(flag, path, e))?;
        }
    }
    let metrics = Arc::new(crate::metrics::Metrics::new());
    let mut admission = crate::admission::Admission::connect(&config, metrics.clone())
        .await
        .map_err(|e| Usage(format!("{}: {e}", args.config.display())))?;
    // In-cluster config, else KUBECONFIG: kube's usual order.
    let kube_config = if config.source.image_pull_secrets || config.recovery.enabled || self_signed
    {
        kube::Config::infer().await.map_err(|e| e.to_string())
    } else {
        Err("not needed".into())
    };
    let client = kube_config
        .clone()
        .and_then(|c| kube::Client::try_from(c).map_err(|e| e.to_string()));
    let eviction_client = kube_config
        .ok()
        .filter(|_| config.recovery.evict.enabled)
        .and_then(|c| crate::watch::evict::client_without_retry(c).ok());
    if config.source.image_pull_secrets {
        let client = client.clone().map_err(|e| {
            Usage(format!(
                "{}: source.imagePullSecrets is on, but no Kubernetes API client could be built: {e}",
                args.config.display()
            ))
        })?;
        admission = admission.with_pull_secrets(client);
    }
    if let (true, Err(e)) = (config.recovery.enabled, &client) {
        tracing::warn!(error = %e, "no Kubernetes API client: pull-failure recovery is off (set recovery.enabled: false to silence this)");
    }
    let opts = crate::server::ServerOptions {
        listen: args.listen.unwrap_or(config.server.listen),
        health_listen: args.health_listen.unwrap_or(config.server.health_listen),
        tls_cert,
        tls_key,
        reload_interval: std::time::Duration::from_secs(10),
        limits: crate::server::Limits::from_config(&config.server),
    };
    if config.copy_deadline_exceeds_budget() {
        tracing::warn!(
            copy_deadline = %humantime::format_duration(config.copy_deadline),
            admission_budget = %humantime::format_duration(config.server.admission_budget),
            "copyDeadline is longer than server.admissionBudget; an admission waits for a copy at most the budget"
        );
    }
    tracing::info!(listen = %opts.listen, health = %opts.health_listen, target = %config.target.registry, "starting");
    let admission = Arc::new(admission);
    let token = tokio_util::sync::CancellationToken::new();
    if self_signed {
        install::self_signed(
            &args.self_signed,
            client.clone(),
            opts.tls_cert.clone(),
            opts.tls_key.clone(),
            token.clone(),
        )
        .await?;
    }
    tokio::spawn(
        admission
            .mirror()
            .clone()
            .refresh_credentials_every(crate::mirror::CREDENTIALS_REFRESH, token.clone()),
    );
    tokio::spawn(admission.mirror().clone().resume_copies(token.clone()));
    let background = crate::watch::Background::start_with(
        admission.mirror().clone(),
        &config,
        client.ok(),
        eviction_client,
        token.clone(),
    );
    let plans = retention::plan_route(background.planner());
    let served = crate::server::serve_with(opts, admission, metrics, plans, async move {
        crate::server::shutdown_signal().await;
        token.cancel();
    })
    .await;
    background.stop().await;
    served?;
    Ok(ExitCode::SUCCESS)
}

async fn purge(args: PurgeArgs) -> anyhow::Result<ExitCode> {
    if let Some(r) = &args.reference {
        Reference::parse(r).map_err(|e| Usage(e.to_string()))?;
    }
    let base = url::Url::parse(&args.server).map_err(|e| {
        Usage(format!(
            "--server {:?}: {e}; expected e.g. http://127.0.0.1:8080",
            args.server
        ))
    })?;
    let url = base
        .join("cache/purge")
        .map_err(|e| Usage(format!("--server {:?}: {e}", args.server)))?;
    let body = crate::server::PurgeRequest {
        all: args.all,
        reference: args.reference.clone(),
    };
    let resp = reqwest::Client::new()
        .post(url.clone())
        .json(&body)
        .timeout(std::time::Duration::from_secs(30))
        .send()
        .await
        .with_context(|| format!("POST {url}"))?;
    let status = resp.status();
    let text = resp.text().await.unwrap_or_default();
    if !status.is_success() {
        anyhow::bail!("POST {url}: {status}: {}", text.trim());
    }
    let purged = serde_json::from_str::<serde_json::Value>(&text)
        .ok()
        .and_then(|v| v.get("purged").and_then(serde_json::Value::as_u64))
        .with_context(|| format!("POST {url}: unexpected answer {text:?}"))?;
    println!("purged {purged} cache entries");
    Ok(ExitCode::SUCCESS)
}

/// `pinswap node-agent`: rounds until SIGTERM.
async fn node_agent(args: NodeAgentArgs) -> anyhow::Result<ExitCode> {
    if args.interval < std::time::Duration::from_secs(1) {
        return Err(Usage(format!(
            "--interval {}: at least 1s",
            humantime::format_duration(args.interval)
        ))
        .into());
    }
    // A config that does not load at start is a usage error; later, the
    // files are kept while it is fixed.
    let config = load_config(&args.config)?;
    let prewarm = match config.prewarm.enabled {
        true => Some(prewarmer(&args, &config).await?),
        false => None,
    };
    // Read again each round with "*"; a Secret the Pod mounts exists
    // before it starts, so a missing file is a mistake, not a wait.
    if let Some(path) = &args.target_auth {
        std::fs::File::open(path).map_err(|e| unreadable("--target-auth", path, e))?;
    }
    let daemonset = match (args.daemonset, std::env::var("POD_NAMESPACE")) {
        (Some(name), Ok(ns)) if !ns.is_empty() => Some((ns, name)),
        (Some(_), _) => {
            return Err(Usage("--daemonset needs $POD_NAMESPACE (the downward API)".into()).into());
        }
        (None, _) => None,
    };
    let agent = crate::nodeconfig::agent::Agent {
        config: args.config,
        runtime: args.node.runtime,
        mode: args.node.mode,
        dir: args.dir,
        registries_conf: args.registries_conf,
        interval: args.interval,
        daemonset,
        target_auth: args.target_auth,
        registries_file: args.registries_file,
    };
    // SIGTERM's handler is installed now, before the first round: as PID 1
    // without one, the kernel would drop the signal.
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| anyhow::anyhow!("cannot listen for SIGTERM: {e}"))?;
    // Once per agent start: a new node (an agent Pod replaced on a node
    // it marked before finds nothing to do).
    let warming = prewarm.map(|p| {
        let settings = config.prewarm.clone();
        tokio::spawn(async move {
            p.run(&settings).await;
        })
    });
    agent
        .run(async move {
            tokio::select! {
                _ = term.recv() => tracing::info!("received SIGTERM"),
                _ = tokio::signal::ctrl_c() => tracing::info!("received Ctrl-C"),
            }
        })
        .await;
    if let Some(w) = warming {
        w.abort();
    }
    Ok(ExitCode::SUCCESS)
}

/// The pre-warm of `pinswap node-agent`, and its metrics endpoint.
async fn prewarmer(
    args: &NodeAgentArgs,
    config: &crate::config::Config,
) -> anyhow::Result<crate::nodeconfig::prewarm::Prewarmer> {
    use crate::nodeconfig::prewarm::{PrewarmMetrics, Prewarmer, encode};
    let node = args.node_name.clone().filter(|n| !n.is_empty()).ok_or_else(|| {
        Usage("prewarm.enabled needs --node-name or $NODE_NAME (the downward API's spec.nodeName)".into())
    })?;
    let namespace = args
        .namespace
        .clone()
        .or_else(|| std::env::var("POD_NAMESPACE").ok())
        .filter(|n| !n.is_empty())
        .ok_or_else(|| Usage("prewarm.enabled needs --namespace or $POD_NAMESPACE".into()))?;
    let endpoint = args.cri_endpoint.clone().unwrap_or_else(|| {
        match args.node.runtime {
            crate::nodeconfig::Runtime::Containerd => "unix:///run/containerd/containerd.sock",
            crate::nodeconfig::Runtime::CriO => "unix:///var/run/crio/crio.sock",
        }
        .to_owned()
    });
    let cri = crate::nodeconfig::cri::Cri::connect(&endpoint)
        .map_err(|e| Usage(format!("--cri-endpoint: {e}")))?;
    let client = kube::Client::try_default()
        .await
        .map_err(|e| anyhow::anyhow!("prewarm.enabled: no Kubernetes client: {e}"))?;
    let metrics = std::sync::Arc::new(PrewarmMetrics::default());
    if let Some(addr) = args.metrics_address {
        let mut registry = prometheus_client::registry::Registry::default();
        metrics.register(&mut registry);
        let registry = std::sync::Arc::new(registry);
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| Usage(format!("--metrics-address {addr}: {e}")))?;
        let app = axum::Router::new().route(
            "/metrics",
            axum::routing::get(move || {
                let registry = registry.clone();
                async move { encode(&registry) }
            }),
        );
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
    }
    let target = crate::reference::MirrorTarget::parse(&config.target.registry).ok();
    Ok(Prewarmer {
        target,
        cri,
        client,
        namespace,
        node,
        image_fs: args.image_fs.clone(),
        target_auth: args.target_auth.clone(),
        metrics,
    })
}

/// `pinswap node-config`: renders, then prints or writes.
fn node_config(args: &NodeConfigArgs) -> anyhow::Result<ExitCode> {
    let config = load_config(&args.config)?;
    let files = crate::nodeconfig::render(&config, args.node.runtime, args.node.mode).map_err(
        |e| match e {
            // What "*" allows is known only by listing the target, which
            // the node agent does every round.
            crate::nodeconfig::NodeConfigError::NoRegistries => Usage(format!(
                "{e}; name the registries in source.registries, or run `pinswap node-agent` (pinswap manifests --node-agent), which also configures each registry the target holds images of"
            )),
            e => Usage(e.to_string()),
        },
    )?;
    if config.source.registries.iter().any(|r| r.registry == "*") {
        eprintln!(
            "note: source.registries allows \"*\"; only the registries it names get a mirror (`pinswap node-agent` also configures each registry the target holds images of)"
        );
    }
    if config.identity.collisions == crate::config::CollisionPolicy::Repair {
        eprintln!(
            "note: identity.collisions is repair: a Pod admitted as written gets the repaired copy for a tag, and a digest's own bytes, as from the source, for a digest"
        );
    }
    match &args.out {
        Some(dir) => {
            let registries_conf = args
                .registries_conf
                .clone()
                .unwrap_or_else(|| crate::nodeconfig::default_registries_conf(dir));
            let fitted =
                crate::nodeconfig::fit(args.node.runtime, dir, &registries_conf, files.clone());
            crate::nodeconfig::write(dir, &fitted.files)?;
            for f in &fitted.files {
                eprintln!("wrote {}", dir.join(&f.path).display());
            }
            // A refused source's earlier file of ours would still override
            // the node's setting.
            let refused: Vec<_> = files
                .iter()
                .map(|f| f.path.clone())
                .filter(|p| !fitted.keep().contains(p))
                .collect();
            for p in crate::nodeconfig::remove_ours(dir, args.node.runtime, &refused)? {
                eprintln!("removed {}", dir.join(p).display());
            }
            if !fitted.refused.is_empty() {
                for e in &fitted.refused {
                    eprintln!("error: {e}");
                }
                return Ok(ExitCode::FAILURE);
            }
        }
        None => {
            for f in &files {
                println!("# FILE: {}\n{}", f.path.display(), f.contents);
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_read_in_binary_units() {
        assert_eq!(human_bytes(0), "0 B");
        assert_eq!(human_bytes(1023), "1023 B");
        assert_eq!(human_bytes(1536), "1.5 KiB");
        assert_eq!(human_bytes(5 * 1024 * 1024), "5.0 MiB");
        assert_eq!(human_bytes(3 << 30), "3.0 GiB");
        assert_eq!(human_bytes(u64::MAX), "16384.0 PiB");
    }
}
