//! Retries and dead letters: the pure ladder arithmetic ([`schedule`]) and
//! the confirmed capture that settles a failed delivery ([`capture`]).

pub mod capture;
pub mod schedule;
