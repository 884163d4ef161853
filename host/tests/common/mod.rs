//! Helpers shared by the guest-fault and runtime-isolation tests: the faulty
//! guest's bytes, message construction, and a [`CallLog`] that timestamps every
//! guest call. Waiting and assertions stay in each test file.

#![allow(dead_code, reason = "each test crate uses a different subset")]

pub mod cluster;
pub mod compliance;
pub mod devloop;
pub mod http;
pub mod nats;
pub mod nats_proxy;
pub mod nats_servers;
pub mod pg;
pub mod rabbit;
pub mod registry;
pub mod tools;

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Instant;

use parking_lot::Mutex;
use weir::envelope::{self, Envelope};
use weir::runtime::{CallObserver, HandlerSettings, Runtime, RuntimeOptions};

/// Run `cleanup` to completion from a `Drop`: drop cannot await, and may run
/// inside the test's runtime, so it gets a thread and a runtime of its own.
pub fn clean_up_on_a_thread<F>(cleanup: impl FnOnce() -> F + Send + 'static)
where
    F: std::future::Future<Output = ()>,
{
    let thread = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(cleanup());
    });
    let _ = thread.join();
}

/// The faulty test guest, as built by `host/build.rs`.
pub fn faulty_bytes() -> Vec<u8> {
    let path = weir::node::bundled::FAULTY_PATH;
    std::fs::read(path).unwrap_or_else(|e| panic!("reading the faulty guest at {path}: {e}"))
}

/// `options` with the compiled-code cache in the test scratch directory,
/// warmed once per test binary: the first caller compiles the faulty guest
/// (the others wait), so parallel tests do not each compile it again.
pub fn cached(mut options: RuntimeOptions) -> RuntimeOptions {
    static WARM: OnceLock<()> = OnceLock::new();
    options.cache_dir = Some(PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("weir-compiled-guests"));
    WARM.get_or_init(|| {
        let rt = Runtime::new(options.clone()).expect("warm-up runtime starts");
        let mut settings = HandlerSettings::new("warm-up");
        settings.memory_limit = options.max_memory;
        rt.load(&faulty_bytes(), settings, "faulty guest (cache warm-up)")
            .expect("the faulty guest compiles");
    });
    options
}

/// A fresh message (attempt 1, no tenant, no extra headers).
pub fn message(message_type: &str, group: Option<&str>, payload: &[u8]) -> Envelope {
    envelope::new_message(
        envelope::fresh_id(),
        message_type,
        group.map(str::to_owned),
        None,
        Vec::new(),
        payload.to_vec(),
    )
}

/// One guest call as the observer saw it.
#[derive(Debug, Clone)]
pub struct Call {
    /// Message id.
    pub id: String,
    /// Message type.
    pub message_type: String,
    /// Group id.
    pub group: Option<String>,
    /// Delivery attempt.
    pub attempt: u32,
    /// Right before the guest was entered.
    pub start: Instant,
    /// Right after it returned, trapped or was interrupted (`None`: still running).
    pub end: Option<Instant>,
}

impl Call {
    /// How long the call ran; panics if it has not ended.
    pub fn duration(&self) -> std::time::Duration {
        self.end
            .unwrap_or_else(|| panic!("call of {} (attempt {}) has not ended", self.id, self.attempt))
            - self.start
    }
}

/// Records every guest call with timestamps.
#[derive(Debug, Default)]
pub struct CallLog {
    calls: Mutex<Vec<Call>>,
}

impl CallLog {
    /// Every call so far, in start order.
    pub fn all(&self) -> Vec<Call> {
        self.calls.lock().clone()
    }

    /// The calls of message `id`, in start order.
    pub fn of(&self, id: &str) -> Vec<Call> {
        self.calls.lock().iter().filter(|c| c.id == id).cloned().collect()
    }

    /// The calls of messages of type `message_type`.
    pub fn of_type(&self, message_type: &str) -> Vec<Call> {
        self.calls
            .lock()
            .iter()
            .filter(|c| c.message_type == message_type)
            .cloned()
            .collect()
    }
}

impl CallObserver for CallLog {
    fn before(&self, msg: &Envelope) {
        self.calls.lock().push(Call {
            id: msg.id.clone(),
            message_type: msg.message_type.clone(),
            group: msg.group_id.clone(),
            attempt: msg.attempt,
            start: Instant::now(),
            end: None,
        });
    }

    fn after(&self, msg: &Envelope) {
        let now = Instant::now();
        let mut calls = self.calls.lock();
        if let Some(c) = calls
            .iter_mut()
            .rev()
            .find(|c| c.id == msg.id && c.attempt == msg.attempt && c.end.is_none())
        {
            c.end = Some(now);
        }
    }
}

/// Publish like a careful client: a broker may refuse (nack) a publish, as
/// RabbitMQ did here once while a consumer of the queue was being killed;
/// the publisher tries again (at-least-once), up to five times.
pub async fn publish_confirmed(
    t: &(impl weir::transport::Transport + ?Sized),
    topology: &str,
    slot: u32,
    msg: &Envelope,
) {
    let mut attempt = 1;
    loop {
        match t.publish(topology, slot, envelope::encode(msg)).await {
            Ok(()) => return,
            Err(e) if attempt < 5 => {
                eprintln!("publish of {} refused ({e}); trying again", msg.id);
                attempt += 1;
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
            Err(e) => panic!("publish of {} failed {attempt} times: {e}", msg.id),
        }
    }
}
