//! `instructions`: instructions per message by callgrind, which counts the
//! same whatever else the machine is doing. Each shape runs this binary twice
//! under `valgrind --tool=callgrind`, with 20 000 and 40 000 messages (each run
//! also does a warm-up of a tenth); the difference of the two totals, less the
//! bench's own pre-publish (`prepublish`, inclusive), divided by the 22 000
//! messages between them, is the cost of a message with start-up and the
//! compile cache taken out.
//!
//! Shapes: `handle` and `handle-batch` of 100 in the default shape (1 000
//! groups), and both again with full batches (8 groups, prefetch 1 000).

use std::path::Path;
use std::process::Command;

use anyhow::{Context as _, bail};

use crate::{Opts, Row};

const SMALL: u64 = 20_000;
const LARGE: u64 = 40_000;

/// (row name, scenario, extra arguments).
const SHAPES: [(&str, &str, &[&str]); 4] = [
    ("instr-handle", "e2e-reuse", &[]),
    ("instr-batch-100", "e2e-batch-100", &[]),
    (
        "instr-handle-full",
        "e2e-reuse",
        &["--groups", "8", "--prefetch", "1000"],
    ),
    (
        "instr-batch-full",
        "e2e-batch-100",
        &["--groups", "8", "--prefetch", "1000"],
    ),
];

/// A number as callgrind_annotate prints it (`1,234,567`).
fn count(field: &str) -> Option<u64> {
    field.replace(',', "").parse().ok()
}

/// (whole-program total, inclusive cost of the bench's pre-publish) of one
/// callgrind output file.
fn totals(out: &Path) -> anyhow::Result<(u64, u64)> {
    let ann = Command::new("callgrind_annotate")
        .arg("--inclusive=yes")
        .arg("--threshold=100")
        .arg(out)
        .output()
        .context("running callgrind_annotate (it comes with valgrind)")?;
    if !ann.status.success() {
        bail!(
            "callgrind_annotate {}: {}",
            out.display(),
            String::from_utf8_lossy(&ann.stderr)
        );
    }
    let text = String::from_utf8_lossy(&ann.stdout);
    let first = |l: &str| l.split_whitespace().next().and_then(count);
    let total = text
        .lines()
        .find(|l| l.contains("PROGRAM TOTALS"))
        .and_then(first)
        .context("no PROGRAM TOTALS in callgrind_annotate's output")?;
    let prepublish = text
        .lines()
        .filter(|l| l.contains("weir_bench::prepublish"))
        .filter_map(first)
        .max()
        .context("no weir_bench::prepublish in callgrind_annotate's output")?;
    Ok((total, prepublish))
}

/// One child run of this binary, under callgrind when `out` is given.
fn child(dir: &Path, scenario: &str, extra: &[&str], messages: u64, callgrind: Option<&Path>) -> anyhow::Result<()> {
    let exe = std::env::current_exe().context("finding weir-bench's own path")?;
    let mut cmd = match callgrind {
        Some(out) => {
            let mut c = Command::new("valgrind");
            c.arg("--tool=callgrind")
                .arg(format!("--callgrind-out-file={}", out.display()))
                .arg(&exe);
            c
        }
        None => Command::new(&exe),
    };
    // valgrind cannot reserve the address space of the default pool.
    cmd.env("WEIR_BENCH_POOL_INSTANCES", "4")
        .arg(scenario)
        .args(extra)
        .args([
            "--messages",
            &messages.to_string(),
            "--runs",
            "1",
            "--no-charts",
            "--out",
        ])
        .arg(dir.join("callgrind-run.json"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    let status = cmd.status().with_context(|| {
        format!(
            "starting {}",
            if callgrind.is_some() { "valgrind" } else { "weir-bench" }
        )
    })?;
    if !status.success() {
        bail!("{scenario} {extra:?} with {messages} messages exited with {status}");
    }
    Ok(())
}

pub fn instructions(o: &Opts) -> anyhow::Result<Vec<Row>> {
    let dir = o.out.parent().context("--out has no directory")?.to_path_buf();
    std::fs::create_dir_all(&dir)?;
    // Fill the compile cache beside `--out` with the same engine settings,
    // natively and under valgrind: valgrind reports other CPU features, so its
    // code is cached apart, and a first measured run that compiled would cost
    // more than the larger one (a negative difference).
    child(&dir, "e2e-reuse", &[], 1_000, None)?;
    let warm = dir.join("callgrind-warm-up.out");
    child(&dir, "e2e-reuse", &[], 1_000, Some(&warm))?;
    let _ = std::fs::remove_file(&warm);
    let mut rows = Vec::new();
    for (name, scenario, extra) in SHAPES {
        let mut t = Vec::new();
        for n in [SMALL, LARGE] {
            let out = dir.join(format!("callgrind-{name}-{n}.out"));
            child(&dir, scenario, extra, n, Some(&out))?;
            t.push(totals(&out)?);
            let _ = std::fs::remove_file(&out);
        }
        let between = (LARGE - SMALL) as f64 * 1.1;
        let whole = (t[1].0 as f64 - t[0].0 as f64) / between;
        let prepublish = (t[1].1 as f64 - t[0].1 as f64) / between;
        let per_msg = whole - prepublish;
        if per_msg <= 0.0 {
            bail!(
                "{name}: the {LARGE}-message run cost no more than the {SMALL}-message one \
                 ({} against {} instructions): one of them paid a one-off cost; run it again",
                t[1].0,
                t[0].0
            );
        }
        eprintln!(
            "[weir-bench] {name:<10} {per_msg:.0} instructions/msg (whole process {whole:.0}, pre-publish {prepublish:.0})"
        );
        rows.push(Row {
            name,
            messages: LARGE - SMALL,
            runs_ns: Vec::new(),
            extra: vec![
                ("instructions_per_message", vec![per_msg]),
                ("whole_process_per_message", vec![whole]),
                ("prepublish_per_message", vec![prepublish]),
            ],
            note: format!(
                "callgrind: ({LARGE} - {SMALL} message run) / {between:.0}, less the pre-publish; \
                 `{scenario}{}{}`",
                if extra.is_empty() { "" } else { " " },
                extra.join(" ")
            ),
        });
    }
    Ok(rows)
}
