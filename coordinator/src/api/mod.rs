//! The coordinator's front doors: inference.v1 ([`inference`]), admin.v1 ([`admin`], its
//! tenant half in [`admin_tenants`], its rollouts in [`admin_rollouts`]),
//! their credentials ([`auth`]), the audit log of admin actions ([`audit`]) and the gRPC server that carries them ([`server`]).

pub mod admin;
pub mod admin_rollouts;
pub mod admin_tenants;
pub mod audit;
pub mod audited;
pub mod auth;
mod build_pb;
pub mod http;
pub mod inference;
pub mod server;
