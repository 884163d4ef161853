//! Validation of a whole config: every key checked against the others, errors and warnings that
//! name the key. One file per section of the config.

mod handler;
mod node;
mod tenant;
mod topology;

use super::Config;
use super::load::ConfigError;
use crate::retry::schedule::Violation;

/// Collects violations during validation.
#[derive(Default)]
struct Issues(Vec<Violation>);

impl Issues {
    fn add(&mut self, key: impl Into<String>, message: impl Into<String>) {
        self.0.push(Violation {
            key: key.into(),
            message: message.into(),
        });
    }
}

fn is_broker_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'_' | b'-'))
}

fn is_handler_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
}

impl Config {
    /// Checks everything that can be checked without a broker. Errors stop the start; the
    /// warnings (retry rules that do not reject, unused keys) are returned for logging.
    pub fn validate(&self) -> Result<Vec<Violation>, ConfigError> {
        let mut errors = Issues::default();
        let mut warnings = Vec::new();
        self.validate_node(&mut errors);
        self.validate_transport(&mut errors, &mut warnings);
        self.validate_cluster(&mut errors, &mut warnings);
        self.validate_topologies(&mut errors, &mut warnings);
        self.validate_handlers(&mut errors);
        self.validate_tenants(&mut errors);
        self.validate_telemetry(&mut errors);
        if errors.0.is_empty() {
            Ok(warnings)
        } else {
            Err(ConfigError::Invalid {
                origin: self.origin.clone(),
                issues: errors.0,
            })
        }
    }
}

/// A JetStream KV bucket name: `[A-Za-z0-9_-]+`.
pub(crate) fn is_bucket_name(b: &str) -> bool {
    !b.is_empty() && b.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b'-')
}
