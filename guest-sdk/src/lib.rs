//! Write Weir message handlers in Rust.
//!
//! A handler is a type that implements [`Handler`], exported from a `cdylib` crate with
//! [`export!`] and built for `wasm32-wasip2`. This crate owns the guest side of the
//! `weir:handler` WIT contract; everything about brokers, slots, lanes, retries and dead letters
//! belongs to the host and is invisible here.
//!
//! What a handler returns decides what happens to the message:
//!
//! | the handler returns | the host                                          |
//! |---------------------|---------------------------------------------------|
//! | `Ok(())`            | publishes the cascaded messages, then acks        |
//! | [`Failure::retry`]  | puts the message back on the retry ladder         |
//! | [`Failure::reject`] | dead-letters it now (poison message)              |
//! | a trap (panic, OOM) | treats it as a retry and discards the instance    |
//!
//! `?` on an ordinary error (anything implementing [`std::error::Error`]) means **retry**:
//! an error you did not anticipate is assumed to be transient. Rejecting is always explicit,
//! except for [`Message::json`] and [`Message::text`], which reject because a payload that does
//! not decode today will not decode tomorrow.
//!
//! # Example
//!
//! ```rust
//! use serde::{Deserialize, Serialize};
//! use weir_guest::{Failure, Handler, Message};
//!
//! #[derive(Deserialize)]
//! struct Greeting {
//!     name: String,
//! }
//!
//! #[derive(Serialize)]
//! struct Greeted<'a> {
//!     name: &'a str,
//!     attempt: u32,
//! }
//!
//! struct Greeter;
//!
//! impl Handler for Greeter {
//!     fn handle(msg: Message) -> Result<(), Failure> {
//!         if msg.message_type() != "greeting" {
//!             return Err(Failure::reject(format!("unknown message type {:?}", msg.message_type())));
//!         }
//!         // A payload that is not a `Greeting` is rejected (dead-lettered) with serde's reason.
//!         let greeting: Greeting = msg.json()?;
//!         if greeting.name.is_empty() {
//!             return Err(Failure::reject("a greeting needs a name"));
//!         }
//!         let salutation = weir_guest::config("salutation").unwrap_or_else(|| "Hello".into());
//!         weir_guest::info!("{salutation}, {}!", greeting.name);
//!         // Held by the host until this call succeeds; a host error becomes a retry.
//!         weir_guest::publish_json(
//!             "greeted",
//!             msg.group_id(),
//!             &Greeted { name: &greeting.name, attempt: msg.attempt() },
//!         )?;
//!         Ok(())
//!     }
//! }
//!
//! weir_guest::export!(Greeter);
//! # fn main() {}
//! ```
//!
//! Build it with `cargo build --release --target wasm32-wasip2`; the `cdylib` artifact is
//! already a component.
//!
//! # Testing natively
//!
//! On targets other than `wasm32` the host imports ([`publish`], [`log()`], [`config`]) are
//! served by a per-thread in-memory host, driven through the [`testing`] module, so a handler's
//! logic can be unit-tested with plain `cargo test`.

#![warn(missing_docs)]

#[cfg(not(target_arch = "wasm32"))]
pub mod testing;

use std::cell::OnceCell;
use std::fmt;
use std::mem::ManuallyDrop;

use serde::Serialize;
use serde::de::DeserializeOwned;

use __private::bindings::weir::handler::types as wit;

/// A message handler.
///
/// Both functions are associated functions without `self`: the host may run every call on a
/// fresh instance, so a handler must not rely on anything surviving between calls.
pub trait Handler {
    /// Handles one message.
    fn handle(msg: Message) -> Result<(), Failure>;

    /// Handles a batch (all of one tenant and group, in arrival order) and returns exactly one
    /// result per message, in the same order.
    ///
    /// The default calls [`Handler::handle`] for each message, through [`members`], so that what
    /// each call [`publish`]es belongs to its message: it is sent only if that message succeeds.
    ///
    /// Override it to do bulk work (one lookup, one config read, one validation pass for the
    /// whole batch). Iterate with [`members`], or call [`begin_member`] before publishing for a
    /// member: a message published before the first [`begin_member`] of a call belongs to the
    /// whole batch, and if some member then fails, the host replays every member alone through
    /// [`Handler::handle`]. If an override returns the wrong number of results, every message of
    /// the batch is retried with an error naming both counts.
    fn handle_batch(batch: Vec<Message>) -> Vec<Result<(), Failure>> {
        members(batch).map(Self::handle).collect()
    }
}

/// One incoming message, as delivered by the host.
///
/// The host keeps the message; each accessor reads its field from the host the first time it
/// is called and keeps it, so a field the handler never reads is never copied (WIT 0.3.0).
/// A message handed to [`Handler::handle`] or [`Handler::handle_batch`] is readable during
/// that call only.
pub struct Message {
    host: Host,
    id: OnceCell<String>,
    message_type: OnceCell<String>,
    group_id: OnceCell<Option<String>>,
    tenant_id: OnceCell<Option<String>>,
    headers: OnceCell<Vec<(String, String)>>,
    payload: OnceCell<Vec<u8>>,
    attempt: OnceCell<u32>,
}

/// Where a [`Message`]'s fields come from.
enum Host {
    /// Built by hand ([`Message::new`]): every field is set.
    Local,
    /// The message of a `handle` call: borrowed from the host, so never dropped here.
    Borrowed(ManuallyDrop<wit::Message>),
    /// A member of a `handle-batch` call.
    Owned(wit::Message),
}

impl Message {
    /// Builds a message by hand: for tests. It has no group, no tenant, no headers and is on its
    /// first attempt; the `with_*` methods set the rest.
    pub fn new(id: impl Into<String>, message_type: impl Into<String>, payload: impl Into<Vec<u8>>) -> Self {
        Message {
            host: Host::Local,
            id: OnceCell::from(id.into()),
            message_type: OnceCell::from(message_type.into()),
            group_id: OnceCell::from(None),
            tenant_id: OnceCell::from(None),
            headers: OnceCell::from(Vec::new()),
            payload: OnceCell::from(payload.into()),
            attempt: OnceCell::from(1),
        }
    }

    fn from_host(host: Host) -> Self {
        Message {
            host,
            id: OnceCell::new(),
            message_type: OnceCell::new(),
            group_id: OnceCell::new(),
            tenant_id: OnceCell::new(),
            headers: OnceCell::new(),
            payload: OnceCell::new(),
            attempt: OnceCell::new(),
        }
    }

    /// The message of a `handle` call, read through the host's handle.
    fn borrowed(msg: &wit::Message) -> Self {
        // SAFETY: the handle stays the host's (ManuallyDrop: never dropped here) and is only
        // used while `msg` is borrowed, during the call it was given to; a use after that
        // traps in the host, it never reads another message.
        Self::from_host(Host::Borrowed(ManuallyDrop::new(unsafe {
            wit::Message::from_handle(msg.handle())
        })))
    }

    /// The host's handle, or `None` for a message built by hand.
    fn host(&self) -> Option<&wit::Message> {
        match &self.host {
            Host::Local => None,
            Host::Borrowed(m) => Some(m),
            Host::Owned(m) => Some(m),
        }
    }

    /// Sets the group id (tests).
    pub fn with_group_id(mut self, group_id: impl Into<String>) -> Self {
        self.group_id = OnceCell::from(Some(group_id.into()));
        self
    }

    /// Sets the tenant id (tests).
    pub fn with_tenant_id(mut self, tenant_id: impl Into<String>) -> Self {
        self.tenant_id = OnceCell::from(Some(tenant_id.into()));
        self
    }

    /// Appends a header (tests).
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        let _ = self.headers();
        if let Some(h) = self.headers.get_mut() {
            h.push((name.into(), value.into()));
        }
        self
    }

    /// Sets the delivery attempt, 1 for the first delivery (tests).
    pub fn with_attempt(mut self, attempt: u32) -> Self {
        self.attempt = OnceCell::from(attempt);
        self
    }

    /// Unique id of the message, stable across redeliveries.
    pub fn id(&self) -> &str {
        self.id
            .get_or_init(|| self.host().map(wit::Message::id).unwrap_or_default())
    }

    /// The routing type, e.g. `order.placed`.
    pub fn message_type(&self) -> &str {
        self.message_type
            .get_or_init(|| self.host().map(wit::Message::message_type).unwrap_or_default())
    }

    /// The group id; messages of one group never run concurrently. `None` means unordered
    /// (an empty group id is delivered as `None`).
    pub fn group_id(&self) -> Option<&str> {
        self.group_id
            .get_or_init(|| self.host().and_then(wit::Message::group_id))
            .as_deref()
            .filter(|g| !g.is_empty())
    }

    /// The tenant the message belongs to, if any.
    pub fn tenant_id(&self) -> Option<&str> {
        self.tenant_id
            .get_or_init(|| self.host().and_then(wit::Message::tenant_id))
            .as_deref()
    }

    /// The first header named `name`, compared ASCII case-insensitively.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v)
    }

    /// The other headers as delivered, in delivery order. The message id, type, group, tenant
    /// and attempt are fields ([`Message::id`] and friends), not repeated here.
    pub fn headers(&self) -> impl Iterator<Item = (&str, &str)> {
        self.headers
            .get_or_init(|| self.host().map(wit::Message::headers).unwrap_or_default())
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_str()))
    }

    /// The body, untouched.
    pub fn payload(&self) -> &[u8] {
        self.payload
            .get_or_init(|| self.host().map(wit::Message::payload).unwrap_or_default())
    }

    /// Takes the body out of the message, leaving it empty.
    pub fn take_payload(&mut self) -> Vec<u8> {
        let body = match self.payload.take() {
            Some(body) => body,
            None => self.host().map(wit::Message::payload).unwrap_or_default(),
        };
        self.payload = OnceCell::from(Vec::new());
        body
    }

    /// The delivery attempt: 1 on the first delivery, incremented on every retry. Use it to
    /// give up early or to back off in the handler's own logic.
    pub fn attempt(&self) -> u32 {
        *self
            .attempt
            .get_or_init(|| self.host().map_or(1, wit::Message::attempt))
    }

    /// Decodes the payload as JSON. A payload that does not decode is **rejected** (poison):
    /// the reason names the message type, the target type and serde's error.
    pub fn json<T: DeserializeOwned>(&self) -> Result<T, Failure> {
        serde_json::from_slice(self.payload()).map_err(|e| {
            Failure::reject(format!(
                "payload of {:?} is not a valid {}: {e}",
                self.message_type(),
                std::any::type_name::<T>()
            ))
        })
    }

    /// The payload as UTF-8 text. A payload that is not UTF-8 is **rejected** (poison).
    pub fn text(&self) -> Result<&str, Failure> {
        std::str::from_utf8(self.payload())
            .map_err(|e| Failure::reject(format!("payload of {:?} is not UTF-8: {e}", self.message_type())))
    }
}

/// A copy with every field read: it no longer depends on the host's handle.
impl Clone for Message {
    fn clone(&self) -> Self {
        Message {
            host: Host::Local,
            id: OnceCell::from(self.id().to_owned()),
            message_type: OnceCell::from(self.message_type().to_owned()),
            group_id: OnceCell::from(self.group_id().map(str::to_owned)),
            tenant_id: OnceCell::from(self.tenant_id().map(str::to_owned)),
            headers: OnceCell::from(
                self.headers()
                    .map(|(n, v)| (n.to_owned(), v.to_owned()))
                    .collect::<Vec<_>>(),
            ),
            payload: OnceCell::from(self.payload().to_vec()),
            attempt: OnceCell::from(self.attempt()),
        }
    }
}

impl fmt::Debug for Message {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Message")
            .field("id", &self.id())
            .field("message_type", &self.message_type())
            .field("group_id", &self.group_id())
            .field("tenant_id", &self.tenant_id())
            .field("headers", &self.headers().collect::<Vec<_>>())
            .field("payload_len", &self.payload().len())
            .field("attempt", &self.attempt())
            .finish()
    }
}

/// Why a message could not be handled: transient ([`Failure::retry`]) or permanent
/// ([`Failure::reject`]).
///
/// Any [`std::error::Error`] converts into a *retry* through `From`, so `?` on an ordinary
/// error puts the message back on the retry ladder. To make an error permanent, say so:
/// `.map_err(Failure::reject)?`.
///
/// `Failure` deliberately does not implement [`std::error::Error`] itself: that would conflict
/// with the blanket conversion (the same design as `anyhow::Error`). It implements
/// [`Display`](fmt::Display) and [`Debug`](fmt::Debug).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    kind: FailureKind,
    reason: String,
}

/// The two dispositions of a [`Failure`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FailureKind {
    /// Transient: the host retries the message on its ladder, then dead-letters it when the
    /// ladder is exhausted.
    Retry,
    /// Permanent: the host dead-letters the message now.
    Reject,
}

impl Failure {
    /// A transient failure: try again later.
    pub fn retry(reason: impl fmt::Display) -> Self {
        Failure {
            kind: FailureKind::Retry,
            reason: reason.to_string(),
        }
    }

    /// A permanent failure: dead-letter the message now, with `reason` as its error text.
    pub fn reject(reason: impl fmt::Display) -> Self {
        Failure {
            kind: FailureKind::Reject,
            reason: reason.to_string(),
        }
    }

    /// Whether this is a retry or a reject.
    pub fn kind(&self) -> FailureKind {
        self.kind
    }

    /// True for [`Failure::retry`].
    pub fn is_retry(&self) -> bool {
        self.kind == FailureKind::Retry
    }

    /// True for [`Failure::reject`].
    pub fn is_reject(&self) -> bool {
        self.kind == FailureKind::Reject
    }

    /// The reason text, as the host will record it.
    pub fn reason(&self) -> &str {
        &self.reason
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.kind {
            FailureKind::Retry => "retry",
            FailureKind::Reject => "reject",
        };
        write!(f, "{kind}: {}", self.reason)
    }
}

/// `?` on an ordinary error means retry. The reason is the error followed by its sources,
/// joined with `": "`.
impl<E: std::error::Error> From<E> for Failure {
    fn from(error: E) -> Self {
        let mut reason = error.to_string();
        let mut source = error.source();
        while let Some(cause) = source {
            reason.push_str(": ");
            reason.push_str(&cause.to_string());
            source = cause.source();
        }
        Failure::retry(reason)
    }
}

impl From<Failure> for wit::Failure {
    fn from(failure: Failure) -> Self {
        match failure.kind {
            FailureKind::Retry => wit::Failure::Retry(failure.reason),
            FailureKind::Reject => wit::Failure::Reject(failure.reason),
        }
    }
}

/// Severity of a log line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Level {
    /// Very detailed tracing.
    Trace,
    /// Diagnostics for developers.
    Debug,
    /// Normal operation.
    Info,
    /// Something unexpected that the handler coped with.
    Warn,
    /// Something failed.
    Error,
}

/// Writes a line to the host's log; the host tags it with the handler and the current message.
pub fn log(level: Level, text: &str) {
    imports::log(level, text);
}

/// Publishes a message. The host holds it until the current call succeeds, then sends it
/// through the broker (with confirms) before acknowledging the incoming message; it inherits the
/// incoming message's tenant. If the call fails or traps, nothing is published.
///
/// # Errors
/// The host's refusal (e.g. too many messages, a reserved header) as a [`Failure::retry`].
pub fn publish(
    message_type: &str,
    group_id: Option<&str>,
    headers: &[(&str, &str)],
    payload: &[u8],
) -> Result<(), Failure> {
    imports::publish(message_type, group_id, headers, payload)
        .map_err(|e| Failure::retry(format!("publishing {message_type:?} failed: {e}")))
}

/// Publishes `value` as JSON with the header `content-type: application/json`; see [`publish`].
///
/// # Errors
/// A value that cannot be serialized is a [`Failure::reject`] (it is a bug in the handler that
/// retrying cannot fix); a host refusal is a [`Failure::retry`].
pub fn publish_json<T: Serialize + ?Sized>(
    message_type: &str,
    group_id: Option<&str>,
    value: &T,
) -> Result<(), Failure> {
    let payload = serde_json::to_vec(value).map_err(|e| {
        Failure::reject(format!(
            "cannot serialize {} for {message_type:?}: {e}",
            std::any::type_name::<T>()
        ))
    })?;
    publish(
        message_type,
        group_id,
        &[("content-type", "application/json")],
        &payload,
    )
}

/// A value from this handler's own config table (the `config` map of its `[[handler]]` entry).
pub fn config(key: &str) -> Option<String> {
    imports::config(key)
}

/// In [`Handler::handle_batch`]: what is [`publish`]ed from now on belongs to member `index` of
/// the batch (0-based, batch order), until the next `begin_member`. The host sends it only if
/// that member's result is `Ok`, before acknowledging that member; it drops it if the member
/// fails. Members may be begun in any order and more than once. [`members`] calls this for you.
///
/// In [`Handler::handle`] the message is member 0. An index outside the batch traps the call
/// (the host then replays each member alone through [`Handler::handle`]).
pub fn begin_member(index: usize) {
    imports::begin_member(u32::try_from(index).unwrap_or(u32::MAX));
}

/// The messages of a batch, each yielded after [`begin_member`] for it, so that what is
/// published while handling a message belongs to that message:
///
/// ```
/// use weir_guest::{Failure, Message};
///
/// fn handle_batch(batch: Vec<Message>) -> Vec<Result<(), Failure>> {
///     let currency = weir_guest::config("currency"); // once for the whole batch
///     weir_guest::members(batch)
///         .map(|msg| weir_guest::publish("seen", msg.group_id(), &[], currency.as_deref().unwrap_or("EUR").as_bytes()))
///         .collect()
/// }
/// # weir_guest::testing::reset();
/// # let results = handle_batch(vec![Message::new("a", "t", ""), Message::new("b", "t", "")]);
/// # assert_eq!(results.len(), 2);
/// # let members: Vec<_> = weir_guest::testing::take_published().into_iter().map(|p| p.member).collect();
/// # assert_eq!(members, [Some(0), Some(1)]);
/// ```
pub fn members(batch: Vec<Message>) -> Members {
    Members {
        inner: batch.into_iter().enumerate(),
    }
}

/// The iterator of [`members`].
pub struct Members {
    inner: std::iter::Enumerate<std::vec::IntoIter<Message>>,
}

impl Iterator for Members {
    type Item = Message;

    fn next(&mut self) -> Option<Message> {
        let (index, msg) = self.inner.next()?;
        begin_member(index);
        Some(msg)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.inner.size_hint()
    }
}

impl ExactSizeIterator for Members {}

/// Log functions, one per [`Level`]; the macros ([`info!`] etc.) format and call these.
pub mod log {
    use super::Level;

    /// Logs `text` at [`Level::Trace`].
    pub fn trace(text: &str) {
        super::log(Level::Trace, text);
    }
    /// Logs `text` at [`Level::Debug`].
    pub fn debug(text: &str) {
        super::log(Level::Debug, text);
    }
    /// Logs `text` at [`Level::Info`].
    pub fn info(text: &str) {
        super::log(Level::Info, text);
    }
    /// Logs `text` at [`Level::Warn`].
    pub fn warn(text: &str) {
        super::log(Level::Warn, text);
    }
    /// Logs `text` at [`Level::Error`].
    pub fn error(text: &str) {
        super::log(Level::Error, text);
    }
}

/// Logs a `format!`-style line at trace level.
#[macro_export]
macro_rules! trace {
    ($($arg:tt)+) => { $crate::log($crate::Level::Trace, &::std::format!($($arg)+)) };
}
/// Logs a `format!`-style line at debug level.
#[macro_export]
macro_rules! debug {
    ($($arg:tt)+) => { $crate::log($crate::Level::Debug, &::std::format!($($arg)+)) };
}
/// Logs a `format!`-style line at info level.
#[macro_export]
macro_rules! info {
    ($($arg:tt)+) => { $crate::log($crate::Level::Info, &::std::format!($($arg)+)) };
}
/// Logs a `format!`-style line at warn level.
#[macro_export]
macro_rules! warn {
    ($($arg:tt)+) => { $crate::log($crate::Level::Warn, &::std::format!($($arg)+)) };
}
/// Logs a `format!`-style line at error level.
#[macro_export]
macro_rules! error {
    ($($arg:tt)+) => { $crate::log($crate::Level::Error, &::std::format!($($arg)+)) };
}

/// Exports a [`Handler`] as this component's `handle` and `handle-batch`.
///
/// Invoke it exactly once, at item level, in the `cdylib` crate that builds the component:
/// `weir_guest::export!(MyHandler);`. The argument may be any type path that implements
/// [`Handler`].
#[macro_export]
macro_rules! export {
    ($handler:ty) => {
        const _: () = {
            type WeirGuestExport = $crate::__private::Export<$handler>;
    $crate::__private::__weir_export_world!(WeirGuestExport with_types_in $crate::__private::bindings);
        };
    };
}

/// The host imports: the real ones on wasm32, the in-memory test host elsewhere.
mod imports {
    #[cfg(not(target_arch = "wasm32"))]
    pub(crate) use crate::testing::imports::*;
    #[cfg(target_arch = "wasm32")]
    pub(crate) use real::*;

    #[cfg(target_arch = "wasm32")]
    mod real {
        use crate::__private::bindings::weir::handler::{host, types};
        use crate::Level;

        pub(crate) fn log(level: Level, text: &str) {
            let level = match level {
                Level::Trace => types::Level::Trace,
                Level::Debug => types::Level::Debug,
                Level::Info => types::Level::Info,
                Level::Warn => types::Level::Warn,
                Level::Error => types::Level::Error,
            };
            host::log(level, text);
        }

        pub(crate) fn publish(
            message_type: &str,
            group_id: Option<&str>,
            headers: &[(&str, &str)],
            payload: &[u8],
        ) -> Result<(), String> {
            host::publish(message_type, group_id, headers, payload)
        }

        pub(crate) fn config(key: &str) -> Option<String> {
            host::config(key)
        }

        pub(crate) fn begin_member(index: u32) {
            host::begin_member(index);
        }
    }
}

/// Used by [`export!`]; not part of the API.
#[doc(hidden)]
pub mod __private {
    /// The generated bindings.
    #[allow(clippy::all, reason = "generated by wit-bindgen")]
    pub mod bindings {
        wit_bindgen::generate!({
            // The crate's own copy of `wit/handler.wit` (the same bytes: the
            // host's layout test checks), so the crate packages on its own.
            path: "wit/handler.wit",
            world: "handler",
            ownership: Borrowing { duplicate_if_necessary: false },
            pub_export_macro: true,
            export_macro_name: "__weir_export_world",
            default_bindings_module: "$crate::__private::bindings",
        });
    }

    pub use bindings::__weir_export_world;

    use crate::{Handler, Host, Message, wit};

    /// Adapts a [`Handler`] to the generated `Guest` trait.
    pub struct Export<H>(core::marker::PhantomData<H>);

    impl<H: Handler> bindings::Guest for Export<H> {
        fn handle(msg: &wit::Message) -> Result<(), wit::Failure> {
            H::handle(Message::borrowed(msg)).map_err(wit::Failure::from)
        }

        fn handle_batch(batch: &wit::Batch) -> Vec<Result<(), wit::Failure>> {
            let members = (0..batch.len()).map(|i| Message::from_host(Host::Owned(batch.member(i))));
            handle_batch::<H>(members.collect())
        }
    }

    /// [`Handler::handle_batch`], with the length of its answer checked.
    pub(crate) fn handle_batch<H: Handler>(batch: Vec<Message>) -> Vec<Result<(), wit::Failure>> {
        let expected = batch.len();
        let results = H::handle_batch(batch);
        if results.len() != expected {
            let reason = format!(
                "handle_batch returned {} results for {expected} messages",
                results.len()
            );
            return vec![Err(wit::Failure::Retry(reason)); expected];
        }
        results.into_iter().map(|r| r.map_err(wit::Failure::from)).collect()
    }
}

#[cfg(all(test, not(target_arch = "wasm32")))]
mod tests {
    use super::__private::handle_batch;
    use super::*;

    #[derive(Debug)]
    struct Outer(std::io::Error);
    impl fmt::Display for Outer {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("loading the price list")
        }
    }
    impl std::error::Error for Outer {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn question_mark_on_an_error_means_retry_with_its_sources() {
        fn load() -> Result<(), Failure> {
            Err(Outer(std::io::Error::other("connection reset")))?
        }
        let failure = load().unwrap_err();
        assert_eq!(failure.kind(), FailureKind::Retry);
        assert_eq!(failure.reason(), "loading the price list: connection reset");
        assert_eq!(failure.to_string(), "retry: loading the price list: connection reset");
    }

    #[test]
    fn decoding_errors_reject_and_name_the_type() {
        #[derive(Debug, serde::Deserialize)]
        #[allow(dead_code, reason = "only decoded")]
        struct Order {
            id: u32,
        }
        let failure = Message::new("m", "order", "{\"id\":\"x\"}")
            .json::<Order>()
            .unwrap_err();
        assert!(failure.is_reject());
        assert!(failure.reason().contains("Order"), "{failure}");
        assert!(failure.reason().contains("invalid type"), "{failure}");
        assert!(Message::new("m", "t", vec![0xff]).text().unwrap_err().is_reject());
        assert_eq!(Message::new("m", "t", "hé").text().unwrap(), "hé");
    }

    #[test]
    fn message_accessors() {
        let msg = Message::new("m-1", "t", "p")
            .with_group_id("g")
            .with_tenant_id("acme")
            .with_header("Weir-Attempt", "2")
            .with_attempt(2);
        assert_eq!((msg.id(), msg.message_type(), msg.payload()), ("m-1", "t", &b"p"[..]));
        assert_eq!((msg.group_id(), msg.tenant_id()), (Some("g"), Some("acme")));
        assert_eq!(msg.header("weir-attempt"), Some("2"));
        assert_eq!(msg.header("weir-group-id"), None);
        assert_eq!(msg.attempt(), 2);
        assert_eq!(Message::new("m", "t", "").with_group_id("").group_id(), None);
    }

    #[test]
    fn publish_failures_are_retries_and_json_is_labelled() {
        testing::reset();
        publish_json("done", Some("g"), &serde_json::json!({ "n": 1 })).unwrap();
        let published = testing::take_published();
        assert_eq!(
            published[0].headers,
            [("content-type".to_owned(), "application/json".to_owned())]
        );
        assert_eq!(published[0].text(), r#"{"n":1}"#);
        testing::fail_publish(Some("too many messages"));
        let failure = publish("done", None, &[], b"").unwrap_err();
        assert!(failure.is_retry());
        assert!(failure.reason().contains("too many messages"), "{failure}");
    }

    #[test]
    fn logs_and_config_reach_the_host() {
        testing::reset();
        testing::set_config("currency", "EUR");
        assert_eq!(config("currency").as_deref(), Some("EUR"));
        assert_eq!(config("missing"), None);
        crate::warn!("low stock: {}", 3);
        log::error("gone");
        assert_eq!(
            testing::take_logs(),
            [
                (Level::Warn, "low stock: 3".to_owned()),
                (Level::Error, "gone".to_owned())
            ]
        );
    }

    struct Short;
    impl Handler for Short {
        fn handle(msg: Message) -> Result<(), Failure> {
            match msg.message_type() {
                "bad" => Err(Failure::reject("bad")),
                _ => Ok(()),
            }
        }
        fn handle_batch(_batch: Vec<Message>) -> Vec<Result<(), Failure>> {
            vec![Ok(())]
        }
    }

    fn wit_message(message_type: &str) -> Message {
        Message::new("m", message_type, "")
    }

    struct Publisher;
    impl Handler for Publisher {
        fn handle(msg: Message) -> Result<(), Failure> {
            publish("out", None, &[], msg.id().as_bytes())?;
            match msg.message_type() {
                "bad" => Err(Failure::retry("bad")),
                _ => Ok(()),
            }
        }
    }

    #[test]
    fn the_default_batch_loop_attributes_each_publish_to_its_member() {
        testing::reset();
        let results = handle_batch::<Publisher>(vec![wit_message("ok"), wit_message("bad"), wit_message("ok")]);
        assert!(results[0].is_ok() && results[1].is_err() && results[2].is_ok());
        let members: Vec<_> = testing::take_published().into_iter().map(|p| p.member).collect();
        assert_eq!(members, [Some(0), Some(1), Some(2)]);
        // A single call names no member.
        testing::start_call();
        Publisher::handle(wit_message("ok")).unwrap();
        assert_eq!(testing::take_published()[0].member, None);
    }

    #[test]
    fn a_message_built_by_hand_reads_like_a_delivered_one() {
        let mut m = Message::new("m-1", "order.placed", "{}")
            .with_group_id("g")
            .with_header("X-Trace", "t")
            .with_attempt(3);
        assert_eq!(
            (m.id(), m.message_type(), m.group_id(), m.attempt()),
            ("m-1", "order.placed", Some("g"), 3)
        );
        assert_eq!(m.header("x-trace"), Some("t"));
        let copy = m.clone();
        assert_eq!(m.take_payload(), b"{}");
        assert!(m.payload().is_empty(), "taken");
        assert_eq!(copy.payload(), b"{}", "a clone keeps its own payload");
        assert_eq!(
            Message::new("m", "t", "").with_group_id("").group_id(),
            None,
            "empty is none"
        );
    }

    #[test]
    fn adapter_maps_failures_and_guards_the_batch_length() {
        assert!(
            matches!(Short::handle(wit_message("bad")).map_err(wit::Failure::from), Err(wit::Failure::Reject(r)) if r == "bad")
        );
        let results = handle_batch::<Short>(vec![wit_message("a"), wit_message("b")]);
        assert_eq!(results.len(), 2);
        for result in results {
            assert!(
                matches!(result, Err(wit::Failure::Retry(r)) if r == "handle_batch returned 1 results for 2 messages")
            );
        }
    }
}
