//! The admin HTTP listener (`[node] admin = "ADDR"`): `GET /health`,
//! `GET /ready`, `GET /metrics` (Prometheus text), `GET /v1/slots`,
//! `GET /v1/handlers`, `PUT /v1/handlers/{name}` (body: component bytes;
//! optional grants `?env=NAME&dir=GUEST:HOST`) and
//! `POST /v1/handlers/{name}/rollback`, `POST /v1/topologies/{T}/messages`
//! (publish through this node's broker, see [`messages`]), and the
//! dead-letter tools under `/v1/dead-letters` ([`dead_letters`]: list,
//! redrive, purge; tenant-scoped). `GET /` is a dashboard over these
//! ([`dashboard`]), and `GET /v1/whoami` tells it who a token is.
//!
//! Bearer tokens: `node.admin_token` (the operator) may do everything; a
//! `[[tenant]] token` sees and changes only that tenant's handlers. `/health`
//! and `/ready` are open (probes). With no token configured at all, the
//! read-only routes are open and deploys are refused. Missing or unknown
//! token: 401; a tenant token on an operator route: 403; a tenant token on
//! a handler that is not its tenant's, whether it exists or not: 404 with
//! one and the same body; an upload over `node.max_component_size`: 413; a
//! component that fails validation: 400 with the reason. A refused deploy
//! leaves the running version serving.
//!
//! Hostile clients are bounded: the request line and headers must arrive
//! within `node.admin_header_timeout` (which also closes idle connections),
//! an upload within `node.admin_body_timeout` with no pause longer than
//! `node.admin_idle_timeout` (else 408), at most `node.admin_max_connections`
//! connections are held (more are closed at once). Uploads are streamed to
//! a file (`node.data_dir/uploads`, else the system's temporary directory),
//! never held in memory while they arrive; at most `node.admin_max_uploads`
//! run at once (more: 503), `node.admin_max_uploads_per_caller` of them for
//! one token (more: 429), both with `Retry-After`. Each caller's deploys
//! compile in its own queue (see [`crate::registry`]).

//!
//! The files: [`listener`] (the accept loop and its bounds), [`routes`]
//! (each route's answer), [`auth`] (bearer tokens), [`limits`] and
//! [`upload`] (uploads: caps, spooling), [`metrics`] (the Prometheus
//! encoding), [`state`] (what the routes read).

pub mod auth;
pub mod dashboard;
pub mod dead_letters;
pub mod error;
pub mod limits;
pub mod listener;
pub mod messages;
pub mod metrics;
pub mod routes;
pub mod state;
pub mod upload;
pub mod write_timeout;

pub use auth::Auth;
pub use limits::Limits;
pub use listener::{serve, serve_metrics};
pub use state::{AdminState, NegativeControls};
