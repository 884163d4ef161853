//! [`Interrupt`]: one slot runner's calls, interrupted together, and the
//! moment none of them runs any more.
//!
//! A fence must end before the lease can expire, and what it must end is the
//! guest code, not the broker traffic after it (acks, releases, closing the
//! consumer), which may be slow on a starved machine and harms nobody. So a
//! fence cancels the runner's interrupt and waits for [`Interrupt::calls_ended`]:
//! every call that entered guest code has left it, and none can enter any
//! more ([`Interrupt::enter`] refuses once cancelled). The runner drains the
//! rest in the background.
//!
//! A call whose worker thread runs below normal priority (a demoted long
//! call, a failing tenant's background worker) registers that thread here,
//! and the cancel lifts it back to normal priority: next to busy cores a
//! thread in the idle class may not run for seconds, and the fence waits for
//! it to notice the interrupt.
//!
//! A drain is gentler: [`Interrupt::stop_starting`] lets the calls inside
//! guest code finish and refuses every call that has not entered yet (the
//! rest of a job holding several messages), which the job then releases to
//! the broker unstarted; so a drain lasts as long as the calls that were
//! running when it began, and no longer.
//!
//! The two counters are ordered like Dekker's flags: a call counts itself in
//! and then reads the flag, a fence sets the flag and then reads the count
//! (both sequentially consistent), so either the call sees the cancel and
//! does not run, or the fence sees the call and waits for it.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use tokio::sync::Notify;

/// See the module docs.
#[derive(Debug, Default)]
pub struct Interrupt {
    cancelled: AtomicBool,
    /// Set when the runner's drain began: no call may enter any more, the
    /// running ones are not interrupted.
    stopping: AtomicBool,
    /// Calls inside guest code (instantiation included).
    running: AtomicUsize,
    /// Told when `running` drops to zero.
    quiet: Notify,
    /// Threads running these calls below normal priority (see the module docs).
    lowered: parking_lot::Mutex<Vec<i32>>,
}

/// One call inside guest code; leaves on drop.
#[must_use = "the call counts as running until this is dropped"]
#[derive(Debug)]
pub struct Entered<'a>(&'a Interrupt);

impl Drop for Entered<'_> {
    fn drop(&mut self) {
        // Only a fence waits, and only after its cancel: an ordinary call
        // leaves with two atomics and no lock.
        if self.0.running.fetch_sub(1, Ordering::SeqCst) == 1 && self.0.cancelled.load(Ordering::SeqCst) {
            self.0.quiet.notify_waiters();
        }
    }
}

impl Interrupt {
    /// Interrupt the running calls (at their next epoch tick or blocking
    /// wait) and refuse new ones.
    pub fn cancel(&self) {
        self.cancelled.store(true, Ordering::SeqCst);
        for tid in self.lowered.lock().drain(..) {
            lift(tid);
        }
        self.quiet.notify_waiters();
    }

    /// Thread `tid` runs one of these calls below normal priority: a
    /// cancel lifts it (at once when cancelled already).
    pub fn lowered(&self, tid: i32) {
        let mut lowered = self.lowered.lock();
        // Under the lock: a cancel either finds it in the list or was seen here.
        if self.cancelled.load(Ordering::SeqCst) {
            drop(lowered);
            lift(tid);
            return;
        }
        lowered.push(tid);
    }

    /// The call on thread `tid` ended: false when a cancel lifted the thread
    /// (it should lower itself again).
    pub fn forget(&self, tid: i32) -> bool {
        let mut lowered = self.lowered.lock();
        match lowered.iter().position(|t| *t == tid) {
            Some(i) => {
                lowered.swap_remove(i);
                true
            }
            None => false,
        }
    }

    /// The runner drains: the calls inside guest code run on, no other call
    /// may start (see the module docs). Returns how many calls were inside
    /// guest code at that moment (ordered like a cancel: a call that enters
    /// later is refused).
    pub fn stop_starting(&self) -> usize {
        self.stopping.store(true, Ordering::SeqCst);
        self.running.load(Ordering::SeqCst)
    }

    /// Whether [`Interrupt::stop_starting`] or [`Interrupt::cancel`] was
    /// called: a call that has not started must not start.
    pub fn is_stopping(&self) -> bool {
        self.stopping.load(Ordering::Relaxed) || self.is_cancelled()
    }

    /// Whether [`Interrupt::cancel`] was called: read on every epoch tick.
    pub fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Relaxed)
    }

    /// A call is about to run guest code: `None` once cancelled or stopping
    /// (it must not start), else a guard that counts it as running until
    /// dropped.
    pub fn enter(&self) -> Option<Entered<'_>> {
        self.running.fetch_add(1, Ordering::SeqCst);
        let entered = Entered(self);
        if self.cancelled.load(Ordering::SeqCst) || self.stopping.load(Ordering::SeqCst) {
            drop(entered);
            return None;
        }
        Some(entered)
    }

    /// Calls inside guest code now.
    pub fn running(&self) -> usize {
        self.running.load(Ordering::SeqCst)
    }

    /// Resolves once cancelled and no call is inside guest code; from then
    /// on none can enter. Waits for [`Interrupt::cancel`] first.
    pub async fn calls_ended(&self) {
        loop {
            let quiet = self.quiet.notified();
            tokio::pin!(quiet);
            // Registered before the check: a call leaving in between wakes it.
            quiet.as_mut().enable();
            if self.cancelled.load(Ordering::SeqCst) && self.running.load(Ordering::SeqCst) == 0 {
                return;
            }
            quiet.await;
        }
    }
}

/// Back to normal priority, so the interrupted call can end.
fn lift(tid: i32) {
    if let Err(e) = crate::sched::restore_thread(tid) {
        tracing::warn!(tid, error = %e, "could not lift an interrupted call's thread to normal priority");
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_cancelled_interrupt_lets_no_call_enter() {
        let i = Interrupt::default();
        let e = i.enter().expect("enters before the cancel");
        i.cancel();
        assert!(i.enter().is_none(), "refused after the cancel");
        assert_eq!(i.running(), 1, "the refused call did not count");
        drop(e);
        assert_eq!(i.running(), 0);
    }

    /// A drain lets the running call finish (it is not interrupted) and
    /// lets no other call start.
    #[test]
    fn stop_starting_lets_the_running_call_finish_and_none_start() {
        let i = Interrupt::default();
        let e = i.enter().expect("enters before the drain");
        assert_eq!(i.stop_starting(), 1, "one call was running when the drain began");
        assert!(!i.is_cancelled(), "the running call is not interrupted");
        assert!(i.is_stopping());
        assert!(i.enter().is_none(), "no call starts once the drain began");
        drop(e);
        assert_eq!(i.running(), 0);
    }

    /// `calls_ended` waits for the call inside guest code, and returns as
    /// soon as it leaves; a call that arrives after the cancel never runs.
    #[tokio::test]
    async fn calls_ended_waits_for_the_running_call_only() {
        let i = Arc::new(Interrupt::default());
        let (entered, leave) = (
            Arc::new(std::sync::Barrier::new(2)),
            Arc::new(std::sync::Barrier::new(2)),
        );
        let worker = std::thread::spawn({
            let (i, entered, leave) = (i.clone(), entered.clone(), leave.clone());
            move || {
                let e = i.enter().unwrap();
                entered.wait();
                leave.wait();
                drop(e);
            }
        });
        entered.wait();
        i.cancel();
        let ended = tokio::spawn({
            let i = i.clone();
            async move { i.calls_ended().await }
        });
        assert!(
            tokio::time::timeout(Duration::from_millis(50), async {
                while !ended.is_finished() {
                    tokio::task::yield_now().await;
                }
            })
            .await
            .is_err(),
            "a call still runs: calls_ended must wait"
        );
        leave.wait();
        worker.join().unwrap();
        tokio::time::timeout(Duration::from_secs(10), ended)
            .await
            .expect("calls_ended returned once the call left")
            .unwrap();
        assert!(i.enter().is_none());
    }

    /// A fence lifts a call's thread out of the idle class (where, next to
    /// busy cores, it might not run for seconds to see the interrupt); the
    /// thread lowers itself again once its call ended.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_cancel_lifts_a_lowered_call_to_normal_priority() {
        // SAFETY: a plain syscall reading a thread's policy.
        let policy = |tid: i32| unsafe { libc::sched_getscheduler(tid) };
        let i = Arc::new(Interrupt::default());
        let (registered, cancelled) = (
            Arc::new(std::sync::Barrier::new(2)),
            Arc::new(std::sync::Barrier::new(2)),
        );
        let call = std::thread::spawn({
            let (i, registered, cancelled) = (i.clone(), registered.clone(), cancelled.clone());
            move || {
                crate::sched::idle_current_thread().unwrap();
                let tid = crate::sched::current_tid();
                assert_eq!(policy(tid), libc::SCHED_IDLE);
                i.lowered(tid);
                registered.wait();
                cancelled.wait();
                let during = policy(tid);
                let still_lowered = i.forget(tid);
                if !still_lowered {
                    crate::sched::lower_again();
                }
                (during, still_lowered, policy(tid))
            }
        });
        registered.wait();
        i.cancel();
        cancelled.wait();
        let (during, still_lowered, after) = call.join().unwrap();
        assert_eq!(during, libc::SCHED_OTHER, "the cancel lifted the call's thread");
        assert!(!still_lowered, "the thread learns that it was lifted");
        assert_eq!(after, libc::SCHED_IDLE, "and lowers itself again after its call");
    }

    /// Many threads entering while the fence cancels: every call that got
    /// in had entered before `calls_ended` returned, none after.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn no_call_enters_after_calls_ended() {
        for _ in 0..50 {
            let i = Arc::new(Interrupt::default());
            let after = Arc::new(AtomicBool::new(false));
            let late = Arc::new(AtomicUsize::new(0));
            let threads: Vec<_> = (0..4)
                .map(|_| {
                    let (i, after, late) = (i.clone(), after.clone(), late.clone());
                    std::thread::spawn(move || {
                        for _ in 0..2_000 {
                            if let Some(e) = i.enter() {
                                if after.load(Ordering::SeqCst) {
                                    late.fetch_add(1, Ordering::SeqCst);
                                }
                                drop(e);
                            }
                        }
                    })
                })
                .collect();
            i.cancel();
            i.calls_ended().await;
            after.store(true, Ordering::SeqCst);
            for t in threads {
                t.join().unwrap();
            }
            assert_eq!(late.load(Ordering::SeqCst), 0, "a call entered after calls_ended");
        }
    }
}
