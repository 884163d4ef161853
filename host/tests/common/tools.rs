//! Tools some tests drive (promtool, chromium), installed on first use from
//! Debian's packages, so `cargo test --workspace` passes on a fresh machine of
//! this project's kind as `.ci/run` does. One install at a time across the
//! test binaries (a file lock); a tool that cannot be installed fails the
//! test with the command that installs it.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Where `command` is on the PATH.
fn which(command: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(command))
        .find(|p| p.is_file())
}

fn apt_install(package: &str) -> bool {
    let install = || {
        Command::new("apt-get")
            .args(["install", "-y", "--no-install-recommends", package])
            .env("DEBIAN_FRONTEND", "noninteractive")
            .output()
            .is_ok_and(|o| o.status.success())
    };
    install() || {
        // A fresh machine has no package lists yet.
        let _ = Command::new("apt-get").arg("update").output();
        install()
    }
}

/// `command`, installing Debian's `package` first when it is missing (as
/// root, with apt-get). Panics with what to do when that is not possible.
pub fn ensure(command: &str, package: &str) -> PathBuf {
    if let Some(p) = which(command) {
        return p;
    }
    let lock_path = std::env::temp_dir().join("weir-test-tools.lock");
    let lock = std::fs::File::create(&lock_path).unwrap_or_else(|e| panic!("creating {}: {e}", lock_path.display()));
    // SAFETY: flock on a file descriptor this function owns for its whole use.
    let locked = unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&lock), libc::LOCK_EX) } == 0;
    assert!(locked, "locking {}", lock_path.display());
    if let Some(p) = which(command) {
        return p; // another test binary installed it meanwhile
    }
    eprintln!("tests: installing {package} (Debian's package) for `{command}`, once");
    let is_root = Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0");
    if is_root
        && Path::new("/usr/bin/apt-get").exists()
        && apt_install(package)
        && let Some(p) = which(command)
    {
        return p;
    }
    panic!(
        "`{command}` is needed by this test and could not be installed: install it with \
         `apt-get install {package}` (as root), then run the tests again"
    );
}
