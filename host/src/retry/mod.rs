//! Retries: the pure ladder arithmetic ([`schedule`]): which delivery waits
//! how long, when the ladder is exhausted, and whether a broker can serve it.
//! Settlement ([`crate::settle`]) climbs it.

pub mod schedule;
