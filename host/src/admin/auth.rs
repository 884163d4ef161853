//! Bearer tokens: the operator's (`node.admin_token`) and each tenant's,
//! kept as digests; who a request is and what it may do.

use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};

use super::error::error_body;
use crate::registry::Caller;

/// The tokens, kept as sha256 digests and compared digest to digest, so a
/// comparison's time says nothing about the secret.
#[derive(Debug, Clone, Default)]
pub struct Auth {
    operator: Option<[u8; 32]>,
    tenants: Vec<([u8; 32], String)>,
}

fn token_digest(token: &str) -> [u8; 32] {
    use sha2::Digest as _;
    sha2::Sha256::digest(token.as_bytes()).into()
}

/// The refusal of a deploy or rollback on a node without tokens.
pub(super) const DEPLOYS_DISABLED: &str = "deploys are disabled on this node (no admin_token): set node.admin_token \
     (or a tenant's token) in its config to take deploys";

/// The refusal of a publish on a node without tokens.
pub(super) const PUBLISHING_DISABLED: &str = "publishing through the admin listener is disabled on this node (no \
     admin_token): set node.admin_token (or a tenant's token) in its config";

/// Why a request is refused before it does anything.
pub(super) enum Denied {
    /// No credentials, or unknown ones.
    Unauthorized(&'static str),
    /// Known caller, not allowed here.
    Forbidden(String),
}

impl IntoResponse for Denied {
    fn into_response(self) -> Response {
        match self {
            Denied::Unauthorized(why) => (
                StatusCode::UNAUTHORIZED,
                [(header::WWW_AUTHENTICATE, "Bearer")],
                error_body(why),
            )
                .into_response(),
            Denied::Forbidden(why) => (StatusCode::FORBIDDEN, error_body(&why)).into_response(),
        }
    }
}

impl Auth {
    /// The operator token and every tenant's.
    pub fn from_config(config: &crate::config::Config) -> Self {
        Self {
            operator: config.node.admin_token.as_deref().map(token_digest),
            tenants: config
                .tenant
                .iter()
                .filter_map(|t| Some((token_digest(t.token.as_deref()?), t.name.clone())))
                .collect(),
        }
    }

    pub(super) fn configured(&self) -> bool {
        self.operator.is_some() || !self.tenants.is_empty()
    }

    /// Who presented `headers`' bearer token. `None` with no tokens configured at all.
    fn caller(&self, headers: &HeaderMap) -> Result<Option<Caller>, Denied> {
        let presented = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")))
            .map(str::trim);
        let Some(token) = presented else {
            return if self.configured() {
                Err(Denied::Unauthorized(
                    "missing bearer token (Authorization: Bearer TOKEN)",
                ))
            } else {
                Ok(None)
            };
        };
        if !self.configured() {
            // Nothing to check it against: reads stay open, writes are refused by `writer`.
            return Ok(None);
        }
        let d = token_digest(token);
        if self.operator == Some(d) {
            return Ok(Some(Caller::Operator));
        }
        match self.tenants.iter().find(|(t, _)| *t == d) {
            Some((_, name)) => Ok(Some(Caller::Tenant(name.clone()))),
            None => Err(Denied::Unauthorized("unknown token")),
        }
    }

    /// Operator routes (metrics, slots): open only when no token is configured.
    pub(super) fn operator(&self, headers: &HeaderMap) -> Result<(), Denied> {
        match self.caller(headers)? {
            None | Some(Caller::Operator) => Ok(()),
            Some(Caller::Tenant(t)) => Err(Denied::Forbidden(format!(
                "a tenant token ({t}) may only see and change its own handlers"
            ))),
        }
    }

    /// Reading handlers: everyone configured sees what is theirs; with no tokens, all.
    pub(super) fn reader(&self, headers: &HeaderMap) -> Result<Caller, Denied> {
        Ok(self.caller(headers)?.unwrap_or(Caller::Operator))
    }

    /// Changing handlers: a token is always needed, and a node with none
    /// configured takes no deploys at all, whatever is presented.
    pub(super) fn writer(&self, headers: &HeaderMap) -> Result<Caller, Denied> {
        if !self.configured() {
            return Err(Denied::Forbidden(DEPLOYS_DISABLED.to_owned()));
        }
        self.caller(headers)?.ok_or(Denied::Unauthorized(
            "missing bearer token (Authorization: Bearer TOKEN)",
        ))
    }

    /// Publishing messages (`POST /v1/topologies/{T}/messages`): like a
    /// deploy, a token is always needed, and a node with none takes none.
    pub(super) fn publisher(&self, headers: &HeaderMap) -> Result<Caller, Denied> {
        if !self.configured() {
            return Err(Denied::Forbidden(PUBLISHING_DISABLED.to_owned()));
        }
        self.caller(headers)?.ok_or(Denied::Unauthorized(
            "missing bearer token (Authorization: Bearer TOKEN)",
        ))
    }
}
