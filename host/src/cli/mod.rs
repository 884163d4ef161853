//! The command line: its grammar (`args`), and one module per subcommand.
//! `main.rs` parses and hands the command here; nothing in the library
//! imports this wing.

use std::process::ExitCode;

use anyhow::Context as _;

use weir::demo::{self, DemoOptions};

pub mod args;
pub mod call;
pub mod dead_letters;
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
        Command::Demo { groups, per_group } => {
            let opts = DemoOptions {
                groups,
                per_group,
                ..DemoOptions::default()
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
        Command::Run { config } => run::run(&config),
        Command::Publish {
            config,
            message_type,
            group,
            tenant,
            count,
            payload,
            topology,
        } => {
            let cfg = config::load(&config)?;
            if cfg.transport.kind == config::TransportKind::Memory {
                anyhow::bail!("{}", publish::memory_refusal(&cfg));
            }
            let payload = match payload.strip_prefix('@') {
                Some(file) => std::fs::read(file).with_context(|| format!("--payload @{file}: cannot read {file}"))?,
                None => payload.into_bytes(),
            };
            let req = publish::Request {
                message_type,
                group,
                tenant,
                count,
                payload,
                topology,
            };
            let summary = runtime()?.block_on(publish::run(&cfg, req))?;
            println!("{summary}");
            Ok(ExitCode::SUCCESS)
        }
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
        Command::Call {
            component,
            message_type,
            group,
            tenant,
            payload,
            each,
            headers,
            config,
            batch,
            timeout,
        } => {
            let req = call::Request {
                component,
                message_type,
                group,
                tenant,
                headers,
                payloads: call::payloads(payload.as_deref(), each.as_deref())?,
                config: config.into_iter().collect(),
                batch,
                timeout,
            };
            call::run(req, guest_log)
        }
        Command::New { lang, name, dir, list } => {
            match (lang, name) {
                (Some(lang), Some(name)) if !list => {
                    scaffold::new(lang, &name, &dir)?;
                }
                _ => {
                    use clap::ValueEnum as _;
                    println!("templates (weir new LANG NAME):");
                    for lang in scaffold::Lang::value_variants() {
                        let help = lang
                            .to_possible_value()
                            .and_then(|v| v.get_help().map(ToString::to_string));
                        println!("  {:<8} {}", lang.as_str(), help.unwrap_or_default());
                    }
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Build { dir, offline } => {
            scaffold::build(&dir, offline)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Dev {
            dir,
            admin,
            types,
            offline,
            rebuild,
        } => dev::run(dev::Options {
            dir,
            admin,
            types,
            offline,
            rebuild,
        }),
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
        Command::Handlers {
            config,
            admin,
            token,
            json,
        } => handlers::run(handlers::Request {
            config,
            admin,
            token,
            json,
        }),
        Command::Logs {
            handler,
            config,
            admin,
            token,
            follow,
            limit,
            json,
        } => logs::run(logs::Request {
            handler,
            config,
            admin,
            token,
            follow,
            limit: usize::from(limit),
            json,
        }),
        Command::Status {
            config,
            admin,
            token,
            json,
            watch,
        } => status::run(status::Request {
            config,
            admin,
            token,
            json,
            watch: watch
                .map(|w| {
                    std::time::Duration::try_from_secs_f64(w)
                        .ok()
                        .filter(|d| !d.is_zero())
                        .context("--watch: a number of seconds above 0, e.g. --watch 2")
                })
                .transpose()?,
        }),
    }
}
