//! The gRPC edge's one mapping from error class to status code.

use strata_common::{Error, ErrorClass};
use tonic::{Code, Status};

pub fn to_status(e: Error) -> Status {
    let code = match e.class() {
        ErrorClass::InvalidInput => Code::InvalidArgument,
        ErrorClass::NotFound => Code::NotFound,
        ErrorClass::Overloaded => Code::ResourceExhausted,
        ErrorClass::Unavailable => Code::Unavailable,
        ErrorClass::Internal => Code::Internal,
    };
    Status::new(code, e.to_string())
}
