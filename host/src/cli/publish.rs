//! `weir publish`: messages through the configured broker to the slot of
//! their group, each confirmed by the broker, with a progress bar for large
//! counts. The CLI's own output; the logic is `node::publish`.

use std::time::Instant;

use anyhow::{Context as _, bail};
use futures::StreamExt as _;
use indicatif::{ProgressBar, ProgressStyle};

use weir::config::Config;
use weir::envelope;
use weir::node;
use weir::transport::TopologySpec;

/// Publishes in flight at once (confirms awaited individually).
const IN_FLIGHT: usize = 64;
/// From this count on, a progress bar is shown.
const BAR_FROM: u64 = 1_000;

/// What to publish.
pub struct Request {
    pub message_type: String,
    pub group: Option<String>,
    pub tenant: Option<String>,
    pub count: u64,
    pub payload: Vec<u8>,
    pub topology: Option<String>,
}

/// Why `weir publish` refuses a memory config, and where to publish instead.
pub fn memory_refusal(cfg: &Config) -> String {
    let topology = cfg.topology.first().map_or("T", |t| t.name.as_str());
    let admin = cfg
        .node
        .admin
        .map_or_else(|| "http://NODE.ADMIN".to_owned(), |a| format!("http://{a}"));
    format!(
        "{origin}: transport.kind = \"memory\": the memory broker lives inside one `weir` process, so a message \
         published from here would reach no node. Publish into the running node instead: \
         `curl -H 'Authorization: Bearer TOKEN' -d '{{\"type\": \"T\", \"group\": \"G\", \"payload\": …}}' \
         {admin}/v1/topologies/{topology}/messages` on its admin listener (node.admin{set}), or type it into `weir dev`",
        origin = cfg.origin,
        set = if cfg.node.admin.is_some() {
            ""
        } else {
            ", which this config does not set"
        },
    )
}

/// Say so when a slot just published to has no consumer (the broker's
/// count): the messages wait there until a node consumes it. A group's
/// messages went to one slot; unordered ones to any.
async fn warn_unconsumed(transport: &dyn weir::transport::Transport, topology: &str, slots: u32, group: Option<&str>) {
    let targets: Vec<u32> = match group.filter(|g| !g.is_empty()) {
        Some(g) => vec![weir::partition::slot_for(Some(g), "", slots)],
        None => (0..slots).collect(),
    };
    let mut idle = Vec::new();
    for slot in targets {
        match transport.consumers(topology, slot).await {
            Ok(Some(0)) => idle.push(slot),
            Ok(_) => {}
            Err(e) => {
                tracing::debug!(error = %e, "cannot read the slots' consumers");
                return;
            }
        }
    }
    if idle.is_empty() {
        return;
    }
    let which = match group {
        Some(g) => format!("group {g:?} goes to slot {}", idle[0]),
        None => format!("slot(s) {idle:?}"),
    };
    eprintln!(
        "warning: {which} of topology `{topology}`, which no consumer reads now: those messages wait until a node \
         consumes it (`weir status` shows who owns what; in static mode, list it in some node's cluster.owned_slots)"
    );
}

/// Publish and return a one-paragraph summary.
pub async fn run(cfg: &Config, req: Request) -> anyhow::Result<String> {
    let names: Vec<&str> = cfg.topology.iter().map(|t| t.name.as_str()).collect();
    let topo = match &req.topology {
        Some(name) => cfg
            .topology
            .iter()
            .find(|t| &t.name == name)
            .with_context(|| format!("--topology {name:?}: not in {}; accepted: {names:?}", cfg.origin))?,
        None => match cfg.topology.as_slice() {
            [only] => only,
            [] => bail!("{}: no [[topology]] to publish to", cfg.origin),
            _ => bail!(
                "{}: several topologies; choose one with --topology, accepted: {names:?}",
                cfg.origin
            ),
        },
    };
    if req.message_type.is_empty() {
        bail!("--type must not be empty");
    }
    let transport = weir::transport::connect::for_config(cfg)?;
    transport
        .declare(&TopologySpec {
            name: topo.name.clone(),
            slots: topo.slots,
            retry: topo.retry_policy(cfg.transport.kind),
        })
        .await
        .with_context(|| format!("declaring topology `{}` on {}", topo.name, transport.system()))
        .map_err(|e| weir::transport::connect::unreachable(cfg, transport.system(), e))?;

    let bar = if req.count >= BAR_FROM {
        let bar = ProgressBar::new(req.count);
        bar.set_style(
            ProgressStyle::with_template("{bar:40} {pos}/{len} published, {per_sec}, eta {eta}")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        bar
    } else {
        ProgressBar::hidden()
    };
    let started = Instant::now();
    let transport = transport.as_ref();
    let (name, slots) = (topo.name.as_str(), topo.slots);
    let mut results = futures::stream::iter(0..req.count)
        .map(|_| {
            let env = envelope::new_message(
                envelope::fresh_id(),
                req.message_type.clone(),
                req.group.clone(),
                req.tenant.clone(),
                Vec::new(),
                req.payload.clone(),
            );
            async move { node::publish(transport, name, slots, &env).await }
        })
        .buffered(IN_FLIGHT);
    let mut published = 0u64;
    while let Some(r) = results.next().await {
        if let Err(e) = r {
            bar.abandon();
            bail!(
                "publishing to topology `{name}` on {} failed after {published} of {} confirmed: {e}",
                transport.system(),
                req.count
            );
        }
        published += 1;
        bar.inc(1);
    }
    bar.finish_and_clear();
    let secs = started.elapsed().as_secs_f64();
    warn_unconsumed(transport, name, slots, req.group.as_deref()).await;
    Ok(format!(
        "published {published} message(s) of type `{}` to topology `{name}` on {} ({} slots{}) in {:.2}s ({:.0} msg/s), every one confirmed",
        req.message_type,
        transport.system(),
        slots,
        req.group
            .as_deref()
            .map(|g| format!(
                ", group {g:?} -> slot {}",
                weir::partition::slot_for(Some(g), "", slots)
            ))
            .unwrap_or_default(),
        secs,
        published as f64 / secs.max(1e-9),
    ))
}
