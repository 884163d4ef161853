//! Who consumes which slot: a [`Coordinator`] per `cluster.mode`. `solo`
//! and `static` decide at start ([`solo`], [`fixed`]); in `rabbitmq-sac` the
//! broker decides ([`sac`]); in `postgres` and `nats-kv` a coordinator
//! assigns slots with leases, live handoff and fencing ([`leased`], over
//! [`postgres`] tables or a [`nats_kv`] bucket). The assignment itself is
//! a pure function ([`assign`]); the slots a node runs are a
//! [`slots::SlotSet`]; what the cluster looks like is a [`status::Status`].
//!
//! A new mode is one new file here and one line in
//! [`crate::config::ClusterMode`] (and its arm in [`coordinator`]).

pub mod assign;
pub mod coordinator;
pub mod fixed;
pub mod leased;
pub mod nats_kv;
pub mod postgres;
pub mod sac;
pub mod slots;
pub mod solo;
pub mod status;

use std::sync::Arc;

use anyhow::Context as _;
use sqlx::PgPool;

pub use coordinator::{Coordinator, Start};

use crate::config::{ClusterMode, Config};

/// The coordinator `config.cluster.mode` names; `database` is the
/// coordinator database of `postgres` mode, `bucket` the KV bucket of
/// `nats-kv` mode (each opened at start, so that a wrong one stops it).
pub fn coordinator(
    config: &Config,
    database: Option<PgPool>,
    bucket: Option<async_nats::jetstream::kv::Store>,
) -> anyhow::Result<Arc<dyn Coordinator>> {
    Ok(match config.cluster.mode {
        ClusterMode::Solo => Arc::new(solo::Solo),
        ClusterMode::Static => Arc::new(fixed::Static {
            owned: config.cluster.owned_slots.iter().flatten().copied().collect(),
        }),
        ClusterMode::RabbitmqSac => Arc::new(sac::SingleActiveConsumer),
        ClusterMode::Postgres => {
            let pool = database
                .with_context(|| format!("{}: cluster.mode = \"postgres\" without a database", config.origin))?;
            Arc::new(postgres::Postgres::new(pool, config))
        }
        ClusterMode::NatsKv => Arc::new(nats_kv::NatsKv::new(config, bucket)),
    })
}
