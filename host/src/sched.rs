//! Thread priorities (a leaf): the lease loop above everything, compilers
//! and failing tenants' work below it.

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
            return Ok(());
        }
    }
    nice_current_thread(19)
}
