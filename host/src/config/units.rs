//! Sizes and durations as a config writes them (`"64MiB"`, `"250ms"`), and their serde readers.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use serde::Deserialize;
use serde::de::{self, Deserializer};

/// A size in bytes, written `"64MiB"`, `"512KiB"`, `"1GiB"`, `"100B"` or a plain integer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct ByteSize(pub u64);

impl ByteSize {
    /// Parses `"64MiB"`, `"512 KiB"`, `"1GiB"`, `"1TiB"`, `"100B"` or `"4096"`.
    pub fn parse(text: &str) -> Result<Self, String> {
        let t = text.trim();
        let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
        let (number, unit) = t.split_at(split);
        let accepted = "expected a whole number of bytes or a number with a unit B, KiB, MiB, \
                        GiB or TiB, e.g. \"64MiB\"";
        let number: u64 = number
            .parse()
            .map_err(|_| format!("invalid size {text:?}: {accepted}"))?;
        let factor: u64 = match unit.trim_start() {
            "" | "B" => 1,
            "KiB" => 1 << 10,
            "MiB" => 1 << 20,
            "GiB" => 1 << 30,
            "TiB" => 1 << 40,
            _ => return Err(format!("invalid size {text:?}: {accepted}")),
        };
        number
            .checked_mul(factor)
            .map(ByteSize)
            .ok_or_else(|| format!("size {text:?} does not fit in 64 bits"))
    }

    /// The size in bytes.
    pub fn bytes(self) -> u64 {
        self.0
    }
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let units = [
            (1u64 << 40, "TiB"),
            (1 << 30, "GiB"),
            (1 << 20, "MiB"),
            (1 << 10, "KiB"),
        ];
        for (factor, unit) in units {
            if self.0 >= factor && self.0.is_multiple_of(factor) {
                return write!(f, "{}{unit}", self.0 / factor);
            }
        }
        write!(f, "{}B", self.0)
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Int(i64),
            Text(String),
        }
        match Raw::deserialize(d)? {
            Raw::Int(n) => u64::try_from(n)
                .map(ByteSize)
                .map_err(|_| de::Error::custom(format!("invalid size {n}: a size cannot be negative"))),
            Raw::Text(t) => ByteSize::parse(&t).map_err(de::Error::custom),
        }
    }
}

pub(super) fn parse_duration(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text.trim()).map_err(|e| {
        format!(
            "invalid duration {text:?} ({e}); expected a number with a unit, e.g. \"20ms\", \
             \"5s\", \"10m\", \"1h\""
        )
    })
}

pub(super) fn de_duration<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    let text = String::deserialize(d)?;
    parse_duration(&text).map_err(de::Error::custom)
}

pub(super) fn de_duration_opt<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    de_duration(d).map(Some)
}

pub(super) fn de_duration_list<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<Duration>>, D::Error> {
    let texts = Vec::<String>::deserialize(d)?;
    texts
        .iter()
        .enumerate()
        .map(|(i, t)| parse_duration(t).map_err(|e| de::Error::custom(format!("ladder[{i}]: {e}"))))
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

pub(super) fn de_string_table<'de, D: Deserializer<'de>>(d: D) -> Result<BTreeMap<String, String>, D::Error> {
    let raw = BTreeMap::<String, toml::Value>::deserialize(d)?;
    raw.into_iter()
        .map(|(key, value)| match value {
            toml::Value::String(s) => Ok((key, s)),
            other => Err(de::Error::custom(format!(
                "config.{key}: expected a string, found {} {other}; handler config values are \
                 strings: write {key} = \"{}\"",
                other.type_str(),
                other.to_string().trim_matches('"'),
            ))),
        })
        .collect()
}
