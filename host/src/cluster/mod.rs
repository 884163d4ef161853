//! Who consumes which slot. `solo` and `static` decide at start; in
//! `rabbitmq-sac` the broker decides; in `postgres` a coordinator assigns
//! slots with leases, live handoff and fencing ([`postgres`]). The
//! assignment itself is a pure function ([`assign`]); the slots a node runs
//! are a [`slots::SlotSet`]; what the cluster looks like is a
//! [`status::Status`].

pub mod assign;
pub mod postgres;
pub mod slots;
pub mod status;
