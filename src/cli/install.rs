//! `pinswap manifests` and the `--self-signed` part of `pinswap serve`.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, ValueEnum};

use super::{Usage, unreadable};
use crate::install::manifests::{self, Tls};

/// `pinswap manifests [--namespace NS] [--config FILE] [--replicas N] [--tls MODE] [--image REF]
/// [--image-pull-secret NAME]...`.
#[derive(Debug, Args)]
#[command(after_help = "Examples:\n  \
    pinswap manifests --config pinswap.yaml --image registry.example.com/pinswap:0.1.0 | kubectl apply -f -\n  \
    pinswap manifests --tls self-signed --config pinswap.yaml --image registry.example.com/pinswap:0.1.0 > pinswap-install.yaml")]
pub struct ManifestsArgs {
    /// Namespace to install into (created by the output).
    #[arg(long, short = 'n', default_value = "pinswap")]
    pub namespace: String,
    /// Config file to store in the ConfigMap (validated first); default: `pinswap config default`.
    #[arg(long, short = 'c', value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Deployment replicas.
    #[arg(long, default_value_t = 2)]
    pub replicas: i32,
    /// Where the webhook's serving certificate comes from. The chart's
    /// default too: it needs nothing else in the cluster.
    #[arg(long, value_enum, default_value_t = TlsMode::SelfSigned)]
    pub tls: TlsMode,
    /// pinswap's own container image, built from the Dockerfile and pushed
    /// where the cluster can pull it [default: ghcr.io/pinswap/pinswap:VERSION, not published yet].
    #[arg(long, value_name = "REFERENCE")]
    pub image: Option<String>,
    /// Secret in the install's namespace holding credentials for pulling
    /// --image (type kubernetes.io/dockerconfigjson); repeatable. For other
    /// settings (resources, scheduling, webhook selectors) use the Helm chart.
    #[arg(long = "image-pull-secret", value_name = "NAME")]
    pub image_pull_secrets: Vec<String>,
    /// Add the node agent: a DaemonSet that keeps each node's mirror configuration (`pinswap node-config`'s files) true, and removes them when uninstalled.
    #[arg(long)]
    pub node_agent: bool,
    /// The nodes' container runtime, for --node-agent.
    #[arg(
        long,
        value_enum,
        default_value = "containerd",
        requires = "node_agent"
    )]
    pub node_agent_runtime: crate::nodeconfig::Runtime,
    /// How tags resolve, for --node-agent (see node-config --mode).
    #[arg(long, value_enum, default_value = "resolve", requires = "node_agent")]
    pub node_agent_mode: crate::nodeconfig::Mode,
    /// The runtime's directory on each node, for --node-agent [default: /etc/containerd/certs.d, or /etc/containers/registries.conf.d for cri-o].
    #[arg(long, value_name = "DIR", requires = "node_agent")]
    pub node_agent_dir: Option<PathBuf>,
    /// For --node-agent with a "*" allowlist: a Secret (type kubernetes.io/dockerconfigjson) with read-only credentials for the target, which the agent lists; without it, it lists anonymously. Never the webhook's Secret (it can push).
    #[arg(long, value_name = "NAME", requires = "node_agent")]
    pub node_agent_registry_auth_secret: Option<String>,
}

/// The image `pinswap manifests` names without `--image`.
pub const DEFAULT_IMAGE: &str = concat!("ghcr.io/pinswap/pinswap:", env!("CARGO_PKG_VERSION"));

/// `--tls`.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum TlsMode {
    /// cert-manager issues the certificate and injects the CA bundle.
    CertManager,
    /// `pinswap serve --self-signed` creates both and patches the webhook.
    SelfSigned,
}

/// `pinswap serve --self-signed` and the names it works on.
#[derive(Debug, Args)]
pub struct SelfSignedArgs {
    /// Generate the serving certificate, share it through a Secret and set
    /// the webhook's caBundle (needs the Kubernetes API); --tls-cert and
    /// --tls-key name where the files are written.
    #[arg(long)]
    pub self_signed: bool,
    /// Secret holding the certificate, in the Pod's namespace.
    #[arg(long, value_name = "NAME", default_value = crate::install::TLS_SECRET, requires = "self_signed")]
    pub self_signed_secret: String,
    /// MutatingWebhookConfiguration whose caBundle is kept true.
    #[arg(long, value_name = "NAME", default_value = crate::install::NAME, requires = "self_signed")]
    pub webhook_configuration: String,
    /// Service the API server calls (the certificate is for NAME.NAMESPACE.svc).
    #[arg(long, value_name = "NAME", default_value = crate::install::NAME, requires = "self_signed")]
    pub webhook_service: String,
}

pub(super) fn manifests(args: ManifestsArgs) -> anyhow::Result<ExitCode> {
    let (config_text, source) = match &args.config {
        Some(path) => (
            std::fs::read_to_string(path).map_err(|e| unreadable("--config", path, e))?,
            path.display().to_string(),
        ),
        None => {
            eprintln!(
                "warning: no --config: the ConfigMap holds `pinswap config default`, whose target.registry is a placeholder; edit it before applying"
            );
            (
                crate::config::DEFAULT_YAML.to_owned(),
                "the default config".to_owned(),
            )
        }
    };
    let config = crate::config::Config::from_yaml(&config_text, &source)
        .map_err(|e| Usage(e.to_string()))?;
    if let Some(w) = manifests::loopback_target(&config) {
        eprintln!("warning: {w}");
    }
    if config.server.tls_cert.is_some() || config.server.tls_key.is_some() {
        eprintln!(
            "warning: server.tlsCert/tlsKey are overridden by the Deployment's --tls-cert/--tls-key (the certificate comes from --tls)"
        );
    }
    let tls = match args.tls {
        TlsMode::CertManager => Tls::CertManager,
        TlsMode::SelfSigned => Tls::SelfSigned,
    };
    let image = args.image.unwrap_or_else(|| {
        eprintln!(
            "warning: no --image: {DEFAULT_IMAGE} is not published yet; build the Dockerfile, push it, and pass --image"
        );
        DEFAULT_IMAGE.to_owned()
    });
    let opts = manifests::Options {
        namespace: args.namespace,
        replicas: args.replicas,
        tls,
        image,
        image_pull_secrets: args.image_pull_secrets,
        config_text,
        config,
        node_agent: args
            .node_agent
            .then(|| crate::install::node_agent::NodeAgent {
                runtime: args.node_agent_runtime,
                mode: args.node_agent_mode,
                host_path: args.node_agent_dir.clone().unwrap_or_else(|| {
                    crate::install::node_agent::NodeAgent::default_path(args.node_agent_runtime)
                }),
                registry_auth_secret: args.node_agent_registry_auth_secret.clone(),
            }),
    };
    let objects = manifests::objects(&opts).map_err(|e| Usage(e.to_string()))?;
    let mut header = format!(
        "pinswap {} install: namespace {}, --tls {}, config from {source}.\nApply with: kubectl apply -f -",
        env!("CARGO_PKG_VERSION"),
        opts.namespace,
        tls.as_str()
    );
    if tls == Tls::CertManager {
        header.push_str(" (cert-manager must be installed first)");
    }
    print!("{}", manifests::to_yaml(&objects, &header));
    Ok(ExitCode::SUCCESS)
}

/// Runs the startup pass of the self-signed bootstrap and starts its
/// re-check loop; the files at `cert`/`key` exist when this returns.
pub(super) async fn self_signed(
    args: &SelfSignedArgs,
    client: Result<kube::Client, String>,
    cert: PathBuf,
    key: PathBuf,
    token: tokio_util::sync::CancellationToken,
) -> anyhow::Result<()> {
    let client = client.map_err(|e| {
        Usage(format!(
            "--self-signed needs the Kubernetes API, but no client could be built: {e}"
        ))
    })?;
    // The Downward API's namespace (the manifests set POD_NAMESPACE), else
    // the client's (in-cluster service account, or kubeconfig context).
    let namespace = std::env::var("POD_NAMESPACE")
        .ok()
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| client.default_namespace().to_owned());
    let bootstrap = crate::install::self_signed::SelfSigned::new(
        client,
        &namespace,
        &args.webhook_service,
        &args.self_signed_secret,
        &args.webhook_configuration,
        cert,
        key,
    );
    let material = bootstrap.bootstrap().await?;
    tracing::info!(
        secret = %format!("{namespace}/{}", args.self_signed_secret),
        not_after = %humantime::format_rfc3339_seconds(material.not_after),
        "self-signed TLS ready"
    );
    tokio::spawn(bootstrap.run(token));
    Ok(())
}
