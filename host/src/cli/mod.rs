//! The command line: its grammar (`args`), and one module per subcommand.
//! `main.rs` parses and hands the command here; nothing in the library
//! imports this wing.

use std::process::ExitCode;

use anyhow::Context as _;

pub mod args;
pub mod call;
pub mod dead_letters;
pub mod demo;
pub mod deploy;
pub mod dev;
pub mod groups;
pub mod handlers;
pub mod inspect;
pub mod logging;
pub mod logs;
pub mod publish;
mod run;
pub mod scaffold;
mod schedule;
pub mod status;

use args::{Cli, Command, ConfigCommand, GroupsCommand, ScheduleCommand};
use weir::config;

/// The async runtime a command runs its I/O on.
pub fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    weir::sched::async_runtime().context("starting the async runtime")
}

/// Run the command `cli` names.
pub fn dispatch(cli: Cli, guest_log: &call::GuestLog) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Demo { groups, per_group } => run_demo(groups, per_group),
        Command::Run { config } => run::run(&config),
        Command::Publish {
            config,
            message_type,
            group,
            tenant,
            count,
            payload,
            topology,
        } => publish(
            &config,
            publish::Request {
                message_type,
                group,
                tenant,
                count,
                payload: payload.into_bytes(),
                topology,
            },
        ),
        Command::Schedule {
            command: ScheduleCommand::Check { config },
        } => schedule::check(&config),
        Command::Config {
            command: ConfigCommand::Check { file },
        } => inspect::config_check(&file),
        Command::Inspect { file, json } => inspect::inspect(&file, json),
        Command::Completions { shell } => {
            let mut cmd = <Cli as clap::CommandFactory>::command();
            clap_complete::generate(shell, &mut cmd, "weir", &mut std::io::stdout());
            Ok(ExitCode::SUCCESS)
        }
        Command::Deploy {
            target,
            grant_env,
            grant_dir,
            canary,
            file,
        } => {
            deploy::deploy(&target.as_target(), &file, &grant_env, &grant_dir, &canary)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Promote { target } => {
            deploy::promote(&target.as_target())?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Call(args) => call::run(args.request()?, guest_log),
        Command::New { lang, name, dir, list } => {
            match (lang, name) {
                (Some(lang), Some(name)) if !list => {
                    scaffold::new(lang, &name, &dir)?;
                }
                _ => list_templates(),
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Build { dir, offline } => {
            scaffold::build(&dir, offline)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Dev(options) => dev::run(options),
        Command::DeadLetters { command } => dead_letters::run(command),
        Command::Groups { command } => match command {
            GroupsCommand::List { admin, token, json } => groups::list(&admin, token.as_deref(), json),
            GroupsCommand::Unpark(a) => {
                groups::order(&a.admin, &a.token, &a.topology, &a.group, a.tenant.as_deref(), false)
            }
            GroupsCommand::Skip(a) => {
                groups::order(&a.admin, &a.token, &a.topology, &a.group, a.tenant.as_deref(), true)
            }
        },
        Command::Rollback { target } => {
            deploy::rollback(&target.as_target())?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Handlers(req) => handlers::run(req),
        Command::Logs(req) => logs::run(req),
        Command::Status(args) => status::run(args.request()?),
    }
}

/// `weir demo`: the run, its summary, and whether it held.
fn run_demo(groups: u32, per_group: u32) -> anyhow::Result<ExitCode> {
    let opts = demo::DemoOptions {
        groups,
        per_group,
        ..demo::DemoOptions::default()
    };
    let summary = runtime()?.block_on(demo::run(opts))?;
    println!("{summary}");
    if summary.ok() {
        println!("OK: nothing lost, no intra-group overlap.");
        Ok(ExitCode::SUCCESS)
    } else {
        println!("FAILED: see the lost / overlap / dead-letter lines above.");
        Ok(ExitCode::FAILURE)
    }
}

/// `weir publish`: `req`'s payload is its text, or with a leading `@` the file it names.
fn publish(config: &std::path::Path, mut req: publish::Request) -> anyhow::Result<ExitCode> {
    let cfg = config::load(config)?;
    if cfg.transport.kind == config::TransportKind::Memory {
        anyhow::bail!("{}", publish::memory_refusal(&cfg));
    }
    if let Some(file) = req.payload.strip_prefix(b"@") {
        let file = String::from_utf8_lossy(file).into_owned();
        req.payload = std::fs::read(&file).with_context(|| format!("--payload @{file}: cannot read {file}"))?;
    }
    let summary = runtime()?.block_on(publish::run(&cfg, req))?;
    println!("{summary}");
    Ok(ExitCode::SUCCESS)
}

/// `weir new --list`: the templates.
fn list_templates() {
    use clap::ValueEnum as _;
    println!("templates (weir new LANG NAME):");
    for lang in scaffold::Lang::value_variants() {
        let help = lang
            .to_possible_value()
            .and_then(|v| v.get_help().map(ToString::to_string));
        println!("  {:<8} {}", lang.as_str(), help.unwrap_or_default());
    }
}
