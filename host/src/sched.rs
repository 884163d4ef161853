//! Threads (a leaf): how many the async side gets, and their priorities: the
//! lease loop above everything, compilers and failing tenants' work below it.
//!
//! A thread remembers how it lowered itself, so that a fence can lift a
//! lowered thread's call back to normal priority from outside (it must end
//! now, and a thread in the idle class next to busy cores may not run for
//! seconds), and the thread can lower itself again after that call.

use std::cell::Cell;

/// How the calling thread lowered itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lowered {
    Idle,
    Nice(i32),
}

thread_local! {
    static LOWERED: Cell<Option<Lowered>> = const { Cell::new(None) };
}

/// Whether the calling thread runs below normal priority (it lowered itself).
pub fn lowered() -> bool {
    LOWERED.get().is_some()
}

/// The calling thread's id (Linux: `gettid`; 0 elsewhere).
pub fn current_tid() -> i32 {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: gettid has no preconditions.
        unsafe { libc::gettid() }
    }
    #[cfg(not(target_os = "linux"))]
    0
}

/// Put thread `tid` of this process back at normal priority (the normal
/// class, nice 0), from any thread. Lowering it again is the thread's own
/// business ([`lower_again`]).
pub fn restore_thread(tid: i32) -> std::io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        let param = libc::sched_param { sched_priority: 0 };
        // SAFETY: plain syscalls on a thread id with a valid parameter; a
        // thread that is gone gives ESRCH.
        if unsafe { libc::sched_setscheduler(tid, libc::SCHED_OTHER, &param) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: as above (`who` is a thread id on Linux).
        if unsafe { libc::setpriority(libc::PRIO_PROCESS, u32::try_from(tid).unwrap_or(0), 0) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = tid;
    Ok(())
}

/// Lower the calling thread again as it last lowered itself (after a fence
/// lifted it for one call).
pub fn lower_again() {
    let result = match LOWERED.get() {
        Some(Lowered::Idle) => idle_current_thread(),
        Some(Lowered::Nice(n)) => nice_current_thread(n),
        None => Ok(()),
    };
    if let Err(e) = result {
        tracing::warn!(error = %e, "could not lower a worker thread again after a fence lifted it");
    }
}

/// Set the calling thread's nice value (Linux: per thread). Raising it
/// (negative values) needs `CAP_SYS_NICE` or a `RLIMIT_NICE` that allows
/// it; the error says so.
pub fn nice_current_thread(nice: i32) -> std::io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: a plain syscall on the calling thread (who = 0 is the
        // calling thread on Linux).
        if unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, nice) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = nice;
    LOWERED.set((nice > 0).then_some(Lowered::Nice(nice)));
    Ok(())
}

/// Move the calling thread to the idle scheduling class (it runs only when
/// a core would otherwise idle); nice 19 where that is refused.
pub fn idle_current_thread() -> std::io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        let param = libc::sched_param { sched_priority: 0 };
        // SAFETY: a plain syscall on the calling thread (pid 0), with a valid parameter.
        if unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) } == 0 {
            LOWERED.set(Some(Lowered::Idle));
            return Ok(());
        }
    }
    nice_current_thread(19)
}

/// Threads for the async side (broker I/O, lanes, settlement). The Wasm
/// workers take one thread per core; the async side needs far less, and on a
/// 2-core machine one thread beat two by 20 % end to end (BENCHMARKS.md).
pub fn async_threads() -> usize {
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2);
    (cores / 2).max(1)
}

/// The async runtime `weir` runs on (see [`async_threads`]).
pub fn async_runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(async_threads())
        .enable_all()
        .build()
}
