//! An in-memory host for native unit tests (only on targets other than `wasm32`).
//!
//! Each test thread has its own host: a config table, the messages published so far (with the
//! batch member each belongs to) and the lines logged so far. Nothing here exists in the built component, where the real host answers.
//!
//! ```
//! use weir_guest::{Failure, Message, testing};
//!
//! fn forward(msg: &Message) -> Result<(), Failure> {
//!     let target = weir_guest::config("target").ok_or_else(|| Failure::reject("no target"))?;
//!     weir_guest::publish(&target, msg.group_id(), &[], msg.payload())
//! }
//!
//! testing::reset();
//! testing::set_config("target", "audit");
//! forward(&Message::new("m-1", "any", "hi").with_group_id("g")).unwrap();
//! let published = testing::take_published();
//! assert_eq!(published[0].message_type, "audit");
//! assert_eq!(published[0].group_id.as_deref(), Some("g"));
//!
//! testing::fail_publish(Some("broker unavailable"));
//! let failure = forward(&Message::new("m-2", "any", "hi")).unwrap_err();
//! assert!(failure.is_retry());
//! ```

use std::cell::RefCell;
use std::collections::HashMap;

use crate::Level;

/// A message the handler published.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Published {
    /// Its message type.
    pub message_type: String,
    /// Its group id.
    pub group_id: Option<String>,
    /// Its headers, in the order given.
    pub headers: Vec<(String, String)>,
    /// Its payload.
    pub payload: Vec<u8>,
    /// The batch member it belongs to: the last [`crate::begin_member`] since [`reset`] (or
    /// since the last [`start_call`]); `None` before any.
    pub member: Option<usize>,
}

impl Published {
    /// The payload as UTF-8 text (lossy), for assertions.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.payload).into_owned()
    }
}

#[derive(Default)]
struct Host {
    config: HashMap<String, String>,
    published: Vec<Published>,
    logs: Vec<(Level, String)>,
    publish_error: Option<String>,
    member: Option<usize>,
}

thread_local! {
    static HOST: RefCell<Host> = RefCell::new(Host::default());
}

/// Clears this thread's host: no config, nothing published or logged, publishing succeeds.
pub fn reset() {
    HOST.with(|h| *h.borrow_mut() = Host::default());
}

/// Sets a key of the handler's config table.
pub fn set_config(key: impl Into<String>, value: impl Into<String>) {
    HOST.with(|h| h.borrow_mut().config.insert(key.into(), value.into()));
}

/// Removes a key from the handler's config table.
pub fn remove_config(key: &str) {
    HOST.with(|h| h.borrow_mut().config.remove(key));
}

/// Starts a new call: what is published next belongs to no member until [`crate::begin_member`]
/// (what the host does at the start of every call).
pub fn start_call() {
    HOST.with(|h| h.borrow_mut().member = None);
}

/// Makes every following [`crate::publish`] fail with `error` (`None`: succeed again).
pub fn fail_publish(error: Option<&str>) {
    HOST.with(|h| h.borrow_mut().publish_error = error.map(str::to_owned));
}

/// Returns and forgets the messages published so far, in order.
pub fn take_published() -> Vec<Published> {
    HOST.with(|h| std::mem::take(&mut h.borrow_mut().published))
}

/// Returns and forgets the lines logged so far, in order.
pub fn take_logs() -> Vec<(Level, String)> {
    HOST.with(|h| std::mem::take(&mut h.borrow_mut().logs))
}

pub(crate) mod imports {
    use super::{HOST, Published};
    use crate::Level;

    pub(crate) fn log(level: Level, text: &str) {
        HOST.with(|h| h.borrow_mut().logs.push((level, text.to_owned())));
    }

    pub(crate) fn publish(
        message_type: &str,
        group_id: Option<&str>,
        headers: &[(&str, &str)],
        payload: &[u8],
    ) -> Result<(), String> {
        HOST.with(|h| {
            let mut host = h.borrow_mut();
            if let Some(error) = &host.publish_error {
                return Err(error.clone());
            }
            let member = host.member;
            host.published.push(Published {
                message_type: message_type.to_owned(),
                group_id: group_id.map(str::to_owned),
                headers: headers
                    .iter()
                    .map(|(n, v)| ((*n).to_owned(), (*v).to_owned()))
                    .collect(),
                payload: payload.to_vec(),
                member,
            });
            Ok(())
        })
    }

    pub(crate) fn begin_member(index: u32) {
        HOST.with(|h| h.borrow_mut().member = Some(index as usize));
    }

    pub(crate) fn config(key: &str) -> Option<String> {
        HOST.with(|h| h.borrow().config.get(key).cloned())
    }
}
