//! The gRPC edge's one mapping between error classes and status codes, both ways.

use crate::{Error, ErrorClass};
use tonic::{Code, Status};

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
    Status::new(code, e.to_string())
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
