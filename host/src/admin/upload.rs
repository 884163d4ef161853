//! An upload's body: streamed to a spool file within the size cap and the
//! body timeouts, or read and thrown away when it is refused.

use std::path::PathBuf;
use std::time::Duration;

use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use futures::StreamExt as _;
use tokio::io::AsyncWriteExt as _;

use super::error::{deploy_error, error_body};
use super::limits::Limits;
use crate::registry::DeployError;

/// An upload spooled to a file, removed when dropped.
pub(super) struct Spooled {
    pub(super) path: PathBuf,
    pub(super) size: usize,
}

impl Drop for Spooled {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_file(&self.path)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(file = %self.path.display(), error = %e, "cannot remove a spooled upload");
        }
    }
}

pub(super) fn closing(mut response: Response) -> Response {
    response
        .headers_mut()
        .insert(header::CONNECTION, axum::http::HeaderValue::from_static("close"));
    response
}

/// Of a refused upload, the bytes read and thrown away before answering.
const DRAIN_MAX: usize = 4 << 20;
/// The longest a refused upload is drained.
const DRAIN_TIME: Duration = Duration::from_secs(2);

/// Answer a refused upload with `response` after reading and discarding
/// up to [`DRAIN_MAX`] bytes of its body for at most [`DRAIN_TIME`], so a
/// client that sends a small body before it reads sees the answer, not a
/// reset; what is left of a larger or slower body is not read (the
/// connection closes).
///
/// A request that asked `Expect: 100-continue` has sent no body yet and
/// will not until told to: it is answered at once, its body never asked
/// for (reading it would send the `100 Continue`), and the connection closes.
pub(super) async fn refuse(
    body: axum::body::Body,
    limits: &Limits,
    expects_continue: bool,
    response: Response,
) -> Response {
    if expects_continue {
        return closing(response);
    }
    let mut stream = body.into_data_stream();
    let deadline = tokio::time::Instant::now() + DRAIN_TIME.min(limits.idle_timeout);
    let mut seen = 0usize;
    loop {
        match tokio::time::timeout_at(deadline, stream.next()).await {
            Ok(None) => return response,
            Ok(Some(Ok(chunk))) if seen + chunk.len() <= DRAIN_MAX => seen += chunk.len(),
            _ => return closing(response),
        }
    }
}

/// Stream an upload's body to a file in `limits.upload_dir`, within the
/// size cap and the body timeouts.
pub(super) async fn spool(body: axum::body::Body, limits: &Limits) -> Result<Spooled, Response> {
    let store_error = |e: std::io::Error, path: &std::path::Path| {
        tracing::error!(file = %path.display(), error = %e, "cannot spool an upload");
        (
            StatusCode::SERVICE_UNAVAILABLE,
            error_body(&format!("cannot spool the upload to {}: {e}", path.display())),
        )
            .into_response()
    };
    if let Err(e) = tokio::fs::create_dir_all(&limits.upload_dir).await {
        return Err(store_error(e, &limits.upload_dir));
    }
    let mut spooled = Spooled {
        path: limits.upload_dir.join(format!("weir-{}.upload", uuid::Uuid::new_v4())),
        size: 0,
    };
    let mut file = match tokio::fs::File::create(&spooled.path).await {
        Ok(f) => f,
        Err(e) => return Err(store_error(e, &spooled.path)),
    };
    let timed_out = |why: String| (StatusCode::REQUEST_TIMEOUT, error_body(&why)).into_response();
    let deadline = tokio::time::Instant::now() + limits.body_timeout;
    let mut stream = body.into_data_stream();
    loop {
        let pause = tokio::time::Instant::now() + limits.idle_timeout;
        let next = match tokio::time::timeout_at(pause.min(deadline), stream.next()).await {
            Ok(next) => next,
            Err(_) if tokio::time::Instant::now() >= deadline => {
                return Err(timed_out(format!(
                    "the upload did not arrive within node.admin_body_timeout ({:?}); {} bytes came",
                    limits.body_timeout, spooled.size
                )));
            }
            Err(_) => {
                return Err(timed_out(format!(
                    "the upload paused longer than node.admin_idle_timeout ({:?}) after {} bytes",
                    limits.idle_timeout, spooled.size
                )));
            }
        };
        let chunk = match next {
            None => break,
            Some(Ok(chunk)) => chunk,
            Some(Err(e)) => {
                return Err((StatusCode::BAD_REQUEST, error_body(&format!("reading the upload: {e}"))).into_response());
            }
        };
        spooled.size += chunk.len();
        if spooled.size > limits.max_upload {
            let too_large = deploy_error(DeployError::TooLarge {
                size: spooled.size,
                max: limits.max_upload,
            });
            // The body is being read, so any `100 Continue` has gone out.
            return Err(refuse(axum::body::Body::new(stream), limits, false, too_large).await);
        }
        if let Err(e) = file.write_all(&chunk).await {
            return Err(store_error(e, &spooled.path));
        }
    }
    if let Err(e) = file.flush().await {
        return Err(store_error(e, &spooled.path));
    }
    Ok(spooled)
}
