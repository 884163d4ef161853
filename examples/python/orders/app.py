"""Example handler in Python: validates orders and announces the accepted ones.

The same handler as examples/rust/orders, answer for answer:

- `order.placed` -> validate -> publish `order.accepted` in the same group.
- `order.paid` -> validate -> log (no cascade).
- `order.line-added` -> validate one order line; as a batched type, a whole batch
  of lines is validated in one pass by `handle_batch`, which also rejects a line
  repeated within the batch.
- Anything else is rejected.

Config: `currency` (optional) is the only currency accepted; an order without a
currency gets the configured one, or `EUR` when none is configured.

Built with componentize-py against wit/ (world `handler`); `wit_world` is the
module componentize-py generates from it.
"""

import json
from typing import Any, List, Optional

import wit_world
from componentize_py_types import Err, Ok, Result
from wit_world.imports import host
from wit_world.imports.types import Failure, Failure_Reject, Failure_Retry, Level, Message

DEFAULT_CURRENCY = "EUR"
U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1


class Rejected(Exception):
    """A permanent failure: the message is dead-lettered."""


class Retried(Exception):
    """A transient failure: the message goes back onto the retry ladder."""


def quoted(value: str) -> str:
    """A string as the Rust handler's `{:?}` shows it (a JSON string literal)."""
    return json.dumps(value)


def decode(msg: Message, what: str, check) -> Any:
    """The payload as JSON, checked by `check`; anything else rejects the message."""
    try:
        value = json.loads(msg.payload)
        return check(value)
    except (ValueError, TypeError) as e:
        raise Rejected(f"payload of {quoted(msg.message_type)} is not a valid {what}: {e}")


def field(obj: dict, name: str, kind: str, optional: bool = False) -> Any:
    """One field of a JSON object, of JSON type `kind` (`str`, `u32`, `u64`, `list`)."""
    if not isinstance(obj, dict):
        raise TypeError(f"expected an object, found {type(obj).__name__}")
    value = obj.get(name)
    if value is None:
        if optional:
            return None
        raise ValueError(f"missing field `{name}`")
    if kind == "str" and isinstance(value, str):
        return value
    if kind == "list" and isinstance(value, list):
        return value
    if kind in ("u32", "u64") and isinstance(value, int) and not isinstance(value, bool):
        if 0 <= value <= (U32_MAX if kind == "u32" else U64_MAX):
            return value
        raise ValueError(f"field `{name}`: {value} is out of range for {kind}")
    raise TypeError(f"field `{name}`: expected {kind}, found {json.dumps(value)}")


def line_of(obj: dict) -> dict:
    return {
        "sku": field(obj, "sku", "str"),
        "qty": field(obj, "qty", "u32"),
        "unit_price_cents": field(obj, "unit_price_cents", "u64"),
    }


def order_of(obj: dict) -> dict:
    return {
        "order_id": field(obj, "order_id", "str"),
        "customer": field(obj, "customer", "str"),
        "lines": [line_of(line) for line in field(obj, "lines", "list")],
        "currency": field(obj, "currency", "str", optional=True),
        "simulate": field(obj, "simulate", "str", optional=True),
    }


def line_added_of(obj: dict) -> dict:
    return {"order_id": field(obj, "order_id", "str"), "line": line_of(obj)}


def validate(order: dict, configured: Optional[str]) -> dict:
    """The accepted order, or ValueError with the reason it is invalid."""
    if not order["order_id"]:
        raise ValueError("empty order_id")
    if not order["lines"]:
        raise ValueError("no lines")
    given = order["currency"]
    if given is not None and configured is not None and given != configured:
        raise ValueError(f"currency {quoted(given)}, this shop accepts only {quoted(configured)}")
    if given is not None:
        currency = given
    elif configured is not None:
        currency = configured
    else:
        currency = DEFAULT_CURRENCY
    total = 0
    for i, line in enumerate(order["lines"]):
        if line["qty"] == 0:
            raise ValueError(f"line {i} ({quoted(line['sku'])}) has qty 0")
        total += line["unit_price_cents"] * line["qty"]
        if total > U64_MAX:
            raise ValueError(f"line {i} ({quoted(line['sku'])}) overflows the total")
    return {"order_id": order["order_id"], "total_cents": total, "currency": currency}


def process(msg: Message, configured: Optional[str]) -> None:
    kind = msg.message_type
    if kind not in ("order.placed", "order.paid"):
        raise Rejected(f"unknown message type {quoted(kind)}")
    order = decode(msg, "Order", order_of)
    if order["simulate"] == "transient" and msg.attempt < 3:
        raise Retried("simulated transient failure")
    try:
        accepted = validate(order, configured)
    except ValueError as reason:
        raise Rejected(
            f"invalid order {quoted(order['order_id'])} from {quoted(order['customer'])}: {reason}"
        )
    amount = f"{accepted['total_cents']} {accepted['currency']}"
    if kind == "order.paid":
        host.log(Level.DEBUG, f"order {accepted['order_id']} paid: {amount}")
        return
    payload = json.dumps(accepted, separators=(",", ":")).encode()
    try:
        host.publish(
            "order.accepted", msg.group_id, [("content-type", "application/json")], payload
        )
    except Err as e:
        raise Retried(f'publishing "order.accepted" failed: {e.value}')
    host.log(Level.DEBUG, f"order {accepted['order_id']} accepted: {amount}")


def line_added(msg: Message) -> dict:
    """Decode and check one `order.line-added`."""
    added = decode(msg, "LineAdded", line_added_of)
    line = added["line"]
    prefix = f"order {quoted(added['order_id'])}: "
    if not added["order_id"]:
        raise Rejected("order line without order_id")
    if not line["sku"]:
        raise Rejected(prefix + "line without sku")
    if line["qty"] == 0:
        raise Rejected(prefix + f"line {quoted(line['sku'])} has qty 0")
    if line["unit_price_cents"] * line["qty"] > U64_MAX:
        raise Rejected(prefix + f"line {quoted(line['sku'])} overflows its amount")
    return added


def failure(e: Exception) -> Failure:
    if isinstance(e, Retried):
        return Failure_Retry(str(e))
    return Failure_Reject(str(e))


class WitWorld(wit_world.WitWorld):
    """The handler. An exception other than Rejected/Retried escapes and traps the
    instance: the host discards it and retries the message, as for a Rust panic."""

    def handle(self, msg: Message) -> None:
        try:
            if msg.message_type == "order.line-added":
                line_added(msg)
            else:
                process(msg, host.config("currency"))
        except (Rejected, Retried) as e:
            raise Err(failure(e))

    def handle_batch(self, batch: List[Message]) -> List[Result[None, Failure]]:
        """Bulk validation: the config is read once for the whole batch, and the order
        lines of the batch are checked in one pass (each on its own, and no line twice).
        One result per message, in order. `begin_member` before each message makes what
        it publishes (an `order.accepted`) its own: sent only if that message succeeds."""
        currency = host.config("currency")
        seen = set()
        lines = 0
        results: List[Result[None, Failure]] = []
        for i, msg in enumerate(batch):
            host.begin_member(i)
            try:
                if msg.message_type != "order.line-added":
                    process(msg, currency)
                else:
                    added = line_added(msg)
                    key = (added["order_id"], added["line"]["sku"])
                    if key in seen:
                        raise Rejected(
                            f"order {quoted(key[0])}: sku {quoted(key[1])} added twice in one batch"
                        )
                    seen.add(key)
                    lines += 1
                results.append(Ok(None))
            except (Rejected, Retried) as e:
                results.append(Err(failure(e)))
        host.log(Level.DEBUG, f"validated {lines} order lines in a batch of {len(batch)}")
        return results
