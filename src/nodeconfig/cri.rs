//! A client of the container runtime's CRI image service
//! (`runtime.v1.ImageService`, k8s.io/cri-api), over its unix socket: the
//! calls the node agent pulls a warm set with.
//!
//! The messages are written here with prost's derive, field numbers as in
//! cri-api's `api.proto` (v0.37), rather than generated: the generating
//! crates need `protoc` at build time, and these four calls use a handful
//! of fields. Fields this client does not read are left out; protobuf
//! skips them.

use std::path::{Path, PathBuf};
use std::time::Duration;

use http::uri::PathAndQuery;
use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint, Uri};

/// How long connecting to the socket may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Errors talking to the runtime.
#[derive(Debug, thiserror::Error)]
pub enum CriError {
    /// The socket could not be reached.
    #[error("the container runtime at {socket}: {why}")]
    Connect {
        /// The socket.
        socket: String,
        /// Why.
        why: String,
    },
    /// A call failed (the runtime's status, without credentials).
    #[error("{call} {image}: {code:?}: {message}")]
    Call {
        /// The method.
        call: &'static str,
        /// The image it was about.
        image: String,
        /// The gRPC status code.
        code: tonic::Code,
        /// The runtime's message.
        message: String,
    },
}

/// `runtime.v1.ImageSpec`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ImageSpec {
    /// The image reference.
    #[prost(string, tag = "1")]
    pub image: String,
}

/// `runtime.v1.AuthConfig`. Its `Debug` shows no password.
#[derive(Clone, PartialEq, prost::Message)]
#[prost(skip_debug)]
pub struct AuthConfig {
    /// User name.
    #[prost(string, tag = "1")]
    pub username: String,
    /// Password.
    #[prost(string, tag = "2")]
    pub password: String,
    /// The registry host.
    #[prost(string, tag = "4")]
    pub server_address: String,
}

impl std::fmt::Debug for AuthConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AuthConfig")
            .field("username", &self.username)
            .field("server_address", &self.server_address)
            .finish_non_exhaustive()
    }
}

#[derive(Clone, PartialEq, prost::Message)]
struct PullImageRequest {
    #[prost(message, optional, tag = "1")]
    image: Option<ImageSpec>,
    #[prost(message, optional, tag = "2")]
    auth: Option<AuthConfig>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct PullImageResponse {
    #[prost(string, tag = "1")]
    image_ref: String,
}

#[derive(Clone, PartialEq, prost::Message)]
struct ImageStatusRequest {
    #[prost(message, optional, tag = "1")]
    image: Option<ImageSpec>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct ImageStatusResponse {
    #[prost(message, optional, tag = "1")]
    image: Option<Image>,
}

/// `runtime.v1.Image`: what the runtime holds.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Image {
    /// The image ID (containerd: `sha256:` of the config).
    #[prost(string, tag = "1")]
    pub id: String,
    /// `repository@digest` names.
    #[prost(string, repeated, tag = "3")]
    pub repo_digests: Vec<String>,
    /// Its size on disk.
    #[prost(uint64, tag = "4")]
    pub size: u64,
}

#[derive(Clone, PartialEq, prost::Message)]
struct ImageFsInfoRequest {}

#[derive(Clone, PartialEq, prost::Message)]
struct ImageFsInfoResponse {
    #[prost(message, repeated, tag = "1")]
    image_filesystems: Vec<FilesystemUsage>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct FilesystemUsage {
    #[prost(message, optional, tag = "2")]
    fs_id: Option<FilesystemIdentifier>,
    #[prost(message, optional, tag = "3")]
    used_bytes: Option<UInt64Value>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct FilesystemIdentifier {
    #[prost(string, tag = "1")]
    mountpoint: String,
}

#[derive(Clone, PartialEq, prost::Message)]
struct UInt64Value {
    #[prost(uint64, tag = "1")]
    value: u64,
}

/// The image filesystem, as the runtime reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageFs {
    /// Where it is mounted.
    pub mountpoint: PathBuf,
    /// Bytes its images take.
    pub used: u64,
}

/// A connection to the runtime's image service.
#[derive(Clone)]
pub struct Cri {
    grpc: tonic::client::Grpc<Channel>,
    socket: String,
}

impl std::fmt::Debug for Cri {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cri").field("socket", &self.socket).finish()
    }
}

impl Cri {
    /// A client of the unix socket `socket` (a path, or `unix://PATH`).
    ///
    /// # Errors
    /// [`CriError::Connect`] for a socket that is not an absolute path.
    pub fn connect(socket: &str) -> Result<Self, CriError> {
        let path = PathBuf::from(socket.strip_prefix("unix://").unwrap_or(socket));
        if !path.is_absolute() {
            return Err(CriError::Connect {
                socket: socket.to_owned(),
                why: "expected unix:///PATH or an absolute path".into(),
            });
        }
        // Lazily: the runtime may start after the agent; each call
        // connects again when it must. The URI is not used: every
        // connection goes to the socket.
        let channel = Endpoint::from_static("http://cri.local")
            .connect_timeout(CONNECT_TIMEOUT)
            .connect_with_connector_lazy(tower::service_fn(move |_: Uri| {
                let path = path.clone();
                async move {
                    Ok::<_, std::io::Error>(TokioIo::new(
                        tokio::net::UnixStream::connect(path).await?,
                    ))
                }
            }));
        Ok(Self {
            grpc: tonic::client::Grpc::new(channel),
            socket: socket.to_owned(),
        })
    }

    async fn unary<Req, Resp>(
        &self,
        method: &'static str,
        image: &str,
        request: Req,
        timeout: Option<Duration>,
    ) -> Result<Resp, CriError>
    where
        Req: prost::Message + Send + Sync + 'static,
        Resp: prost::Message + Default + Send + Sync + 'static,
    {
        let failed = |s: tonic::Status| CriError::Call {
            call: method,
            image: image.to_owned(),
            code: s.code(),
            message: s.message().chars().take(400).collect(),
        };
        let mut grpc = self.grpc.clone();
        grpc.ready().await.map_err(|e| CriError::Connect {
            socket: self.socket.clone(),
            why: error_chain(&e),
        })?;
        let mut request = tonic::Request::new(request);
        if let Some(t) = timeout {
            request.set_timeout(t);
        }
        let path = PathAndQuery::from_static(method);
        let codec = tonic_prost::ProstCodec::<Req, Resp>::default();
        let call = grpc.unary(request, path, codec);
        // The runtime is sent the deadline (grpc-timeout); the client holds
        // it too, for a runtime that does not answer at all.
        let answer = match timeout {
            Some(t) => tokio::time::timeout(t, call)
                .await
                .unwrap_or_else(|_| Err(tonic::Status::deadline_exceeded("no answer in time"))),
            None => call.await,
        };
        answer.map(tonic::Response::into_inner).map_err(failed)
    }

    /// The image the runtime holds under `image`, if any.
    ///
    /// # Errors
    /// [`CriError`].
    pub async fn image_status(&self, image: &str) -> Result<Option<Image>, CriError> {
        let r: ImageStatusResponse = self
            .unary(
                "/runtime.v1.ImageService/ImageStatus",
                image,
                ImageStatusRequest {
                    image: Some(ImageSpec {
                        image: image.to_owned(),
                    }),
                },
                Some(Duration::from_secs(30)),
            )
            .await?;
        Ok(r.image)
    }

    /// Pulls `image` (with `auth` when given), within `timeout`; returns
    /// the runtime's image reference.
    ///
    /// # Errors
    /// [`CriError`].
    pub async fn pull(
        &self,
        image: &str,
        auth: Option<AuthConfig>,
        timeout: Duration,
    ) -> Result<String, CriError> {
        let r: PullImageResponse = self
            .unary(
                "/runtime.v1.ImageService/PullImage",
                image,
                PullImageRequest {
                    image: Some(ImageSpec {
                        image: image.to_owned(),
                    }),
                    auth,
                },
                Some(timeout),
            )
            .await?;
        Ok(r.image_ref)
    }

    /// The image filesystem (the first the runtime lists).
    ///
    /// # Errors
    /// [`CriError`]; a runtime that lists none is a
    /// [`tonic::Code::NotFound`] call error.
    pub async fn image_fs(&self) -> Result<ImageFs, CriError> {
        let r: ImageFsInfoResponse = self
            .unary(
                "/runtime.v1.ImageService/ImageFsInfo",
                "",
                ImageFsInfoRequest {},
                Some(Duration::from_secs(30)),
            )
            .await?;
        let fs = r
            .image_filesystems
            .into_iter()
            .next()
            .ok_or(CriError::Call {
                call: "/runtime.v1.ImageService/ImageFsInfo",
                image: String::new(),
                code: tonic::Code::NotFound,
                message: "the runtime lists no image filesystem".into(),
            })?;
        Ok(ImageFs {
            mountpoint: fs.fs_id.map(|f| f.mountpoint).unwrap_or_default().into(),
            used: fs.used_bytes.map_or(0, |u| u.value),
        })
    }
}

/// Free bytes of the filesystem holding `path` (for unprivileged users).
///
/// # Errors
/// The `statvfs` error.
pub fn free_bytes(path: &Path) -> std::io::Result<u64> {
    let s = rustix::fs::statvfs(path)?;
    Ok(s.f_bavail.saturating_mul(s.f_frsize))
}

/// `e` and its sources, joined.
fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut next = e.source();
    while let Some(s) = next {
        out.push_str(": ");
        out.push_str(&s.to_string());
        next = s.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message as _;

    #[test]
    fn messages_use_the_cri_api_field_numbers() {
        // PullImageRequest{image: {image: "a"}, auth: {username: "u", server_address: "h"}}
        let bytes = PullImageRequest {
            image: Some(ImageSpec { image: "a".into() }),
            auth: Some(AuthConfig {
                username: "u".into(),
                password: String::new(),
                server_address: "h".into(),
            }),
        }
        .encode_to_vec();
        assert_eq!(
            bytes,
            [
                0x0a, 3, 0x0a, 1, b'a', 0x12, 6, 0x0a, 1, b'u', 0x22, 1, b'h'
            ]
        );
        let auth = AuthConfig {
            username: "u".into(),
            password: "s3cret".into(),
            server_address: "h".into(),
        };
        assert!(!format!("{auth:?}").contains("s3cret"));
        // ImageFsInfoResponse with a timestamp (1) and inodes (4) it skips.
        let fs = [
            0x08, 5, 0x12, 3, 0x0a, 1, b'/', 0x1a, 2, 0x08, 42, 0x22, 2, 0x08, 1,
        ];
        let mut resp = vec![0x0a, fs.len() as u8];
        resp.extend_from_slice(&fs);
        let r = ImageFsInfoResponse::decode(resp.as_slice()).unwrap();
        assert_eq!(
            r.image_filesystems[0].used_bytes.as_ref().unwrap().value,
            42
        );
        assert_eq!(
            r.image_filesystems[0].fs_id.as_ref().unwrap().mountpoint,
            "/"
        );
    }
}
