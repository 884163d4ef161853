//! `weir schedule check`: the retry ladders of a config, with what the broker says.

use std::process::ExitCode;

use anyhow::Context as _;

use weir::config;

use super::runtime;

/// What the configured broker reports for each topology's schedule check
/// (JetStream: stream `max_age`, consumer `AckWait`); nothing for brokers
/// without such facts. A broker that cannot be reached is reported and the
/// check goes on without its facts.
fn broker_facts(cfg: &config::Config) -> anyhow::Result<Vec<Option<weir::transport::RetryFacts>>> {
    if cfg.transport.kind != config::TransportKind::Nats {
        return Ok(Vec::new());
    }
    let transport = weir::transport::connect::for_config(cfg)?;
    runtime()?.block_on(async {
        let mut out = Vec::new();
        for t in &cfg.topology {
            let read = tokio::time::timeout(std::time::Duration::from_secs(10), transport.retry_facts(&t.name)).await;
            match read {
                Ok(Ok(f)) => out.push(f),
                Ok(Err(e)) => {
                    println!(
                        "warning: topology `{}`: the broker's facts could not be read ({e}); checked without them",
                        t.name
                    );
                    out.push(None);
                }
                Err(_) => {
                    println!(
                        "warning: topology `{}`: the broker did not answer in 10s; checked without its facts",
                        t.name
                    );
                    out.push(None);
                }
            }
        }
        Ok(out)
    })
}

/// `weir schedule check`: each topology's ladder as a table, with its violations.
pub fn check(path: &std::path::Path) -> anyhow::Result<ExitCode> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let origin = path.display().to_string();
    // Parse without validation first so every retry violation is shown in the table view.
    let cfg = match config::parse(&text, &origin) {
        Ok(c) => c,
        Err(config::ConfigError::Invalid { issues, .. }) => {
            println!("{origin}: invalid config");
            for v in issues {
                println!("  error   {v}");
            }
            return Ok(ExitCode::FAILURE);
        }
        Err(e) => return Err(e.into()),
    };
    let facts = broker_facts(&cfg)?;
    let mut violations = 0;
    for (i, t) in cfg.topology.iter().enumerate() {
        let fact = facts.get(i).cloned().flatten();
        let schedule = t.schedule(cfg.transport.kind, fact.as_ref().and_then(|f| f.ack_wait));
        let policy = schedule.policy();
        println!(
            "topology `{}` on {} (max_deliver {}):",
            t.name,
            cfg.transport.kind.as_str(),
            if policy.max_deliver <= 0 {
                "unlimited".to_string()
            } else {
                policy.max_deliver.to_string()
            }
        );
        println!(
            "  {:>8}  {:>12}  {:>12}  role",
            "delivery", "delay before", "cumulative"
        );
        let rows = schedule.table(u32::try_from(policy.ladder.len()).unwrap_or(8).saturating_add(3).max(6));
        for r in &rows {
            println!(
                "  {:>8}  {:>12}  {:>12}  {}",
                r.delivery,
                humantime::format_duration(r.delay_before).to_string(),
                humantime::format_duration(r.since_first).to_string(),
                r.role.as_str()
            );
        }
        match schedule.time_to_dead_letter() {
            Some(d) => println!("  time to dead-letter: {}", humantime::format_duration(d)),
            None => println!("  time to dead-letter: never (unlimited deliveries)"),
        }
        if let Some(f) = &fact {
            println!(
                "  broker: stream max_age {}, consumer AckWait {}",
                f.stream_max_age.map_or_else(
                    || "unlimited".to_string(),
                    |d| humantime::format_duration(d).to_string()
                ),
                f.ack_wait.map_or_else(
                    || "(no consumer yet)".to_string(),
                    |d| humantime::format_duration(d).to_string()
                ),
            );
        }
        let ctx = weir::retry::schedule::CheckContext {
            key: config::Config::retry_key(i),
            stream_max_age: fact.as_ref().and_then(|f| f.stream_max_age),
        };
        let report = schedule.check(&ctx);
        for v in &report.errors {
            println!("  error   {v}");
        }
        for v in &report.warnings {
            println!("  warning {v}");
        }
        violations += report.errors.len();
        println!();
    }
    if violations > 0 {
        println!("{violations} violation(s)");
        Ok(ExitCode::FAILURE)
    } else {
        println!("no violations");
        Ok(ExitCode::SUCCESS)
    }
}
