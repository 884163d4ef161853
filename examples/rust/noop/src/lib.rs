//! The smallest handler: accepts every message without looking at it. Used by benchmarks to
//! measure the host's own cost per message.

use weir_guest::{Failure, Handler, Message};

/// Accepts everything.
pub struct Noop;

impl Handler for Noop {
    fn handle(_msg: Message) -> Result<(), Failure> {
        Ok(())
    }

    fn handle_batch(batch: Vec<Message>) -> Vec<Result<(), Failure>> {
        vec![Ok(()); batch.len()]
    }
}

weir_guest::export!(Noop);
