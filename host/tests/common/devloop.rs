//! Helpers of the developer-loop tests (issue 18): `weir` run in a project
//! folder with its caches (installed toolchains, compiled components) kept
//! in the test scratch directory across runs, and what a command printed.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// `XDG_CACHE_HOME` of the `weir` these tests run: `weir/toolchains/` (the
/// Python and JavaScript toolchains) and the compiled-code cache live here.
pub fn cache_home() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join("devloop-cache")
}

/// The compiled-code cache `weir call` and `weir dev` use under [`cache_home`].
pub fn compiled_cache() -> PathBuf {
    cache_home().join("weir")
}

/// `bin ARGS` in `dir` (`bin`: `env!("CARGO_BIN_EXE_weir")`, which only the
/// tests of `host/` have), with the caches of [`cache_home`].
pub fn weir(bin: &str, dir: &Path, args: &[&str]) -> Output {
    Command::new(bin)
        .args(args)
        .current_dir(dir)
        .env("XDG_CACHE_HOME", cache_home())
        .env_remove("WEIR_TOKEN")
        .output()
        .unwrap()
}

/// `program ARGS` in `dir`.
pub fn run(dir: &Path, program: &str, args: &[&str]) -> Output {
    Command::new(program)
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {program}: {e}"))
}

/// What a command did, for assertion messages.
pub fn text(o: &Output) -> String {
    format!(
        "exit {:?}\n--- stdout\n{}--- stderr\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}
