//! The coordinator's front doors: inference.v1 ([`inference`]), admin.v1 ([`admin`]),
//! their credentials ([`auth`]) and the gRPC server that carries them ([`server`]).

pub mod admin;
pub mod auth;
pub mod inference;
pub mod server;
