//! Small hand-written SVG bar charts of a run (no plotting dependency):
//! horizontal bars, one per figure, with the value written beside each bar
//! and, where a figure has a target, a tick at the target and the bar
//! coloured by whether it is met.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::Context as _;

/// One bar.
pub struct Bar {
    pub label: String,
    pub value: f64,
    /// The figure to reach (higher is better), if any.
    pub target: Option<f64>,
}

impl Bar {
    pub fn new(label: impl Into<String>, value: f64, target: Option<f64>) -> Self {
        Self {
            label: label.into(),
            value,
            target,
        }
    }
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// A horizontal bar chart; `unit` is appended to the value labels.
pub fn bars(title: &str, subtitle: &str, unit: &str, bars: &[Bar]) -> String {
    const W: f64 = 760.0;
    const LEFT: f64 = 230.0;
    const RIGHT: f64 = 150.0;
    const TOP: f64 = 58.0;
    const ROW: f64 = 28.0;
    let h = TOP + ROW * bars.len() as f64 + 34.0;
    let max = bars
        .iter()
        .flat_map(|b| [b.value, b.target.unwrap_or(0.0)])
        .filter(|v| v.is_finite())
        .fold(0.0f64, f64::max)
        .max(f64::MIN_POSITIVE);
    let scale = (W - LEFT - RIGHT) / max;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{h}" viewBox="0 0 {W} {h}" font-family="sans-serif" font-size="13">"#
    );
    let _ = writeln!(s, r#"<rect width="{W}" height="{h}" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="12" y="22" font-size="16" font-weight="bold">{}</text>"#,
        esc(title)
    );
    let _ = writeln!(s, r##"<text x="12" y="42" fill="#555">{}</text>"##, esc(subtitle));
    for (i, b) in bars.iter().enumerate() {
        let y = TOP + ROW * i as f64;
        let v = if b.value.is_finite() { b.value.max(0.0) } else { 0.0 };
        let colour = match b.target {
            Some(t) if b.value >= t => "#3a8f4b",
            Some(_) => "#c0392b",
            None => "#4a6fa5",
        };
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" text-anchor="end">{}</text>"#,
            LEFT - 8.0,
            y + 17.0,
            esc(&b.label)
        );
        let _ = writeln!(
            s,
            r#"<rect x="{LEFT}" y="{}" width="{:.1}" height="{}" fill="{colour}"/>"#,
            y + 4.0,
            v * scale,
            ROW - 8.0
        );
        let value = if b.value.is_finite() {
            let digits = if b.value.abs() >= 100.0 { 0 } else { 2 };
            format!("{:.*}{unit}", digits, b.value)
        } else {
            "n/a".to_owned()
        };
        let text = match b.target {
            Some(t) => format!("{value} (target {t}{unit})"),
            None => value,
        };
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{}">{}</text>"#,
            LEFT + v * scale + 6.0,
            y + 17.0,
            esc(&text)
        );
        if let Some(t) = b.target {
            let x = LEFT + t * scale;
            let _ = writeln!(
                s,
                r##"<line x1="{x:.1}" y1="{}" x2="{x:.1}" y2="{}" stroke="#222" stroke-width="2" stroke-dasharray="3,2"/>"##,
                y + 1.0,
                y + ROW - 1.0
            );
        }
    }
    let base = TOP + ROW * bars.len() as f64;
    let _ = writeln!(
        s,
        r##"<line x1="{LEFT}" y1="{}" x2="{LEFT}" y2="{base}" stroke="#222"/>"##,
        TOP - 2.0
    );
    let _ = writeln!(
        s,
        r##"<text x="{LEFT}" y="{}" fill="#555">0</text><text x="{}" y="{}" fill="#555" text-anchor="end">{:.2}{unit}</text>"##,
        base + 18.0,
        W - RIGHT,
        base + 18.0,
        max
    );
    s.push_str("</svg>\n");
    s
}

/// Write `svg` to `dir/name`.
pub fn write(dir: &Path, name: &str, svg: &str) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let path = dir.join(name);
    std::fs::write(&path, svg).with_context(|| format!("writing {}", path.display()))
}
