//! The `weir` command: parse the arguments, set up logging, and hand the
//! command to its module in `cli/`. No logic beyond that.

// A function over 100 lines is a room to split (clippy.toml sets the threshold); tests
// are exempt, the product code is not.
#![deny(clippy::too_many_lines)]
#![cfg_attr(test, allow(clippy::too_many_lines))]

use std::process::ExitCode;

use clap::Parser as _;

use cli::args::{Cli, Command};
use cli::{call, deploy, dev, logging};
use weir::config;

mod cli;

/// mimalloc: the host allocates small, short-lived objects on several threads
/// per message; glibc's malloc cost a third of the end-to-end time (BENCHMARKS.md).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let cli = Cli::parse();
    if !matches!(cli.command, Command::Run { .. }) {
        // A command whose output is piped into `head` ends quietly when the
        // pipe closes, as Unix tools do, instead of panicking on the write.
        // SAFETY: setting a signal's disposition before any thread starts.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    // `weir run` takes its log settings from its config unless the flags say otherwise.
    let from_config = match &cli.command {
        Command::Run { config } => config::load(config).ok().map(|c| (c.node.log_format, c.node.log_level)),
        _ => None,
    };
    let settings = logging::Settings {
        kind: match cli.command {
            // A node logs what it does.
            Command::Run { .. } => logging::Kind::Other,
            Command::Call { .. } => logging::Kind::Call,
            Command::Dev { .. } => logging::Kind::Dev,
            // The other commands' output is their progress and summary, or a
            // table: warnings only (no broker client's connection lines).
            _ => logging::Kind::Quiet,
        },
        format: cli.log_format.or(from_config.and_then(|c| c.0)).unwrap_or_default(),
        level: cli.log_level.or(from_config.and_then(|c| c.1)),
    };
    let guest_log = call::GuestLog::default();
    match settings.kind {
        // `weir call` prints the guest's log lines with the call they belong to.
        logging::Kind::Call => logging::init(&settings, Some(guest_log.clone())),
        // `weir dev` prints them as they come, in the message's block.
        logging::Kind::Dev => logging::init(&settings, Some(dev::GuestEcho)),
        _ => logging::init(&settings, None::<dev::GuestEcho>),
    }
    match cli::dispatch(cli, &guest_log) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            // `weir deploy` / `weir rollback`: one exit code per kind of failure.
            match e.downcast_ref::<deploy::Failure>() {
                Some(f) => ExitCode::from(f.exit_code()),
                None => ExitCode::FAILURE,
            }
        }
    }
}
