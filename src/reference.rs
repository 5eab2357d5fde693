//! Image references, parsed and normalised the way Docker and containerd do
//! it, manifest digests, and the mirror-path mapping.
//!
//! # Grammar
//!
//! References follow Docker's `github.com/distribution/reference` package
//! (`regexp.go`, `reference.go`, `normalize.go`). The scanners here are written
//! by hand and use no regex crate:
//!
//! ```text
//! reference        := name [ ":" tag ] [ "@" digest ]
//! name             := [ domain "/" ] path-component ( "/" path-component )*
//! domain           := host [ ":" port ]
//! host             := domain-component ( "." domain-component )*
//!                   | "[" ipv6-address "]"
//! domain-component := [a-zA-Z0-9] | [a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9]
//! port             := [0-9]+
//! path-component   := [a-z0-9]+ ( ( [._] | "__" | [-]* ) [a-z0-9]+ )*
//! tag              := [A-Za-z0-9_] [A-Za-z0-9_.-]{0,127}
//! digest           := algorithm ":" hex
//! ```
//!
//! The repository name (the path after the registry) may be at most 255
//! characters long, which is `RepositoryNameTotalLengthMax` in Docker's code.
//!
//! Digests follow the "Digests" section of the OCI image-spec descriptor
//! document (`descriptor.md`). Only the registered algorithms `sha256`
//! (64 lowercase hex characters) and `sha512` (128) are accepted.
//!
//! # Normalisation
//!
//! This is `splitDockerDomain` in Docker's `normalize.go`. The first
//! `/`-separated component of a name is a registry when it is `localhost`,
//! contains a `.` or a `:` (this covers `[::1]:5000`), or contains an uppercase
//! letter (Docker Hub namespaces are lowercase, so Docker takes such a
//! component to be a host). Otherwise the registry is [`DEFAULT_REGISTRY`]. The
//! legacy `index.docker.io` becomes `docker.io`. On `docker.io`, a repository
//! with a single component gets the `library/` prefix. [`DEFAULT_TAG`] is added
//! only when a reference has neither a tag nor a digest. Registries keep the
//! case they were written in, as in Docker.
//!
//! # Mirror path
//!
//! [`MirrorTarget::map`] builds
//! `<target registry>[/<prefix>]/<registry_path_component(source registry)>/<source repository>`.
//! The tag and digest are the source's.

use std::fmt;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::str::FromStr;

/// The registry Docker assumes when a reference names none: `docker.io`.
pub const DEFAULT_REGISTRY: &str = "docker.io";

/// The tag Docker assumes when a reference has neither a tag nor a digest:
/// `latest`.
pub const DEFAULT_TAG: &str = "latest";

/// The longest repository name allowed, in characters: 255. This is
/// Distribution's `RepositoryNameTotalLengthMax`. It counts the path after the
/// registry, including any `library/` prefix added by normalisation.
pub const REPOSITORY_MAX_LEN: usize = 255;

/// The old Docker Hub host name, which normalises to [`DEFAULT_REGISTRY`].
const LEGACY_DEFAULT_REGISTRY: &str = "index.docker.io";
/// The prefix of Docker Hub's official images.
const OFFICIAL_REPOSITORY_PREFIX: &str = "library/";
/// The longest tag allowed, in characters.
const TAG_MAX_LEN: usize = 128;
/// Tag grammar as shown in error messages.
const TAG_GRAMMAR: &str = "[A-Za-z0-9_][A-Za-z0-9._-]{0,127}";
/// Path-component grammar as shown in error messages.
const PATH_COMPONENT_GRAMMAR: &str = "[a-z0-9]+(?:(?:[._]|__|[-]*)[a-z0-9]+)*";

const REASON_EMPTY: &str = "is empty (expected host[:port])";
const REASON_HOST: &str = "is not a valid host: expected dot-separated labels of letters, digits \
     and '-' that start and end with a letter or digit, optionally followed by :port";
const REASON_PORT: &str = "has an invalid port: expected ':' followed by one or more digits";
const REASON_IPV6: &str =
    "is not a valid bracketed IPv6 literal (expected e.g. [::1] or [fd00::1]:5000)";
const REASON_NOT_A_REGISTRY: &str = "would be read as a Docker Hub namespace: a registry must \
     contain '.' or ':', or be \"localhost\"";

/// The kind of text being parsed when a [`ReferenceError`] occurred. It
/// appears in the message: `invalid <subject> "<input>": ...`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Subject {
    /// An image reference (`[registry/]repository[:tag][@digest]`), from
    /// [`Reference::parse`], [`Reference::new`] or [`Reference::with_tag`].
    Reference,
    /// A bare digest (`algorithm:hex`), from [`Digest::parse`].
    Digest,
    /// A mirror target (`host[:port][/prefix]`), from [`MirrorTarget::parse`].
    MirrorTarget,
    /// A reference built by [`MirrorTarget::map`].
    MirrorPath,
}

impl fmt::Display for Subject {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Subject::Reference => "reference",
            Subject::Digest => "digest",
            Subject::MirrorTarget => "mirror target",
            Subject::MirrorPath => "mirror path",
        })
    }
}

/// Why a reference, digest or mirror target was rejected.
///
/// The `Display` text is the contract. It quotes the whole input, names the
/// part at fault, and gives the expected form. For example:
/// `invalid reference "x:-bad": tag "-bad" must match [A-Za-z0-9_][A-Za-z0-9._-]{0,127}`.
/// Quoted values use Rust's `{:?}` string escaping, so control characters and
/// quotes in the input stay visible.
#[derive(Debug, thiserror::Error, PartialEq, Eq, Clone)]
pub enum ReferenceError {
    /// The input is the empty string. Docker's `ErrNameEmpty`.
    #[error("invalid {subject} \"\": empty {subject}")]
    EmptyReference {
        /// What was being parsed.
        subject: Subject,
    },
    /// The whole input is 64 lowercase hex characters: an image ID, not a
    /// name. Docker refuses these so an ID can't be mistaken for a repository.
    #[error(
        "invalid {subject} {input:?}: cannot specify 64-byte hexadecimal strings \
         (an image ID is not a reference; write <repository>@sha256:<hex>)"
    )]
    HexIdentifier {
        /// What was being parsed.
        subject: Subject,
        /// The whole input.
        input: String,
    },
    /// The input starts with a URL scheme such as `https://`.
    #[error(
        "invalid {subject} {input:?}: a URL scheme is not allowed \
         (write host[:port]/path, not scheme://host)"
    )]
    UrlScheme {
        /// What was being parsed.
        subject: Subject,
        /// The whole input.
        input: String,
    },
    /// There is a `:` with nothing after it.
    #[error("invalid {subject} {input:?}: empty tag after ':'")]
    EmptyTag {
        /// What was being parsed.
        subject: Subject,
        /// The whole input.
        input: String,
    },
    /// The tag does not match `[A-Za-z0-9_][A-Za-z0-9._-]{0,127}`.
    #[error("invalid {subject} {input:?}: tag {tag:?} must match {TAG_GRAMMAR}")]
    InvalidTag {
        /// What was being parsed.
        subject: Subject,
        /// The whole input.
        input: String,
        /// The offending tag.
        tag: String,
    },
    /// There is an `@` with nothing after it.
    #[error("invalid {subject} {input:?}: empty digest after '@'")]
    EmptyDigest {
        /// What was being parsed.
        subject: Subject,
        /// The whole input.
        input: String,
    },
    /// The digest is not `algorithm:hex` (no `:`, or nothing before it).
    #[error(
        "invalid {subject} {input:?}: digest {digest:?} must have the form algorithm:hex, \
         e.g. sha256:<64 lowercase hex characters>"
    )]
    MalformedDigest {
        /// What was being parsed.
        subject: Subject,
        /// The whole input.
        input: String,
        /// The offending digest.
        digest: String,
    },
    /// The algorithm is neither `sha256` nor `sha512`.
    #[error(
        "invalid {subject} {input:?}: unsupported digest algorithm {algorithm:?} \
         (expected sha256 or sha512)"
    )]
    UnsupportedAlgorithm {
        /// What was being parsed.
        subject: Subject,
        /// The whole input.
        input: String,
        /// The offending algorithm, as written.
        algorithm: String,
    },
    /// The hex part is not exactly the algorithm's length in lowercase hex.
    #[error(
        "invalid {subject} {input:?}: digest {digest:?} must have {expected_len} lowercase hex \
         characters"
    )]
    InvalidDigest {
        /// What was being parsed.
        subject: Subject,
        /// The whole input.
        input: String,
        /// The offending digest.
        digest: String,
        /// The length the algorithm requires: 64 for sha256, 128 for sha512.
        expected_len: usize,
    },
    /// The repository name (or mirror prefix) has an uppercase letter. Docker's
    /// `ErrNameContainsUppercase`.
    #[error("invalid {subject} {input:?}: repository name must be lowercase ({repository:?})")]
    Uppercase {
        /// What was being parsed.
        subject: Subject,
        /// The whole input.
        input: String,
        /// The repository as written, before any `library/` prefix was added.
        repository: String,
    },
    /// No repository name, e.g. `example.com/` or `:tag`.
    #[error(
        "invalid {subject} {input:?}: repository name is missing \
         (expected [registry/]repository[:tag][@digest])"
    )]
    MissingRepository {
        /// What was being parsed.
        subject: Subject,
        /// The whole input.
        input: String,
    },
    /// The path has an empty component: a leading, trailing or doubled `/`.
    #[error(
        "invalid {subject} {input:?}: path {repository:?} has an empty component \
         (leading, trailing or doubled '/')"
    )]
    EmptyPathComponent {
        /// What was being parsed.
        subject: Subject,
        /// The whole input.
        input: String,
        /// The path (repository or mirror prefix) as written.
        repository: String,
    },
    /// A path component does not match
    /// `[a-z0-9]+(?:(?:[._]|__|[-]*)[a-z0-9]+)*`.
    #[error(
        "invalid {subject} {input:?}: path component {component:?} in {repository:?} \
         must match {PATH_COMPONENT_GRAMMAR}"
    )]
    InvalidRepository {
        /// What was being parsed.
        subject: Subject,
        /// The whole input.
        input: String,
        /// The path (repository or mirror prefix) as written.
        repository: String,
        /// The first offending component.
        component: String,
    },
    /// The registry is not `host[:port]` as Docker's grammar defines it.
    #[error("invalid {subject} {input:?}: registry {registry:?} {reason}")]
    InvalidRegistry {
        /// What was being parsed.
        subject: Subject,
        /// The whole input.
        input: String,
        /// The offending registry.
        registry: String,
        /// What is wrong, and the expected form.
        reason: &'static str,
    },
    /// The repository name is longer than [`REPOSITORY_MAX_LEN`]. Docker's
    /// `ErrNameTooLong`.
    #[error(
        "invalid {subject} {input:?}: repository name {repository:?} is {len} characters long, \
         more than the {REPOSITORY_MAX_LEN} allowed"
    )]
    NameTooLong {
        /// What was being parsed.
        subject: Subject,
        /// The whole input (for [`Subject::MirrorPath`], the mapped reference).
        input: String,
        /// The normalised repository name.
        repository: String,
        /// Its length in characters.
        len: usize,
    },
    /// A mirror target has a tag or a digest.
    #[error(
        "invalid mirror target {input:?}: a mirror target is host[:port][/prefix] and must not \
         have a tag or digest"
    )]
    TargetHasTagOrDigest {
        /// The whole input.
        input: String,
    },
    /// A mirror target does not start with an explicit registry host.
    #[error(
        "invalid mirror target {input:?}: {first:?} is not a registry host; a mirror target \
         starts with a host that contains '.' or ':', or is localhost \
         (e.g. mirror.example.com/prefix or 127.0.0.1:5000)"
    )]
    TargetWithoutRegistry {
        /// The whole input.
        input: String,
        /// The first `/`-separated component, which should have been a host.
        first: String,
    },
}

/// The subject and input that the errors of one parse quote.
struct Ctx<'a> {
    subject: Subject,
    input: &'a str,
}

impl Ctx<'_> {
    fn input(&self) -> String {
        self.input.to_owned()
    }
}

// ---------------------------------------------------------------------------
// Digests
// ---------------------------------------------------------------------------

/// A digest algorithm registered by the OCI image-spec (descriptor.md,
/// "Registered algorithms").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DigestAlgorithm {
    /// SHA-256: `sha256`, 64 hex characters.
    Sha256,
    /// SHA-512: `sha512`, 128 hex characters.
    Sha512,
}

impl DigestAlgorithm {
    /// The identifier used in digests: `"sha256"` or `"sha512"`.
    pub fn as_str(&self) -> &'static str {
        match self {
            DigestAlgorithm::Sha256 => "sha256",
            DigestAlgorithm::Sha512 => "sha512",
        }
    }

    /// The number of hex characters in an encoded digest: 64 for sha256, 128
    /// for sha512.
    pub fn hex_len(&self) -> usize {
        match self {
            DigestAlgorithm::Sha256 => 64,
            DigestAlgorithm::Sha512 => 128,
        }
    }
}

impl fmt::Display for DigestAlgorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A content digest, `algorithm:hex`, e.g. `sha256:<64 lowercase hex>`.
///
/// This is the OCI image-spec descriptor digest grammar (descriptor.md,
/// "Digests") restricted to the registered algorithms `sha256` and `sha512`.
/// The hex part must be lowercase and exactly [`DigestAlgorithm::hex_len`]
/// characters long, as go-digest's `Digest.Validate` requires. The full string
/// is stored, so [`Digest::as_str`] costs nothing. Digests order by that string.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest {
    /// The full `algorithm:hex` string, validated.
    value: String,
}

impl Digest {
    /// Parses `algorithm:hex`.
    ///
    /// # Errors
    ///
    /// With [`Subject::Digest`], these [`ReferenceError`] variants:
    /// [`EmptyReference`](ReferenceError::EmptyReference) for `""`;
    /// [`MalformedDigest`](ReferenceError::MalformedDigest) when there is no
    /// `algorithm:` part;
    /// [`UnsupportedAlgorithm`](ReferenceError::UnsupportedAlgorithm) for
    /// anything but `sha256` and `sha512`, including `SHA256` and `sha384`;
    /// [`InvalidDigest`](ReferenceError::InvalidDigest) when the hex part is
    /// not exactly 64 (sha256) or 128 (sha512) characters of `[0-9a-f]`.
    pub fn parse(s: &str) -> Result<Digest, ReferenceError> {
        if s.is_empty() {
            return Err(ReferenceError::EmptyReference {
                subject: Subject::Digest,
            });
        }
        parse_digest(
            &Ctx {
                subject: Subject::Digest,
                input: s,
            },
            s,
        )
    }

    /// The algorithm: [`DigestAlgorithm::Sha256`] or [`DigestAlgorithm::Sha512`].
    pub fn algorithm(&self) -> DigestAlgorithm {
        if self.value.starts_with("sha512:") {
            DigestAlgorithm::Sha512
        } else {
            DigestAlgorithm::Sha256
        }
    }

    /// The encoded part after `algorithm:`: 64 or 128 lowercase hex characters.
    pub fn hex(&self) -> &str {
        &self.value[self.algorithm().as_str().len() + 1..]
    }

    /// The full digest, `algorithm:hex`.
    pub fn as_str(&self) -> &str {
        &self.value
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.value)
    }
}

impl FromStr for Digest {
    type Err = ReferenceError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Digest::parse(s)
    }
}

/// Validates a non-empty `algorithm:hex` and reports faults against `ctx`.
fn parse_digest(ctx: &Ctx<'_>, digest: &str) -> Result<Digest, ReferenceError> {
    let Some((algorithm, hex)) = digest.split_once(':').filter(|(a, _)| !a.is_empty()) else {
        return Err(ReferenceError::MalformedDigest {
            subject: ctx.subject,
            input: ctx.input(),
            digest: digest.to_owned(),
        });
    };
    let algorithm = match algorithm {
        "sha256" => DigestAlgorithm::Sha256,
        "sha512" => DigestAlgorithm::Sha512,
        other => {
            return Err(ReferenceError::UnsupportedAlgorithm {
                subject: ctx.subject,
                input: ctx.input(),
                algorithm: other.to_owned(),
            });
        }
    };
    let lowercase_hex = hex
        .bytes()
        .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    if hex.len() != algorithm.hex_len() || !lowercase_hex {
        return Err(ReferenceError::InvalidDigest {
            subject: ctx.subject,
            input: ctx.input(),
            digest: digest.to_owned(),
            expected_len: algorithm.hex_len(),
        });
    }
    Ok(Digest {
        value: digest.to_owned(),
    })
}

// ---------------------------------------------------------------------------
// References
// ---------------------------------------------------------------------------

/// A normalised image reference: registry, repository, optional tag, optional
/// digest.
///
/// Every `Reference` is normalised as the module documentation describes. Its
/// [`Display`](fmt::Display) form is the full one, e.g.
/// `docker.io/library/nginx:latest`, `127.0.0.1:5000/a/b@sha256:<hex>` or
/// `[::1]:5000/x:t@sha256:<hex>`. Parsing that form gives back an equal value.
/// The one exception is a reference with neither tag nor digest (made with
/// [`Reference::without_tag`] or [`Reference::new`]), which parses back with
/// the tag `latest`.
///
/// A leader keeps one for every image each Pod names, so it is laid out
/// compactly: `registry/repository[:tag]` in one allocation, the parts
/// found by offsets, and the digest beside it.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Reference {
    /// `registry/repository[:tag]`.
    name: Box<str>,
    /// Where the repository starts in `name`.
    repository_at: u32,
    /// Where the tag starts in `name`, after its `:`.
    tag_at: Option<u32>,
    digest: Option<Digest>,
}

impl fmt::Debug for Reference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reference")
            .field("registry", &self.registry())
            .field("repository", &self.repository())
            .field("tag", &self.tag())
            .field("digest", &self.digest)
            .finish()
    }
}

impl Reference {
    /// Lays out parts already validated.
    fn of_parts(
        registry: &str,
        repository: &str,
        tag: Option<&str>,
        digest: Option<Digest>,
    ) -> Reference {
        let mut name = String::with_capacity(
            registry.len() + 1 + repository.len() + tag.map_or(0, |t| t.len() + 1),
        );
        name.push_str(registry);
        name.push('/');
        let repository_at = name.len();
        name.push_str(repository);
        let tag_at = tag.map(|t| {
            name.push(':');
            let at = name.len();
            name.push_str(t);
            at
        });
        // Validated parts are short: a registry name, a repository of at
        // most 255 characters and a tag of at most 128.
        let offset = |at: usize| u32::try_from(at).expect("a reference under 4 GiB");
        Reference {
            name: name.into_boxed_str(),
            repository_at: offset(repository_at),
            tag_at: tag_at.map(offset),
            digest,
        }
    }

    /// Parses `[registry/]repository[:tag][@digest]` and normalises it as
    /// Docker's `ParseNormalizedNamed` does. For example, `nginx` gives
    /// `docker.io/library/nginx:latest`; `index.docker.io/nginx` and
    /// `docker.io/nginx` give `docker.io/library/nginx:latest`;
    /// `localhost:5000/x@sha256:<hex>` keeps no tag; `x:t@sha256:<hex>` keeps
    /// both. `localhost:5000` on its own is the Docker Hub image
    /// `library/localhost` with tag `5000`, as in Docker.
    ///
    /// # Errors
    ///
    /// With [`Subject::Reference`], checked in this order:
    /// [`EmptyReference`](ReferenceError::EmptyReference),
    /// [`HexIdentifier`](ReferenceError::HexIdentifier) (the whole input is 64
    /// lowercase hex characters), [`UrlScheme`](ReferenceError::UrlScheme),
    /// [`Uppercase`](ReferenceError::Uppercase) (the repository has an
    /// uppercase letter), [`InvalidRegistry`](ReferenceError::InvalidRegistry),
    /// [`MissingRepository`](ReferenceError::MissingRepository),
    /// [`EmptyPathComponent`](ReferenceError::EmptyPathComponent),
    /// [`InvalidRepository`](ReferenceError::InvalidRepository),
    /// [`NameTooLong`](ReferenceError::NameTooLong) (normalised repository
    /// over 255 characters), [`EmptyTag`](ReferenceError::EmptyTag),
    /// [`InvalidTag`](ReferenceError::InvalidTag),
    /// [`EmptyDigest`](ReferenceError::EmptyDigest), and the digest errors of
    /// [`Digest::parse`].
    ///
    /// ```
    /// use pinswap::reference::Reference;
    /// let r = Reference::parse("nginx").unwrap();
    /// assert_eq!(r.to_string(), "docker.io/library/nginx:latest");
    /// let r = Reference::parse("localhost:5000/team/app:v1").unwrap();
    /// assert_eq!((r.registry(), r.repository(), r.tag()), ("localhost:5000", "team/app", Some("v1")));
    /// assert!(Reference::parse("Nginx").is_err());
    /// ```
    pub fn parse(s: &str) -> Result<Reference, ReferenceError> {
        let ctx = Ctx {
            subject: Subject::Reference,
            input: s,
        };
        if s.is_empty() {
            return Err(ReferenceError::EmptyReference {
                subject: ctx.subject,
            });
        }
        if s.len() == 64
            && s.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        {
            return Err(ReferenceError::HexIdentifier {
                subject: ctx.subject,
                input: ctx.input(),
            });
        }
        if s.contains("://") {
            return Err(ReferenceError::UrlScheme {
                subject: ctx.subject,
                input: ctx.input(),
            });
        }
        let (name_and_tag, digest) = match s.split_once('@') {
            Some((name_and_tag, digest)) => (name_and_tag, Some(digest)),
            None => (s, None),
        };
        let (name, tag) = split_tag(name_and_tag);
        let (registry, repository) = split_registry(name);
        let (registry, repository) = check_name(&ctx, registry, repository)?;
        let tag = tag.map(|t| check_tag(&ctx, t)).transpose()?;
        let digest = match digest {
            None => None,
            Some("") => {
                return Err(ReferenceError::EmptyDigest {
                    subject: ctx.subject,
                    input: ctx.input(),
                });
            }
            Some(d) => Some(parse_digest(&ctx, d)?),
        };
        let tag = match (tag, &digest) {
            (None, None) => Some(DEFAULT_TAG),
            (tag, _) => tag,
        };
        Ok(Reference::of_parts(&registry, &repository, tag, digest))
    }

    /// Builds a reference from its parts, validating and normalising each as
    /// [`Reference::parse`] does: `index.docker.io` becomes `docker.io`, and a
    /// single-component repository on `docker.io` gets `library/`. No default
    /// tag is added: with `tag` and `digest` both `None`, the reference has
    /// neither.
    ///
    /// # Errors
    ///
    /// The errors of [`Reference::parse`] (apart from
    /// [`HexIdentifier`](ReferenceError::HexIdentifier) and
    /// [`EmptyDigest`](ReferenceError::EmptyDigest)), quoting the
    /// parts joined as `registry/repository[:tag][@digest]`. Also
    /// [`InvalidRegistry`](ReferenceError::InvalidRegistry) when `registry`
    /// would not be read back as a registry (no `.` or `:`, not `localhost`,
    /// no uppercase letter), e.g. `new("library", "nginx", ..)`.
    pub fn new(
        registry: &str,
        repository: &str,
        tag: Option<&str>,
        digest: Option<Digest>,
    ) -> Result<Reference, ReferenceError> {
        let input = render(registry, repository, tag, digest.as_ref());
        let ctx = Ctx {
            subject: Subject::Reference,
            input: &input,
        };
        if !registry.is_empty() && !looks_like_registry(registry) {
            return Err(ReferenceError::InvalidRegistry {
                subject: ctx.subject,
                input: ctx.input(),
                registry: registry.to_owned(),
                reason: REASON_NOT_A_REGISTRY,
            });
        }
        let (registry, repository) = check_name(&ctx, registry, repository)?;
        let tag = tag.map(|t| check_tag(&ctx, t)).transpose()?;
        Ok(Reference::of_parts(&registry, &repository, tag, digest))
    }

    /// The registry, `host[:port]`, e.g. `docker.io`, `127.0.0.1:5000` or
    /// `[::1]:5000`. Its case is kept as written.
    pub fn registry(&self) -> &str {
        &self.name[..self.repository_at as usize - 1]
    }

    /// The repository path, e.g. `library/nginx` or `a/b`.
    pub fn repository(&self) -> &str {
        let end = self.tag_at.map_or(self.name.len(), |t| t as usize - 1);
        &self.name[self.repository_at as usize..end]
    }

    /// The tag, if any, e.g. `latest`.
    pub fn tag(&self) -> Option<&str> {
        self.tag_at.map(|t| &self.name[t as usize..])
    }

    /// `registry/repository[:tag]`.
    fn name_and_tag(&self) -> &str {
        &self.name
    }

    /// The digest, if any.
    pub fn digest(&self) -> Option<&Digest> {
        self.digest.as_ref()
    }

    /// `registry/repository`, e.g. `docker.io/library/nginx`.
    pub fn name(&self) -> String {
        let end = self.tag_at.map_or(self.name.len(), |t| t as usize - 1);
        self.name[..end].to_owned()
    }

    /// The same reference with its tag replaced by `tag`. The digest is kept.
    ///
    /// # Errors
    ///
    /// [`EmptyTag`](ReferenceError::EmptyTag) or
    /// [`InvalidTag`](ReferenceError::InvalidTag), quoting the reference as it
    /// would have been.
    pub fn with_tag(&self, tag: &str) -> Result<Reference, ReferenceError> {
        let input = render(
            self.registry(),
            self.repository(),
            Some(tag),
            self.digest.as_ref(),
        );
        let ctx = Ctx {
            subject: Subject::Reference,
            input: &input,
        };
        check_tag(&ctx, tag)?;
        Ok(Reference::of_parts(
            self.registry(),
            self.repository(),
            Some(tag),
            self.digest.clone(),
        ))
    }

    /// The same reference with its digest replaced by `digest`. The tag is kept.
    pub fn with_digest(&self, digest: Digest) -> Reference {
        Reference {
            digest: Some(digest),
            ..self.clone()
        }
    }

    /// The same reference without a tag. The digest is kept.
    pub fn without_tag(&self) -> Reference {
        Reference::of_parts(
            self.registry(),
            self.repository(),
            None,
            self.digest.clone(),
        )
    }

    /// The same reference without a digest. The tag is kept.
    pub fn without_digest(&self) -> Reference {
        Reference {
            digest: None,
            ..self.clone()
        }
    }

    /// The equivalent `oci_client::Reference` (which is
    /// `oci_spec::distribution::Reference`), built with `with_tag`,
    /// `with_digest` or `with_tag_and_digest`, so its `whole()` equals this
    /// reference's `Display`. A reference with neither tag nor digest gets the
    /// tag `latest`, as oci-client's own parser would give it.
    pub fn to_oci(&self) -> oci_client::Reference {
        let registry = self.registry().to_owned();
        let repository = self.repository().to_owned();
        match (self.tag(), &self.digest) {
            (Some(tag), Some(digest)) => oci_client::Reference::with_tag_and_digest(
                registry,
                repository,
                tag.to_owned(),
                digest.to_string(),
            ),
            (Some(tag), None) => {
                oci_client::Reference::with_tag(registry, repository, tag.to_owned())
            }
            (None, Some(digest)) => {
                oci_client::Reference::with_digest(registry, repository, digest.to_string())
            }
            (None, None) => {
                oci_client::Reference::with_tag(registry, repository, DEFAULT_TAG.to_owned())
            }
        }
    }

    /// True when the registry's host is a loopback host: `localhost` (any
    /// case), an IPv4 address in 127.0.0.0/8, or the IPv6 literal `[::1]`
    /// (also written out in full, or as the IPv4-mapped `[::ffff:7f00:1]`).
    /// The port is ignored. This looks only at the text. It does no DNS
    /// lookup, so a name that resolves to 127.0.0.1 is not loopback here.
    pub fn is_loopback(&self) -> bool {
        is_loopback_registry(self.registry())
    }
}

impl fmt::Display for Reference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name_and_tag())?;
        if let Some(digest) = &self.digest {
            write!(f, "@{digest}")?;
        }
        Ok(())
    }
}

impl FromStr for Reference {
    type Err = ReferenceError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Reference::parse(s)
    }
}

/// `registry/repository[:tag][@digest]`, for quoting inputs that were given
/// in parts.
fn render(registry: &str, repository: &str, tag: Option<&str>, digest: Option<&Digest>) -> String {
    let mut out = format!("{registry}/{repository}");
    if let Some(tag) = tag {
        out.push(':');
        out.push_str(tag);
    }
    if let Some(digest) = digest {
        out.push('@');
        out.push_str(digest.as_str());
    }
    out
}

/// Splits `name[:tag]`. A `:` is a tag separator only when no `/` follows it;
/// otherwise it is a registry port.
fn split_tag(name_and_tag: &str) -> (&str, Option<&str>) {
    match name_and_tag.rfind(':') {
        Some(i) if !name_and_tag[i..].contains('/') => {
            (&name_and_tag[..i], Some(&name_and_tag[i + 1..]))
        }
        _ => (name_and_tag, None),
    }
}

/// Docker's `splitDockerDomain` without the normalisation: returns the
/// registry as written (or [`DEFAULT_REGISTRY`]) and the repository as written.
fn split_registry(name: &str) -> (&str, &str) {
    match name.split_once('/') {
        Some((first, rest)) if looks_like_registry(first) => (first, rest),
        _ => (DEFAULT_REGISTRY, name),
    }
}

/// Whether Docker reads the first component of a name as a registry.
fn looks_like_registry(first: &str) -> bool {
    first == "localhost" || first.contains(['.', ':']) || first.chars().any(char::is_uppercase)
}

/// Validates registry and repository, normalises them, and checks the length.
fn check_name(
    ctx: &Ctx<'_>,
    registry: &str,
    repository: &str,
) -> Result<(String, String), ReferenceError> {
    if repository.chars().any(char::is_uppercase) {
        return Err(ReferenceError::Uppercase {
            subject: ctx.subject,
            input: ctx.input(),
            repository: repository.to_owned(),
        });
    }
    check_registry(ctx, registry)?;
    if repository.is_empty() {
        return Err(ReferenceError::MissingRepository {
            subject: ctx.subject,
            input: ctx.input(),
        });
    }
    check_path(ctx, repository)?;
    let registry = if registry == LEGACY_DEFAULT_REGISTRY {
        DEFAULT_REGISTRY
    } else {
        registry
    };
    let repository = if registry == DEFAULT_REGISTRY && !repository.contains('/') {
        format!("{OFFICIAL_REPOSITORY_PREFIX}{repository}")
    } else {
        repository.to_owned()
    };
    if repository.len() > REPOSITORY_MAX_LEN {
        return Err(ReferenceError::NameTooLong {
            subject: ctx.subject,
            input: ctx.input(),
            len: repository.len(),
            repository,
        });
    }
    Ok((registry.to_owned(), repository))
}

/// Validates `host[:port]` against Docker's domain grammar. Bracketed IPv6
/// literals must also be real addresses (Docker's pattern only checks the
/// characters).
fn check_registry(ctx: &Ctx<'_>, registry: &str) -> Result<(), ReferenceError> {
    let fail = |reason| {
        Err(ReferenceError::InvalidRegistry {
            subject: ctx.subject,
            input: ctx.input(),
            registry: registry.to_owned(),
            reason,
        })
    };
    if registry.is_empty() {
        return fail(REASON_EMPTY);
    }
    let port = if let Some(rest) = registry.strip_prefix('[') {
        let Some((inner, after)) = rest.split_once(']') else {
            return fail(REASON_IPV6);
        };
        let ipv6 = !inner.is_empty()
            && inner.bytes().all(|b| b.is_ascii_hexdigit() || b == b':')
            && inner.parse::<Ipv6Addr>().is_ok();
        if !ipv6 {
            return fail(REASON_IPV6);
        }
        if after.is_empty() {
            None
        } else if let Some(port) = after.strip_prefix(':') {
            Some(port)
        } else {
            return fail(REASON_IPV6);
        }
    } else {
        let (host, port) = match registry.split_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (registry, None),
        };
        if !host.split('.').all(is_domain_component) {
            return fail(REASON_HOST);
        }
        port
    };
    match port {
        Some(port) if port.is_empty() || !port.bytes().all(|b| b.is_ascii_digit()) => {
            fail(REASON_PORT)
        }
        _ => Ok(()),
    }
}

/// Validates a non-empty `/`-separated path of path components.
fn check_path(ctx: &Ctx<'_>, path: &str) -> Result<(), ReferenceError> {
    for component in path.split('/') {
        if component.is_empty() {
            return Err(ReferenceError::EmptyPathComponent {
                subject: ctx.subject,
                input: ctx.input(),
                repository: path.to_owned(),
            });
        }
        if !is_path_component(component) {
            return Err(ReferenceError::InvalidRepository {
                subject: ctx.subject,
                input: ctx.input(),
                repository: path.to_owned(),
                component: component.to_owned(),
            });
        }
    }
    Ok(())
}

/// Validates a tag against `[A-Za-z0-9_][A-Za-z0-9._-]{0,127}`.
fn check_tag<'t>(ctx: &Ctx<'_>, tag: &'t str) -> Result<&'t str, ReferenceError> {
    if tag.is_empty() {
        return Err(ReferenceError::EmptyTag {
            subject: ctx.subject,
            input: ctx.input(),
        });
    }
    let word = |b: u8| b.is_ascii_alphanumeric() || b == b'_';
    let mut bytes = tag.bytes();
    let first_ok = bytes.next().is_some_and(word);
    let rest_ok = bytes.all(|b| word(b) || b == b'.' || b == b'-');
    if !first_ok || !rest_ok || tag.len() > TAG_MAX_LEN {
        return Err(ReferenceError::InvalidTag {
            subject: ctx.subject,
            input: ctx.input(),
            tag: tag.to_owned(),
        });
    }
    Ok(tag)
}

/// `[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9]`
fn is_domain_component(s: &str) -> bool {
    let b = s.as_bytes();
    match (b.first(), b.last()) {
        (Some(first), Some(last)) => {
            first.is_ascii_alphanumeric()
                && last.is_ascii_alphanumeric()
                && b.iter().all(|c| c.is_ascii_alphanumeric() || *c == b'-')
        }
        _ => false,
    }
}

/// `[a-z0-9]+(?:(?:[._]|__|[-]*)[a-z0-9]+)*`, scanned left to right: a run of
/// alphanumerics, then any number of (separator, run of alphanumerics), where a
/// separator is `.`, `_`, `__` or one or more `-`.
fn is_path_component(s: &str) -> bool {
    let b = s.as_bytes();
    let alnum = |c: u8| c.is_ascii_lowercase() || c.is_ascii_digit();
    let mut i = 0;
    loop {
        // A run of alphanumerics, at least one.
        let start = i;
        while i < b.len() && alnum(b[i]) {
            i += 1;
        }
        if i == start {
            return false;
        }
        if i == b.len() {
            return true;
        }
        // A separator.
        match b[i] {
            b'.' => i += 1,
            b'_' => {
                i += 1;
                if i < b.len() && b[i] == b'_' {
                    i += 1;
                }
            }
            b'-' => {
                while i < b.len() && b[i] == b'-' {
                    i += 1;
                }
            }
            _ => return false,
        }
    }
}

/// Splits a valid registry into host (IPv6 literals keep their brackets) and
/// optional port.
fn split_host_port(registry: &str) -> (&str, Option<&str>) {
    if registry.starts_with('[') {
        return match registry.find(']') {
            Some(i) => {
                let (host, after) = registry.split_at(i + 1);
                (host, after.strip_prefix(':'))
            }
            None => (registry, None),
        };
    }
    match registry.split_once(':') {
        Some((host, port)) => (host, Some(port)),
        None => (registry, None),
    }
}

/// A registry name as references normalise it: lowercased, and Docker Hub's
/// other names (`index.docker.io`, `registry-1.docker.io`) as `docker.io`.
/// For matching config entries (allowlist, credentials) against references.
pub fn normalize_registry(registry: &str) -> String {
    let r = registry.trim().to_ascii_lowercase();
    match r.as_str() {
        "index.docker.io" | "registry-1.docker.io" => DEFAULT_REGISTRY.to_owned(),
        _ => r,
    }
}

/// Whether a registry (`host[:port]`) is a loopback address: `localhost`,
/// `127.0.0.0/8`, `[::1]` or an IPv4-mapped loopback. Textual only, no DNS
/// lookup. Docker treats these as insecure registries (plain HTTP allowed).
pub fn is_loopback_registry(registry: &str) -> bool {
    let (host, _) = split_host_port(registry);
    if host.eq_ignore_ascii_case("localhost") {
        return true;
    }
    match host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        Some(inner) => inner.parse::<Ipv6Addr>().is_ok_and(|a| {
            a.is_loopback() || a.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
        }),
        None => host.parse::<Ipv4Addr>().is_ok_and(|a| a.is_loopback()),
    }
}

/// Turns a source registry (`host[:port]`) into one repository path component,
/// used by [`MirrorTarget::map`].
///
/// The rule:
/// - The host is lowercased: `Example.COM` gives `example.com`, and
///   `docker.io` stays `docker.io`.
/// - A `:port` becomes `_port`: `127.0.0.1:5001` gives `127.0.0.1_5001`, and
///   `localhost:5000` gives `localhost_5000`.
/// - A bracketed IPv6 literal becomes its 8 groups, fully expanded, in
///   lowercase hex without leading zeros, joined with `-`. So `[::1]:5000`
///   gives `0-0-0-0-0-0-0-1_5000`, and `[FD00::A:1]` gives
///   `fd00-0-0-0-0-0-a-1`.
///
/// For every registry that [`Reference::parse`] accepts, the result matches
/// Distribution's path-component grammar
/// `[a-z0-9]+(?:(?:[._]|__|[-]*)[a-z0-9]+)*`. Host names never contain `_`,
/// so `_` marks the port unambiguously. The output for other strings is
/// unspecified (no panic); [`MirrorTarget::map`] validates what it builds.
pub fn registry_path_component(registry: &str) -> String {
    let (host, port) = split_host_port(registry);
    let ipv6 = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .and_then(|h| h.parse::<Ipv6Addr>().ok());
    let mut out = match ipv6 {
        Some(addr) => addr
            .segments()
            .iter()
            .map(|group| format!("{group:x}"))
            .collect::<Vec<_>>()
            .join("-"),
        None => host.to_ascii_lowercase(),
    };
    if let Some(port) = port {
        out.push('_');
        out.push_str(port);
    }
    out
}

/// The repository under a target's prefix that holds the usage records of
/// the clusters sharing it. One path component: a mirror path always has
/// two or more (`<registry>/<path>`), so it never names a mirrored image.
pub const USAGE_REPOSITORY: &str = "pinswap-usage";

/// Whether `repository` (without the registry) is a target's usage-record
/// repository, under any prefix.
pub fn is_usage_repository(repository: &str) -> bool {
    repository == USAGE_REPOSITORY
        || repository
            .strip_suffix(USAGE_REPOSITORY)
            .is_some_and(|p| p.ends_with('/'))
}

/// The registry a mirror path component names: the inverse of
/// [`registry_path_component`], `None` when it names none.
pub fn registry_of_path_component(component: &str) -> Option<String> {
    let (host, port) = match component.rsplit_once('_') {
        Some((h, p)) if !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) => (h, Some(p)),
        _ => (component, None),
    };
    let groups: Vec<&str> = host.split('-').collect();
    let host = if groups.len() == 8 && groups.iter().all(|g| u16::from_str_radix(g, 16).is_ok()) {
        format!("[{}]", groups.join(":"))
    } else if host.contains('.') || host == "localhost" {
        host.to_owned()
    } else {
        return None;
    };
    Some(match port {
        Some(p) => format!("{host}:{p}"),
        None => host,
    })
}

// ---------------------------------------------------------------------------
// Mirror targets
// ---------------------------------------------------------------------------

/// Where mirrors go: a registry plus an optional path prefix, written
/// `host[:port][/prefix]`, e.g. `127.0.0.1:5002/mirror` or
/// `mirror.example.com`. [`Display`](fmt::Display) gives that form back, with
/// `index.docker.io` normalised to `docker.io`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct MirrorTarget {
    registry: String,
    prefix: Option<String>,
}

impl MirrorTarget {
    /// Parses `host[:port][/prefix]`. The registry must be explicit: a host
    /// that contains `.` or `:`, or is `localhost`. Unlike in a reference, no
    /// Docker Hub default applies. The prefix is one or more path components.
    ///
    /// # Errors
    ///
    /// With [`Subject::MirrorTarget`]:
    /// [`EmptyReference`](ReferenceError::EmptyReference);
    /// [`UrlScheme`](ReferenceError::UrlScheme) for `https://...`;
    /// [`TargetHasTagOrDigest`](ReferenceError::TargetHasTagOrDigest) for any
    /// `@`, or a `:` after the first `/`;
    /// [`TargetWithoutRegistry`](ReferenceError::TargetWithoutRegistry) when
    /// the first component is not an explicit host;
    /// [`InvalidRegistry`](ReferenceError::InvalidRegistry);
    /// [`Uppercase`](ReferenceError::Uppercase) for an uppercase prefix;
    /// [`EmptyPathComponent`](ReferenceError::EmptyPathComponent) for a
    /// trailing or doubled `/`;
    /// [`InvalidRepository`](ReferenceError::InvalidRepository) for a prefix
    /// component outside the path-component grammar.
    pub fn parse(s: &str) -> Result<MirrorTarget, ReferenceError> {
        let ctx = Ctx {
            subject: Subject::MirrorTarget,
            input: s,
        };
        if s.is_empty() {
            return Err(ReferenceError::EmptyReference {
                subject: ctx.subject,
            });
        }
        if s.contains("://") {
            return Err(ReferenceError::UrlScheme {
                subject: ctx.subject,
                input: ctx.input(),
            });
        }
        let (registry, prefix) = match s.split_once('/') {
            Some((registry, prefix)) => (registry, Some(prefix)),
            None => (s, None),
        };
        if s.contains('@') || prefix.is_some_and(|p| p.contains(':')) {
            return Err(ReferenceError::TargetHasTagOrDigest { input: ctx.input() });
        }
        if !(registry == "localhost" || registry.contains(['.', ':'])) {
            return Err(ReferenceError::TargetWithoutRegistry {
                input: ctx.input(),
                first: registry.to_owned(),
            });
        }
        check_registry(&ctx, registry)?;
        if let Some(prefix) = prefix {
            if prefix.chars().any(char::is_uppercase) {
                return Err(ReferenceError::Uppercase {
                    subject: ctx.subject,
                    input: ctx.input(),
                    repository: prefix.to_owned(),
                });
            }
            // `check_path` reports "" as an empty component, the trailing '/'.
            check_path(&ctx, prefix)?;
        }
        let registry = if registry == LEGACY_DEFAULT_REGISTRY {
            DEFAULT_REGISTRY
        } else {
            registry
        };
        Ok(MirrorTarget {
            registry: registry.to_owned(),
            prefix: prefix.map(str::to_owned),
        })
    }

    /// The target registry, `host[:port]`.
    pub fn registry(&self) -> &str {
        &self.registry
    }

    /// The path prefix under the registry, if any, e.g. `mirror` or `a/b`.
    pub fn prefix(&self) -> Option<&str> {
        self.prefix.as_deref()
    }

    /// The mirror path of `source`:
    /// `<target registry>[/<prefix>]/<registry_path_component(source registry)>/<source repository>`,
    /// with the source's tag and digest (a digest-only source stays
    /// digest-only). For example, with target `127.0.0.1:5002/mirror`,
    /// `docker.io/library/nginx:1.25` maps to
    /// `127.0.0.1:5002/mirror/docker.io/library/nginx:1.25`.
    ///
    /// # Errors
    ///
    /// [`NameTooLong`](ReferenceError::NameTooLong), with
    /// [`Subject::MirrorPath`] and the mapped reference as input, when the
    /// mapped repository is longer than [`REPOSITORY_MAX_LEN`] (255)
    /// characters.
    ///
    /// ```
    /// use pinswap::reference::{MirrorTarget, Reference};
    /// let target = MirrorTarget::parse("mirror.example.com/cache").unwrap();
    /// let src = Reference::parse("127.0.0.1:5001/team/app:v1").unwrap();
    /// assert_eq!(
    ///     target.map(&src).unwrap().to_string(),
    ///     "mirror.example.com/cache/127.0.0.1_5001/team/app:v1"
    /// );
    /// ```
    pub fn map(&self, source: &Reference) -> Result<Reference, ReferenceError> {
        let component = registry_path_component(source.registry());
        let repository = match &self.prefix {
            Some(prefix) => format!("{prefix}/{component}/{}", source.repository()),
            None => format!("{component}/{}", source.repository()),
        };
        let input = render(&self.registry, &repository, source.tag(), source.digest());
        let ctx = Ctx {
            subject: Subject::MirrorPath,
            input: &input,
        };
        let (registry, repository) = check_name(&ctx, &self.registry, &repository)?;
        Ok(Reference::of_parts(
            &registry,
            &repository,
            source.tag(),
            source.digest.clone(),
        ))
    }

    /// The source whose mirror path is `repository` (a repository of this
    /// target, without the registry), untagged: the inverse of
    /// [`map`](Self::map). `None` when `repository` is not under the prefix,
    /// its first component there names no registry, or mapping the source
    /// back gives another name.
    ///
    /// ```
    /// use pinswap::reference::MirrorTarget;
    /// let target = MirrorTarget::parse("mirror.example.com/cache").unwrap();
    /// let src = target.source_of("cache/127.0.0.1_5001/team/app").unwrap();
    /// assert_eq!(src.to_string(), "127.0.0.1:5001/team/app");
    /// assert!(target.source_of("cache/team/app").is_none());
    /// assert!(target.source_of("tools/docker.io/app").is_none());
    /// ```
    pub fn source_of(&self, repository: &str) -> Option<Reference> {
        let rest = match &self.prefix {
            Some(p) => repository.strip_prefix(p.as_str())?.strip_prefix('/')?,
            None => repository,
        };
        let (component, path) = rest.split_once('/')?;
        let source = Reference::parse(&format!(
            "{}/{path}",
            registry_of_path_component(component)?
        ))
        .ok()?
        .without_tag();
        let back = self.map(&source).ok()?;
        (back.repository() == repository).then_some(source)
    }

    /// True when `r` already lives under this target: the same registry
    /// (compared ignoring ASCII case, as host names are) and, when there is a
    /// prefix, a repository that starts with `<prefix>/`. Without a prefix,
    /// every repository on the registry counts. Admission uses this to leave
    /// an already-mirrored image alone.
    pub fn contains(&self, r: &Reference) -> bool {
        if !self.registry.eq_ignore_ascii_case(r.registry()) {
            return false;
        }
        match &self.prefix {
            None => true,
            Some(prefix) => r
                .repository()
                .strip_prefix(prefix.as_str())
                .is_some_and(|rest| rest.starts_with('/')),
        }
    }
}

impl fmt::Display for MirrorTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.registry)?;
        if let Some(prefix) = &self.prefix {
            write!(f, "/{prefix}")?;
        }
        Ok(())
    }
}

impl FromStr for MirrorTarget {
    type Err = ReferenceError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        MirrorTarget::parse(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mirror_path_components_name_their_registry() {
        for r in [
            "docker.io",
            "127.0.0.1:5001",
            "localhost:5000",
            "[fd00::a:1]:443",
        ] {
            let c = registry_path_component(r);
            let back = registry_of_path_component(&c).unwrap();
            assert_eq!(registry_path_component(&back), c, "{r}");
        }
        assert_eq!(registry_of_path_component("team"), None);
    }

    const H64: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    fn h128() -> String {
        H64.repeat(2)
    }

    fn sha256() -> String {
        format!("sha256:{H64}")
    }

    fn sha512() -> String {
        format!("sha512:{}", h128())
    }

    fn parse(s: &str) -> Reference {
        Reference::parse(s).unwrap_or_else(|e| panic!("{s:?} should parse: {e}"))
    }

    fn parse_err(s: &str) -> String {
        match Reference::parse(s) {
            Ok(r) => panic!("{s:?} should be rejected, got {r}"),
            Err(e) => e.to_string(),
        }
    }

    /// Expected outcome: the normalised `Display`, or the exact error message.
    type Case = (String, Result<String, String>);

    fn ok(input: impl Into<String>, display: impl Into<String>) -> Case {
        (input.into(), Ok(display.into()))
    }

    fn bad(input: impl Into<String>, message: impl Into<String>) -> Case {
        (input.into(), Err(message.into()))
    }

    fn valid_cases() -> Vec<Case> {
        let d = sha256();
        vec![
            ok("nginx", "docker.io/library/nginx:latest"),
            ok("library/nginx", "docker.io/library/nginx:latest"),
            ok("docker.io/nginx", "docker.io/library/nginx:latest"),
            ok("docker.io/library/nginx", "docker.io/library/nginx:latest"),
            ok(
                "index.docker.io/library/nginx",
                "docker.io/library/nginx:latest",
            ),
            ok("index.docker.io/nginx", "docker.io/library/nginx:latest"),
            ok(
                "docker.io/library/nginx:latest",
                "docker.io/library/nginx:latest",
            ),
            ok("nginx:1.25", "docker.io/library/nginx:1.25"),
            ok("bitnami/redis:7.2", "docker.io/bitnami/redis:7.2"),
            ok("docker.io/library", "docker.io/library/library:latest"),
            ok("localhost/x", "localhost/x:latest"),
            ok("localhost:5000/x", "localhost:5000/x:latest"),
            // As in Docker: with no '/', "localhost:5000" is image "localhost", tag "5000".
            ok("localhost:5000", "docker.io/library/localhost:5000"),
            ok("127.0.0.1:5001/a/b:t", "127.0.0.1:5001/a/b:t"),
            ok("[::1]:5000/x", "[::1]:5000/x:latest"),
            ok("[::1]/x:t", "[::1]/x:t"),
            ok(
                "[fd00:dead:beef::1]:443/team/app:v1",
                "[fd00:dead:beef::1]:443/team/app:v1",
            ),
            ok(format!("nginx@{d}"), format!("docker.io/library/nginx@{d}")),
            ok(
                format!("nginx:1.25@{d}"),
                format!("docker.io/library/nginx:1.25@{d}"),
            ),
            ok(format!("[::1]:5000/x:t@{d}"), format!("[::1]:5000/x:t@{d}")),
            ok(
                format!("ghcr.io/org/app@{}", sha512()),
                format!("ghcr.io/org/app@{}", sha512()),
            ),
            // Uppercase is fine in a registry, and kept as written.
            ok("Example.COM/foo", "Example.COM/foo:latest"),
            // Docker: an uppercase first component must be a host.
            ok("Foo/bar", "Foo/bar:latest"),
            ok("my-registry:5000/x", "my-registry:5000/x:latest"),
            ok(
                "registry.example.com:5000/a/b/c:v1.2.3-rc_1",
                "registry.example.com:5000/a/b/c:v1.2.3-rc_1",
            ),
            ok("quay.io/a__b/c-d/e.f:x", "quay.io/a__b/c-d/e.f:x"),
            ok("a--b/c", "docker.io/a--b/c:latest"),
            ok(
                "gcr.io/distroless/static:nonroot",
                "gcr.io/distroless/static:nonroot",
            ),
            ok("x:_under", "docker.io/library/x:_under"),
            ok("x:UPPER.Tag-1", "docker.io/library/x:UPPER.Tag-1"),
            ok("org/a.b_c__d---e9", "docker.io/org/a.b_c__d---e9:latest"),
            ok(
                format!("x:{}", "t".repeat(128)),
                format!("docker.io/library/x:{}", "t".repeat(128)),
            ),
            ok(
                format!("example.com/{}", "a".repeat(255)),
                format!("example.com/{}:latest", "a".repeat(255)),
            ),
            // 8 ("library/") + 247 = 255.
            ok(
                "a".repeat(247),
                format!("docker.io/library/{}:latest", "a".repeat(247)),
            ),
            // Docker reads "sha256" as a name and the hex as its tag.
            ok(
                format!("sha256:{H64}"),
                format!("docker.io/library/sha256:{H64}"),
            ),
        ]
    }

    fn malformed_cases() -> Vec<Case> {
        let tag_rule = "must match [A-Za-z0-9_][A-Za-z0-9._-]{0,127}";
        let path_rule = "must match [a-z0-9]+(?:(?:[._]|__|[-]*)[a-z0-9]+)*";
        let host_rule = "is not a valid host: expected dot-separated labels of letters, digits \
                         and '-' that start and end with a letter or digit, optionally followed \
                         by :port";
        let port_rule = "has an invalid port: expected ':' followed by one or more digits";
        let ipv6_rule =
            "is not a valid bracketed IPv6 literal (expected e.g. [::1] or [fd00::1]:5000)";
        let long = "t".repeat(129);
        let upper_hex = H64.to_uppercase();
        let r256 = "a".repeat(256);
        let r248 = "a".repeat(248);
        vec![
            bad("", r#"invalid reference "": empty reference"#),
            bad(
                "Nginx",
                r#"invalid reference "Nginx": repository name must be lowercase ("Nginx")"#,
            ),
            bad(
                "docker.io/Foo/bar",
                r#"invalid reference "docker.io/Foo/bar": repository name must be lowercase ("Foo/bar")"#,
            ),
            bad(
                "a/B:t",
                r#"invalid reference "a/B:t": repository name must be lowercase ("a/B")"#,
            ),
            bad(
                "example.com/Foo",
                r#"invalid reference "example.com/Foo": repository name must be lowercase ("Foo")"#,
            ),
            bad(
                "nginx:",
                r#"invalid reference "nginx:": empty tag after ':'"#,
            ),
            bad(
                "x:-bad",
                format!(r#"invalid reference "x:-bad": tag "-bad" {tag_rule}"#),
            ),
            bad(
                "x:.bad",
                format!(r#"invalid reference "x:.bad": tag ".bad" {tag_rule}"#),
            ),
            bad(
                "x:a+b",
                format!(r#"invalid reference "x:a+b": tag "a+b" {tag_rule}"#),
            ),
            bad(
                format!("x:{long}"),
                format!(r#"invalid reference "x:{long}": tag "{long}" {tag_rule}"#),
            ),
            bad(
                "x@sha256:abc",
                r#"invalid reference "x@sha256:abc": digest "sha256:abc" must have 64 lowercase hex characters"#,
            ),
            bad(
                format!("x@sha256:{upper_hex}"),
                format!(
                    r#"invalid reference "x@sha256:{upper_hex}": digest "sha256:{upper_hex}" must have 64 lowercase hex characters"#
                ),
            ),
            bad(
                format!("x@sha512:{H64}"),
                format!(
                    r#"invalid reference "x@sha512:{H64}": digest "sha512:{H64}" must have 128 lowercase hex characters"#
                ),
            ),
            bad(
                "x@md5:d41d8cd98f00b204e9800998ecf8427e",
                r#"invalid reference "x@md5:d41d8cd98f00b204e9800998ecf8427e": unsupported digest algorithm "md5" (expected sha256 or sha512)"#,
            ),
            bad(
                format!("x@sha384:{H64}"),
                format!(
                    r#"invalid reference "x@sha384:{H64}": unsupported digest algorithm "sha384" (expected sha256 or sha512)"#
                ),
            ),
            bad(
                format!("x@SHA256:{H64}"),
                format!(
                    r#"invalid reference "x@SHA256:{H64}": unsupported digest algorithm "SHA256" (expected sha256 or sha512)"#
                ),
            ),
            bad("x@", r#"invalid reference "x@": empty digest after '@'"#),
            bad(
                "x@abc",
                r#"invalid reference "x@abc": digest "abc" must have the form algorithm:hex, e.g. sha256:<64 lowercase hex characters>"#,
            ),
            bad(
                format!("x@:{H64}"),
                format!(
                    r#"invalid reference "x@:{H64}": digest ":{H64}" must have the form algorithm:hex, e.g. sha256:<64 lowercase hex characters>"#
                ),
            ),
            bad(
                "x:t@sha256:abc",
                r#"invalid reference "x:t@sha256:abc": digest "sha256:abc" must have 64 lowercase hex characters"#,
            ),
            bad(
                H64,
                format!(
                    r#"invalid reference "{H64}": cannot specify 64-byte hexadecimal strings (an image ID is not a reference; write <repository>@sha256:<hex>)"#
                ),
            ),
            bad(
                "/nginx",
                r#"invalid reference "/nginx": path "/nginx" has an empty component (leading, trailing or doubled '/')"#,
            ),
            bad(
                "nginx/",
                r#"invalid reference "nginx/": path "nginx/" has an empty component (leading, trailing or doubled '/')"#,
            ),
            bad(
                "a//b",
                r#"invalid reference "a//b": path "a//b" has an empty component (leading, trailing or doubled '/')"#,
            ),
            bad(
                "example.com//a",
                r#"invalid reference "example.com//a": path "/a" has an empty component (leading, trailing or doubled '/')"#,
            ),
            bad(
                "example.com/",
                r#"invalid reference "example.com/": repository name is missing (expected [registry/]repository[:tag][@digest])"#,
            ),
            bad(
                ":tag",
                r#"invalid reference ":tag": repository name is missing (expected [registry/]repository[:tag][@digest])"#,
            ),
            bad(
                "a..b",
                format!(r#"invalid reference "a..b": path component "a..b" in "a..b" {path_rule}"#),
            ),
            bad(
                "-a",
                format!(r#"invalid reference "-a": path component "-a" in "-a" {path_rule}"#),
            ),
            bad(
                "a-",
                format!(r#"invalid reference "a-": path component "a-" in "a-" {path_rule}"#),
            ),
            bad(
                "org/a___b",
                format!(
                    r#"invalid reference "org/a___b": path component "a___b" in "org/a___b" {path_rule}"#
                ),
            ),
            bad(
                "a.-b",
                format!(r#"invalid reference "a.-b": path component "a.-b" in "a.-b" {path_rule}"#),
            ),
            bad(
                "a$b",
                format!(r#"invalid reference "a$b": path component "a$b" in "a$b" {path_rule}"#),
            ),
            bad(
                " nginx",
                format!(
                    r#"invalid reference " nginx": path component " nginx" in " nginx" {path_rule}"#
                ),
            ),
            bad(
                "exa_mple.com/x",
                format!(
                    r#"invalid reference "exa_mple.com/x": registry "exa_mple.com" {host_rule}"#
                ),
            ),
            bad(
                "-example.com/x",
                format!(
                    r#"invalid reference "-example.com/x": registry "-example.com" {host_rule}"#
                ),
            ),
            bad(
                "example..com/x",
                format!(
                    r#"invalid reference "example..com/x": registry "example..com" {host_rule}"#
                ),
            ),
            bad(
                "example.com:/x",
                format!(
                    r#"invalid reference "example.com:/x": registry "example.com:" {port_rule}"#
                ),
            ),
            bad(
                "example.com:http/x",
                format!(
                    r#"invalid reference "example.com:http/x": registry "example.com:http" {port_rule}"#
                ),
            ),
            bad(
                "[::1/x",
                format!(r#"invalid reference "[::1/x": registry "[::1" {ipv6_rule}"#),
            ),
            bad(
                "[::g]:5000/x",
                format!(r#"invalid reference "[::g]:5000/x": registry "[::g]:5000" {ipv6_rule}"#),
            ),
            bad(
                "[1:2:3]/x",
                format!(r#"invalid reference "[1:2:3]/x": registry "[1:2:3]" {ipv6_rule}"#),
            ),
            bad(
                "[::1]:/x",
                format!(r#"invalid reference "[::1]:/x": registry "[::1]:" {port_rule}"#),
            ),
            bad(
                "https://example.com/x",
                r#"invalid reference "https://example.com/x": a URL scheme is not allowed (write host[:port]/path, not scheme://host)"#,
            ),
            bad(
                format!("example.com/{r256}"),
                format!(
                    r#"invalid reference "example.com/{r256}": repository name "{r256}" is 256 characters long, more than the 255 allowed"#
                ),
            ),
            bad(
                r248.clone(),
                format!(
                    r#"invalid reference "{r248}": repository name "library/{r248}" is 256 characters long, more than the 255 allowed"#
                ),
            ),
            bad(
                "a\"b",
                format!(r#"invalid reference "a\"b": path component "a\"b" in "a\"b" {path_rule}"#),
            ),
        ]
    }

    #[test]
    fn parse_table() {
        let cases: Vec<Case> = valid_cases().into_iter().chain(malformed_cases()).collect();
        assert!(cases.len() >= 40, "only {} cases", cases.len());
        let mut failures = Vec::new();
        for (input, expected) in &cases {
            let got = Reference::parse(input)
                .map(|r| r.to_string())
                .map_err(|e| e.to_string());
            if &got != expected {
                failures.push(format!(
                    "input {input:?}\n  expected {expected:?}\n  got      {got:?}"
                ));
            }
        }
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    }

    #[test]
    fn display_round_trips() {
        for (input, _) in valid_cases() {
            let r = parse(&input);
            let again = parse(&r.to_string());
            assert_eq!(again, r, "{input:?}");
            assert_eq!(again.to_string(), r.to_string());
            let via_from_str: Reference = r.to_string().parse().unwrap();
            assert_eq!(via_from_str, r);
        }
    }

    #[test]
    fn normalisation_parts() {
        let d = Digest::parse(&sha256()).unwrap();
        // (input, registry, repository, tag, digest)
        type Parts<'a> = (
            String,
            &'a str,
            &'a str,
            Option<&'a str>,
            Option<&'a Digest>,
        );
        let cases: Vec<Parts<'_>> = vec![
            (
                "nginx".into(),
                "docker.io",
                "library/nginx",
                Some("latest"),
                None,
            ),
            (
                "index.docker.io/library/nginx".into(),
                "docker.io",
                "library/nginx",
                Some("latest"),
                None,
            ),
            ("localhost/x".into(), "localhost", "x", Some("latest"), None),
            (
                "localhost:5000/x".into(),
                "localhost:5000",
                "x",
                Some("latest"),
                None,
            ),
            (
                "127.0.0.1:5001/a/b:t".into(),
                "127.0.0.1:5001",
                "a/b",
                Some("t"),
                None,
            ),
            (
                "[::1]:5000/x".into(),
                "[::1]:5000",
                "x",
                Some("latest"),
                None,
            ),
            (
                format!("nginx@{d}"),
                "docker.io",
                "library/nginx",
                None,
                Some(&d),
            ),
            (
                format!("x:t@{d}"),
                "docker.io",
                "library/x",
                Some("t"),
                Some(&d),
            ),
            (
                "Example.COM/foo".into(),
                "Example.COM",
                "foo",
                Some("latest"),
                None,
            ),
        ];
        for (input, registry, repository, tag, digest) in cases {
            let r = parse(&input);
            assert_eq!(r.registry(), registry, "{input}");
            assert_eq!(r.repository(), repository, "{input}");
            assert_eq!(r.tag(), tag, "{input}");
            assert_eq!(r.digest(), digest, "{input}");
            assert_eq!(r.name(), format!("{registry}/{repository}"));
            // The same parts, however the reference was made.
            let again = Reference::new(registry, repository, tag, digest.cloned()).unwrap();
            assert_eq!(again, r, "{input}");
            let bare = r.without_tag().without_digest();
            assert_eq!((bare.repository(), bare.tag()), (repository, None));
            assert_eq!(bare.with_tag("t").unwrap().tag(), Some("t"));
        }
        // One allocation for the name, one for a digest: a leader holds
        // one for every image each Pod names.
        assert!(std::mem::size_of::<Reference>() <= 56);
        let r = parse(&format!("ghcr.io/o/a@{}", sha512()));
        assert_eq!(r.digest().unwrap().algorithm(), DigestAlgorithm::Sha512);
        assert_eq!(r.tag(), None);
    }

    #[test]
    fn digest_parts_and_errors() {
        let d = Digest::parse(&sha256()).unwrap();
        assert_eq!(d.algorithm(), DigestAlgorithm::Sha256);
        assert_eq!(d.hex(), H64);
        assert_eq!(d.as_str(), sha256());
        assert_eq!(d.to_string(), sha256());
        assert_eq!(sha256().parse::<Digest>().unwrap(), d);

        let d512 = Digest::parse(&sha512()).unwrap();
        assert_eq!(d512.algorithm(), DigestAlgorithm::Sha512);
        assert_eq!(d512.hex(), h128());
        assert_eq!(d512.algorithm().hex_len(), 128);
        assert_eq!(d.algorithm().hex_len(), 64);
        assert_eq!(DigestAlgorithm::Sha512.as_str(), "sha512");
        assert!(d < d512, "digests order by their string");

        let cases = [
            ("", r#"invalid digest "": empty digest"#.to_owned()),
            (
                "sha256:abc",
                r#"invalid digest "sha256:abc": digest "sha256:abc" must have 64 lowercase hex characters"#
                    .to_owned(),
            ),
            (
                "md5:abc",
                r#"invalid digest "md5:abc": unsupported digest algorithm "md5" (expected sha256 or sha512)"#
                    .to_owned(),
            ),
            (
                "nocolon",
                r#"invalid digest "nocolon": digest "nocolon" must have the form algorithm:hex, e.g. sha256:<64 lowercase hex characters>"#
                    .to_owned(),
            ),
        ];
        for (input, message) in cases {
            assert_eq!(Digest::parse(input).unwrap_err().to_string(), message);
        }
        // The hex must be exact: one character too many is rejected.
        assert!(Digest::parse(&format!("{}0", sha256())).is_err());
        assert_eq!(
            Digest::parse("x").unwrap_err(),
            ReferenceError::MalformedDigest {
                subject: Subject::Digest,
                input: "x".into(),
                digest: "x".into(),
            }
        );
    }

    #[test]
    fn error_variants() {
        assert_eq!(
            Reference::parse("").unwrap_err(),
            ReferenceError::EmptyReference {
                subject: Subject::Reference
            }
        );
        assert!(matches!(
            Reference::parse("Nginx"),
            Err(ReferenceError::Uppercase { .. })
        ));
        assert!(matches!(
            Reference::parse("x:-a"),
            Err(ReferenceError::InvalidTag { .. })
        ));
        assert!(matches!(
            Reference::parse(&"a".repeat(300)),
            Err(ReferenceError::NameTooLong { len: 308, .. })
        ));
        assert!(matches!(
            Reference::parse("a_b.com/x"),
            Err(ReferenceError::InvalidRegistry { .. })
        ));
    }

    #[test]
    fn new_validates_and_normalises() {
        let d = Digest::parse(&sha256()).unwrap();
        let r = Reference::new("index.docker.io", "nginx", Some("1"), None).unwrap();
        assert_eq!(r.to_string(), "docker.io/library/nginx:1");
        assert_eq!(r, parse("nginx:1"));

        let r = Reference::new("127.0.0.1:5000", "a/b", None, Some(d.clone())).unwrap();
        assert_eq!(r.to_string(), format!("127.0.0.1:5000/a/b@{d}"));

        let r = Reference::new("localhost", "x", None, None).unwrap();
        assert_eq!(r.tag(), None);
        assert_eq!(r.digest(), None);
        assert_eq!(r.to_string(), "localhost/x");

        let err = |registry, repository, tag| {
            Reference::new(registry, repository, tag, None)
                .unwrap_err()
                .to_string()
        };
        assert_eq!(
            err("library", "nginx", None),
            r#"invalid reference "library/nginx": registry "library" would be read as a Docker Hub namespace: a registry must contain '.' or ':', or be "localhost""#
        );
        assert_eq!(
            err("", "nginx", None),
            r#"invalid reference "/nginx": registry "" is empty (expected host[:port])"#
        );
        assert_eq!(
            err("example.com", "Bad", None),
            r#"invalid reference "example.com/Bad": repository name must be lowercase ("Bad")"#
        );
        assert_eq!(
            err("example.com", "a", Some("")),
            r#"invalid reference "example.com/a:": empty tag after ':'"#
        );
        assert_eq!(
            err("example.com", "", None),
            r#"invalid reference "example.com/": repository name is missing (expected [registry/]repository[:tag][@digest])"#
        );
    }

    #[test]
    fn with_and_without() {
        let d = Digest::parse(&sha256()).unwrap();
        let r = parse("nginx:1.25");
        let pinned = r.with_digest(d.clone());
        assert_eq!(
            pinned.to_string(),
            format!("docker.io/library/nginx:1.25@{d}")
        );
        assert_eq!(
            pinned.without_tag().to_string(),
            format!("docker.io/library/nginx@{d}")
        );
        assert_eq!(pinned.without_digest(), r);
        assert_eq!(
            pinned.with_tag("1.26").unwrap().to_string(),
            format!("docker.io/library/nginx:1.26@{d}")
        );
        assert_eq!(
            r.without_tag().without_digest().to_string(),
            "docker.io/library/nginx"
        );
        assert_eq!(
            pinned.with_tag("-x").unwrap_err().to_string(),
            format!(
                r#"invalid reference "docker.io/library/nginx:-x@{d}": tag "-x" must match [A-Za-z0-9_][A-Za-z0-9._-]{{0,127}}"#
            )
        );
        assert_eq!(
            pinned.with_digest(Digest::parse(&sha512()).unwrap()).tag(),
            Some("1.25")
        );
    }

    #[test]
    fn to_oci_whole() {
        let d = sha256();
        let cases = [
            (
                "nginx".to_owned(),
                "docker.io/library/nginx:latest".to_owned(),
            ),
            (
                format!("127.0.0.1:5000/a/b@{d}"),
                format!("127.0.0.1:5000/a/b@{d}"),
            ),
            (format!("[::1]:5000/x:t@{d}"), format!("[::1]:5000/x:t@{d}")),
        ];
        for (input, whole) in cases {
            let r = parse(&input);
            let oci = r.to_oci();
            assert_eq!(oci.whole(), whole);
            assert_eq!(oci.registry(), r.registry());
            assert_eq!(oci.repository(), r.repository());
            assert_eq!(oci.tag(), r.tag());
            assert_eq!(oci.digest(), r.digest().map(Digest::as_str));
        }
        // Neither tag nor digest: oci-client's reference gets `latest`.
        let bare = parse("localhost:5000/x").without_tag();
        assert_eq!(bare.to_oci().whole(), "localhost:5000/x:latest");
        // oci-client parses our Display back to the same parts.
        let r = parse(&format!("ghcr.io/o/a:v1@{d}"));
        let reparsed: oci_client::Reference = r.to_string().parse().unwrap();
        assert_eq!(reparsed, r.to_oci());
    }

    #[test]
    fn loopback() {
        let cases = [
            ("localhost/x", true),
            ("LOCALHOST:5000/x", true),
            ("127.0.0.1/x", true),
            ("127.255.0.9:80/x", true),
            ("[::1]/x", true),
            ("[::1]:5000/x", true),
            ("[0:0:0:0:0:0:0:1]:5000/x", true),
            ("[::ffff:7f00:1]/x", true),
            ("nginx", false),
            ("128.0.0.1/x", false),
            ("10.0.0.1:5000/x", false),
            ("[::2]/x", false),
            ("localhost.example.com/x", false),
            ("127.0.0.1.nip.io/x", false),
        ];
        for (input, expected) in cases {
            assert_eq!(parse(input).is_loopback(), expected, "{input}");
        }
    }

    /// An independent check of Distribution's path-component grammar: split
    /// into runs of `[a-z0-9]` and of other characters, then require that the
    /// string starts and ends with a run of alphanumerics and that every other
    /// run is `.`, `_`, `__` or `-+`.
    fn grammar_path_component(s: &str) -> bool {
        let alnum = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit();
        let mut runs: Vec<(bool, String)> = Vec::new();
        for c in s.chars() {
            match runs.last_mut() {
                Some((is_alnum, run)) if *is_alnum == alnum(c) => run.push(c),
                _ => runs.push((alnum(c), c.to_string())),
            }
        }
        let (Some(first), Some(last)) = (runs.first(), runs.last()) else {
            return false;
        };
        first.0
            && last.0
            && runs.iter().filter(|(a, _)| !a).all(|(_, sep)| {
                sep == "." || sep == "_" || sep == "__" || sep.chars().all(|c| c == '-')
            })
    }

    #[test]
    fn path_component_scanner_agrees_with_grammar() {
        let samples = [
            "a", "a1", "a.b", "a_b", "a__b", "a___b", "a-b", "a---b", "a.-b", "a-.b", "a..b", ".a",
            "a.", "_a", "a_", "-a", "a-", "", "A", "a b", "a/b", "0", "1.2.3", "a_b-c.d",
        ];
        for s in samples {
            assert_eq!(is_path_component(s), grammar_path_component(s), "{s:?}");
        }
    }

    #[test]
    fn registry_path_components() {
        let cases = [
            ("docker.io", "docker.io"),
            ("127.0.0.1:5001", "127.0.0.1_5001"),
            ("localhost:5000", "localhost_5000"),
            ("localhost", "localhost"),
            ("[::1]:5000", "0-0-0-0-0-0-0-1_5000"),
            ("[::1]", "0-0-0-0-0-0-0-1"),
            ("[FD00::A:1]", "fd00-0-0-0-0-0-a-1"),
            ("[2001:db8:0:0:0:0:2:1]:443", "2001-db8-0-0-0-0-2-1_443"),
            ("Example.COM", "example.com"),
            (
                "my-registry.example.com:5000",
                "my-registry.example.com_5000",
            ),
            ("a--b.io", "a--b.io"),
            ("Foo", "foo"),
        ];
        for (registry, expected) in cases {
            // Every case is a registry that references accept.
            let r = parse(&format!("{registry}/x:t"));
            assert_eq!(r.registry(), registry);
            let got = registry_path_component(registry);
            assert_eq!(got, expected, "{registry}");
            assert!(
                grammar_path_component(&got),
                "{got:?} is not a path component"
            );
            assert!(is_path_component(&got), "{got:?}");
        }
    }

    fn target(s: &str) -> MirrorTarget {
        MirrorTarget::parse(s).unwrap_or_else(|e| panic!("{s:?} should parse: {e}"))
    }

    #[test]
    fn mirror_target_parse() {
        let valid = [
            ("mirror.example.com", "mirror.example.com", None),
            ("127.0.0.1:5002/mirror", "127.0.0.1:5002", Some("mirror")),
            ("localhost", "localhost", None),
            ("localhost:5000", "localhost:5000", None),
            ("[::1]:5000/m/n", "[::1]:5000", Some("m/n")),
            ("index.docker.io/myorg", "docker.io", Some("myorg")),
            (
                "Mirror.Example.com/a-b/c_d",
                "Mirror.Example.com",
                Some("a-b/c_d"),
            ),
        ];
        for (input, registry, prefix) in valid {
            let t = target(input);
            assert_eq!(t.registry(), registry, "{input}");
            assert_eq!(t.prefix(), prefix, "{input}");
            let display = t.to_string();
            assert_eq!(display.parse::<MirrorTarget>().unwrap(), t);
        }
        assert_eq!(
            target("index.docker.io/myorg").to_string(),
            "docker.io/myorg"
        );
        assert_eq!(
            target("127.0.0.1:5002/mirror").to_string(),
            "127.0.0.1:5002/mirror"
        );

        let d = sha256();
        let malformed = [
            ("".to_owned(), r#"invalid mirror target "": empty mirror target"#.to_owned()),
            (
                "mirror".to_owned(),
                r#"invalid mirror target "mirror": "mirror" is not a registry host; a mirror target starts with a host that contains '.' or ':', or is localhost (e.g. mirror.example.com/prefix or 127.0.0.1:5000)"#.to_owned(),
            ),
            (
                "mirror/prefix".to_owned(),
                r#"invalid mirror target "mirror/prefix": "mirror" is not a registry host; a mirror target starts with a host that contains '.' or ':', or is localhost (e.g. mirror.example.com/prefix or 127.0.0.1:5000)"#.to_owned(),
            ),
            (
                "mirror.example.com/p:v1".to_owned(),
                r#"invalid mirror target "mirror.example.com/p:v1": a mirror target is host[:port][/prefix] and must not have a tag or digest"#.to_owned(),
            ),
            (
                format!("mirror.example.com/p@{d}"),
                format!(
                    r#"invalid mirror target "mirror.example.com/p@{d}": a mirror target is host[:port][/prefix] and must not have a tag or digest"#
                ),
            ),
            (
                "mirror.example.com/P".to_owned(),
                r#"invalid mirror target "mirror.example.com/P": repository name must be lowercase ("P")"#.to_owned(),
            ),
            (
                "mirror.example.com/".to_owned(),
                r#"invalid mirror target "mirror.example.com/": path "" has an empty component (leading, trailing or doubled '/')"#.to_owned(),
            ),
            (
                "mirror.example.com//p".to_owned(),
                r#"invalid mirror target "mirror.example.com//p": path "/p" has an empty component (leading, trailing or doubled '/')"#.to_owned(),
            ),
            (
                "mirror.example.com/a..b".to_owned(),
                r#"invalid mirror target "mirror.example.com/a..b": path component "a..b" in "a..b" must match [a-z0-9]+(?:(?:[._]|__|[-]*)[a-z0-9]+)*"#.to_owned(),
            ),
            (
                "https://mirror.example.com".to_owned(),
                r#"invalid mirror target "https://mirror.example.com": a URL scheme is not allowed (write host[:port]/path, not scheme://host)"#.to_owned(),
            ),
            (
                "mirror.example.com:abc".to_owned(),
                r#"invalid mirror target "mirror.example.com:abc": registry "mirror.example.com:abc" has an invalid port: expected ':' followed by one or more digits"#.to_owned(),
            ),
        ];
        for (input, message) in malformed {
            assert_eq!(
                MirrorTarget::parse(&input).unwrap_err().to_string(),
                message,
                "{input:?}"
            );
        }
    }

    #[test]
    fn mirror_map() {
        let d = sha256();
        // (target, source, mapped)
        let cases = [
            (
                "mirror.example.com",
                "nginx".to_owned(),
                "mirror.example.com/docker.io/library/nginx:latest".to_owned(),
            ),
            (
                "127.0.0.1:5002/mirror",
                "nginx:1.25".to_owned(),
                "127.0.0.1:5002/mirror/docker.io/library/nginx:1.25".to_owned(),
            ),
            (
                "127.0.0.1:5002/mirror",
                "127.0.0.1:5001/a/b:t".to_owned(),
                "127.0.0.1:5002/mirror/127.0.0.1_5001/a/b:t".to_owned(),
            ),
            (
                "127.0.0.1:5002/mirror",
                "localhost:5000/x".to_owned(),
                "127.0.0.1:5002/mirror/localhost_5000/x:latest".to_owned(),
            ),
            (
                "mirror.example.com/a/b",
                format!("[::1]:5000/x:t@{d}"),
                format!("mirror.example.com/a/b/0-0-0-0-0-0-0-1_5000/x:t@{d}"),
            ),
            (
                "mirror.example.com",
                format!("nginx@{d}"),
                format!("mirror.example.com/docker.io/library/nginx@{d}"),
            ),
            (
                "[::1]:5000",
                "Example.COM/foo:v1".to_owned(),
                "[::1]:5000/example.com/foo:v1".to_owned(),
            ),
            (
                "index.docker.io/myorg",
                "quay.io/a/b:c".to_owned(),
                "docker.io/myorg/quay.io/a/b:c".to_owned(),
            ),
        ];
        for (t, source, expected) in cases {
            let t = target(t);
            let source = parse(&source);
            let mapped = t.map(&source).unwrap();
            assert_eq!(mapped.to_string(), expected);
            assert_eq!(mapped.tag(), source.tag());
            assert_eq!(mapped.digest(), source.digest());
            assert!(t.contains(&mapped), "{t} should contain {mapped}");
            assert_eq!(parse(&mapped.to_string()), mapped, "mapped form re-parses");
        }

        // Digest-only sources stay digest-only.
        let mapped = target("mirror.example.com")
            .map(&parse(&format!("nginx@{d}")))
            .unwrap();
        assert_eq!(mapped.tag(), None);

        // 255 characters fit; 256 do not.
        let t = target("mirror.example.com/m"); // adds "m/example.com/" = 14 characters
        let fits = parse(&format!("example.com/{}", "a".repeat(241)));
        assert_eq!(t.map(&fits).unwrap().repository().len(), 255);
        let repo = "a".repeat(242);
        let too_long = parse(&format!("example.com/{repo}:t"));
        assert_eq!(
            t.map(&too_long).unwrap_err().to_string(),
            format!(
                r#"invalid mirror path "mirror.example.com/m/example.com/{repo}:t": repository name "m/example.com/{repo}" is 256 characters long, more than the 255 allowed"#
            )
        );
        assert!(matches!(
            t.map(&too_long),
            Err(ReferenceError::NameTooLong {
                subject: Subject::MirrorPath,
                len: 256,
                ..
            })
        ));
    }

    #[test]
    fn mirror_contains() {
        let with_prefix = target("127.0.0.1:5002/mirror");
        let no_prefix = target("mirror.example.com");
        let cases = [
            (
                &with_prefix,
                "127.0.0.1:5002/mirror/docker.io/library/nginx:1",
                true,
            ),
            (&with_prefix, "127.0.0.1:5002/mirror/x", true),
            (&with_prefix, "127.0.0.1:5002/mirror", false),
            (&with_prefix, "127.0.0.1:5002/mirrors/x", false),
            (&with_prefix, "127.0.0.1:5002/other/mirror/x", false),
            (&with_prefix, "127.0.0.1:5003/mirror/x", false),
            (&with_prefix, "127.0.0.1/mirror/x", false),
            (&with_prefix, "nginx", false),
            (&no_prefix, "mirror.example.com/anything/at/all:t", true),
            (&no_prefix, "MIRROR.example.com/x", true),
            (&no_prefix, "mirror.example.com:443/x", false),
            (&no_prefix, "other.example.com/x", false),
            (&no_prefix, "docker.io/library/nginx", false),
        ];
        for (t, input, expected) in cases {
            assert_eq!(t.contains(&parse(input)), expected, "{t} contains {input}?");
        }
        // Mapping then checking is idempotent: the mapped image is recognised.
        let mapped = with_prefix.map(&parse("nginx")).unwrap();
        assert!(with_prefix.contains(&mapped));
    }

    #[test]
    fn subject_display() {
        assert_eq!(Subject::Reference.to_string(), "reference");
        assert_eq!(Subject::Digest.to_string(), "digest");
        assert_eq!(Subject::MirrorTarget.to_string(), "mirror target");
        assert_eq!(Subject::MirrorPath.to_string(), "mirror path");
    }

    #[test]
    fn helpers_work_on_bad_input_without_panicking() {
        let _ = parse_err("[");
        let _ = parse_err("[]");
        let _ = parse_err("@");
        let _ = parse_err(":");
        let _ = parse_err("/");
        let _ = registry_path_component("[");
        let _ = registry_path_component("");
        let _ = registry_path_component("[::1");
        assert_eq!(registry_path_component(DEFAULT_REGISTRY), "docker.io");
        assert_eq!(DEFAULT_TAG, "latest");
    }
}
