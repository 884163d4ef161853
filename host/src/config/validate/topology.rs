//! `[[topology]]`: names, slots, windows, retry ladders, park bounds.

use std::collections::HashMap;

use super::super::Config;
use super::{Issues, is_broker_name};
use crate::retry::schedule::{CheckContext, Violation};

impl Config {
    pub(super) fn validate_topologies(&self, errors: &mut Issues, warnings: &mut Vec<Violation>) {
        let mut names: HashMap<&str, usize> = HashMap::new();
        for (i, t) in self.topology.iter().enumerate() {
            let key = format!("topology[{i}]");
            if !is_broker_name(&t.name) {
                errors.add(
                    format!("{key}.name"),
                    format!("{:?} cannot name broker objects; accepted: lowercase letters, digits, '_' and '-' ([a-z0-9_-]+)", t.name),
                );
            }
            if let Some(first) = names.insert(&t.name, i) {
                errors.add(
                    format!("{key}.name"),
                    format!(
                        "{:?} is already the name of topology[{first}]; topology names are unique",
                        t.name
                    ),
                );
            }
            if t.slots == 0 {
                errors.add(format!("{key}.slots"), "is 0; accepted: 1 or more");
            }
            let prefetch = self.transport.prefetch;
            if let Some(hold) = t.park_hold
                && (hold == 0 || (prefetch > 0 && hold > prefetch / 2))
            {
                errors.add(
                    format!("{key}.park_hold"),
                    format!(
                        "is {hold}; a parked group's held messages count against the slot's window \
                         (transport.prefetch = {prefetch}), and the failed head and the other groups need \
                         room in it; accepted: 1 to {}",
                        if prefetch > 0 { (prefetch / 2).max(1) } else { u32::MAX }
                    ),
                );
            }
            self.validate_park_hold_slot(t, &key, errors, warnings);
            if t.max_concurrent_groups == 0 {
                errors.add(
                    format!("{key}.max_concurrent_groups"),
                    "is 0, which would run nothing; accepted: 1 or more",
                );
            }
            if t.max_unordered == 0 {
                errors.add(
                    format!("{key}.max_unordered"),
                    "is 0, which would never run messages without a group id; accepted: 1 or more",
                );
            }
            let report = t
                .schedule(self.transport.kind, None)
                .check(&CheckContext::new(Self::retry_key(i)));
            errors.0.extend(report.errors);
            warnings.extend(report.warnings);
        }
    }
    /// `park_hold_slot` must leave room in the slot's window (issue 32: a
    /// hold that fills it stops the slot for good on RabbitMQ); a group's
    /// `park_hold` above it is only ever reached through it (a warning).
    pub(super) fn validate_park_hold_slot(
        &self,
        t: &crate::config::Topology,
        key: &str,
        errors: &mut Issues,
        warnings: &mut Vec<Violation>,
    ) {
        let prefetch = self.transport.prefetch;
        let Some(bound) = t.park_hold_slot else { return };
        if prefetch > 0 && bound >= prefetch {
            errors.add(
                format!("{key}.park_hold_slot"),
                format!(
                    "is {bound}, which is not below the slot's window (transport.prefetch = {prefetch}): \
                     parked groups could fill it, and then neither their failed heads (RabbitMQ brings \
                     them back through the slot's queue) nor the slot's other groups are delivered again, \
                     so the slot stops; accepted: 0 to {} (default: prefetch / 2 = {})",
                    prefetch - 1,
                    prefetch / 2
                ),
            );
        } else if let Some(hold) = t.park_hold
            && hold > bound
        {
            warnings.push(Violation {
                key: format!("{key}.park_hold"),
                message: format!(
                    "is {hold}, above {key}.park_hold_slot = {bound}: no parked group holds more than \
                     the slot's bound"
                ),
            });
        }
    }
}
