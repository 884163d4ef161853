//! The coordinator loop of the leased modes (see the module docs of
//! [`super`]): renew, fence, lead, reconcile every tick; leave on stop.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::handoff::{fence, fence_all};
use super::renewals::Renewals;
use super::{Member, NEGATIVE_CONTROL_LATE_FENCE, NotReady, Store, TICK, Tick, bounded, step};
use crate::cluster::coordinator::Start;
use crate::cluster::slots::SlotKey;

/// Nice value of the coordinator thread: above every other thread of the
/// node (and of a machine's ordinary processes), so that renewing and
/// fencing are not starved by calls, compilers or neighbours.
const COORDINATOR_NICE: i32 = -10;

/// What a leased mode's coordinator needs to start its loop.
#[derive(Debug, Clone)]
pub struct Setup {
    /// `[node] name`.
    pub name: String,
    /// `cluster.lease`.
    pub lease: Duration,
    /// `cluster.drain_deadline`.
    pub drain_deadline: Duration,
}

impl Setup {
    /// From `[node]` and `[cluster]`.
    pub fn of(config: &crate::config::Config) -> Self {
        Self {
            name: config.node.name.clone(),
            lease: config.cluster.lease,
            drain_deadline: config.cluster.drain_deadline(),
        }
    }
}

/// Run the loop on a thread of its own (`weir-coordinator`), with its own
/// runtime and its own connections to the store (`open` makes them, on that
/// runtime), at a raised priority where the node may raise it: a node whose
/// runtime and cores are busy must still renew its lease, and fence in time
/// when it cannot.
pub fn spawn(
    setup: Setup,
    start: Start,
    open: impl Fn(&Setup, &[SlotKey]) -> BoxFuture<'static, anyhow::Result<Arc<dyn Store>>> + Send + 'static,
) -> JoinHandle<anyhow::Result<()>> {
    let (done, result) = tokio::sync::oneshot::channel();
    let thread = std::thread::Builder::new().name("weir-coordinator".into()).spawn(move || {
        if let Err(e) = crate::sched::nice_current_thread(COORDINATOR_NICE) {
            tracing::info!(error = %e, "the coordinator thread runs at normal priority (raising it needs CAP_SYS_NICE); under CPU starvation its fence margin grows instead");
        }
        let ran = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
            Ok(rt) => rt.block_on(async move {
                // Connections made on this thread's runtime: their I/O is
                // driven here, not by the node's busy runtime.
                let mut stop = start.stop.clone();
                let Some(store) = until_done("connecting to the coordinator", &mut stop, || open(&setup, &start.all)).await else {
                    return Ok(());
                };
                let member = Member::new(
                    store,
                    &setup.name,
                    setup.lease,
                    setup.drain_deadline,
                    start.slots,
                    start.ready,
                );
                run(member, start.stop).await
            }),
            Err(e) => Err(anyhow::Error::new(e).context("starting the coordinator thread's runtime")),
        };
        let _ = done.send(ran);
    });
    if let Err(e) = thread {
        return tokio::spawn(async move { Err(anyhow::Error::new(e).context("starting the coordinator thread")) });
    }
    tokio::spawn(async move {
        result.await.unwrap_or_else(|_| {
            Err(anyhow::anyhow!(
                "the coordinator thread ended without a result (it panicked)"
            ))
        })
    })
}

/// The store's change stream, so a node acts on a change at once instead of
/// at its next tick (the handoff pause is two such waits). Best effort:
/// without one the loop still runs every tick, and it asks again at most
/// once a second.
#[derive(Default)]
struct Wakeups {
    changes: Option<BoxStream<'static, ()>>,
    tried: Option<Instant>,
}

impl Wakeups {
    async fn ensure(&mut self, c: &Member, fence_at: Option<Instant>) {
        if self.changes.is_some() || self.tried.is_some_and(|t| t.elapsed() < Duration::from_secs(1)) {
            return;
        }
        self.tried = Some(Instant::now());
        match step(c, fence_at, c.store.changes()).await {
            Ok(s) => self.changes = Some(s),
            Err(e) => tracing::debug!(error = %format!("{e:#}"), "cannot follow cluster changes; ticking only"),
        }
    }

    /// The next change (and any that queued up behind it); never returns
    /// without a stream.
    async fn next(&mut self) {
        let Some(s) = self.changes.as_mut() else {
            return std::future::pending().await;
        };
        match s.next().await {
            Some(()) => while let Some(Some(())) = futures::FutureExt::now_or_never(s.next()) {},
            None => self.changes = None,
        }
    }
}

/// Where a node is in its leaving sequence (after `stop`).
struct Leaving {
    /// When the stop came.
    since: Instant,
    /// The `leaving` mark is in the store.
    marked: bool,
    /// The drain deadline passed: every call was interrupted.
    interrupted: bool,
}

/// Run the coordinator until `stop`; then leave: mark the node leaving,
/// drain and release every slot (interrupting the calls still running at
/// `cluster.drain_deadline`), deregister. The lease is renewed throughout,
/// and the node fences itself whenever it cannot renew in time, leaving or
/// not.
pub async fn run(c: Member, mut stop: watch::Receiver<bool>) -> anyhow::Result<()> {
    let mut registered = Instant::now();
    let register = || {
        registered = Instant::now();
        bounded(c.store.what(), c.step_timeout(), c.store.register())
    };
    let Some(node_id) = until_done("registering with the coordinator", &mut stop, register).await else {
        return Ok(());
    };
    let mut st = Tick {
        node_id,
        renewed: Some(registered),
        fenced: false,
        leader: false,
        releasing: HashMap::new(),
        epochs: HashMap::new(),
        owned: 0,
    };
    tracing::info!(node = %c.name, id = %st.node_id, lease = ?c.lease, "registered with the coordinator");
    let late_control = late_fence_control();
    let renewals = Renewals::start(c.store.clone(), c.lease, st.node_id, registered);
    let mut margin = c.margin();
    let mut listener = Wakeups::default();
    let mut leaving: Option<Leaving> = None;
    loop {
        let renewed = renewals.now();
        if let Some(sent) = renewed.sent.filter(|_| !renewed.expired) {
            st.renewed = Some(sent);
        }
        let fence_after = if late_control {
            c.lease + TICK * 3
        } else {
            c.lease.saturating_sub(margin.current(&c.name))
        };
        // The fencing deadline: the last renewal sent + lease − margin
        // (none while fenced: there is nothing left to fence).
        let fence_at = st.renewed.filter(|_| !st.fenced).map(|r| r + fence_after);
        let drain_at = leaving
            .as_ref()
            .filter(|l| !l.interrupted)
            .map(|l| l.since + c.drain_deadline);
        fence_or_interrupt(&c, &mut st, leaving.as_mut(), fence_at, drain_at, fence_after).await;
        if let Some(l) = &leaving
            && left(&c, &mut st, l)?
        {
            break;
        }
        let fence_at = st.renewed.filter(|_| !st.fenced).map(|r| r + fence_after);
        let give_up_at = leaving
            .as_ref()
            .filter(|l| l.interrupted)
            .map(|l| l.since + c.drain_deadline + c.lease);
        let wake_at = [fence_at, drain_at, give_up_at].into_iter().flatten().min();
        listener.ensure(&c, fence_at).await;
        let tick = Instant::now() + TICK;
        tokio::select! {
            () = tokio::time::sleep_until(tick.into()) => margin.woke(tick, Instant::now()),
            () = listener.next() => {}
            () = sleep_until(wake_at) => {
                if let Some(due) = wake_at {
                    margin.woke(due, Instant::now());
                }
                continue;
            }
            changed = stop.changed(), if leaving.is_none() => {
                if changed.is_err() || *stop.borrow() {
                    tracing::info!(node = %c.name, drain_deadline = ?c.drain_deadline, "leaving the cluster: draining every slot, renewing the lease until done");
                    c.ready.store(false, std::sync::atomic::Ordering::Relaxed);
                    leaving = Some(Leaving { since: Instant::now(), marked: false, interrupted: false });
                }
            }
        }
        let renewed = renewals.now();
        if renewed.expired {
            // Expired: whatever we held may be someone else's now.
            tracing::warn!(node = %c.name, id = %st.node_id, "this node's lease had expired; stopping every slot and registering again as a new node");
            fence_all(&c, &mut st).await;
            if leaving.is_some() {
                break;
            }
            register_again(&c, &mut st, &renewals).await;
            continue;
        }
        if let Some(sent) = renewed.sent {
            st.renewed = Some(sent);
        }
        if !fresh(&c, &mut st, leaving.is_none(), fence_after) {
            fence(&c, &mut st, fence_after).await;
            continue;
        }
        let fence_at = st.renewed.map(|r| r + fence_after);
        duties(&c, &mut st, leaving.as_mut(), fence_at).await;
    }
    leave(&c, st, renewals).await;
    Ok(())
}

/// Is the negative control of the fencing tests on? Said loudly when it is.
fn late_fence_control() -> bool {
    let late_control = std::env::var(NEGATIVE_CONTROL_LATE_FENCE).is_ok_and(|v| v == "1");
    if late_control {
        tracing::error!(
            "{NEGATIVE_CONTROL_LATE_FENCE}=1: fencing AFTER the lease expired (a test's negative control; never in production)"
        );
    }
    late_control
}

/// Fence once the fencing deadline passed; else, once a leaving node's
/// drain deadline passed, interrupt the calls still running.
async fn fence_or_interrupt(
    c: &Member,
    st: &mut Tick,
    leaving: Option<&mut Leaving>,
    fence_at: Option<Instant>,
    drain_at: Option<Instant>,
    fence_after: Duration,
) {
    if fence_at.is_some_and(|f| Instant::now() >= f) {
        fence(c, st, fence_after).await;
    } else if drain_at.is_some_and(|d| Instant::now() >= d) {
        if let Some(l) = leaving {
            l.interrupted = true;
        }
        tracing::warn!(node = %c.name, deadline = ?c.drain_deadline, running = ?c.slots.running(), "drain deadline: interrupting the calls still running (they are released, not failed)");
        c.slots.interrupt_all();
    }
}

/// Has a leaving node finished (every slot drained and released, or the
/// node fenced)? An error when it must give up instead.
fn left(c: &Member, st: &mut Tick, l: &Leaving) -> anyhow::Result<bool> {
    let done = st.fenced || (l.marked && st.owned == 0 && st.releasing.is_empty() && c.slots.running().is_empty());
    if done {
        return Ok(true);
    }
    // A lease after the deadline the interrupted calls have ended;
    // a runner still not done waits on something else (the broker).
    // Give up: stop renewing without freeing anything, so the
    // leader frees the slots only once the lease (and the margin)
    // ran out, by which time this process has exited.
    if l.interrupted && l.since.elapsed() >= c.drain_deadline + c.lease {
        let stuck = c.slots.running();
        tracing::error!(node = %c.name, slots = ?stuck, "drain deadline + lease passed and these slots still drain; exiting without releasing them (the leader frees them when this node's lease expires)");
        for (_, h) in st.releasing.drain() {
            h.abort();
        }
        c.ready.store(false, std::sync::atomic::Ordering::Relaxed);
        anyhow::bail!("{} slots did not finish draining: {stuck:?}", stuck.len());
    }
    Ok(false)
}

/// After the lease expired and everything was fenced: register as a new
/// node (retried on the next pass when it fails).
async fn register_again(c: &Member, st: &mut Tick, renewals: &Renewals) {
    let sent = Instant::now();
    match step(c, None, c.store.register()).await {
        Ok(id) => {
            st.node_id = id;
            st.renewed = Some(sent);
            st.fenced = false;
            renewals.registered(id, sent);
            tracing::info!(node = %c.name, id = %id, "registered again");
        }
        Err(e) => tracing::warn!(error = %format!("{e:#}"), "registering again failed; retrying"),
    }
}

/// Is the lease renewed recently enough to act on? Then a fenced node is
/// unfenced, and one that is not leaving is ready.
fn fresh(c: &Member, st: &mut Tick, staying: bool, fence_after: Duration) -> bool {
    let fresh = st.renewed.is_some_and(|r| r.elapsed() < fence_after);
    if fresh {
        if st.fenced {
            tracing::info!(node = %c.name, "coordinator reachable again; lease renewed");
            st.fenced = false;
        }
        if staying {
            c.ready.store(true, std::sync::atomic::Ordering::Relaxed);
        }
    }
    fresh
}

/// A renewed node's duties of one pass: mark itself leaving (once), take or
/// keep the leadership and make the leader's pass, reconcile its slots.
async fn duties(c: &Member, st: &mut Tick, leaving: Option<&mut Leaving>, fence_at: Option<Instant>) {
    let is_leaving = leaving.is_some();
    if let Some(l) = leaving.filter(|l| !l.marked) {
        match step(c, fence_at, c.store.mark_leaving(st.node_id)).await {
            Ok(()) => l.marked = true,
            Err(e) => {
                tracing::warn!(node = %c.name, error = %format!("{e:#}"), "marking this node as leaving failed; retrying")
            }
        }
    }
    // A leaving node keeps the leadership it has (and its duties) but
    // does not take it.
    if !is_leaving || st.leader {
        match step(c, fence_at, c.store.try_lead(st.node_id)).await {
            Ok(lead) => {
                if lead != st.leader {
                    tracing::info!(node = %c.name, leader = lead, "leadership changed");
                }
                st.leader = lead;
                if lead && let Err(e) = step(c, fence_at, c.store.lead(st.node_id)).await {
                    warn_unless_not_ready(&e, "leader pass failed");
                }
            }
            Err(e) => warn_unless_not_ready(&e, "leader lease check failed"),
        }
    }
    if let Err(e) = step(c, fence_at, c.reconcile(st, is_leaving)).await {
        warn_unless_not_ready(&e, "reconciling this node's slots failed");
    }
}

/// Every slot is drained (or fenced): give up what is left and the
/// registration. Bounded: a store that does not answer lets the lease
/// expire, and the leader frees the slots then.
async fn leave(c: &Member, mut st: Tick, renewals: Renewals) {
    for (_, h) in st.releasing.drain() {
        h.abort();
    }
    c.slots.interrupt_and_drain_all().await;
    // Renewed until here: the lease must outlive the drain.
    drop(renewals);
    match bounded(c.store.what(), c.step_timeout() * 2, c.store.leave(st.node_id)).await {
        Ok(()) => tracing::info!(node = %c.name, "left the cluster: slots freed for the others"),
        Err(e) => {
            tracing::warn!(node = %c.name, error = %format!("{e:#}"), "could not leave the cluster cleanly; the leader frees this node's slots when its lease expires")
        }
    }
}

/// `f` until it succeeds, every second, warning once per failure streak and
/// then every minute; `None` when the node stops first (nothing to undo).
async fn until_done<T, F: std::future::Future<Output = anyhow::Result<T>>>(
    what: &str,
    stop: &mut watch::Receiver<bool>,
    mut f: impl FnMut() -> F,
) -> Option<T> {
    let mut warned: Option<Instant> = None;
    loop {
        if *stop.borrow() {
            return None;
        }
        match f().await {
            Ok(v) => {
                if warned.is_some() {
                    tracing::info!("{what}: done");
                }
                return Some(v);
            }
            Err(e) => {
                if warned.is_none_or(|w| w.elapsed() >= Duration::from_secs(60)) {
                    warned = Some(Instant::now());
                    tracing::warn!(error = %format!("{e:#}"), "{what} failed; trying again every second (the node takes no slot until then)");
                }
            }
        }
        tokio::select! {
            () = tokio::time::sleep(Duration::from_secs(1)) => {}
            _ = stop.changed() => {}
        }
    }
}

/// A step that failed: a warning, unless the store is still reading what
/// it holds ([`NotReady`]: expected at start, said at debug level).
fn warn_unless_not_ready(e: &anyhow::Error, what: &str) {
    if e.downcast_ref::<NotReady>().is_some() {
        tracing::debug!(error = %format!("{e:#}"), "{what}");
    } else {
        tracing::warn!(error = %format!("{e:#}"), "{what}");
    }
}

/// Sleep until `at`; never returns without one.
async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}
