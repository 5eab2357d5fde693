//! pinswap's annotations: their keys, and keeping them inside the API
//! server's annotation limit.
//!
//! The API server refuses an object whose annotations (keys plus values)
//! total more than 256 KiB, so per-slot notes on a Pod with thousands of
//! containers would turn a webhook that fails open into a rejection. The
//! notes get at most [`OWN_SHARE`], and never more than what the Pod's other
//! annotations leave. Past that, the decisions and identity findings are
//! summarised (counts per reason), and the sources and original images,
//! which recovery reads, are kept for as many slots as fit.

use std::collections::{BTreeMap, HashMap};

/// Annotation: JSON map of slot → original image, for rewritten slots.
pub const ORIGINAL_IMAGES: &str = "pinswap.dev/original-images";
/// Annotation: JSON map of slot → why it was or was not rewritten.
pub const DECISIONS: &str = "pinswap.dev/decisions";
/// Annotation: JSON map of slot → image-ID finding or repair.
pub const IDENTITY: &str = "pinswap.dev/identity";
/// Annotation: JSON map of slot → the source pinned to the digest that was
/// mirrored (`registry/repository[:tag]@digest`), for rewritten slots.
/// Recovery reads it to mirror the same content again.
pub const SOURCES: &str = "pinswap.dev/sources";

/// pinswap's own annotations.
pub const OURS: [&str; 4] = [ORIGINAL_IMAGES, DECISIONS, IDENTITY, SOURCES];

/// The API server's limit on the total size of an object's annotations
/// (`TotalAnnotationSizeLimitB`).
pub const ANNOTATIONS_LIMIT: usize = 256 * 1024;

/// The most pinswap's own annotations take of [`ANNOTATIONS_LIMIT`].
pub const OWN_SHARE: usize = 64 * 1024;

/// The key of a summary entry; no slot key (`kind/name`, `kind[i]`) has it.
pub const SUMMARY_KEY: &str = "*";

/// Reasons listed by name in a summary; the rest are counted together.
const LISTED_REASONS: usize = 16;
/// Characters of each reason kept in a summary.
const REASON_CHARS: usize = 160;
/// Room kept for the clause saying how many slots the partial maps cover.
const COVERAGE_RESERVE: usize = 256;

/// What an annotation set would add to the API server's count: keys plus
/// values.
pub fn size<'a>(annotations: impl IntoIterator<Item = (&'a str, &'a str)>) -> usize {
    annotations
        .into_iter()
        .map(|(k, v)| k.len() + v.len())
        .sum()
}

fn encode(m: &BTreeMap<String, String>) -> String {
    serde_json::to_string(m).expect("a map of strings serialises")
}

fn json_len(s: &str) -> usize {
    serde_json::to_string(s).map_or(s.len() + 2, |j| j.len())
}

/// `notes` (annotation key → per-slot map) encoded as annotation values
/// that fit beside `others` bytes of other annotations: in full when they
/// fit, else summarised as the module describes; empty when not even the
/// summary fits.
pub fn fit(
    notes: &[(&'static str, BTreeMap<String, String>)],
    others: usize,
) -> Vec<(&'static str, String)> {
    let room = OWN_SHARE.min(ANNOTATIONS_LIMIT.saturating_sub(others));
    // Encoding only adds to the raw lengths: no need to encode maps that
    // cannot fit.
    let raw: usize = notes
        .iter()
        .map(|(k, m)| k.len() + m.iter().map(|(k, v)| k.len() + v.len()).sum::<usize>())
        .sum();
    if raw <= room {
        let full: Vec<(&'static str, String)> =
            notes.iter().map(|(k, m)| (*k, encode(m))).collect();
        if size(full.iter().map(|(k, v)| (*k, v.as_str()))) <= room {
            return full;
        }
    }
    let get = |key: &str| notes.iter().find(|(k, _)| *k == key).map(|(_, m)| m);
    let summary = |text: String| BTreeMap::from([(SUMMARY_KEY.to_owned(), text)]);
    let decisions = get(DECISIONS).map(|m| summarise(m, "slots"));
    let identity = get(IDENTITY).map(|m| encode(&summary(summarise(m, "identity findings"))));
    let fixed = decisions
        .as_ref()
        .map_or(0, |d| DECISIONS.len() + encode(&summary(d.clone())).len())
        + identity.as_ref().map_or(0, |i| IDENTITY.len() + i.len())
        + COVERAGE_RESERVE;
    let Some(mut left) = room.checked_sub(fixed) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    let mut coverage = Vec::new();
    // Sources first: recovery prefers them to the original images.
    for key in [SOURCES, ORIGINAL_IMAGES] {
        let Some(m) = get(key) else { continue };
        let (part, used) = partial(m, left.saturating_sub(key.len()));
        if part.is_empty() {
            coverage.push(format!("{key} left out"));
            continue;
        }
        left -= key.len() + used;
        if part.len() < m.len() {
            coverage.push(format!(
                "{key} kept for {} of {} slots",
                part.len(),
                m.len()
            ));
        }
        out.push((key, encode(&part)));
    }
    if let Some(mut text) = decisions {
        if !coverage.is_empty() {
            text.push_str("; ");
            text.push_str(&coverage.join(", "));
        }
        out.insert(0, (DECISIONS, encode(&summary(text))));
    }
    if let Some(i) = identity {
        out.push((IDENTITY, i));
    }
    out
}

/// The first entries of `m` (in key order) whose JSON encoding fits in
/// `room` bytes, and that encoding's length.
fn partial(m: &BTreeMap<String, String>, room: usize) -> (BTreeMap<String, String>, usize) {
    let mut used = 2; // {}
    let mut part = BTreeMap::new();
    for (k, v) in m {
        let entry = json_len(k) + 1 + json_len(v) + usize::from(!part.is_empty());
        if used + entry > room {
            break;
        }
        used += entry;
        part.insert(k.clone(), v.clone());
    }
    if part.is_empty() {
        (part, 0)
    } else {
        (part, used)
    }
}

/// `N slots, summarised …: 40 × reason; 2 × other reason; …`: each distinct
/// note with its count, most frequent first.
fn summarise(m: &BTreeMap<String, String>, what: &str) -> String {
    let mut counts: HashMap<&str, usize> = HashMap::new();
    for v in m.values() {
        *counts.entry(v.as_str()).or_default() += 1;
    }
    let mut counts: Vec<(&str, usize)> = counts.into_iter().collect();
    counts.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
    let mut text = format!(
        "{} {what}, summarised to keep the Pod's annotations under the API server's limit: ",
        m.len()
    );
    let listed: Vec<String> = counts
        .iter()
        .take(LISTED_REASONS)
        .map(|(reason, n)| format!("{n} × {}", crate::logsafe::clip(reason, REASON_CHARS)))
        .collect();
    text.push_str(&listed.join("; "));
    if counts.len() > LISTED_REASONS {
        let rest = &counts[LISTED_REASONS..];
        let slots: usize = rest.iter().map(|(_, n)| n).sum();
        text.push_str(&format!("; {slots} with {} other reasons", rest.len()));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn many(n: usize, value: impl Fn(usize) -> String) -> BTreeMap<String, String> {
        (0..n)
            .map(|i| (format!("containers/c{i:05}"), value(i)))
            .collect()
    }

    fn total(out: &[(&str, String)]) -> usize {
        size(out.iter().map(|(k, v)| (*k, v.as_str())))
    }

    #[test]
    fn small_notes_are_kept_whole() {
        let notes = vec![(
            DECISIONS,
            many(3, |_| "rewritten: present at the target".into()),
        )];
        let out = fit(&notes, 0);
        assert_eq!(out, vec![(DECISIONS, encode(&notes[0].1))]);
    }

    #[test]
    fn large_notes_are_summarised_and_partial_maps_fit() {
        let n = 5000;
        let notes = vec![
            (
                DECISIONS,
                many(n, |i| {
                    if i % 10 == 0 {
                        format!("unchanged (error): {}", "x".repeat(500))
                    } else {
                        "rewritten: present at the target".into()
                    }
                }),
            ),
            (
                ORIGINAL_IMAGES,
                many(n, |i| format!("docker.io/library/app{i}:1")),
            ),
            (
                SOURCES,
                many(n, |i| {
                    format!("docker.io/library/app{i}:1@sha256:{}", "a".repeat(64))
                }),
            ),
            (
                IDENTITY,
                many(n, |_| "config digest shared with other layers".into()),
            ),
        ];
        for others in [0, 100 * 1024, ANNOTATIONS_LIMIT - 20 * 1024] {
            let out = fit(&notes, others);
            let used = total(&out);
            assert!(
                used <= OWN_SHARE && others + used <= ANNOTATIONS_LIMIT,
                "{used} beside {others}"
            );
            let decisions: BTreeMap<String, String> =
                serde_json::from_str(&out.iter().find(|(k, _)| *k == DECISIONS).unwrap().1)
                    .unwrap();
            let text = &decisions[SUMMARY_KEY];
            assert!(text.starts_with("5000 slots, summarised"), "{text}");
            assert!(
                text.contains("4500 × rewritten: present at the target"),
                "{text}"
            );
            assert!(text.contains("500 × unchanged (error): xxx"), "{text}");
            if let Some((_, s)) = out.iter().find(|(k, _)| *k == SOURCES) {
                let s: BTreeMap<String, String> = serde_json::from_str(s).unwrap();
                assert!(!s.is_empty() && s.len() < n);
                assert!(
                    text.contains(&format!(
                        "pinswap.dev/sources kept for {} of 5000 slots",
                        s.len()
                    )),
                    "{text}"
                );
            }
        }
        // No room at all: nothing is written.
        assert!(fit(&notes, ANNOTATIONS_LIMIT - 100).is_empty());
    }
}
