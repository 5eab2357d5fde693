//! The retention record: when each mirrored image was last in use, kept in
//! a ConfigMap in the install's namespace so that a restart or a new leader
//! never makes an image look unused earlier than it is.
//!
//! `data["record.json"]` holds `{"since": TIME, "images": {"REGISTRY/REPOSITORY@DIGEST": TIME}}`
//! (RFC 3339 times): when tracking began, and per target manifest when a
//! Pod or template last named it (or, for one never seen in use, when
//! retention first saw it). It is written once per pass with the
//! resourceVersion read (a conflict reads it again).
//!
//! The record is bounded ([`MAX_IMAGES`], [`MAX_BYTES`]: a ConfigMap holds
//! at most 1 MiB). At the cap, images not yet in it are not tracked, and an
//! untracked image is never removed.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::jiff::Timestamp;
use kube::Api;
use kube::api::PostParams;
use serde::{Deserialize, Serialize};
use tracing::warn;

use super::RetentionError;

/// The ConfigMap's name.
pub const CONFIG_MAP: &str = "pinswap-retention";
/// Its data key.
pub const KEY: &str = "record.json";
/// The most images the record tracks.
pub const MAX_IMAGES: usize = 4000;
/// The most bytes of JSON the record may take (a ConfigMap is limited to
/// 1 MiB with its metadata).
pub const MAX_BYTES: usize = 900 * 1024;
/// Writes tried per update before giving up on conflicts.
const ATTEMPTS: usize = 5;

/// When tracking began and when each image was last in use.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// When the record was created.
    pub since: Timestamp,
    /// Target `registry/repository@digest` → last seen in use (or first
    /// seen at all).
    pub images: BTreeMap<String, Timestamp>,
}

impl Record {
    /// An empty record started at `now`.
    pub fn new(now: Timestamp) -> Self {
        Self {
            since: now,
            images: BTreeMap::new(),
        }
    }

    /// The JSON size this record takes, about.
    pub fn bytes(&self) -> usize {
        self.images.keys().map(|k| entry_bytes(k)).sum::<usize>() + 64
    }

    /// Sets `image` last seen at `now`, unless a later time is recorded.
    /// A new entry is added only within the caps; returns whether `image`
    /// is tracked.
    pub fn seen(&mut self, image: &str, now: Timestamp, bytes: &mut usize) -> bool {
        if let Some(t) = self.images.get_mut(image) {
            if *t < now {
                *t = now;
            }
            return true;
        }
        let add = entry_bytes(image);
        if self.images.len() >= MAX_IMAGES || *bytes + add > MAX_BYTES {
            return false;
        }
        *bytes += add;
        self.images.insert(image.to_owned(), now);
        true
    }
}

/// The JSON bytes of one entry: its key, a time, quotes and separators.
fn entry_bytes(key: &str) -> usize {
    key.len() + 40
}

/// The record's ConfigMap.
pub struct Store {
    api: Api<ConfigMap>,
    namespace: String,
}

impl Store {
    /// The record [`CONFIG_MAP`] in `namespace`.
    pub fn new(client: kube::Client, namespace: &str) -> Self {
        Self {
            api: Api::namespaced(client, namespace),
            namespace: namespace.to_owned(),
        }
    }

    fn error(&self, source: kube::Error) -> RetentionError {
        RetentionError::Record {
            namespace: self.namespace.clone(),
            name: CONFIG_MAP.into(),
            source,
        }
    }

    /// The record as stored, `None` when there is none yet.
    ///
    /// # Errors
    /// [`RetentionError::Record`] when the API server refuses or fails.
    pub async fn read(&self) -> Result<Option<Record>, RetentionError> {
        let cm = self
            .api
            .get_opt(CONFIG_MAP)
            .await
            .map_err(|e| self.error(e))?;
        Ok(cm.map(|cm| self.parse(&cm, Timestamp::now())))
    }

    /// The record in `cm`; one that cannot be read starts again at `now`,
    /// which makes every image look used now: later, never earlier.
    fn parse(&self, cm: &ConfigMap, now: Timestamp) -> Record {
        let text = cm.data.as_ref().and_then(|d| d.get(KEY));
        match text.map(|t| serde_json::from_str::<Record>(t)) {
            Some(Ok(r)) => r,
            Some(Err(e)) => {
                warn!(configmap = %format!("{}/{CONFIG_MAP}", self.namespace), error = %e, "the retention record cannot be read; starting it again (every image counts as used now)");
                Record::new(now)
            }
            None => Record::new(now),
        }
    }

    /// Reads the record (a new one starts at `now`), lets `apply` change
    /// it, and writes it back conditionally on the resourceVersion read;
    /// on a conflict, reads and applies again. Returns the record written.
    ///
    /// # Errors
    /// [`RetentionError::Record`]; [`RetentionError::Conflict`] after
    /// repeated conflicts.
    pub async fn update(
        &self,
        now: Timestamp,
        mut apply: impl FnMut(&mut Record),
    ) -> Result<Record, RetentionError> {
        for _ in 0..ATTEMPTS {
            let current = self
                .api
                .get_opt(CONFIG_MAP)
                .await
                .map_err(|e| self.error(e))?;
            let (mut record, cm) = match current {
                Some(cm) => (self.parse(&cm, now), Some(cm)),
                None => (Record::new(now), None),
            };
            apply(&mut record);
            let text = serde_json::to_string(&record).expect("a record serialises");
            let data = BTreeMap::from([(KEY.to_owned(), text)]);
            let written = match cm {
                Some(mut cm) => {
                    cm.data = Some(data);
                    // `replace` sends the resourceVersion read: 409 if
                    // anyone wrote in between.
                    self.api
                        .replace(CONFIG_MAP, &PostParams::default(), &cm)
                        .await
                }
                None => {
                    let cm = ConfigMap {
                        metadata: ObjectMeta {
                            name: Some(CONFIG_MAP.into()),
                            namespace: Some(self.namespace.clone()),
                            labels: Some(BTreeMap::from([(
                                "app.kubernetes.io/name".to_owned(),
                                "pinswap".to_owned(),
                            )])),
                            ..Default::default()
                        },
                        data: Some(data),
                        ..Default::default()
                    };
                    self.api.create(&PostParams::default(), &cm).await
                }
            };
            match written {
                Ok(_) => return Ok(record),
                Err(kube::Error::Api(s)) if s.code == 409 => continue,
                Err(e) => return Err(self.error(e)),
            }
        }
        Err(RetentionError::Conflict {
            namespace: self.namespace.clone(),
            attempts: ATTEMPTS,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: i64) -> Timestamp {
        Timestamp::from_second(s).unwrap()
    }

    #[test]
    fn last_use_only_moves_forward() {
        let mut r = Record::new(at(100));
        let mut bytes = r.bytes();
        assert!(r.seen("m/a@sha256:1", at(200), &mut bytes));
        assert!(r.seen("m/a@sha256:1", at(150), &mut bytes));
        assert_eq!(r.images["m/a@sha256:1"], at(200));
        assert!(r.seen("m/a@sha256:1", at(300), &mut bytes));
        assert_eq!(r.images["m/a@sha256:1"], at(300));
    }

    #[test]
    fn at_the_cap_new_images_are_not_tracked_and_known_ones_still_are() {
        let mut r = Record::new(at(0));
        let mut bytes = r.bytes();
        for i in 0..MAX_IMAGES {
            assert!(r.seen(&format!("m/a@sha256:{i:064x}"), at(1), &mut bytes));
        }
        assert!(!r.seen("m/new@sha256:0", at(2), &mut bytes), "not tracked");
        assert!(!r.images.contains_key("m/new@sha256:0"));
        assert!(r.seen(&format!("m/a@sha256:{:064x}", 7), at(3), &mut bytes));
        let json = serde_json::to_string(&r).unwrap();
        assert!(json.len() <= MAX_BYTES, "{} bytes", json.len());
        // Long names reach the byte cap before the count.
        let mut r = Record::new(at(0));
        let mut bytes = r.bytes();
        let long = "r".repeat(250);
        let mut n = 0;
        while r.seen(&format!("m/{long}@sha256:{n:064x}"), at(1), &mut bytes) {
            n += 1;
        }
        assert!(n < MAX_IMAGES);
        assert!(serde_json::to_string(&r).unwrap().len() <= MAX_BYTES);
    }
}
