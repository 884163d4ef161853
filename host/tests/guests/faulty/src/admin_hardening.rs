//! Behaviours of the `admin.` message types (the admin-hardening tests).

use weir_guest::{Failure, Message};

/// `admin.read`: reject with what reading the file named by the payload gave
/// (`read <path>: ok <contents>` or `read <path>: denied (<error>)`), so a test
/// sees through the dead letter what a directory grant exposes.
pub fn handle(kind: &str, msg: &Message) -> Result<(), Failure> {
    match kind {
        "admin.read" => {
            let path = msg.text()?.trim().to_owned();
            let seen = match std::fs::read_to_string(&path) {
                Ok(text) => format!("ok {}", text.chars().take(200).collect::<String>()),
                Err(e) => format!("denied ({e})"),
            };
            Err(Failure::reject(format!("read {path}: {seen}")))
        }
        other => Err(Failure::reject(format!("faulty: unknown message type {other:?}"))),
    }
}
