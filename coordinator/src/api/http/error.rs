//! Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with the
//! HTTP status OpenAI's clients map to their exception classes (400 → BadRequestError,
//! 401 → AuthenticationError, 404 → NotFoundError, 429 → RateLimitError, 5xx →
//! InternalServerError).

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;
use strata_common::{Error, ErrorClass};

/// Longest message (and param) an error body carries, in bytes.
pub const MAX_MESSAGE: usize = 1024;

/// `text` cut at [`MAX_MESSAGE`] bytes (on a character boundary), marked when cut.
pub(super) fn cut(text: &str) -> String {
    if text.len() <= MAX_MESSAGE {
        return text.to_string();
    }
    let mut end = MAX_MESSAGE;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… ({} bytes in all)", &text[..end], text.len())
}

#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds a refused caller should wait (`Retry-After`); None: one second for 429
    /// and 503, no header otherwise.
    pub retry_after: Option<u64>,
}

impl ApiError {
    /// A 400 naming the request field `param`.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: Some(param.into()),
            code: None,
            retry_after: None,
        }
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
            code: None,
            retry_after: None,
        }
    }

    /// The error object (also what a stream sends when it fails after it started). The
    /// message and param are cut at [`MAX_MESSAGE`] bytes: they may quote what the caller
    /// sent (a megabyte of model name is not echoed back).
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": cut(&self.message),
            "type": self.kind,
            "param": self.param.as_deref().map(cut),
            "code": self.code,
        }})
    }

    /// A domain error, with admission's field names renamed by `rename` (None keeps them).
    pub fn from_domain(e: Error, rename: impl Fn(&str) -> Option<String>) -> Self {
        let class = e.class();
        let retry_after = e.retry_after().map(strata_common::status::retry_after_seconds);
        let (status, kind, code) = match class {
            ErrorClass::InvalidInput | ErrorClass::FailedPrecondition => {
                (StatusCode::BAD_REQUEST, "invalid_request_error", None)
            }
            ErrorClass::NotFound => (StatusCode::NOT_FOUND, "invalid_request_error", Some("model_not_found")),
            ErrorClass::Overloaded if retry_after.is_some() => {
                (StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", Some("rate_limit_exceeded"))
            }
            ErrorClass::Overloaded => (StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", Some("overloaded")),
            ErrorClass::Unavailable => (StatusCode::SERVICE_UNAVAILABLE, "service_unavailable", None),
            ErrorClass::DeadlineExceeded => (StatusCode::GATEWAY_TIMEOUT, "timeout", None),
            ErrorClass::Unauthenticated => {
                (StatusCode::UNAUTHORIZED, "invalid_request_error", Some("invalid_api_key"))
            }
            ErrorClass::PermissionDenied => (StatusCode::FORBIDDEN, "permission_error", None),
            ErrorClass::Internal => (StatusCode::INTERNAL_SERVER_ERROR, "server_error", None),
        };
        let (message, param) = match e {
            Error::InvalidArgument { field, reason } => {
                let name = rename(&field).unwrap_or(field);
                (format!("invalid {name}: {reason}"), Some(name))
            }
            Error::Unauthenticated(m) => (m, None),
            other => (other.to_string(), None),
        };
        ApiError { status, message, kind, param, code, retry_after }
    }
}

impl From<Error> for ApiError {
    fn from(e: Error) -> Self {
        ApiError::from_domain(e, |_| None)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if self.status == StatusCode::TOO_MANY_REQUESTS || self.status == StatusCode::SERVICE_UNAVAILABLE {
            // Clients back off and retry: when the limit that refused says, after that;
            // otherwise one second is a fair first step.
            let after = self.retry_after.unwrap_or(1);
            response.headers_mut().insert(axum::http::header::RETRY_AFTER, after.into());
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_a_caller_sent_is_not_echoed_back_whole() {
        let name = "é".repeat(600_000);
        let e = ApiError::from(Error::NotFound(format!("model {name:?}; served: m")));
        let body = e.body().to_string();
        assert!(body.len() < 2 * MAX_MESSAGE, "{} bytes", body.len());
        assert!(body.contains("bytes in all"), "{body}");
        assert_eq!(cut("short"), "short");
    }

    #[test]
    fn domain_errors_map_to_openai_statuses_and_params() {
        let e = ApiError::from_domain(Error::invalid("prompt.text", "must not be empty"), |f| {
            f.starts_with("prompt").then(|| "prompt".to_string())
        });
        assert_eq!((e.status, e.param.as_deref()), (StatusCode::BAD_REQUEST, Some("prompt")));
        assert_eq!(e.message, "invalid prompt: must not be empty");
        let cases = [
            (Error::NotFound("model \"x\"".into()), 404),
            (Error::Overloaded("full".into()), 429),
            (Error::Unavailable("none ready".into()), 503),
            (Error::Unauthenticated("no key".into()), 401),
            (Error::DeadlineExceeded("late".into()), 504),
            (Error::Internal("bug".into()), 500),
        ];
        for (e, status) in cases {
            assert_eq!(ApiError::from(e).status.as_u16(), status);
        }
        let body = ApiError::invalid("n", "must be at least 1").body();
        assert_eq!(body["error"]["param"], "n");
        assert_eq!(body["error"]["type"], "invalid_request_error");
        let limited =
            Error::RateLimited { reason: "t".into(), retry_after: std::time::Duration::from_millis(2100) };
        let response = ApiError::from(limited).into_response();
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(response.headers()[axum::http::header::RETRY_AFTER], "3");
    }
}
