// Example handler in JavaScript: validates orders and announces the accepted ones.
//
// The same handler as examples/rust/orders, answer for answer:
//
// - `order.placed` -> validate -> publish `order.accepted` in the same group.
// - `order.paid` -> validate -> log (no cascade).
// - `order.line-added` -> validate one order line; as a batched type, a whole batch
//   of lines is validated in one pass by `handleBatch`, which also rejects a line
//   repeated within the batch.
// - Anything else is rejected.
//
// Config: `currency` (optional) is the only currency accepted; an order without a
// currency gets the configured one, or `EUR` when none is configured.
//
// Built with ComponentizeJS against wit/ (world `handler`). The bindings map the WIT
// like this: `handle` returns nothing on success and throws a `failure` value
// (`{ tag: 'reject' | 'retry', val: reason }`) to fail; `handleBatch` returns one
// `{ tag: 'ok' }` or `{ tag: 'err', val: failure }` per message. A thrown `Error`
// is not a failure value: it traps the instance, and the host retries the message,
// as it does for a Rust panic.
//
// Amounts are integers in JSON; JavaScript reads numbers as doubles, so the
// total is summed as a BigInt, and a price above 2^53 cents is as precise as the
// double it was read into.

import { beginMember, config, log, publish } from 'weir:handler/host@0.2.0';

const DEFAULT_CURRENCY = 'EUR';
const U32_MAX = 2 ** 32 - 1;
const U64_MAX = 2n ** 64n - 1n;

const reject = (reason) => ({ tag: 'reject', val: reason });
const retry = (reason) => ({ tag: 'retry', val: reason });
/** Is `e` one of our failure values (as opposed to a bug)? */
const isFailure = (e) => e !== null && typeof e === 'object' && (e.tag === 'reject' || e.tag === 'retry');

/** A string as the Rust handler's `{:?}` shows it. */
const quoted = (s) => JSON.stringify(s);

const decoder = new TextDecoder('utf-8', { fatal: true });

/** The payload as JSON, checked by `check`; anything else rejects the message. */
function decode(msg, what, check) {
  try {
    return check(JSON.parse(decoder.decode(msg.payload)));
  } catch (e) {
    throw reject(`payload of ${quoted(msg.messageType)} is not a valid ${what}: ${e.message}`);
  }
}

/** One field of a JSON object, of JSON type `kind` (`str`, `u32`, `u64`, `list`). */
function field(obj, name, kind, optional = false) {
  if (obj === null || typeof obj !== 'object' || Array.isArray(obj)) {
    throw new TypeError(`expected an object, found ${JSON.stringify(obj)}`);
  }
  const value = obj[name];
  if (value === undefined || value === null) {
    if (optional) return null;
    throw new TypeError(`missing field \`${name}\``);
  }
  if (kind === 'str' && typeof value === 'string') return value;
  if (kind === 'list' && Array.isArray(value)) return value;
  if ((kind === 'u32' || kind === 'u64') && Number.isInteger(value)) {
    if (value >= 0 && (kind === 'u64' ? BigInt(value) <= U64_MAX : value <= U32_MAX)) return value;
    throw new RangeError(`field \`${name}\`: ${value} is out of range for ${kind}`);
  }
  throw new TypeError(`field \`${name}\`: expected ${kind}, found ${JSON.stringify(value)}`);
}

const lineOf = (obj) => ({
  sku: field(obj, 'sku', 'str'),
  qty: field(obj, 'qty', 'u32'),
  unitPriceCents: BigInt(field(obj, 'unit_price_cents', 'u64')),
});

const orderOf = (obj) => ({
  orderId: field(obj, 'order_id', 'str'),
  customer: field(obj, 'customer', 'str'),
  lines: field(obj, 'lines', 'list').map(lineOf),
  currency: field(obj, 'currency', 'str', true),
  simulate: field(obj, 'simulate', 'str', true),
});

const lineAddedOf = (obj) => ({ orderId: field(obj, 'order_id', 'str'), line: lineOf(obj) });

/** The accepted order, or a string saying why it is invalid. */
function validate(order, configured) {
  if (order.orderId === '') return 'empty order_id';
  if (order.lines.length === 0) return 'no lines';
  if (order.currency !== null && configured !== undefined && order.currency !== configured) {
    return `currency ${quoted(order.currency)}, this shop accepts only ${quoted(configured)}`;
  }
  const currency = order.currency ?? configured ?? DEFAULT_CURRENCY;
  let total = 0n;
  for (const [i, line] of order.lines.entries()) {
    if (line.qty === 0) return `line ${i} (${quoted(line.sku)}) has qty 0`;
    total += line.unitPriceCents * BigInt(line.qty);
    if (total > U64_MAX) return `line ${i} (${quoted(line.sku)}) overflows the total`;
  }
  return { orderId: order.orderId, totalCents: total, currency };
}

function processOrder(msg, configured) {
  const kind = msg.messageType;
  if (kind !== 'order.placed' && kind !== 'order.paid') {
    throw reject(`unknown message type ${quoted(kind)}`);
  }
  const order = decode(msg, 'Order', orderOf);
  if (order.simulate === 'transient' && msg.attempt < 3) {
    throw retry('simulated transient failure');
  }
  const accepted = validate(order, configured);
  if (typeof accepted === 'string') {
    throw reject(`invalid order ${quoted(order.orderId)} from ${quoted(order.customer)}: ${accepted}`);
  }
  const amount = `${accepted.totalCents} ${accepted.currency}`;
  if (kind === 'order.paid') {
    log('debug', `order ${accepted.orderId} paid: ${amount}`);
    return;
  }
  // Written by hand: JSON.stringify cannot write a BigInt.
  const body = `{"order_id":${quoted(accepted.orderId)},"total_cents":${accepted.totalCents},"currency":${quoted(accepted.currency)}}`;
  try {
    publish('order.accepted', msg.groupId, [['content-type', 'application/json']], new TextEncoder().encode(body));
  } catch (e) {
    throw retry(`publishing "order.accepted" failed: ${e.payload ?? e}`);
  }
  log('debug', `order ${accepted.orderId} accepted: ${amount}`);
}

/** Decode and check one `order.line-added`. */
function lineAdded(msg) {
  const added = decode(msg, 'LineAdded', lineAddedOf);
  const { orderId, line } = added;
  if (orderId === '') throw reject('order line without order_id');
  if (line.sku === '') throw reject(`order ${quoted(orderId)}: line without sku`);
  if (line.qty === 0) throw reject(`order ${quoted(orderId)}: line ${quoted(line.sku)} has qty 0`);
  if (line.unitPriceCents * BigInt(line.qty) > U64_MAX) {
    throw reject(`order ${quoted(orderId)}: line ${quoted(line.sku)} overflows its amount`);
  }
  return added;
}

/** Handle one message: return to succeed, throw a failure value to fail. */
export function handle(msg) {
  if (msg.messageType === 'order.line-added') {
    lineAdded(msg);
    return;
  }
  processOrder(msg, config('currency'));
}

/**
 * Bulk validation: the config is read once for the whole batch, and the order lines of
 * the batch are checked in one pass (each on its own, and no line twice). One result
 * per message, in order: a bad line is rejected alone, the rest of the batch still succeeds.
 * `beginMember` before each message makes what it publishes (an `order.accepted`) its own:
 * sent only if that message succeeds.
 */
export function handleBatch(batch) {
  const currency = config('currency');
  const seen = new Set();
  let lines = 0;
  const results = batch.map((msg, i) => {
    beginMember(i);
    try {
      if (msg.messageType !== 'order.line-added') {
        processOrder(msg, currency);
        return { tag: 'ok' };
      }
      const { orderId, line } = lineAdded(msg);
      const key = JSON.stringify([orderId, line.sku]);
      if (seen.has(key)) {
        throw reject(`order ${quoted(orderId)}: sku ${quoted(line.sku)} added twice in one batch`);
      }
      seen.add(key);
      lines += 1;
      return { tag: 'ok' };
    } catch (e) {
      if (isFailure(e)) return { tag: 'err', val: e };
      throw e;
    }
  });
  log('debug', `validated ${lines} order lines in a batch of ${batch.length}`);
  return results;
}
