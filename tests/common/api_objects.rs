//! Helpers of the API double's self-test: object metadata, Pods, a pull
//! failure in a Pod's status, API errors and watch events.

use std::time::Duration;

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::{
    ContainerState, ContainerStateWaiting, ContainerStatus, Pod, PodStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::WatchEvent;
use kube::core::Status;

pub fn meta(ns: &str, name: &str) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.into()),
        namespace: Some(ns.into()),
        ..Default::default()
    }
}

pub fn pod(ns: &str, name: &str) -> Pod {
    Pod {
        metadata: meta(ns, name),
        ..Default::default()
    }
}

pub fn pull_failing(mut pod: Pod, image: &str) -> Pod {
    pod.status = Some(PodStatus {
        container_statuses: Some(vec![ContainerStatus {
            name: "app".into(),
            image: image.into(),
            state: Some(ContainerState {
                waiting: Some(ContainerStateWaiting {
                    reason: Some("ErrImagePull".into()),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }]),
        ..Default::default()
    });
    pod
}

/// The `Status` of a `kube::Error::Api`, or a panic naming what came instead.
#[track_caller]
pub fn api_error<T: std::fmt::Debug>(result: kube::Result<T>) -> Status {
    match result {
        Err(kube::Error::Api(status)) => *status,
        other => panic!("expected kube::Error::Api, got {other:?}"),
    }
}

/// The next watch event, within 5 s.
pub async fn next<S, K>(stream: &mut S) -> WatchEvent<K>
where
    S: futures::Stream<Item = kube::Result<WatchEvent<K>>> + Unpin,
{
    match tokio::time::timeout(Duration::from_secs(5), stream.next()).await {
        Ok(Some(Ok(event))) => event,
        Ok(Some(Err(e))) => panic!("watch error: {e:?}"),
        Ok(None) => panic!("watch ended early"),
        Err(_) => panic!("no watch event within 5 s"),
    }
}

pub fn name_rv(pod: &Pod) -> (String, u64) {
    let rv = pod
        .metadata
        .resource_version
        .as_deref()
        .expect("resourceVersion");
    (
        pod.metadata.name.clone().unwrap(),
        rv.parse().expect("numeric resourceVersion"),
    )
}
