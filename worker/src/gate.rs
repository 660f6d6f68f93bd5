//! Who may call what on a worker: the role gate in front of worker.v1.
//!
//! With cluster credentials the worker's server already refuses any client without a
//! certificate from the cluster CA (the TLS handshake fails). This layer then reads the
//! client's role from its certificate and refuses, with `PERMISSION_DENIED`, a call its
//! role may not make: only coordinators drive a worker (generate, load, unload, canary,
//! drain, model files); any member may read its status, load and health. Without cluster
//! credentials (loopback development, or `--insecure`) there is no certificate to read and
//! every call passes.

use std::task::{Context, Poll};

use futures::future::BoxFuture;
use strata_common::tls::{peer_roles, Role};
use tonic::body::Body;
use tonic::codegen::http;

/// worker.v1 methods any cluster member may call; every other worker.v1 method is
/// coordinator-only.
const READ_ONLY: [&str; 2] = ["/strata.worker.v1.Worker/Status", "/strata.worker.v1.Worker/Stats"];

/// The role a call to `path` requires, if any beyond cluster membership.
pub fn required_role(path: &str) -> Option<Role> {
    (path.starts_with("/strata.worker.v1.Worker/") && !READ_ONLY.contains(&path)).then_some(Role::Coordinator)
}

/// Why a caller with `roles` may not call `path` (None: it may).
pub fn refusal(path: &str, roles: Option<&[Role]>) -> Option<tonic::Status> {
    let roles = roles?;
    if roles.is_empty() {
        return Some(tonic::Status::permission_denied(
            "the client certificate names no cluster role (strata-coordinator or strata-worker)",
        ));
    }
    let needed = required_role(path)?;
    (!roles.contains(&needed)).then(|| {
        let method = path.rsplit('/').next().unwrap_or(path);
        tonic::Status::permission_denied(format!("{method} is for {needed}s only"))
    })
}

#[derive(Clone, Copy, Default)]
pub struct RoleGateLayer;

impl<S> tower::Layer<S> for RoleGateLayer {
    type Service = RoleGate<S>;
    fn layer(&self, inner: S) -> RoleGate<S> {
        RoleGate { inner }
    }
}

#[derive(Clone)]
pub struct RoleGate<S> {
    inner: S,
}

impl<S, B> tower::Service<http::Request<B>> for RoleGate<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<Body>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future = BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let roles = peer_roles(&req);
        if let Some(status) = refusal(req.uri().path(), roles.as_deref()) {
            tracing::warn!(method = req.uri().path(), "refused a cluster member: {}", status.message());
            return Box::pin(async move { Ok(status.into_http()) });
        }
        Box::pin(self.inner.call(req))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_coordinators_drive_a_worker() {
        let load = "/strata.worker.v1.Worker/LoadShard";
        let status = "/strata.worker.v1.Worker/Status";
        assert!(refusal(load, None).is_none(), "no TLS: no certificate to check");
        assert!(refusal(load, Some(&[Role::Coordinator])).is_none());
        let e = refusal(load, Some(&[Role::Worker])).expect("a worker may not load shards");
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        assert!(e.message().contains("LoadShard is for coordinators"), "{}", e.message());
        assert!(refusal(status, Some(&[Role::Worker])).is_none());
        assert!(refusal("/grpc.health.v1.Health/Check", Some(&[Role::Worker])).is_none());
        assert!(refusal(status, Some(&[])).is_some(), "a certificate without a role is no member");
    }
}
