//! Example handler: validates orders and announces the accepted ones.
//!
//! `order.placed` → validate → publish `order.accepted` in the same group.
//! `order.paid`   → validate → log (no cascade).
//! `order.line-added` → validate one order line; configured as a batched type
//! (`batch = { message_types = ["order.line-added"], ... }`), a whole batch of lines is
//! validated in one pass by `handle_batch`, which also rejects a line repeated within the batch.
//! Anything else is rejected.
//! Config: `currency` (optional) is the only currency accepted; an order without a currency
//! gets the configured one, or `EUR` when none is configured.

use std::collections::HashSet;

use serde::{Deserialize, Serialize};
use weir_guest::{Failure, Handler, Message};

const DEFAULT_CURRENCY: &str = "EUR";

#[derive(Deserialize)]
struct Order {
    order_id: String,
    customer: String,
    lines: Vec<Line>,
    currency: Option<String>,
    /// Demo knob: `"transient"` fails the first two attempts with a retry.
    simulate: Option<String>,
}

#[derive(Deserialize)]
struct Line {
    sku: String,
    qty: u32,
    unit_price_cents: u64,
}

/// `order.line-added`: one line added to an open order.
#[derive(Deserialize)]
struct LineAdded {
    order_id: String,
    #[serde(flatten)]
    line: Line,
}

#[derive(Serialize, Debug, PartialEq)]
struct Accepted {
    order_id: String,
    total_cents: u64,
    currency: String,
}

/// The order handler.
pub struct Orders;

impl Handler for Orders {
    fn handle(msg: Message) -> Result<(), Failure> {
        if msg.message_type() == "order.line-added" {
            return line_added(&msg).map(|_| ());
        }
        process(&msg, weir_guest::config("currency").as_deref())
    }

    /// Bulk validation: the config is read once for the whole batch, and the order lines of
    /// the batch are checked in one pass (each on its own, and no line twice). One result per
    /// message, in order: a bad line is rejected alone, the rest of the batch still succeeds.
    /// `begin_member` before each message makes what it publishes (an `order.accepted`) its
    /// own: sent only if that message succeeds.
    fn handle_batch(batch: Vec<Message>) -> Vec<Result<(), Failure>> {
        let currency = weir_guest::config("currency");
        let mut seen = HashSet::new();
        let mut lines = 0usize;
        let results: Vec<Result<(), Failure>> = batch
            .iter()
            .enumerate()
            .map(|(i, msg)| {
                weir_guest::begin_member(i);
                if msg.message_type() != "order.line-added" {
                    return process(msg, currency.as_deref());
                }
                let added = line_added(msg)?;
                if !seen.insert((added.order_id.clone(), added.line.sku.clone())) {
                    return Err(Failure::reject(format!(
                        "order {:?}: sku {:?} added twice in one batch",
                        added.order_id, added.line.sku
                    )));
                }
                lines += 1;
                Ok(())
            })
            .collect();
        weir_guest::debug!("validated {lines} order lines in a batch of {}", batch.len());
        results
    }
}

/// Decode and check one `order.line-added`.
fn line_added(msg: &Message) -> Result<LineAdded, Failure> {
    let added: LineAdded = msg.json()?;
    let reject = |reason: String| Failure::reject(format!("order {:?}: {reason}", added.order_id));
    if added.order_id.is_empty() {
        return Err(Failure::reject("order line without order_id"));
    }
    if added.line.sku.is_empty() {
        return Err(reject("line without sku".into()));
    }
    if added.line.qty == 0 {
        return Err(reject(format!("line {:?} has qty 0", added.line.sku)));
    }
    if added
        .line
        .unit_price_cents
        .checked_mul(u64::from(added.line.qty))
        .is_none()
    {
        return Err(reject(format!("line {:?} overflows its amount", added.line.sku)));
    }
    Ok(added)
}

weir_guest::export!(Orders);

fn process(msg: &Message, configured: Option<&str>) -> Result<(), Failure> {
    let kind = msg.message_type();
    if kind != "order.placed" && kind != "order.paid" {
        return Err(Failure::reject(format!("unknown message type {kind:?}")));
    }
    let order: Order = msg.json()?;
    if order.simulate.as_deref() == Some("transient") && msg.attempt() < 3 {
        return Err(Failure::retry("simulated transient failure"));
    }
    let accepted = validate(&order, configured).map_err(|reason| {
        Failure::reject(format!(
            "invalid order {:?} from {:?}: {reason}",
            order.order_id, order.customer
        ))
    })?;
    if kind == "order.paid" {
        weir_guest::debug!(
            "order {} paid: {} {}",
            accepted.order_id,
            accepted.total_cents,
            accepted.currency
        );
        return Ok(());
    }
    weir_guest::publish_json("order.accepted", msg.group_id(), &accepted)?;
    weir_guest::debug!(
        "order {} accepted: {} {}",
        accepted.order_id,
        accepted.total_cents,
        accepted.currency
    );
    Ok(())
}

fn validate(order: &Order, configured: Option<&str>) -> Result<Accepted, String> {
    if order.order_id.is_empty() {
        return Err("empty order_id".into());
    }
    if order.lines.is_empty() {
        return Err("no lines".into());
    }
    let currency = match (order.currency.as_deref(), configured) {
        (Some(given), Some(wanted)) if given != wanted => {
            return Err(format!("currency {given:?}, this shop accepts only {wanted:?}"));
        }
        (Some(given), _) => given,
        (None, configured) => configured.unwrap_or(DEFAULT_CURRENCY),
    };
    let mut total_cents: u64 = 0;
    for (i, line) in order.lines.iter().enumerate() {
        if line.qty == 0 {
            return Err(format!("line {i} ({:?}) has qty 0", line.sku));
        }
        total_cents = line
            .unit_price_cents
            .checked_mul(u64::from(line.qty))
            .and_then(|amount| total_cents.checked_add(amount))
            .ok_or_else(|| format!("line {i} ({:?}) overflows the total", line.sku))?;
    }
    Ok(Accepted {
        order_id: order.order_id.clone(),
        total_cents,
        currency: currency.to_owned(),
    })
}

#[cfg(all(test, not(target_arch = "wasm32")))]
mod tests {
    use super::*;
    use serde_json::{Value, json};
    use weir_guest::testing;

    fn order() -> Value {
        json!({ "order_id": "o-1", "customer": "ada", "lines": [
            { "sku": "a", "qty": 2, "unit_price_cents": 150 },
            { "sku": "b", "qty": 1, "unit_price_cents": 99 },
        ]})
    }

    fn placed(payload: &Value) -> Message {
        Message::new("m-1", "order.placed", payload.to_string()).with_group_id("ada")
    }

    #[test]
    fn accepted_order_is_announced_in_its_group() {
        testing::reset();
        Orders::handle(placed(&order())).unwrap();
        let published = testing::take_published();
        assert_eq!(published.len(), 1);
        assert_eq!(published[0].message_type, "order.accepted");
        assert_eq!(published[0].group_id.as_deref(), Some("ada"));
        assert_eq!(
            published[0].text(),
            r#"{"order_id":"o-1","total_cents":399,"currency":"EUR"}"#
        );
    }

    #[test]
    fn invalid_orders_are_rejected_with_a_reason() {
        testing::reset();
        testing::set_config("currency", "USD");
        let with = |key: &str, value: Value| {
            let mut o = order();
            o[key] = value;
            o
        };
        let cases = [
            (with("lines", json!([])), "no lines"),
            (with("order_id", json!("")), "empty order_id"),
            (
                with("lines", json!([{ "sku": "a", "qty": 0, "unit_price_cents": 1 }])),
                "qty 0",
            ),
            (with("currency", json!("EUR")), r#"accepts only "USD""#),
            (json!({ "order_id": "o-1" }), "not a valid"),
        ];
        for (payload, reason) in cases {
            let failure = Orders::handle(placed(&payload)).unwrap_err();
            assert!(failure.is_reject(), "{payload}: {failure}");
            assert!(failure.reason().contains(reason), "{payload}: {failure}");
        }
        assert!(testing::take_published().is_empty());
    }

    #[test]
    fn simulated_transient_failure_succeeds_on_the_third_attempt() {
        testing::reset();
        let mut payload = order();
        payload["simulate"] = json!("transient");
        assert!(Orders::handle(placed(&payload).with_attempt(2)).unwrap_err().is_retry());
        Orders::handle(placed(&payload).with_attempt(3)).unwrap();
    }

    #[test]
    fn batch_returns_one_result_per_message_in_order() {
        testing::reset();
        let batch = vec![
            placed(&order()),
            Message::new("m-2", "order.shipped", "{}"),
            placed(&json!([])),
        ];
        let results = Orders::handle_batch(batch);
        assert_eq!(results.len(), 3);
        assert!(results[0].is_ok());
        assert!(
            results[1]
                .as_ref()
                .unwrap_err()
                .reason()
                .contains("unknown message type")
        );
        assert!(results[2].as_ref().unwrap_err().is_reject());
        let published = testing::take_published();
        assert_eq!(published.len(), 1);
        assert_eq!(published[0].member, Some(0), "the accepted order is its message's own");
    }

    fn line(id: &str, order: &str, sku: &str, qty: u32) -> Message {
        let payload = json!({ "order_id": order, "sku": sku, "qty": qty, "unit_price_cents": 100 });
        Message::new(id, "order.line-added", payload.to_string()).with_group_id(order)
    }

    #[test]
    fn a_batch_of_lines_rejects_only_its_bad_and_repeated_lines() {
        testing::reset();
        let batch = vec![
            line("l-1", "o-1", "a", 1),
            line("l-2", "o-1", "b", 0),
            line("l-3", "o-1", "a", 2),
            line("l-4", "o-1", "c", 3),
        ];
        let results = Orders::handle_batch(batch);
        assert_eq!(results.len(), 4);
        assert!(results[0].is_ok() && results[3].is_ok());
        assert!(results[1].as_ref().unwrap_err().reason().contains("qty 0"));
        assert!(results[2].as_ref().unwrap_err().reason().contains("added twice"));
        // Alone, a line is validated the same way.
        Orders::handle(line("l-5", "o-2", "a", 1)).unwrap();
        assert!(Orders::handle(line("l-6", "o-2", "", 1)).unwrap_err().is_reject());
    }
}
