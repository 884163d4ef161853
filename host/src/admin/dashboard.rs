//! The dashboard at `/`: one page, served from this binary (no build step,
//! no separate server), that reads the admin API with the token the person
//! gives it — slots and nodes, handlers with their versions and history,
//! dead letters per topology, throughput and error rates from `/metrics` —
//! and, for the operator, redrives dead letters and rolls handlers back.
//! A tenant token sees its own handlers and dead letters, read-only.
//! `GET /v1/whoami` tells the page who the token is.

use std::sync::Arc;

use axum::extract::State;
use axum::http::{HeaderMap, header};
use axum::response::{IntoResponse, Response};

use super::state::AdminState;
use crate::registry::Caller;

/// The page.
const PAGE: &str = include_str!("dashboard.html");

pub(super) async fn page() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            // Everything it needs is inline; it talks to this listener only.
            (
                header::CONTENT_SECURITY_POLICY,
                "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; img-src data:",
            ),
            (header::CACHE_CONTROL, "no-store"),
        ],
        PAGE,
    )
        .into_response()
}

/// `GET /v1/whoami`: the node, its mode, and what the presented token may do.
pub(super) async fn whoami(State(s): State<Arc<AdminState>>, headers: HeaderMap) -> Response {
    let caller = match s.auth.reader(&headers) {
        Ok(c) => c,
        Err(d) => return d.into_response(),
    };
    let tokens = s.auth.configured();
    let (role, tenant) = match &caller {
        Caller::Operator if tokens => ("operator", None),
        Caller::Operator => ("anonymous", None),
        Caller::Tenant(t) => ("tenant", Some(t.clone())),
    };
    axum::Json(serde_json::json!({
        "node": s.node,
        "mode": s.mode,
        "transport": s.transport.system(),
        "role": role,
        "tenant": tenant,
        // Actions (redrive, purge, rollback) need the operator's token.
        "can_act": role == "operator",
        "topologies": s.topologies,
    }))
    .into_response()
}

#[cfg(test)]
mod tests {
    /// The page's reason filter offers every reason a dead letter can carry, and no other.
    #[test]
    fn the_reason_filter_lists_every_reason() {
        let select = super::PAGE
            .split("<select id=\"dl-reason\"")
            .nth(1)
            .and_then(|s| s.split("</select>").next())
            .expect("the page has a reason filter");
        let offered: Vec<&str> = select
            .split("<option>")
            .skip(1)
            .map(|o| o.split("</option>").next().unwrap_or_default())
            .collect();
        let all: Vec<&str> = crate::outcome::Reason::ALL.iter().map(|r| r.as_str()).collect();
        assert_eq!(offered, all);
    }
}
