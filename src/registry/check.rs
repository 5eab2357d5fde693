//! Blob integrity while streaming: the size bound, the digest, and the rule
//! that the verdict comes before the last byte is released (an upload with a
//! Content-Length stops reading at its last byte, so a verdict delivered
//! after it would come too late to stop a bad blob from being committed).

use futures::StreamExt;
use sha2::Digest as _;

use super::manifest::Descriptor;
use super::session::BlobStream;
use crate::reference::{Digest, DigestAlgorithm};

/// An incremental sha256/sha512 hasher.
pub(crate) enum Hasher {
    Sha256(sha2::Sha256),
    Sha512(sha2::Sha512),
}

impl Hasher {
    pub(crate) fn new(alg: DigestAlgorithm) -> Self {
        match alg {
            DigestAlgorithm::Sha256 => Self::Sha256(sha2::Sha256::new()),
            DigestAlgorithm::Sha512 => Self::Sha512(sha2::Sha512::new()),
        }
    }

    pub(crate) fn update(&mut self, b: &[u8]) {
        match self {
            Self::Sha256(h) => h.update(b),
            Self::Sha512(h) => h.update(b),
        }
    }

    /// `algorithm:hex`.
    pub(crate) fn finish(self) -> String {
        match self {
            Self::Sha256(h) => format!("sha256:{}", hex::encode(h.finalize())),
            Self::Sha512(h) => format!("sha512:{}", hex::encode(h.finalize())),
        }
    }
}

/// sha256 of `bytes`, as a [`Digest`].
pub fn sha256_digest(bytes: &[u8]) -> Digest {
    let mut h = Hasher::new(DigestAlgorithm::Sha256);
    h.update(bytes);
    Digest::parse(&h.finish()).expect("sha256 hex is a valid digest")
}

/// Who checks the digest: this stream, as it passes (layout files and
/// registry blobs alike).
pub(crate) enum DigestCheck {
    /// Hash here.
    Here,
}

struct State {
    inner: BlobStream,
    hasher: Option<Hasher>,
    seen: u64,
    done: bool,
}

fn bad(msg: String) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, msg)
}

/// Wraps `inner` so it fails unless it yields exactly `desc.size` bytes that
/// hash to `desc.digest`; the last chunk is released only after the verdict.
pub(crate) fn checked(inner: BlobStream, desc: Descriptor, check: DigestCheck) -> BlobStream {
    let hasher = match check {
        DigestCheck::Here => Some(
            Digest::parse(&desc.digest)
                .map(|d| Hasher::new(d.algorithm()))
                .unwrap_or_else(|_| Hasher::new(DigestAlgorithm::Sha256)),
        ),
    };
    let state = State {
        inner,
        hasher,
        seen: 0,
        done: false,
    };
    futures::stream::unfold((state, desc), |(mut st, desc)| async move {
        if st.done {
            return None;
        }
        let item = match st.inner.next().await {
            Some(Ok(b)) => {
                st.seen += b.len() as u64;
                if let Some(h) = st.hasher.as_mut() {
                    h.update(&b);
                }
                if st.seen < desc.size {
                    return Some((Ok(b), (st, desc)));
                }
                if st.seen > desc.size {
                    Err(bad(format!(
                        "blob {} is longer than its descriptor size {}",
                        desc.digest, desc.size
                    )))
                } else {
                    verdict(&mut st, &desc).await.map(|()| b)
                }
            }
            Some(Err(e)) => Err(e),
            None if st.seen != desc.size => Err(bad(format!(
                "blob {} is {} bytes, its descriptor says {}",
                desc.digest, st.seen, desc.size
            ))),
            // Only an empty blob ends here without a verdict yet. An upstream
            // check has given its verdict by ending; ours is still due.
            None => match st.hasher.take().map(Hasher::finish) {
                Some(actual) if actual != desc.digest => {
                    Err(bad(format!("blob {} hashes to {actual}", desc.digest)))
                }
                _ => return None,
            },
        };
        st.done = true;
        Some((item, (st, desc)))
    })
    .boxed()
}

/// Judges a stream that has yielded exactly `desc.size` bytes.
async fn verdict(st: &mut State, desc: &Descriptor) -> std::io::Result<()> {
    match st.hasher.take() {
        Some(h) => {
            let actual = h.finish();
            if actual == desc.digest {
                Ok(())
            } else {
                Err(bad(format!("blob {} hashes to {actual}", desc.digest)))
            }
        }
        None => match st.inner.next().await {
            None => Ok(()),
            Some(Err(e)) => Err(e),
            Some(Ok(extra)) if extra.is_empty() => Ok(()),
            Some(Ok(_)) => Err(bad(format!(
                "blob {} is longer than its descriptor size {}",
                desc.digest, desc.size
            ))),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    fn desc(bytes: &[u8]) -> Descriptor {
        Descriptor {
            media_type: String::new(),
            digest: sha256_digest(bytes).to_string(),
            size: bytes.len() as u64,
            platform: None,
            urls: None,
        }
    }

    fn stream(parts: &[&'static [u8]]) -> BlobStream {
        futures::stream::iter(
            parts
                .iter()
                .map(|p| Ok(Bytes::from_static(p)))
                .collect::<Vec<_>>(),
        )
        .boxed()
    }

    async fn run(s: BlobStream, d: Descriptor, c: DigestCheck) -> (Vec<u8>, Option<String>) {
        let mut out = Vec::new();
        let mut err = None;
        let mut s = checked(s, d, c);
        while let Some(r) = s.next().await {
            match r {
                Ok(b) => out.extend_from_slice(&b),
                Err(e) => err = Some(e.to_string()),
            }
        }
        (out, err)
    }

    #[tokio::test]
    async fn good_bad_long_short_and_empty() {
        let (out, err) = run(stream(&[b"abc", b"de"]), desc(b"abcde"), DigestCheck::Here).await;
        assert_eq!((out.as_slice(), err), (&b"abcde"[..], None));

        // Wrong content of the right size: the last chunk is held back.
        let (out, err) = run(stream(&[b"abc", b"dX"]), desc(b"abcde"), DigestCheck::Here).await;
        assert_eq!(out, b"abc");
        assert!(err.unwrap().contains("hashes to sha256:"));

        let (_, err) = run(stream(&[b"abc", b"def"]), desc(b"abcde"), DigestCheck::Here).await;
        assert!(err.unwrap().contains("longer than its descriptor size 5"));
        let (_, err) = run(stream(&[b"abc"]), desc(b"abcde"), DigestCheck::Here).await;
        assert!(err.unwrap().contains("is 3 bytes, its descriptor says 5"));

        let (out, err) = run(stream(&[]), desc(b""), DigestCheck::Here).await;
        assert_eq!((out.len(), err), (0, None));
        let mut wrong = desc(b"");
        wrong.digest = sha256_digest(b"x").to_string();
        let (_, err) = run(stream(&[]), wrong, DigestCheck::Here).await;
        assert!(err.unwrap().contains("hashes to"));
    }
}
