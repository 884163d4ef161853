//! Coalesced acks for one consumer channel. A `multiple` ack of tag `n`
//! acknowledges every unacknowledged delivery up to `n` on the channel, so
//! it is only ever sent for an `n` below which every delivery the runner
//! received is settled: the *floor*. Deliveries that finished above the
//! floor (behind a slow one) wait for the gap to close, or are acked one by
//! one once they have waited [`STRAGGLER_AGE`], so a slow call does not hold
//! the prefetch window.
//!
//! Ordering: a delivery settled any other way (release, retry, capture)
//! leaves the book only after its own frame was handed to the channel, so a
//! later `multiple` ack, which lapin sends after it on the same channel,
//! can never reach it first.
//!
//! One flush at a time: the flusher holds the send lock from taking a flush
//! out of the book until its last frame is handed to the channel, and
//! [`Coalescer::flush_all`] takes the same lock, so its `multiple` ack
//! cannot overtake a straggler's single ack still being sent (which the
//! broker would then refuse as an unknown delivery tag, closing the channel).
//!
//! [`AckBook`] is the pure bookkeeping; [`Coalescer`] puts it on the wire
//! with a flusher task per channel.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use lapin::options::BasicAckOptions;
use parking_lot::Mutex;
use tokio::sync::Notify;

/// Acks coalesced before the flusher is woken.
pub const BATCH: usize = 128;
/// The flusher runs at least this often while acks are waiting.
pub const TICK: Duration = Duration::from_millis(5);
/// A finished delivery above the floor is acked on its own after this long.
pub const STRAGGLER_AGE: Duration = Duration::from_millis(20);

/// What one flush should put on the wire.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Flush {
    /// One `multiple` ack up to and including this tag.
    pub multiple: Option<u64>,
    /// Single acks.
    pub single: Vec<u64>,
}

impl Flush {
    /// Nothing to send.
    fn is_empty(&self) -> bool {
        self.multiple.is_none() && self.single.is_empty()
    }
}

/// Delivery tags of one channel: received and unsettled, and finished but
/// not yet acked on the wire.
#[derive(Debug, Default)]
pub struct AckBook {
    outstanding: BTreeSet<u64>,
    done: BTreeMap<u64, Instant>,
    highest: u64,
}

impl AckBook {
    /// The runner received `tag` (tags grow on a channel).
    pub fn received(&mut self, tag: u64) {
        self.outstanding.insert(tag);
        self.highest = self.highest.max(tag);
    }

    /// `tag` finished and wants a (coalesced) ack.
    pub fn finished(&mut self, tag: u64, now: Instant) {
        self.outstanding.remove(&tag);
        self.done.insert(tag, now);
    }

    /// `tag` was settled on the wire by the caller (its frame already sent).
    pub fn settled(&mut self, tag: u64) {
        self.outstanding.remove(&tag);
    }

    /// Every tag at or below the floor is settled or finished.
    pub fn floor(&self) -> u64 {
        self.outstanding.first().map_or(self.highest, |t| t - 1)
    }

    /// Finished tags a `multiple` ack can cover now.
    #[cfg(test)]
    pub fn coverable(&self) -> usize {
        self.done.range(..=self.floor()).count()
    }

    /// Whether a `multiple` ack could cover at least `n` finished tags now;
    /// walks at most `n` of them, and none while fewer than `n` are finished
    /// (the common case, asked once per delivery).
    pub fn coverable_at_least(&self, n: usize) -> bool {
        n == 0 || self.done.len() >= n && self.done.range(..=self.floor()).nth(n - 1).is_some()
    }

    /// Take the `multiple` ack over the floor, and single acks for finished
    /// tags above it that are older than `straggler_age` (all of them when
    /// `straggler_age` is zero).
    pub fn take(&mut self, now: Instant, straggler_age: Duration) -> Flush {
        let floor = self.floor();
        let multiple = self.done.range(..=floor).next_back().map(|(t, _)| *t);
        if let Some(m) = multiple {
            self.done = self.done.split_off(&(m + 1));
        }
        let single: Vec<u64> = self
            .done
            .iter()
            .filter(|(_, at)| now.saturating_duration_since(**at) >= straggler_age)
            .map(|(t, _)| *t)
            .collect();
        for t in &single {
            self.done.remove(t);
        }
        Flush { multiple, single }
    }

    /// Nothing finished waits for an ack.
    pub fn idle(&self) -> bool {
        self.done.is_empty()
    }
}

/// An [`AckBook`] and the channel its acks go out on.
pub struct Coalescer {
    book: Mutex<AckBook>,
    channel: lapin::Channel,
    wake: Notify,
    closed: AtomicBool,
    queue: Arc<str>,
    /// Held from taking a flush out of the book until it is on the wire.
    sending: tokio::sync::Mutex<()>,
    /// Tests: where the flusher waits between two single acks.
    #[cfg(test)]
    hook: Option<Arc<tests::Gate>>,
}

impl Coalescer {
    /// A coalescer for `channel`, with its flusher task running until
    /// [`Coalescer::flush_all`] or [`Coalescer::close`].
    pub fn start(channel: lapin::Channel, queue: Arc<str>) -> Arc<Self> {
        let c = Arc::new(Self {
            book: Mutex::new(AckBook::default()),
            channel,
            wake: Notify::new(),
            closed: AtomicBool::new(false),
            queue,
            sending: tokio::sync::Mutex::new(()),
            #[cfg(test)]
            hook: None,
        });
        tokio::spawn(flusher(c.clone()));
        c
    }

    /// The runner received `tag`.
    pub fn received(&self, tag: u64) {
        self.book.lock().received(tag);
    }

    /// `tag` finished: ack it soon, coalesced. False when the coalescer is
    /// closed: the caller acks it on its own.
    pub fn finished(&self, tag: u64) -> bool {
        if self.closed.load(Ordering::Acquire) {
            self.settled(tag);
            return false;
        }
        let wake = {
            let mut b = self.book.lock();
            let was_idle = b.idle();
            b.finished(tag, Instant::now());
            was_idle || b.coverable_at_least(BATCH)
        };
        if wake {
            self.wake.notify_one();
        }
        true
    }

    /// Stop the flusher without sending anything (the channel is gone).
    pub fn close(&self) {
        self.closed.store(true, Ordering::Release);
        self.wake.notify_one();
    }

    /// `tag` was settled on its own (its frame already sent).
    pub fn settled(&self, tag: u64) {
        self.book.lock().settled(tag);
    }

    /// Put every finished tag on the wire (the `multiple` ack, then the
    /// rest one by one) and stop the flusher. Used when the subscription
    /// closes, after the drain.
    pub async fn flush_all(&self) {
        self.close();
        // After a flush the flusher may still be sending.
        let _sending = self.sending.lock().await;
        let flush = self.book.lock().take(Instant::now(), Duration::ZERO);
        self.send(flush).await;
    }

    async fn send(&self, flush: Flush) {
        if flush.is_empty() {
            return;
        }
        let mut lost = 0usize;
        let mut first_error = None;
        if let Some(tag) = flush.multiple
            && let Err(e) = self.channel.basic_ack(tag, BasicAckOptions { multiple: true }).await
        {
            lost += 1;
            first_error.get_or_insert(format!("multiple ack up to {tag}: {e}"));
        }
        for tag in flush.single {
            #[cfg(test)]
            if let Some(gate) = &self.hook {
                gate.pass().await;
            }
            if let Err(e) = self.channel.basic_ack(tag, BasicAckOptions::default()).await {
                lost += 1;
                first_error.get_or_insert(format!("ack of {tag}: {e}"));
            }
        }
        if let Some(error) = first_error {
            tracing::warn!(
                messaging.system = super::wire::SYSTEM,
                queue = %self.queue,
                failed_acks = lost,
                error,
                "acks of finished deliveries did not go out (channel closed); the broker redelivers them"
            );
        }
    }
}

/// Sends coalesced acks: at once when a batch is coverable, else a [`TICK`]
/// after the first delivery finished, then every tick while any waits.
/// Sleeps while nothing is finished; ends when the coalescer is closed.
async fn flusher(c: Arc<Coalescer>) {
    loop {
        if c.closed.load(Ordering::Acquire) {
            return;
        }
        if c.book.lock().idle() {
            c.wake.notified().await;
            continue;
        }
        let woken = tokio::select! {
            () = c.wake.notified() => true,
            () = tokio::time::sleep(TICK) => false,
        };
        if c.closed.load(Ordering::Acquire) {
            return;
        }
        // A wake-up is for the batch; the tick also clears stragglers.
        let sending = c.sending.lock().await;
        if c.closed.load(Ordering::Acquire) {
            return;
        }
        let flush = c
            .book
            .lock()
            .take(Instant::now(), if woken { Duration::MAX } else { STRAGGLER_AGE });
        c.send(flush).await;
        drop(sending);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Holds the flusher before its second single ack until opened.
    #[derive(Default)]
    pub struct Gate {
        passes: std::sync::atomic::AtomicUsize,
        reached: Notify,
        open: Notify,
    }

    impl Gate {
        pub async fn pass(&self) {
            if self.passes.fetch_add(1, Ordering::SeqCst) == 1 {
                self.reached.notify_one();
                self.open.notified().await;
            }
        }
    }

    /// Issue 14 item 7, against the real broker: the flusher has taken two
    /// stragglers (2, 3) and sent the ack of 2 when the subscription closes.
    /// `flush_all`'s `multiple` ack of 4 must not go out before the ack of 3
    /// (the broker would refuse 3 as an unknown tag and close the channel).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn flush_all_waits_for_a_flusher_sending_stragglers() {
        use futures::StreamExt as _;
        use lapin::options::{BasicConsumeOptions, BasicPublishOptions, BasicQosOptions, QueueDeclareOptions};
        use lapin::types::FieldTable;
        let url =
            std::env::var("WEIR_TEST_AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
        let conn = lapin::Connection::connect(&url, lapin::ConnectionProperties::default())
            .await
            .unwrap();
        let ch = conn.create_channel().await.unwrap();
        let opts = QueueDeclareOptions {
            exclusive: true,
            auto_delete: true,
            ..QueueDeclareOptions::default()
        };
        let q = ch.queue_declare("".into(), opts, FieldTable::default()).await.unwrap();
        let queue = q.name().as_str().to_owned();
        for _ in 0..4 {
            ch.basic_publish(
                "".into(),
                queue.as_str().into(),
                BasicPublishOptions::default(),
                b"x",
                Default::default(),
            )
            .await
            .unwrap();
        }
        ch.basic_qos(10, BasicQosOptions::default()).await.unwrap();
        let mut consumer = ch
            .basic_consume(
                queue.as_str().into(),
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        let gate = Arc::new(Gate::default());
        let c = Arc::new(Coalescer {
            book: Mutex::new(AckBook::default()),
            channel: ch.clone(),
            wake: Notify::new(),
            closed: AtomicBool::new(false),
            queue: Arc::from(queue.as_str()),
            sending: tokio::sync::Mutex::new(()),
            hook: Some(gate.clone()),
        });
        tokio::spawn(flusher(c.clone()));
        let mut tags = Vec::new();
        for _ in 0..4 {
            let d = consumer.next().await.unwrap().unwrap();
            c.received(d.delivery_tag);
            tags.push(d.delivery_tag);
        }
        // 1 still runs: 2 and 3 are stragglers, acked singly by the flusher.
        assert!(c.finished(tags[1]) && c.finished(tags[2]));
        gate.reached.notified().await;
        // The flusher has acked 2 and waits before 3. Now 1 and 4 finish
        // and the subscription closes.
        assert!(c.finished(tags[0]) && c.finished(tags[3]));
        let closing = c.clone();
        let mut flush_all = tokio::spawn(async move { closing.flush_all().await });
        // Without the send lock, `flush_all` finishes on its own here
        // (having sent `multiple` 4); with it, it waits for the gate.
        let finished_alone = tokio::time::timeout(Duration::from_millis(500), &mut flush_all)
            .await
            .is_ok();
        gate.open.notify_one();
        if !finished_alone {
            flush_all.await.unwrap();
        }
        // The flusher is done sending once the send lock is free; then a
        // round trip on the channel: the broker answers after every ack.
        drop(c.sending.lock().await);
        let alive = ch.basic_qos(10, BasicQosOptions::default()).await;
        assert!(
            alive.is_ok() && ch.status().connected(),
            "the channel survived the close: {alive:?} (flush_all finished before the straggler: {finished_alone})"
        );
        let _ = conn.close(200, "done".into()).await;
    }

    #[test]
    fn multiple_ack_never_covers_an_unsettled_delivery() {
        let now = Instant::now();
        let mut b = AckBook::default();
        for t in 1..=5 {
            b.received(t);
        }
        b.finished(1, now);
        b.finished(2, now);
        b.finished(4, now);
        assert_eq!(b.floor(), 2);
        let f = b.take(now, Duration::MAX);
        assert_eq!(
            f,
            Flush {
                multiple: Some(2),
                single: vec![]
            }
        );
        // 3 still runs: 4 waits, 5 too.
        assert_eq!(b.take(now, Duration::MAX), Flush::default());
        b.finished(3, now);
        assert_eq!(b.take(now, Duration::MAX).multiple, Some(4));
        b.finished(5, now);
        assert_eq!(b.take(now, Duration::MAX).multiple, Some(5));
        assert!(b.idle());
    }

    #[test]
    fn deliveries_settled_otherwise_do_not_hold_the_floor() {
        let now = Instant::now();
        let mut b = AckBook::default();
        for t in 1..=3 {
            b.received(t);
        }
        b.settled(1); // released, its nack already sent
        b.finished(3, now);
        assert_eq!(b.floor(), 1);
        b.settled(2); // retried: published to a rung and acked on its own
        assert_eq!(b.floor(), 3);
        assert_eq!(b.take(now, Duration::MAX).multiple, Some(3));
    }

    #[test]
    fn stragglers_above_the_floor_are_acked_singly_once_old() {
        let t0 = Instant::now();
        let mut b = AckBook::default();
        for t in 1..=3 {
            b.received(t);
        }
        b.finished(2, t0);
        b.finished(3, t0 + Duration::from_millis(15));
        let later = t0 + STRAGGLER_AGE;
        let f = b.take(later, STRAGGLER_AGE);
        assert_eq!(
            f,
            Flush {
                multiple: None,
                single: vec![2]
            }
        );
        assert_eq!(b.take(later, Duration::ZERO).single, vec![3]);
    }

    #[test]
    fn the_floor_follows_the_highest_tag_when_nothing_is_outstanding() {
        let now = Instant::now();
        let mut b = AckBook::default();
        assert_eq!(b.floor(), 0);
        b.received(7);
        b.finished(7, now);
        assert_eq!(b.floor(), 7);
        assert_eq!(b.coverable(), 1);
        assert!(b.coverable_at_least(1) && !b.coverable_at_least(2));
    }

    #[test]
    fn coverable_at_least_counts_only_below_the_floor() {
        let now = Instant::now();
        let mut b = AckBook::default();
        for t in 1..=6 {
            b.received(t);
        }
        for t in [1, 2, 4, 5, 6] {
            b.finished(t, now);
        }
        // 3 is outstanding: only 1 and 2 are coverable.
        assert!(b.coverable_at_least(2));
        assert!(!b.coverable_at_least(3));
        b.finished(3, now);
        assert!(b.coverable_at_least(6));
        assert!(!b.coverable_at_least(7));
    }
}
