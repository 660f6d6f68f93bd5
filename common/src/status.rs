//! The gRPC edge's one mapping between error classes and status codes, both ways.

use crate::{Error, ErrorClass};
use tonic::{Code, Status};

/// Longest message a status carries: an error that echoes a caller's oversized input (a
/// 10 kB model name) is cut, so the reply stays well under HTTP/2 header limits.
pub const MAX_STATUS_MESSAGE: usize = 1024;

fn bounded(mut message: String) -> String {
    if message.len() > MAX_STATUS_MESSAGE {
        let mut cut = MAX_STATUS_MESSAGE;
        while !message.is_char_boundary(cut) {
            cut -= 1;
        }
        message.truncate(cut);
        message.push_str("… (truncated)");
    }
    message
}

pub fn to_status(e: Error) -> Status {
    let code = match e.class() {
        ErrorClass::InvalidInput => Code::InvalidArgument,
        ErrorClass::NotFound => Code::NotFound,
        ErrorClass::Overloaded => Code::ResourceExhausted,
        ErrorClass::Unavailable => Code::Unavailable,
        ErrorClass::FailedPrecondition => Code::FailedPrecondition,
        ErrorClass::DeadlineExceeded => Code::DeadlineExceeded,
        ErrorClass::Unauthenticated => Code::Unauthenticated,
        ErrorClass::PermissionDenied => Code::PermissionDenied,
        ErrorClass::Internal => Code::Internal,
    };
    let retry = e.retry_after();
    let message = bounded(e.to_string());
    match retry {
        // The standard hint (google.rpc.RetryInfo in grpc-status-details-bin) and a plain
        // `retry-after` in whole seconds, as HTTP spells it, for clients without the former.
        Some(after) => {
            let mut metadata = tonic::metadata::MetadataMap::new();
            metadata.insert("retry-after", retry_after_seconds(after).into());
            let details = tonic_types::ErrorDetails::with_retry_info(Some(after));
            <Status as tonic_types::StatusExt>::with_error_details_and_metadata(
                code, message, details, metadata,
            )
        }
        None => Status::new(code, message),
    }
}

/// Whole seconds to wait, rounded up (at least 1), as a `retry-after` header says it.
pub fn retry_after_seconds(after: std::time::Duration) -> u64 {
    after.as_secs_f64().ceil().max(1.0) as u64
}

/// A status another Strata process answered with, as an error of the same class.
/// Transport failures (connection refused, reset, cancelled) are `Unavailable`.
pub fn from_status(s: &Status, peer: &str) -> Error {
    let class = match s.code() {
        Code::InvalidArgument | Code::OutOfRange => ErrorClass::InvalidInput,
        Code::NotFound => ErrorClass::NotFound,
        Code::ResourceExhausted => ErrorClass::Overloaded,
        Code::FailedPrecondition | Code::AlreadyExists | Code::Aborted => ErrorClass::FailedPrecondition,
        Code::DeadlineExceeded => ErrorClass::DeadlineExceeded,
        Code::Unauthenticated => ErrorClass::Unauthenticated,
        Code::PermissionDenied => ErrorClass::PermissionDenied,
        Code::Internal | Code::DataLoss | Code::Unimplemented => ErrorClass::Internal,
        Code::Unavailable | Code::Cancelled | Code::Unknown | Code::Ok => ErrorClass::Unavailable,
    };
    Error::Relayed { class, message: format!("{peer}: {}", s.message()) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_messages_are_cut_and_keep_their_class() {
        let s = to_status(Error::invalid("model", "é".repeat(5000)));
        assert_eq!(s.code(), Code::InvalidArgument);
        assert!(s.message().len() <= MAX_STATUS_MESSAGE + 20, "{}", s.message().len());
        assert!(s.message().starts_with("invalid model") && s.message().ends_with("(truncated)"));
        assert_eq!(to_status(Error::NotFound("m".into())).message(), "not found: m");
    }

    #[test]
    fn rate_limits_carry_retry_hints() {
        use tonic_types::StatusExt;
        let after = std::time::Duration::from_millis(1500);
        let s = to_status(Error::RateLimited { reason: "tenant t: 2 requests/s".into(), retry_after: after });
        assert_eq!(s.code(), Code::ResourceExhausted);
        assert_eq!(s.metadata().get("retry-after").unwrap(), "2");
        assert_eq!(s.get_details_retry_info().unwrap().retry_delay, Some(after));
        assert!(s.message().contains("tenant t"), "{}", s.message());
    }
}
