//! The WASI calls that block (`wasi:io/poll` `poll` and `pollable.block`), implemented by the
//! host with the current call's deadline and cancel flag.
//!
//! Epoch interruption only fires while wasm code runs: a guest in `std::thread::sleep` (on
//! wasm32-wasip2 a monotonic-clock `subscribe-duration` and a `block` on it) or waiting on any
//! other pollable sits in the host, where no epoch check happens. These two functions shadow
//! wasmtime-wasi's own and wait for the same futures, but no longer than the call's deadline,
//! and no longer than the cancel flag stays clear (checked every [`super::EPOCH_TICK`]); an
//! interrupted wait traps the instance with [`Interruption::Timeout`] or
//! [`Interruption::Cancelled`] recorded, which the executor reports as that fault.
//! A wait longer than the runtime's `demote_after` also runs the worker's long-call hook,
//! as a CPU-heavy call does: a sleeping call gives its place in the pool to a fresh worker
//! instead of holding it until its timeout.
//! The blocking stream methods (`blocking-read`, `blocking-write-and-flush`, …) are shadowed
//! the same way ([`shadow_streams`]): on stdio and files they answer at once, but a guest
//! granted the network can wait in them for as long as its peer likes.
//! A wait that is ready at once (stdio, files, a ready pollable) is answered on the first
//! poll, without the timers.

use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use super::interrupt::Interrupt;
use anyhow::Context as _;
use wasmtime::StoreContextMut;
use wasmtime::component::{Linker, Resource};
use wasmtime_wasi::p2::bindings::io::poll::{Host as _, HostPollable as _};
use wasmtime_wasi::p2::bindings::io::streams::{
    Host as _, HostInputStream as _, HostOutputStream as _, StreamError as WitStreamError,
};
use wasmtime_wasi::p2::{DynInputStream, DynOutputStream, DynPollable, StreamResult};
use wasmtime_wasi::{ResourceTable, runtime::with_ambient_tokio_runtime};

use super::host::{HostState, Interruption};

/// The `wasi:io/poll` instance wasmtime-wasi 48 defines; guests importing an older 0.2.x
/// resolve to it by semver.
const POLL_INSTANCE: &str = "wasi:io/poll@0.2.12";
/// The `wasi:io/streams` instance, likewise.
const STREAMS_INSTANCE: &str = "wasi:io/streams@0.2.12";

/// Replace `poll` and `[method]pollable.block` in `linker` (which must have WASI already).
pub(super) fn shadow_poll(linker: &mut Linker<HostState>) -> anyhow::Result<()> {
    linker.allow_shadowing(true);
    let mut poll = linker
        .instance(POLL_INSTANCE)
        .map_err(anyhow::Error::from)
        .with_context(|| format!("opening {POLL_INSTANCE} in the linker"))?;
    poll.func_wrap(
        "poll",
        |mut store: StoreContextMut<'_, HostState>, (list,): (Vec<Resource<DynPollable>>,)| {
            let state = store.data_mut();
            let (deadline, cancel, long) = (state.deadline, state.cancel.clone(), long_wait(state));
            let r = bounded(deadline, cancel, long, state.table.poll(list));
            match r {
                Ok(ready) => Ok((ready?,)),
                Err(why) => Err(interrupt(state, why)),
            }
        },
    )
    .map_err(anyhow::Error::from)
    .context("shadowing wasi:io/poll.poll")?;
    poll.func_wrap(
        "[method]pollable.block",
        |mut store: StoreContextMut<'_, HostState>, (p,): (Resource<DynPollable>,)| {
            let state = store.data_mut();
            let (deadline, cancel, long) = (state.deadline, state.cancel.clone(), long_wait(state));
            let r = bounded(deadline, cancel, long, state.table.block(p));
            match r {
                Ok(done) => done,
                Err(why) => Err(interrupt(state, why)),
            }
        },
    )
    .map_err(anyhow::Error::from)
    .context("shadowing wasi:io/poll.[method]pollable.block")?;
    linker.allow_shadowing(false);
    Ok(())
}

/// Replace the six blocking methods of `wasi:io/streams` in `linker` (which must have WASI
/// already): each waits as wasmtime-wasi's own does, within the call's deadline and cancel flag.
pub(super) fn shadow_streams(linker: &mut Linker<HostState>) -> anyhow::Result<()> {
    linker.allow_shadowing(true);
    let mut streams = linker
        .instance(STREAMS_INSTANCE)
        .map_err(anyhow::Error::from)
        .with_context(|| format!("opening {STREAMS_INSTANCE} in the linker"))?;
    /// One shadowed method: `$args` are its parameters, `$wait` the wait on `table`.
    macro_rules! shadow {
        ($name:literal, |$table:ident, ($($arg:ident),+ $(,)?): $ty:ty| $wait:expr) => {
            streams
                .func_wrap($name, |mut store: StoreContextMut<'_, HostState>, ($($arg,)+): $ty| {
                    let state = store.data_mut();
                    let (deadline, cancel, long) = (state.deadline, state.cancel.clone(), long_wait(state));
                    let $table = &mut state.table;
                    match bounded(deadline, cancel, long, $wait) {
                        Ok(r) => Ok((stream_result(&mut state.table, r)?,)),
                        Err(why) => Err(interrupt(state, why)),
                    }
                })
                .map_err(anyhow::Error::from)
                .context(concat!("shadowing wasi:io/streams.", $name))?;
        };
    }
    shadow!("[method]input-stream.blocking-read", |t,
                                                   (s, len): (
        Resource<DynInputStream>,
        u64
    )| t.blocking_read(s, len));
    shadow!("[method]input-stream.blocking-skip", |t,
                                                   (s, len): (
        Resource<DynInputStream>,
        u64
    )| t.blocking_skip(s, len));
    shadow!("[method]output-stream.blocking-write-and-flush", |t,
                                                               (s, bytes): (
        Resource<DynOutputStream>,
        Vec<u8>
    )| {
        t.blocking_write_and_flush(s, bytes)
    });
    shadow!("[method]output-stream.blocking-write-zeroes-and-flush", |t,
                                                                      (s, len): (
        Resource<DynOutputStream>,
        u64
    )| {
        t.blocking_write_zeroes_and_flush(s, len)
    });
    shadow!("[method]output-stream.blocking-flush", |t,
                                                     (s,): (
        Resource<DynOutputStream>,
    )| t.blocking_flush(s));
    shadow!("[method]output-stream.blocking-splice", |t,
                                                      (d, s, len): (
        Resource<DynOutputStream>,
        Resource<DynInputStream>,
        u64
    )| {
        t.blocking_splice(d, s, len)
    });
    linker.allow_shadowing(false);
    Ok(())
}

/// A stream method's result as the guest sees it (a trap stays a trap).
fn stream_result<T>(table: &mut ResourceTable, r: StreamResult<T>) -> wasmtime::Result<Result<T, WitStreamError>> {
    match r {
        Ok(v) => Ok(Ok(v)),
        Err(e) => Ok(Err(table.convert_stream_error(e)?)),
    }
}

/// What to run if this wait outlives `demote_after`: the worker's long-call hook (which does
/// its work once per thread, however often a call waits).
fn long_wait(state: &mut HostState) -> Option<(std::time::Duration, LongCallHook)> {
    let after = state.long_call?;
    let hook = state.on_long_call.clone()?;
    Some((after, hook))
}

type LongCallHook = Arc<dyn Fn() + Send + Sync>;

fn interrupt(state: &mut HostState, why: Interruption) -> wasmtime::Error {
    state.interrupted = Some(why);
    wasmtime::Error::msg(match why {
        Interruption::Timeout => "interrupted in a blocking WASI call at the call's timeout",
        Interruption::Cancelled => "interrupted in a blocking WASI call: cancelled by the host",
    })
}

/// Negative control for the cluster tests, never for production: with this environment
/// variable set to `1` a blocking WASI call ignores the cancel flag (it still ends at the
/// call's deadline), as it did before this module: a fence or a lost subscription cannot
/// stop a sleeping guest.
pub const NEGATIVE_CONTROL_BLOCKING_IGNORES_CANCEL: &str = "WEIR_NEGATIVE_CONTROL_BLOCKING_IGNORES_CANCEL";

fn ignores_cancel() -> bool {
    static SET: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *SET.get_or_init(|| {
        let set = std::env::var(NEGATIVE_CONTROL_BLOCKING_IGNORES_CANCEL).is_ok_and(|v| v == "1");
        if set {
            tracing::error!(
                "{NEGATIVE_CONTROL_BLOCKING_IGNORES_CANCEL}=1: blocking WASI calls IGNORE cancellation (a test's negative control; never in production)"
            );
        }
        set
    })
}

/// Run `fut` on wasmtime-wasi's runtime (as its own sync bindings do), but stop at `deadline`
/// or when `cancel` is set, whichever comes first.
fn bounded<F: Future>(
    deadline: Option<Instant>,
    cancel: Option<Arc<Interrupt>>,
    long: Option<(std::time::Duration, LongCallHook)>,
    fut: F,
) -> Result<F::Output, Interruption> {
    let cancel = cancel.filter(|_| !ignores_cancel());
    let is_cancelled = |c: &Option<Arc<Interrupt>>| c.as_ref().is_some_and(|c| c.is_cancelled());
    if is_cancelled(&cancel) {
        return Err(Interruption::Cancelled);
    }
    // Most waits are ready at once (a log line, a ready pollable): answer those without
    // setting up the timers. Polled in wasmtime-wasi's runtime, which its I/O needs.
    let mut fut = std::pin::pin!(fut);
    let first = with_ambient_tokio_runtime(|| {
        fut.as_mut()
            .poll(&mut std::task::Context::from_waker(std::task::Waker::noop()))
    });
    if let std::task::Poll::Ready(out) = first {
        return Ok(out);
    }
    wasmtime_wasi::runtime::in_tokio(async move {
        let timeout = async {
            match deadline {
                Some(d) => tokio::time::sleep_until(d.into()).await,
                None => std::future::pending().await,
            }
        };
        let cancelled = async {
            match &cancel {
                Some(c) => {
                    while !c.is_cancelled() {
                        tokio::time::sleep(super::EPOCH_TICK).await;
                    }
                }
                None => std::future::pending().await,
            }
        };
        // Runs on this worker's thread (`in_tokio` blocks on it here), as the hook expects.
        let demote = async {
            if let Some((after, hook)) = long {
                tokio::time::sleep(after).await;
                hook();
            }
            std::future::pending::<()>().await;
        };
        tokio::select! {
            biased;
            () = cancelled => Err(Interruption::Cancelled),
            () = timeout => Err(Interruption::Timeout),
            out = fut => Ok(out),
            () = demote => Err(Interruption::Cancelled),
        }
    })
}
