//! `/v1/dead-letters`: the dead-letter tools on the admin API, scoped by
//! token. `GET /v1/dead-letters` lists (`full=true`: every header and the
//! payload), `POST /v1/dead-letters/redrive` redrives in order (confirmed
//! before removal; `dry_run=true` only says what would move;
//! `handler_version=DIGEST` pins the version, checked on this node first),
//! `POST /v1/dead-letters/purge` removes (`dry_run=true`: what would go).
//!
//! Query parameters, all optional: `topology` (needed when the node has
//! several), `reason`, `handler`, `group`, `tenant`, `type`, `id`
//! (repeatable: a message id, or `#N` for a position), `since` and `until`
//! (an RFC 3339 time, a date, or a duration back from now such as `2h`),
//! `limit` (list: at most this many letters in the answer), `offset` (list: after skipping
//! this many of those selected; a page of a long list).
//!
//! An operator token sees every letter; a tenant token only those whose
//! `weir-tenant-id` is its tenant (a `tenant` parameter naming another
//! tenant is refused, 403) and may pin only versions of handlers it sees.
//! The counts a tenant is answered (`read`, `matched`, `selected`) are of
//! its own letters alone.
//! Listing is a read (open when the node has no tokens, like the handler
//! list); redrive and purge need a token (refused on a node without any).

use std::sync::Arc;
use std::time::SystemTime;

use axum::extract::{RawQuery, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};

use super::error::error_body;
use super::state::AdminState;
use crate::deadletter::{self, Filter, LetterView, PinCheck};
use crate::registry::{Caller, Registry};

/// What a request asks for, besides the filter.
#[derive(Default)]
struct Query {
    filter: Filter,
    topology: Option<String>,
    limit: Option<usize>,
    offset: usize,
    full: bool,
    dry_run: bool,
    handler_version: Option<String>,
}

const ACCEPTED: &str =
    "topology, reason, handler, group, tenant, type, id, since, until, limit, offset, full, dry_run, handler_version";

fn flag(key: &str, value: &str) -> Result<bool, String> {
    match value {
        "" | "true" | "1" => Ok(true),
        "false" | "0" => Ok(false),
        other => Err(format!("{key}={other:?}: accepted: true or false")),
    }
}

fn parse(query: Option<&str>, now: SystemTime) -> Result<Query, String> {
    let mut q = Query::default();
    for (k, v) in form_urlencoded::parse(query.unwrap_or_default().as_bytes()) {
        let v = v.into_owned();
        let f = &mut q.filter;
        match &*k {
            "topology" => q.topology = Some(v),
            "reason" => f.reason = Some(v),
            "handler" => f.handler = Some(v),
            "group" => f.group = Some(v),
            "tenant" => f.tenant = Some(v),
            "type" => f.message_type = Some(v),
            "id" => f.ids.push(v),
            "since" => f.since = Some(deadletter::parse_time(&v, now).map_err(|e| format!("since: {e}"))?),
            "until" => f.until = Some(deadletter::parse_time(&v, now).map_err(|e| format!("until: {e}"))?),
            "limit" => {
                q.limit = Some(
                    v.parse()
                        .map_err(|_| format!("limit={v:?}: accepted: a whole number"))?,
                );
            }
            "offset" => {
                q.offset = v
                    .parse()
                    .map_err(|_| format!("offset={v:?}: accepted: a whole number"))?;
            }
            "full" => q.full = flag("full", &v)?,
            "dry_run" => q.dry_run = flag("dry_run", &v)?,
            "handler_version" => q.handler_version = Some(v),
            other => return Err(format!("unknown query parameter {other:?}; accepted: {ACCEPTED}")),
        }
    }
    q.filter.validate()?;
    Ok(q)
}

fn answer(status: StatusCode, message: &str) -> Response {
    (status, error_body(message)).into_response()
}

/// A refusal before anything was changed: its status and why.
type Refusal = (StatusCode, String);

fn refused((status, why): Refusal) -> Response {
    answer(status, &why)
}

/// The request's filter with the caller's scope applied, and its topology
/// and slot count; or the refusal.
fn scope(s: &AdminState, caller: &Caller, q: &mut Query) -> Result<(String, u32), Refusal> {
    if let Caller::Tenant(t) = caller {
        match &q.filter.tenant {
            Some(other) if other != t => {
                return Err((
                    StatusCode::FORBIDDEN,
                    format!("a tenant token ({t}) sees only its own dead letters, not tenant {other:?}'s"),
                ));
            }
            _ => q.filter.tenant = Some(t.clone()),
        }
    }
    let Some(store) = s.transport.dead_letters() else {
        return Err((
            StatusCode::NOT_IMPLEMENTED,
            format!(
                "the {} transport of this node offers no dead-letter tools",
                s.transport.system()
            ),
        ));
    };
    let topologies = store.topologies();
    let names: Vec<&str> = topologies.iter().map(|(n, _)| n.as_str()).collect();
    let found = match &q.topology {
        Some(name) => topologies.iter().find(|(n, _)| n == name),
        None if topologies.len() == 1 => topologies.first(),
        None => {
            return Err((
                StatusCode::BAD_REQUEST,
                format!("this node has several topologies; name one with ?topology=, accepted: {names:?}"),
            ));
        }
    };
    found.cloned().ok_or_else(|| {
        (
            StatusCode::NOT_FOUND,
            format!(
                "no topology {:?} on this node; accepted: {names:?}",
                q.topology.as_deref().unwrap_or_default()
            ),
        )
    })
}

/// Read the topology's dead letters that `q` selects; `read` counts only
/// the caller's letters when the caller is a tenant.
async fn select(s: &AdminState, caller: &Caller, topology: &str, q: &Query) -> Result<deadletter::Selection, Refusal> {
    let Some(store) = s.transport.dead_letters() else {
        return Err((StatusCode::NOT_IMPLEMENTED, "no dead-letter tools".to_owned()));
    };
    let scope = match caller {
        Caller::Tenant(t) if !s.controls.unscoped_read_count => Some(t.as_str()),
        _ => None,
    };
    deadletter::select_scoped(store, topology, &q.filter, scope, &deadletter::no_progress)
        .await
        .map_err(|e| {
            let status = match e.kind {
                crate::transport::ErrorKind::Refused => StatusCode::CONFLICT,
                _ => StatusCode::SERVICE_UNAVAILABLE,
            };
            (
                status,
                format!("reading the dead letters of topology `{topology}`: {}", e.detail),
            )
        })
}

pub(super) async fn list(State(s): State<Arc<AdminState>>, RawQuery(query): RawQuery, headers: HeaderMap) -> Response {
    let caller = match s.auth.reader(&headers) {
        Ok(c) => c,
        Err(d) => return d.into_response(),
    };
    let mut q = match parse(query.as_deref(), SystemTime::now()) {
        Ok(q) => q,
        Err(e) => return answer(StatusCode::BAD_REQUEST, &e),
    };
    let (topology, slots) = match scope(&s, &caller, &mut q) {
        Ok(t) => t,
        Err(r) => return refused(r),
    };
    let selection = match select(&s, &caller, &topology, &q).await {
        Ok(sel) => sel,
        Err(r) => return refused(r),
    };
    let matched = selection.selected.len();
    let letters: Vec<LetterView> = selection
        .selected
        .iter()
        .skip(q.offset)
        .take(q.limit.unwrap_or(usize::MAX))
        .map(|l| LetterView::of(l, slots, q.full))
        .collect();
    let read = selection.read;
    selection.close().await;
    axum::Json(serde_json::json!({
        "topology": topology,
        "system": s.transport.system(),
        "read": read,
        "matched": matched,
        "letters": letters,
    }))
    .into_response()
}

/// A pin checked against this node's registry, within what the caller sees.
struct NodePins<'a> {
    registry: &'a Registry,
    caller: &'a Caller,
}

#[async_trait::async_trait]
impl PinCheck for NodePins<'_> {
    async fn check(
        &self,
        topology: &str,
        tenant: Option<&str>,
        message_type: &str,
        digest: &str,
    ) -> Result<String, String> {
        let handler = self
            .registry
            .handler_for(topology, tenant, message_type)
            .filter(|h| self.registry.visible(self.caller, h))
            .ok_or_else(|| {
                format!(
                    "no handler this token sees is bound to message type `{message_type}` (tenant {}) in topology \
                     `{topology}`, so no version of one can be pinned",
                    tenant.unwrap_or("none")
                )
            })?;
        self.registry.pinned_version(&handler, digest).await?;
        Ok(handler)
    }
}

pub(super) async fn redrive(
    State(s): State<Arc<AdminState>>,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
) -> Response {
    let caller = match s.auth.writer(&headers) {
        Ok(c) => c,
        Err(d) => return d.into_response(),
    };
    let mut q = match parse(query.as_deref(), SystemTime::now()) {
        Ok(q) => q,
        Err(e) => return answer(StatusCode::BAD_REQUEST, &e),
    };
    let (topology, slots) = match scope(&s, &caller, &mut q) {
        Ok(t) => t,
        Err(r) => return refused(r),
    };
    if let Some(pin) = &q.handler_version
        && !deadletter::is_digest(pin)
    {
        return answer(
            StatusCode::BAD_REQUEST,
            &format!("handler_version={pin:?} is not a component digest; accepted: 64 hex digits (sha256)"),
        );
    }
    let selection = match select(&s, &caller, &topology, &q).await {
        Ok(sel) => sel,
        Err(r) => return refused(r),
    };
    if let Some(pin) = &q.handler_version {
        let check = NodePins {
            registry: &s.registry,
            caller: &caller,
        };
        if let Err(why) = deadletter::check_pin(&topology, &selection.selected, pin, &check).await {
            selection.close().await;
            return answer(
                StatusCode::CONFLICT,
                &format!("refused: the pin cannot be honoured, nothing was moved: {why}"),
            );
        }
    }
    let pin = q.handler_version.as_deref();
    let report = if q.dry_run {
        selection.dry_run(slots, pin).await
    } else {
        selection
            .redrive(s.transport.as_ref(), &s.seal, slots, pin, &deadletter::no_progress)
            .await
    };
    let status = match report.stopped {
        Some(_) => StatusCode::SERVICE_UNAVAILABLE,
        None => StatusCode::OK,
    };
    (status, axum::Json(report)).into_response()
}

pub(super) async fn purge(State(s): State<Arc<AdminState>>, RawQuery(query): RawQuery, headers: HeaderMap) -> Response {
    let caller = match s.auth.writer(&headers) {
        Ok(c) => c,
        Err(d) => return d.into_response(),
    };
    let mut q = match parse(query.as_deref(), SystemTime::now()) {
        Ok(q) => q,
        Err(e) => return answer(StatusCode::BAD_REQUEST, &e),
    };
    if q.handler_version.is_some() {
        return answer(
            StatusCode::BAD_REQUEST,
            "handler_version applies to a redrive, not a purge",
        );
    }
    let (topology, _) = match scope(&s, &caller, &mut q) {
        Ok(t) => t,
        Err(r) => return refused(r),
    };
    let selection = match select(&s, &caller, &topology, &q).await {
        Ok(sel) => sel,
        Err(r) => return refused(r),
    };
    let report = selection.purge(q.dry_run, &deadletter::no_progress).await;
    let status = match report.stopped {
        Some(_) => StatusCode::SERVICE_UNAVAILABLE,
        None => StatusCode::OK,
    };
    (status, axum::Json(report)).into_response()
}
