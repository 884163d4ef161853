//! Where the `weir` command's log lines go and how they look: stderr, text
//! for people (colour only on a terminal, never with `NO_COLOR`) or one JSON
//! object a line; the level from `--log-level` or `node.log_level` (default
//! `info` for Weir's own lines, `warn` for its libraries), and `RUST_LOG`,
//! when set, replacing the whole filter. `weir call` and `weir dev` print
//! the guest's own lines with the message they belong to.

use tracing_subscriber::Layer as _;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;
use tracing_subscriber::{EnvFilter, Registry};

use weir::config::{LogFormat, LogLevel};

/// Which command is logging, for its defaults.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Every command but `run`, `call` and `dev` (`weir demo`, `publish`,
    /// `status`, `dead-letters`, …): their output is the progress and the
    /// summary, or the table; warnings only.
    Quiet,
    /// `weir call`: guest lines are printed with the call.
    Call,
    /// `weir dev`: guest lines are printed with the message; only what goes wrong is logged.
    Dev,
    /// `weir run`: a node's log.
    Other,
}

/// How to log.
pub struct Settings {
    pub kind: Kind,
    pub format: LogFormat,
    pub level: Option<LogLevel>,
}

/// The filter: `RUST_LOG` when set, else the level for Weir's own lines.
fn filter(s: &Settings) -> EnvFilter {
    if let Ok(f) = EnvFilter::try_from_default_env() {
        return f;
    }
    let text = match (s.kind, s.level) {
        (_, Some(level)) => format!("warn,weir={}", level.as_str()),
        (Kind::Quiet, None) => "warn".to_owned(),
        (Kind::Call | Kind::Dev, None) => "warn,weir::runtime::engine=info,weir::guest=off".to_owned(),
        (Kind::Other, None) => "warn,weir=info".to_owned(),
    };
    EnvFilter::new(text)
}

/// Install the subscriber; `guest` receives the guest's lines (`weir::guest`)
/// for `weir call` and `weir dev`.
pub fn init<G>(s: &Settings, guest: Option<G>)
where
    G: tracing_subscriber::Layer<Registry> + Send + Sync + 'static,
{
    let colour = std::io::IsTerminal::is_terminal(&std::io::stderr()) && std::env::var_os("NO_COLOR").is_none();
    let fmt = match s.format {
        LogFormat::Text => tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(colour)
            .boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .with_writer(std::io::stderr)
            .boxed(),
    };
    let guest = guest.map(|g| {
        g.with_filter(tracing_subscriber::filter::Targets::new().with_target("weir::guest", tracing::Level::TRACE))
    });
    tracing_subscriber::registry()
        .with(guest)
        .with(fmt.with_filter(filter(s)))
        .init();
}
