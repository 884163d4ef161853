//! Error answers: the body (`{"error": "…"}`), and the status of each
//! refused deploy.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

use crate::registry::DeployError;

/// The JSON body of an error answer.
pub(super) fn error_body(message: &str) -> axum::Json<serde_json::Value> {
    axum::Json(serde_json::json!({ "error": message }))
}

/// The answer to a refused deploy, rollback or handler lookup.
pub(super) fn deploy_error(e: DeployError) -> Response {
    let status = match &e {
        DeployError::UnknownHandler(_) | DeployError::NotVisible(_) => StatusCode::NOT_FOUND,
        DeployError::Forbidden(_) => StatusCode::FORBIDDEN,
        DeployError::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
        DeployError::Invalid(_) => StatusCode::BAD_REQUEST,
        DeployError::NoPrevious(_) | DeployError::Conflict(_) => StatusCode::CONFLICT,
        DeployError::Store(_) => StatusCode::SERVICE_UNAVAILABLE,
    };
    (status, error_body(&e.to_string())).into_response()
}
