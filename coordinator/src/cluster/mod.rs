//! Cluster mode: workers and coordinators that find each other through the registry.
//!
//! - [`agent`]: a worker's shard slot (load, lead or follow, unload, drain), transport-free;
//!   [`worker_service`] serves it as worker.v1 and [`membership`] keeps the worker's
//!   leased registration current.
//! - [`view`]: a coordinator's exact copy of the registry (list + watch).
//! - [`clients`]: one worker.v1 client per worker, shared.

pub mod admin;
pub mod agent;
pub mod catalog;
pub mod clients;
pub mod embedded;
pub mod leader;
pub mod membership;
pub mod node;
pub mod plan;
pub mod router;
pub mod routes;
pub mod tasks;
pub mod view;
pub mod worker_service;
