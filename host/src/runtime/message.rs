//! The 0.3.0 world's `message` and `batch` resources: handles onto the
//! messages of the call being run, which the host keeps where they are. A
//! guest reads a field through an accessor, and only that field is copied
//! into its memory; a noop call lowers one handle and nothing else.
//!
//! A handle's `rep` is the member's index in the call, tagged with the
//! call's number ([`CallMessages`]): an owned handle a guest kept from an
//! earlier call (`batch.member` hands out owned ones) names no message of
//! this call, and using it traps instead of reading another message.

use std::ptr::NonNull;

use crate::envelope::Envelope;

/// Bits of a `rep` that hold the member's index (the rest hold the call's number).
const INDEX_BITS: u32 = 20;
const INDEX_MASK: u32 = (1 << INDEX_BITS) - 1;

/// The messages of the call being run, lent by the executor for exactly
/// that call ([`lend`]).
#[derive(Debug, Default)]
pub(crate) struct CallMessages {
    /// The call's messages; `None` between calls.
    at: Option<NonNull<Envelope>>,
    len: usize,
    /// The call's number (wrapping, `32 - INDEX_BITS` bits), part of every `rep`.
    call: u32,
    /// `RuntimeOptions::negative_control_unchecked_handles`: the call's
    /// number is not checked (a red baseline).
    pub(crate) unchecked: bool,
}

// SAFETY: `at` is only set while the executor's borrow of the messages is
// alive (`lend` clears it before that borrow ends) and only read through
// `&self` by host functions the same call runs, on the thread that runs it.
// The store may move between threads between calls, when `at` is `None`.
unsafe impl Send for CallMessages {}

impl CallMessages {
    /// The `rep` of member `index` of the call being run.
    pub(super) fn rep(&self, index: u32) -> u32 {
        (self.call << INDEX_BITS) | index
    }

    /// The message a `rep` names, if it belongs to the call being run.
    pub(super) fn get(&self, rep: u32) -> wasmtime::Result<&Envelope> {
        let index = (rep & INDEX_MASK) as usize;
        match self.at {
            Some(at) if (self.unchecked || rep >> INDEX_BITS == self.call) && index < self.len => {
                // SAFETY: `at..at+len` is the slice `lend` was given, borrowed
                // for as long as `at` is set; `index < len`.
                Ok(unsafe { &*at.as_ptr().add(index) })
            }
            _ => Err(wasmtime::format_err!(
                "a weir:handler message handle was used outside the call it was given to"
            )),
        }
    }

    /// Members of the call being run.
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// Start a call over `messages`: a new call number, and the messages
    /// readable until [`CallMessages::end`]. Only [`lend`] calls it.
    fn start(&mut self, messages: &[Envelope]) {
        self.call = (self.call + 1) & (u32::MAX >> INDEX_BITS);
        self.at = NonNull::new(messages.as_ptr().cast_mut());
        self.len = messages.len().min(INDEX_MASK as usize);
    }

    fn end(&mut self) {
        self.at = None;
        self.len = 0;
    }
}

/// Run `call` with `messages` readable through the 0.3.0 handles of the
/// store's [`CallMessages`] (`messages_of` finds them in the store's data);
/// they are unreachable again once it returns, or unwinds.
pub(super) fn lend<S, R>(
    store: &mut S,
    messages_of: fn(&mut S) -> &mut CallMessages,
    messages: &[Envelope],
    call: impl FnOnce(&mut S) -> R,
) -> R {
    struct End<'a, S> {
        store: &'a mut S,
        messages_of: fn(&mut S) -> &mut CallMessages,
    }
    impl<S> Drop for End<'_, S> {
        fn drop(&mut self) {
            (self.messages_of)(self.store).end();
        }
    }
    messages_of(store).start(messages);
    let guard = End { store, messages_of };
    call(&mut *guard.store)
}
