//! The node's cluster-shared stores, opened by cluster mode: the coordinator database, the
//! handler versions, the nats-kv bucket, `handler.dedup`'s records and the parked groups.

use std::sync::Arc;

use anyhow::Context as _;
use sqlx::PgPool;

use crate::cluster;
use crate::config::{ClusterMode, Config};

/// The coordinator database (`postgres` mode): connected and migrated.
pub(super) async fn connect_database(config: &Config) -> anyhow::Result<Option<PgPool>> {
    if config.cluster.mode != ClusterMode::Postgres {
        return Ok(None);
    }
    let url = config.cluster.database_url.as_deref().unwrap_or_default();
    let pool = crate::cluster::postgres::connect(url)
        .await
        .with_context(|| format!("{}: cluster.mode = \"postgres\"", config.origin))?;
    Ok(Some(pool))
}

/// The buckets a `nats-kv` cluster of coordination bucket `bucket` may make
/// beside it (handler versions, components, dedup records, parked groups,
/// the sealing key),
/// for whoever deletes a cluster.
pub fn side_buckets(bucket: &str) -> Vec<String> {
    vec![
        crate::registry::kv::handlers_bucket(bucket),
        crate::registry::kv::components_bucket(bucket),
        crate::dedup::kv::bucket_name(bucket),
        crate::parked::kv::bucket_name(bucket),
        crate::seal::key::bucket_name(bucket),
    ]
}

/// Where the cluster keeps handler versions and canaries: the coordinator
/// database (`postgres`), or buckets beside the coordination bucket
/// (`nats-kv`); `None` in the modes without a shared store.
pub(super) async fn open_versions(
    config: &Config,
    database: Option<&PgPool>,
) -> anyhow::Result<Option<Arc<dyn crate::registry::shared::Shared>>> {
    match (config.cluster.mode, database) {
        (ClusterMode::Postgres, Some(pool)) => Ok(Some(Arc::new(crate::registry::store::pg::Database(pool.clone())))),
        (ClusterMode::NatsKv, _) => {
            let client = crate::transport::nats::connect(
                &config.transport.urls(),
                &format!("weir {} versions", config.node.name),
            )
            .await?;
            let buckets = crate::registry::kv::Buckets::open(
                &async_nats::jetstream::new(client),
                config.cluster.bucket(),
                config.transport.replicas(),
            )
            .await
            .with_context(|| {
                format!(
                    "{}: cluster.mode = \"nats-kv\": the handler versions' buckets",
                    config.origin
                )
            })?;
            Ok(Some(Arc::new(buckets)))
        }
        _ => Ok(None),
    }
}

/// The coordination bucket (`nats-kv` mode), created when missing, after
/// the topologies (whose declaration checked `transport.replicas` against
/// the cluster's size).
pub(super) async fn open_bucket(config: &Config) -> anyhow::Result<Option<async_nats::jetstream::kv::Store>> {
    if config.cluster.mode != ClusterMode::NatsKv {
        return Ok(None);
    }
    let kv = cluster::nats_kv::NatsKv::open(
        &config.transport.urls(),
        &format!("weir {}", config.node.name),
        config.cluster.bucket(),
        config.transport.replicas(),
    )
    .await
    .with_context(|| format!("{}: cluster.mode = \"nats-kv\"", config.origin))?;
    Ok(Some(kv))
}

/// Where `handler.dedup` keeps its records, when a handler asks for it: a
/// table beside the coordination tables (`postgres`), or a bucket beside
/// the coordination bucket (`nats-kv`), kept for the longest window.
pub(super) async fn open_dedup(config: &Config) -> anyhow::Result<Option<Arc<dyn crate::dedup::Store>>> {
    let Some(longest) = config.handler.iter().filter_map(|h| h.dedup.map(|d| d.window)).max() else {
        return Ok(None);
    };
    let store: Arc<dyn crate::dedup::Store> = match config.cluster.mode {
        ClusterMode::Postgres => {
            let url = config.cluster.database_url.as_deref().unwrap_or_default();
            Arc::new(crate::dedup::pg::Postgres::connect(url).await?)
        }
        ClusterMode::NatsKv => {
            let client =
                crate::transport::nats::connect(&config.transport.urls(), &format!("weir {} dedup", config.node.name))
                    .await?;
            let name = crate::dedup::kv::bucket_name(config.cluster.bucket());
            let bucket = crate::dedup::kv::Bucket::open(
                &async_nats::jetstream::new(client),
                &name,
                config.transport.replicas(),
                longest,
            )
            .await?;
            Arc::new(bucket)
        }
        other => anyhow::bail!(
            "{}: handler.dedup needs cluster.mode = \"postgres\" or \"nats-kv\", not {:?}",
            config.origin,
            other.as_str()
        ),
    };
    tracing::info!(store = store.what(), window = %humantime::format_duration(longest), "handler.dedup records ready");
    Ok(Some(Arc::new(crate::dedup::Coalesced::new(
        store,
        crate::dedup::PARALLEL,
    ))))
}

/// Where parked groups are kept for the next owner of their slot, when a
/// handler parks and the cluster mode has a store.
pub(super) async fn open_parked(
    config: &Config,
    database: Option<&PgPool>,
) -> anyhow::Result<Option<Arc<dyn crate::parked::Store>>> {
    if !config
        .handler
        .iter()
        .any(|h| h.on_failure == crate::config::OnFailure::Park)
    {
        return Ok(None);
    }
    let store: Arc<dyn crate::parked::Store> = match (config.cluster.mode, database) {
        (ClusterMode::Postgres, Some(pool)) => Arc::new(crate::parked::pg::Postgres::new(pool.clone())),
        (ClusterMode::NatsKv, _) => {
            let client =
                crate::transport::nats::connect(&config.transport.urls(), &format!("weir {} parked", config.node.name))
                    .await?;
            let name = crate::parked::kv::bucket_name(config.cluster.bucket());
            Arc::new(
                crate::parked::kv::Bucket::open(
                    &async_nats::jetstream::new(client),
                    &name,
                    config.transport.replicas(),
                )
                .await?,
            )
        }
        _ => {
            tracing::info!(
                mode = config.cluster.mode.as_str(),
                "on_failure = \"park\": this cluster mode has no shared store, so a parked group lives as long as its node"
            );
            return Ok(None);
        }
    };
    Ok(Some(store))
}
