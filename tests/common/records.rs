//! Usage records published at a target as a cluster's leader publishes
//! them, for tests that need a record without running a leader.

use std::sync::Arc;

use k8s_openapi::jiff::Timestamp;
use pinswap::config::Config;
use pinswap::metrics::Metrics;
use pinswap::mirror::Mirror;
use pinswap::retention::clusters::{ClusterRecord, Records};

/// A webhook config whose target is `host/mirror`, with sharing on.
pub fn sharing_yaml(host: &str) -> String {
    format!("target: {{registry: \"{host}/mirror\"}}\ncluster: a\nsharing: {{enabled: true}}\n")
}

/// Publishes cluster `cluster`'s complete record at `host/mirror`,
/// listing `images` (target repositories with `@digest` or `:tag`, as
/// records name them) as used now.
pub async fn publish(host: &str, cluster: &str, images: &[String]) {
    let config = Config::from_yaml(&sharing_yaml(host), "test.yaml").unwrap();
    let mirror = Mirror::connect(&config, Arc::new(Metrics::new()))
        .await
        .unwrap();
    let records = Records::of(&mirror).await.unwrap();
    records
        .publish(
            &ClusterRecord {
                cluster: cluster.into(),
                updated: Timestamp::now(),
                complete: true,
                in_use: images.len(),
                images: images
                    .iter()
                    .map(|i| (i.clone(), Timestamp::now()))
                    .collect(),
                quotas: Vec::new(),
            },
            &mut Default::default(),
        )
        .await
        .unwrap();
}
