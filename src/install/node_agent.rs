//! The node agent's objects (`pinswap manifests --node-agent`): a
//! DaemonSet running `pinswap node-agent` on every node with the
//! runtime's directory as a hostPath, its ServiceAccount, and a Role that
//! lets it read its own DaemonSet (to tell an uninstall from a rolling
//! update).
//!
//! It runs on every node, so it never gets the webhook's registry Secret
//! (push credentials): one compromised node could overwrite tags the
//! others pull. Only a `"*"` allowlist makes it talk to the target (to list
//! its repositories), and then only with a read-only Secret the user names.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use k8s_openapi::api::apps::v1::{DaemonSet, DaemonSetSpec};
use k8s_openapi::api::core::v1::{
    ConfigMapVolumeSource, Container, ContainerPort, EnvVar, EnvVarSource, HostPathVolumeSource,
    LocalObjectReference, ObjectFieldSelector, PodSecurityContext, PodSpec, PodTemplateSpec,
    ResourceRequirements, SeccompProfile, SecretVolumeSource, ServiceAccount, Toleration, Volume,
    VolumeMount,
};
use k8s_openapi::api::rbac::v1::{PolicyRule, Role, RoleBinding, RoleRef, Subject};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};

use super::NAME;
use crate::nodeconfig::{Mode, Runtime};

/// Name of the DaemonSet, its ServiceAccount, Role and RoleBinding.
pub const NODE_AGENT: &str = "pinswap-node-agent";

/// Between the agent's full rounds (the chart's `nodeAgent.interval`).
const INTERVAL: &str = "30s";

/// Where the node's directory is mounted in the agent's container.
const HOST_DIR: &str = "/host-config";

/// CRI-O's own directory on the node, read-only in the agent's container:
/// its `registries.conf` says which registries the node blocks or mirrors
/// itself, and the agent's drop-in must not replace those.
const CRI_O_CONF_DIR: &str = "/etc/containers";

/// Where [`CRI_O_CONF_DIR`] is mounted.
const HOST_CRI_O_CONF_DIR: &str = "/host-containers";

/// Where the ConfigMap of the registries the leader lists is mounted.
const REGISTRIES_DIR: &str = "/etc/pinswap/registries";

/// Where the runtime's CRI socket is mounted, for the pre-warm's pulls.
const CRI_SOCKET: &str = "/var/run/pinswap/cri.sock";

/// Where the runtime's image store is mounted, read-only, so the pre-warm
/// measures its free space.
const HOST_IMAGE_FS: &str = "/host-image-fs";

/// The pre-warm's metrics port.
pub const METRICS_PORT: i32 = 9091;

/// Where [`NodeAgent::registry_auth_secret`] is mounted.
pub const REGISTRY_AUTH_DIR: &str = "/var/run/secrets/pinswap-node-agent";

/// The key of a `kubernetes.io/dockerconfigjson` Secret, under
/// [`REGISTRY_AUTH_DIR`]: the agent's `--target-auth`.
pub const REGISTRY_AUTH_KEY: &str = ".dockerconfigjson";

/// What the node agent is installed with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeAgent {
    /// The nodes' container runtime.
    pub runtime: Runtime,
    /// How tags resolve.
    pub mode: Mode,
    /// The runtime's directory on the node.
    pub host_path: PathBuf,
    /// A `kubernetes.io/dockerconfigjson` Secret with read-only
    /// credentials for the target, for listing it under a `"*"`
    /// allowlist; without it the agent lists anonymously and mounts no
    /// Secret.
    pub registry_auth_secret: Option<String>,
}

impl NodeAgent {
    /// The runtime's CRI socket and image store on the node.
    pub fn runtime_paths(runtime: Runtime) -> (&'static str, &'static str) {
        match runtime {
            Runtime::Containerd => ("/run/containerd/containerd.sock", "/var/lib/containerd"),
            Runtime::CriO => ("/var/run/crio/crio.sock", "/var/lib/containers/storage"),
        }
    }

    /// The runtime's usual directory: containerd's `config_path` as
    /// distributions set it, CRI-O's drop-in directory.
    pub fn default_path(runtime: Runtime) -> PathBuf {
        PathBuf::from(match runtime {
            Runtime::Containerd => "/etc/containerd/certs.d",
            Runtime::CriO => "/etc/containers/registries.conf.d",
        })
    }
}

fn labels() -> BTreeMap<String, String> {
    BTreeMap::from([
        ("app.kubernetes.io/name".to_owned(), NODE_AGENT.to_owned()),
        ("app.kubernetes.io/part-of".to_owned(), NAME.to_owned()),
    ])
}

fn meta(ns: &str) -> ObjectMeta {
    ObjectMeta {
        name: Some(NODE_AGENT.into()),
        namespace: Some(ns.into()),
        labels: Some(labels()),
        ..Default::default()
    }
}

fn mode_arg(mode: Mode) -> &'static str {
    match mode {
        Mode::Resolve => "resolve",
        Mode::DigestOnly => "digest-only",
    }
}

fn runtime_arg(runtime: Runtime) -> &'static str {
    match runtime {
        Runtime::Containerd => "containerd",
        Runtime::CriO => "cri-o",
    }
}

/// What the leader publishes for the agents.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Published {
    /// The registries a `"*"` allowlist has at the target: mounted.
    pub registries: bool,
    /// The warm set: read, and the agents pre-warm their nodes.
    pub warm_set: bool,
}

/// The ServiceAccount, Role, RoleBinding and DaemonSet, in that order.
/// `config_checksum` (annotation key and value) rolls the DaemonSet when
/// the config changes.
pub fn objects(
    agent: &NodeAgent,
    ns: &str,
    image: &str,
    image_pull_secrets: &[String],
    config_path: &str,
    config_checksum: (&str, &str),
    leader: Published,
) -> (ServiceAccount, Role, RoleBinding, DaemonSet) {
    let Published {
        registries: published,
        warm_set: prewarm,
    } = leader;
    let account = ServiceAccount {
        metadata: meta(ns),
        ..Default::default()
    };
    let role = Role {
        metadata: meta(ns),
        rules: Some(
            std::iter::once(PolicyRule {
                api_groups: Some(vec!["apps".into()]),
                resources: Some(vec!["daemonsets".into()]),
                verbs: vec!["get".into()],
                resource_names: Some(vec![NODE_AGENT.into()]),
                ..Default::default()
            })
            .chain(prewarm.then(|| PolicyRule {
                api_groups: Some(vec![String::new()]),
                resources: Some(vec!["configmaps".into()]),
                verbs: vec!["get".into()],
                resource_names: Some(vec![crate::nodeconfig::warm::CONFIG_MAP.into()]),
                ..Default::default()
            }))
            .collect(),
        ),
    };
    let binding = RoleBinding {
        metadata: meta(ns),
        role_ref: RoleRef {
            api_group: "rbac.authorization.k8s.io".into(),
            kind: "Role".into(),
            name: NODE_AGENT.into(),
        },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".into(),
            name: NODE_AGENT.into(),
            namespace: Some(ns.into()),
            ..Default::default()
        }]),
    };
    let config_dir = Path::new(config_path)
        .parent()
        .map(|p| p.display().to_string())
        .unwrap_or_else(|| "/etc/pinswap/config".into());
    let mount = |name: &str, path: &str, read_only: bool| VolumeMount {
        name: name.into(),
        mount_path: path.into(),
        read_only: read_only.then_some(true),
        ..Default::default()
    };
    let quantities = |pairs: &[(&str, &str)]| {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), Quantity((*v).to_owned())))
            .collect::<BTreeMap<_, _>>()
    };
    let cri_o = agent.runtime == Runtime::CriO;
    let mut args: Vec<String> = [
        "node-agent",
        "--config",
        config_path,
        "--runtime",
        runtime_arg(agent.runtime),
        "--mode",
        mode_arg(agent.mode),
        "--dir",
        HOST_DIR,
    ]
    .map(String::from)
    .into();
    if cri_o {
        args.extend([
            "--registries-conf".into(),
            format!("{HOST_CRI_O_CONF_DIR}/registries.conf"),
        ]);
    }
    args.extend(["--interval", INTERVAL, "--daemonset", NODE_AGENT].map(String::from));
    let mut mounts = vec![
        mount("host-config", HOST_DIR, false),
        mount("config", &config_dir, true),
    ];
    let mut volumes = vec![
        Volume {
            name: "host-config".into(),
            host_path: Some(HostPathVolumeSource {
                path: agent.host_path.display().to_string(),
                type_: Some("DirectoryOrCreate".into()),
            }),
            ..Default::default()
        },
        Volume {
            name: "config".into(),
            config_map: Some(ConfigMapVolumeSource {
                name: NAME.into(),
                ..Default::default()
            }),
            ..Default::default()
        },
    ];
    if cri_o {
        mounts.push(mount("host-containers", HOST_CRI_O_CONF_DIR, true));
        // Read-only; DirectoryOrCreate as the drop-in directory's own
        // volume would create it anyway.
        volumes.push(Volume {
            name: "host-containers".into(),
            host_path: Some(HostPathVolumeSource {
                path: CRI_O_CONF_DIR.into(),
                type_: Some("DirectoryOrCreate".into()),
            }),
            ..Default::default()
        });
    }
    if published {
        // The registries the leader lists: optional, as the leader fills
        // it after the install; until then the agent keeps its files.
        args.extend([
            "--registries-file".to_owned(),
            format!("{REGISTRIES_DIR}/{}", crate::nodeconfig::registries::KEY),
        ]);
        mounts.push(mount("registries", REGISTRIES_DIR, true));
        volumes.push(Volume {
            name: "registries".into(),
            config_map: Some(ConfigMapVolumeSource {
                name: crate::nodeconfig::registries::CONFIG_MAP.into(),
                optional: Some(true),
                ..Default::default()
            }),
            ..Default::default()
        });
    }
    let mut env = vec![EnvVar {
        name: "POD_NAMESPACE".into(),
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector {
                field_path: "metadata.namespace".into(),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }];
    let mut ports = None;
    if prewarm {
        let (socket, store) = NodeAgent::runtime_paths(agent.runtime);
        args.extend([
            "--cri-endpoint".to_owned(),
            format!("unix://{CRI_SOCKET}"),
            "--image-fs".to_owned(),
            HOST_IMAGE_FS.to_owned(),
            "--metrics-address".to_owned(),
            format!("0.0.0.0:{METRICS_PORT}"),
        ]);
        env.push(EnvVar {
            name: "NODE_NAME".into(),
            value_from: Some(EnvVarSource {
                field_ref: Some(ObjectFieldSelector {
                    field_path: "spec.nodeName".into(),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        });
        mounts.push(mount("cri-socket", CRI_SOCKET, false));
        mounts.push(mount("image-fs", HOST_IMAGE_FS, true));
        volumes.push(Volume {
            name: "cri-socket".into(),
            host_path: Some(HostPathVolumeSource {
                path: socket.into(),
                type_: Some("Socket".into()),
            }),
            ..Default::default()
        });
        volumes.push(Volume {
            name: "image-fs".into(),
            host_path: Some(HostPathVolumeSource {
                path: store.into(),
                type_: Some("Directory".into()),
            }),
            ..Default::default()
        });
        ports = Some(vec![ContainerPort {
            name: Some("metrics".into()),
            container_port: METRICS_PORT,
            ..Default::default()
        }]);
    }
    env.push(EnvVar {
        name: "HOME".into(),
        value: Some("/tmp".into()),
        ..Default::default()
    });
    if let Some(secret) = &agent.registry_auth_secret {
        args.extend([
            "--target-auth".to_owned(),
            format!("{REGISTRY_AUTH_DIR}/{REGISTRY_AUTH_KEY}"),
        ]);
        mounts.push(mount("registry-auth", REGISTRY_AUTH_DIR, true));
        // Not optional: a Secret the user named and forgot shows as a
        // Pod that cannot start, not as a listing that fails quietly.
        volumes.push(Volume {
            name: "registry-auth".into(),
            secret: Some(SecretVolumeSource {
                secret_name: Some(secret.clone()),
                ..Default::default()
            }),
            ..Default::default()
        });
    }
    let container = Container {
        name: "node-agent".into(),
        image: Some(image.into()),
        image_pull_policy: Some("IfNotPresent".into()),
        args: Some(args),
        env: Some(env),
        ports,
        resources: Some(ResourceRequirements {
            requests: Some(quantities(&[("cpu", "10m"), ("memory", "32Mi")])),
            limits: Some(quantities(&[("memory", "128Mi")])),
            ..Default::default()
        }),
        // Root, to write the root-owned directory it is given; no
        // capability (owner permissions suffice).
        security_context: Some(super::locked_down(true)),
        volume_mounts: Some(mounts),
        ..Default::default()
    };
    let daemonset = DaemonSet {
        metadata: meta(ns),
        spec: Some(DaemonSetSpec {
            selector: LabelSelector {
                match_labels: Some(labels()),
                ..Default::default()
            },
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(labels()),
                    annotations: Some(BTreeMap::from([(
                        config_checksum.0.to_owned(),
                        config_checksum.1.to_owned(),
                    )])),
                    ..Default::default()
                }),
                spec: Some(PodSpec {
                    service_account_name: Some(NODE_AGENT.into()),
                    image_pull_secrets: (!image_pull_secrets.is_empty()).then(|| {
                        image_pull_secrets
                            .iter()
                            .map(|name| LocalObjectReference { name: name.clone() })
                            .collect()
                    }),
                    security_context: Some(PodSecurityContext {
                        seccomp_profile: Some(SeccompProfile {
                            type_: "RuntimeDefault".into(),
                            ..Default::default()
                        }),
                        ..Default::default()
                    }),
                    // Every node pulls images, tainted ones too.
                    tolerations: Some(vec![Toleration {
                        operator: Some("Exists".into()),
                        ..Default::default()
                    }]),
                    termination_grace_period_seconds: Some(30),
                    containers: vec![container],
                    volumes: Some(volumes),
                    ..Default::default()
                }),
            },
            ..Default::default()
        }),
        ..Default::default()
    };
    (account, role, binding, daemonset)
}
