//! The admin listener's bounds, and the caps on uploads running at once.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use parking_lot::Mutex;

use super::error::error_body;
use crate::registry::Caller;

/// The admin listener's bounds (`node.admin_*`, `node.max_component_size`).
#[derive(Debug, Clone)]
pub struct Limits {
    /// Largest upload `PUT /v1/handlers/{name}` reads.
    pub max_upload: usize,
    /// Request line and headers must arrive within this.
    pub header_timeout: Duration,
    /// An upload's body must arrive within this.
    pub body_timeout: Duration,
    /// Longest pause while an upload's body arrives.
    pub idle_timeout: Duration,
    /// Connections held at once.
    pub max_connections: usize,
    /// Uploads at once, and per caller.
    pub max_uploads: usize,
    /// Uploads one caller may have at once.
    pub max_uploads_per_caller: usize,
    /// Where uploads are spooled.
    pub upload_dir: PathBuf,
    uploads: Arc<Mutex<HashMap<String, usize>>>,
}

impl Limits {
    /// From `[node]`.
    pub fn from_config(config: &crate::config::Config) -> Self {
        let n = &config.node;
        Self {
            max_upload: usize::try_from(n.max_component_size.bytes()).unwrap_or(usize::MAX),
            header_timeout: n.admin_header_timeout,
            body_timeout: n.admin_body_timeout,
            idle_timeout: n.admin_idle_timeout,
            max_connections: n.admin_max_connections.max(1) as usize,
            max_uploads: n.admin_max_uploads.max(1) as usize,
            max_uploads_per_caller: n.admin_max_uploads_per_caller.max(1) as usize,
            upload_dir: n
                .data_dir
                .as_ref()
                .map_or_else(std::env::temp_dir, |d| d.join("uploads")),
            uploads: Arc::default(),
        }
    }

    /// A place among the uploads running now, or why not (503: the node's
    /// cap, 429: this caller's share).
    pub(super) fn admit(&self, caller: &Caller) -> Result<UploadPermit, Box<Response>> {
        let key = match caller {
            Caller::Operator => "operator".to_owned(),
            Caller::Tenant(t) => format!("tenant:{t}"),
        };
        let mut running = self.uploads.lock();
        let total: usize = running.values().sum();
        let mine = running.get(&key).copied().unwrap_or(0);
        let busy = |status: StatusCode, why: String| {
            Box::new((status, [(header::RETRY_AFTER, RETRY_AFTER_SECS)], error_body(&why)).into_response())
        };
        if total >= self.max_uploads {
            return Err(busy(
                StatusCode::SERVICE_UNAVAILABLE,
                format!(
                    "{total} uploads are running on this node, node.admin_max_uploads allows {}; retry later (the running version stays)",
                    self.max_uploads
                ),
            ));
        }
        if mine >= self.max_uploads_per_caller {
            return Err(busy(
                StatusCode::TOO_MANY_REQUESTS,
                format!(
                    "this token has {mine} uploads running, node.admin_max_uploads_per_caller allows {}; retry later (the running version stays)",
                    self.max_uploads_per_caller
                ),
            ));
        }
        *running.entry(key.clone()).or_default() += 1;
        Ok(UploadPermit {
            running: self.uploads.clone(),
            key,
        })
    }
}

/// Seconds a client told 503/429 should wait before trying again.
const RETRY_AFTER_SECS: &str = "5";

/// One running upload; counted until dropped.
pub(super) struct UploadPermit {
    running: Arc<Mutex<HashMap<String, usize>>>,
    key: String,
}

impl Drop for UploadPermit {
    fn drop(&mut self) {
        let mut running = self.running.lock();
        if let Some(n) = running.get_mut(&self.key) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                running.remove(&self.key);
            }
        }
    }
}
