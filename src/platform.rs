//! Platforms: an index entry's (image-spec §image index) and the
//! `os/arch[/variant]` filters of `platforms` and `--platform`. A leaf, so
//! that the config and the registry code both use it without importing
//! each other.

use serde::Deserialize;

/// An index entry's platform (image-spec §image index).
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
pub struct Platform {
    /// e.g. `amd64`.
    pub architecture: String,
    /// e.g. `linux`.
    pub os: String,
    /// e.g. `v8`.
    #[serde(default)]
    pub variant: Option<String>,
}

/// A platform filter that is not `os/arch[/variant]`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid platform {0:?}: expected os/arch[/variant], e.g. linux/arm64/v8")]
pub struct PlatformError(pub String);

/// A platform filter entry, `os/arch[/variant]` as in `--platform`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlatformSpec {
    /// e.g. `linux`.
    pub os: String,
    /// e.g. `arm64`.
    pub architecture: String,
    /// e.g. `v8`; `None` matches any variant.
    pub variant: Option<String>,
}

impl std::str::FromStr for PlatformSpec {
    type Err = PlatformError;
    fn from_str(s: &str) -> Result<Self, PlatformError> {
        let parts: Vec<&str> = s.split('/').collect();
        let ok = |p: &str| {
            !p.is_empty()
                && p.chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.')
        };
        match parts.as_slice() {
            [os, arch] if ok(os) && ok(arch) => Ok(Self {
                os: os.to_string(),
                architecture: arch.to_string(),
                variant: None,
            }),
            [os, arch, v] if ok(os) && ok(arch) && ok(v) => Ok(Self {
                os: os.to_string(),
                architecture: arch.to_string(),
                variant: Some(v.to_string()),
            }),
            _ => Err(PlatformError(s.to_owned())),
        }
    }
}

impl std::fmt::Display for PlatformSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.os, self.architecture)?;
        match &self.variant {
            Some(v) => write!(f, "/{v}"),
            None => Ok(()),
        }
    }
}

impl PlatformSpec {
    /// Whether an index entry's platform matches.
    pub fn matches(&self, p: &Platform) -> bool {
        self.os == p.os
            && self.architecture == p.architecture
            && self
                .variant
                .as_ref()
                .is_none_or(|v| p.variant.as_deref() == Some(v.as_str()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_print_and_match() {
        let arm: PlatformSpec = "linux/arm64".parse().unwrap();
        assert_eq!(arm.to_string(), "linux/arm64");
        let v8 = Platform {
            architecture: "arm64".into(),
            os: "linux".into(),
            variant: Some("v8".into()),
        };
        assert!(arm.matches(&v8));
        let v7: PlatformSpec = "linux/arm64/v7".parse().unwrap();
        assert!(!v7.matches(&v8));
        assert_eq!(
            "linux".parse::<PlatformSpec>().unwrap_err().to_string(),
            "invalid platform \"linux\": expected os/arch[/variant], e.g. linux/arm64/v8"
        );
    }
}
