//! The error type shared across crates.
//!
//! Every error knows its class where it is raised; the gRPC edge maps the class to a
//! status code and the CLI prints the message. Messages name the file or field at fault
//! and what is wrong with it.

use std::path::PathBuf;

/// What kind of failure an error is, independent of where it happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    /// The caller sent something we cannot accept (bad field, bad file).
    InvalidInput,
    /// A named thing (model, request, file) does not exist.
    NotFound,
    /// Capacity is exhausted right now; retrying later may succeed.
    Overloaded,
    /// A dependency (worker, peer) is gone or did not answer.
    Unavailable,
    /// The operation does not fit the current state (e.g. a worker that already holds a shard).
    FailedPrecondition,
    /// The caller's deadline passed.
    DeadlineExceeded,
    /// No credentials, or credentials that are not valid.
    Unauthenticated,
    /// Valid credentials without the right to do this.
    PermissionDenied,
    /// A bug or an unexpected state.
    Internal,
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A request or configuration field has an unusable value.
    #[error("invalid {field}: {reason}")]
    InvalidArgument { field: String, reason: String },

    /// A model file is missing, unreadable or malformed.
    #[error("{}: {reason}", path.display())]
    ModelFile { path: PathBuf, reason: String },

    /// The model asks for something this engine does not implement.
    #[error("unsupported model: {0}")]
    Unsupported(String),

    #[error("not found: {0}")]
    NotFound(String),

    #[error("overloaded: {0}")]
    Overloaded(String),

    /// A limit of the caller's (its tenant's rate, tokens or streams) refused the request;
    /// it may succeed after `retry_after`.
    #[error("rate limited: {reason}; retry in {:.1} s", retry_after.as_secs_f64())]
    RateLimited { reason: String, retry_after: std::time::Duration },

    #[error("unavailable: {0}")]
    Unavailable(String),

    /// A rank lost its connection to another rank of its replica (which is likely gone):
    /// the replica cannot step, and `rank` is the one to blame.
    #[error("lost rank {rank}: {reason}")]
    RankLost { rank: usize, reason: String },

    #[error("failed precondition: {0}")]
    FailedPrecondition(String),

    #[error("deadline exceeded: {0}")]
    DeadlineExceeded(String),

    #[error("unauthenticated: {0}")]
    Unauthenticated(String),

    #[error("permission denied: {0}")]
    PermissionDenied(String),

    #[error("internal error: {0}")]
    Internal(String),

    /// An error another Strata process reported, relayed with its class.
    #[error("{message}")]
    Relayed { class: ErrorClass, message: String },
}

impl Error {
    pub fn invalid(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::InvalidArgument { field: field.into(), reason: reason.into() }
    }

    pub fn model_file(path: impl Into<PathBuf>, reason: impl Into<String>) -> Self {
        Error::ModelFile { path: path.into(), reason: reason.into() }
    }

    /// When a refused request may be tried again, if the refusal says.
    pub fn retry_after(&self) -> Option<std::time::Duration> {
        match self {
            Error::RateLimited { retry_after, .. } => Some(*retry_after),
            _ => None,
        }
    }

    pub fn class(&self) -> ErrorClass {
        match self {
            Error::InvalidArgument { .. } | Error::ModelFile { .. } | Error::Unsupported(_) => {
                ErrorClass::InvalidInput
            }
            Error::NotFound(_) => ErrorClass::NotFound,
            Error::Overloaded(_) | Error::RateLimited { .. } => ErrorClass::Overloaded,
            Error::Unavailable(_) | Error::RankLost { .. } => ErrorClass::Unavailable,
            Error::FailedPrecondition(_) => ErrorClass::FailedPrecondition,
            Error::DeadlineExceeded(_) => ErrorClass::DeadlineExceeded,
            Error::Unauthenticated(_) => ErrorClass::Unauthenticated,
            Error::PermissionDenied(_) => ErrorClass::PermissionDenied,
            Error::Internal(_) => ErrorClass::Internal,
            Error::Relayed { class, .. } => *class,
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
