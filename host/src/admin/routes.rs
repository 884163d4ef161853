//! Each route's answer: readiness, slots, handlers, deploys, rollbacks.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};

use super::error::{deploy_error, error_body};
use super::state::AdminState;
use super::upload::{closing, refuse, spool};
use crate::cluster::status::{SlotStatus, Status};
use crate::registry::canary::{ThresholdMode, Thresholds};
use crate::registry::{DeployError, DirGrant, Grants, Upload};

pub(super) async fn ready(State(s): State<Arc<AdminState>>) -> Response {
    let failing = s.stats.failing();
    if !failing.is_empty() {
        let slots: Vec<String> = failing.iter().map(|((t, n), why)| format!("{t}/{n}: {why}")).collect();
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: slot runner failed, restarting: {}\n", slots.join("; ")),
        )
            .into_response();
    }
    if s.ready.load(Ordering::Relaxed) {
        (StatusCode::OK, "ready\n").into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: starting, fenced or stopping\n",
        )
            .into_response()
    }
}

/// The slots as `weir status --json` shows them: the coordinator's view in
/// the modes that have one, else every slot of the config with this node's
/// own marked; lag and consumers from the broker, the calls running on the
/// slots this node runs.
pub async fn slot_status(s: &AdminState) -> anyhow::Result<Status> {
    let mut status = match s.coordinator.status().await? {
        Some(status) => status,
        None => {
            let running = s.slots.running();
            let mut topologies: Vec<(&String, &u32)> = s.topologies.iter().collect();
            topologies.sort();
            let slots = topologies
                .into_iter()
                .flat_map(|(t, n)| (0..*n).map(move |slot| (t.clone(), slot)))
                .map(|(topology, slot)| {
                    let here = running.iter().any(|(t, n)| *t == topology && *n == slot);
                    let owner = here.then(|| s.node.clone());
                    SlotStatus::new(topology, slot, owner, 0, if here { "consumed" } else { "not here" })
                })
                .collect();
            Status {
                mode: String::new(),
                nodes: Vec::new(),
                slots,
            }
        }
    };
    status.mode = s.mode.to_owned();
    let counters = s.stats.slots();
    for slot in &mut status.slots {
        if slot.owner.as_deref() == Some(s.node.as_str()) {
            let here = counters
                .iter()
                .find(|((t, n), _)| **t == *slot.topology && *n == slot.slot);
            slot.in_flight = here.map(|(_, c)| c.depth().1);
            slot.parked = here.map(|(_, c)| c.parked());
        }
    }
    for slot in &mut status.slots {
        let (lag, consumers) = tokio::join!(
            s.transport.backlog(&slot.topology, slot.slot),
            s.transport.consumers(&slot.topology, slot.slot)
        );
        match (lag, consumers) {
            (Ok(lag), Ok(consumers)) => {
                slot.lag = lag;
                slot.consumers = consumers;
            }
            (Err(e), _) | (_, Err(e)) => {
                tracing::warn!(error = %e, "cannot read slot backlogs");
                break;
            }
        }
    }
    Ok(status)
}

pub(super) async fn slots(State(s): State<Arc<AdminState>>, headers: HeaderMap) -> Response {
    if let Err(d) = s.auth.operator(&headers) {
        return d.into_response();
    }
    match slot_status(&s).await {
        Ok(status) => axum::Json(status).into_response(),
        Err(e) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("cannot read the slots: {e:#}\n"),
        )
            .into_response(),
    }
}

/// `GET /v1/groups`: the groups parked on this node (`on_failure =
/// "park"`); a tenant's token sees its own.
pub(super) async fn groups(State(s): State<Arc<AdminState>>, headers: HeaderMap) -> Response {
    let caller = match s.auth.reader(&headers) {
        Ok(c) => c,
        Err(d) => return d.into_response(),
    };
    let groups: Vec<_> = s
        .stats
        .parked_groups()
        .into_iter()
        .filter(|g| match &caller {
            crate::registry::Caller::Operator => true,
            crate::registry::Caller::Tenant(t) => g.tenant.as_deref() == Some(t.as_str()),
        })
        .collect();
    axum::Json(serde_json::json!({ "node": s.node, "parked": groups })).into_response()
}

/// What `POST /v1/groups/unpark` and `/v1/groups/skip` take.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct GroupRef {
    topology: String,
    group: String,
    #[serde(default)]
    tenant: Option<String>,
}

/// `POST /v1/groups/{action}` (`unpark`, `skip`): release a parked group
/// whose slot runs on this node; a tenant's token, only its own groups.
pub(super) async fn order_group(
    State(s): State<Arc<AdminState>>,
    Path(action): Path<String>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    let caller = match s.auth.writer(&headers) {
        Ok(c) => c,
        Err(d) => return d.into_response(),
    };
    let skip = match action.as_str() {
        "unpark" => false,
        "skip" => true,
        other => {
            return (
                StatusCode::NOT_FOUND,
                format!("no action `{other}` on groups; accepted: unpark, skip\n"),
            )
                .into_response();
        }
    };
    let r: GroupRef = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            return (
                StatusCode::BAD_REQUEST,
                format!("the body must be {{\"topology\": T, \"group\": G, \"tenant\": X (optional)}}: {e}\n"),
            )
                .into_response();
        }
    };
    if let crate::registry::Caller::Tenant(t) = &caller
        && r.tenant.as_deref() != Some(t.as_str())
    {
        return (
            StatusCode::FORBIDDEN,
            format!("a tenant token ({t}) may only act on its own groups (give \"tenant\": \"{t}\")\n"),
        )
            .into_response();
    }
    match s.slots.order_group(&r.topology, r.tenant, r.group.clone(), skip).await {
        Ok(head) => axum::Json(serde_json::json!({ "node": s.node, "group": r.group, "head": head, "skipped": skip }))
            .into_response(),
        Err(why) => (StatusCode::NOT_FOUND, format!("{why}\n")).into_response(),
    }
}

pub(super) async fn handlers(State(s): State<Arc<AdminState>>, headers: HeaderMap) -> Response {
    match s.auth.reader(&headers) {
        Ok(caller) => axum::Json(serde_json::json!({ "handlers": s.registry.list(&caller) })).into_response(),
        Err(d) => d.into_response(),
    }
}

pub(super) async fn handler(
    State(s): State<Arc<AdminState>>,
    Path(name): Path<String>,
    headers: HeaderMap,
) -> Response {
    let caller = match s.auth.reader(&headers) {
        Ok(c) => c,
        Err(d) => return d.into_response(),
    };
    if let Err(e) = s.registry.access(&caller, &name) {
        return deploy_error(e);
    }
    match s.registry.list(&caller).into_iter().find(|h| h.name == name) {
        Some(h) => axum::Json(h).into_response(),
        None => deploy_error(DeployError::UnknownHandler(name)),
    }
}

/// `GET /v1/handlers/{name}/logs?after=SEQ&limit=N`: the handler's recent log lines, its
/// failures and faults, after sequence number `after` (default 0: all it holds), the newest
/// `limit` (default 100, at most 1000). A tenant's token, only its own handlers.
pub(super) async fn logs(
    State(s): State<Arc<AdminState>>,
    Path(name): Path<String>,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
) -> Response {
    let caller = match s.auth.reader(&headers) {
        Ok(c) => c,
        Err(d) => return d.into_response(),
    };
    let (after, limit) = match parse_logs(query.as_deref()) {
        Ok(q) => q,
        Err(e) => return (StatusCode::BAD_REQUEST, error_body(&e)).into_response(),
    };
    match s.registry.logs(&caller, &name) {
        Ok(ring) => {
            let page = ring.page(after, limit);
            axum::Json(serde_json::json!({
                "node": s.node,
                "handler": name,
                "lines": page.lines,
                "next": page.next,
                "missed": page.missed,
            }))
            .into_response()
        }
        Err(e) => deploy_error(e),
    }
}

/// The most lines one `logs` answer holds.
const LOGS_MAX_LIMIT: usize = 1000;

/// `after=SEQ&limit=N`, each optional.
fn parse_logs(query: Option<&str>) -> Result<(u64, usize), String> {
    let (mut after, mut limit) = (0, 100);
    for (k, v) in form_urlencoded::parse(query.unwrap_or_default().as_bytes()) {
        let number = |what: &str| {
            v.parse::<u64>()
                .map_err(|_| format!("`{k}` must be a whole number ({what}), not `{v}`"))
        };
        match k.as_ref() {
            "after" => after = number("the sequence number of the last line seen")?,
            "limit" => {
                limit = usize::try_from(number("lines, 1 to 1000")?).unwrap_or(usize::MAX);
                if !(1..=LOGS_MAX_LIMIT).contains(&limit) {
                    return Err(format!("`limit` must be 1 to {LOGS_MAX_LIMIT}, not {limit}"));
                }
            }
            other => return Err(format!("unknown query parameter `{other}` (accepted: after, limit)")),
        }
    }
    Ok((after, limit))
}

/// A deploy's query: grants, and whether it is a canary.
#[derive(Default)]
struct DeployAsk {
    /// `None`: what the config gives.
    grants: Option<Grants>,
    /// `canary_slots=0,1` (or `10%`).
    canary_slots: Option<String>,
    thresholds: Thresholds,
}

/// `?env=NAME&dir=GUEST:HOST` (repeatable; grants are `None` when neither is
/// given), and for a canary `canary_slots=0,1|10%` with optional
/// `max_dead_letter_rate`, `max_retry_rate`, `min_messages` and
/// `threshold_mode` (`relative`, the default, or `absolute`).
fn parse_deploy(query: Option<&str>) -> Result<DeployAsk, String> {
    let Some(q) = query.filter(|q| !q.is_empty()) else {
        return Ok(DeployAsk::default());
    };
    let mut ask = DeployAsk::default();
    let mut g = Grants::default();
    let mut any = false;
    let rate = |k: &str, v: &str| {
        v.parse::<f64>()
            .map_err(|_| format!("{k}={v:?}: accepted: a rate from 0 to 1, e.g. 0.05"))
    };
    for (k, v) in form_urlencoded::parse(q.as_bytes()) {
        match &*k {
            "canary_slots" => ask.canary_slots = Some(v.into_owned()),
            "max_dead_letter_rate" => ask.thresholds.max_dead_letter_rate = Some(rate(&k, &v)?),
            "max_retry_rate" => ask.thresholds.max_retry_rate = Some(rate(&k, &v)?),
            "threshold_mode" => ask.thresholds.mode = ThresholdMode::parse(&v)?,
            "min_messages" => {
                ask.thresholds.min_messages = v
                    .parse()
                    .map_err(|_| format!("min_messages={v:?}: accepted: a whole number, e.g. 20"))?;
            }
            "env" => {
                any = true;
                g.env.push(v.into_owned());
            }
            "dir" => {
                any = true;
                let (guest, host) = v
                    .split_once(':')
                    .ok_or_else(|| format!("dir={v:?}: accepted: GUEST:HOST, e.g. /data:/srv/acme/data"))?;
                g.dirs.push(DirGrant {
                    guest: guest.to_owned(),
                    host: host.into(),
                });
            }
            "grants" if v == "none" => any = true,
            other => {
                return Err(format!(
                    "unknown query parameter {other:?}; accepted: env, dir, grants=none, canary_slots, \
                     max_dead_letter_rate, max_retry_rate, min_messages, threshold_mode"
                ));
            }
        }
    }
    if ask.canary_slots.is_none() && ask.thresholds != Thresholds::default() {
        return Err(
            "max_dead_letter_rate, max_retry_rate, min_messages and threshold_mode apply to a canary: add canary_slots"
                .into(),
        );
    }
    ask.grants = any.then_some(g);
    Ok(ask)
}

pub(super) async fn deploy(
    State(s): State<Arc<AdminState>>,
    Path(name): Path<String>,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Response {
    // A client that waits for `100 Continue` (`weir deploy` does) is refused
    // before it sends a byte, so it reads the answer instead of a reset.
    let expects = headers
        .get(header::EXPECT)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
    let caller = match s.auth.writer(&headers) {
        Ok(c) => c,
        Err(d) => return refuse(body, &s.limits, expects, d.into_response()).await,
    };
    if let Err(e) = s.registry.access(&caller, &name) {
        return refuse(body, &s.limits, expects, deploy_error(e)).await;
    }
    let ask = match parse_deploy(query.as_deref()) {
        Ok(a) => a,
        Err(e) => {
            return refuse(
                body,
                &s.limits,
                expects,
                (StatusCode::BAD_REQUEST, error_body(&e)).into_response(),
            )
            .await;
        }
    };
    let max = s.limits.max_upload;
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if let Some(n) = declared.filter(|n| *n > max as u64) {
        let too_large = deploy_error(DeployError::TooLarge {
            size: usize::try_from(n).unwrap_or(usize::MAX),
            max,
        });
        return refuse(body, &s.limits, expects, too_large).await;
    }
    let _permit = match s.limits.admit(&caller) {
        Ok(p) => p,
        Err(busy) => return refuse(body, &s.limits, expects, *busy).await,
    };
    let spooled = match spool(body, &s.limits).await {
        Ok(f) => f,
        Err(refused) => return closing(refused),
    };
    let upload = Upload::File {
        path: spooled.path.clone(),
        size: spooled.size,
    };
    let result = match ask.canary_slots {
        Some(slots) => s
            .registry
            .start_canary(&caller, &name, upload, ask.grants, &slots, ask.thresholds)
            .await
            .map(|c| axum::Json(c).into_response()),
        None => s
            .registry
            .deploy_from(&caller, &name, upload, ask.grants, "admin")
            .await
            .map(|d| axum::Json(d).into_response()),
    };
    drop(spooled);
    match result {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(handler = %name, error = %e, "deploy refused; the running version stays");
            deploy_error(e)
        }
    }
}

/// `response`, and close the connection after it (the rest of a request
/// body is not read).
pub(super) async fn rollback(
    State(s): State<Arc<AdminState>>,
    Path(name): Path<String>,
    headers: HeaderMap,
) -> Response {
    let caller = match s.auth.writer(&headers) {
        Ok(c) => c,
        Err(d) => return d.into_response(),
    };
    match s.registry.rollback(&caller, &name).await {
        Ok(d) => axum::Json(d).into_response(),
        Err(e) => deploy_error(e),
    }
}

/// `POST /v1/handlers/{name}/promote`: the running canary becomes the
/// current version on every slot (and every node, in `postgres` mode).
pub(super) async fn promote(
    State(s): State<Arc<AdminState>>,
    Path(name): Path<String>,
    headers: HeaderMap,
) -> Response {
    let caller = match s.auth.writer(&headers) {
        Ok(c) => c,
        Err(d) => return d.into_response(),
    };
    match s.registry.promote(&caller, &name).await {
        Ok(d) => axum::Json(d).into_response(),
        Err(e) => deploy_error(e),
    }
}
