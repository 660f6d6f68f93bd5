//! Strata's coordinator: everything between a caller and the workers, and no tensor math
//! (this crate does not link the engine).
//!
//! - [`api`]: inference.v1 and admin.v1 over gRPC, auth, the server's lifecycle;
//! - [`frontend`]: the request path one process owns — admission (a domain request in,
//!   token ids and sampling out), tenant limits, the response cache, fair admission, usage
//!   — shared by gRPC, HTTP and batch jobs;
//! - [`request`]: the tokenizer and chat templates, the incremental detokenizer with stop
//!   strings, the generation path with failover;
//! - [`routing`]: the Catalog/Routes/Replica seam, routing policy, the `WorkerApi` clients;
//! - [`control`]: the registry view, leader election and the reconciler;
//! - [`tenant`]: who a key belongs to, the tenant's limits, usage accounting;
//! - [`node`]: `strata coordinator` wired from those parts;
//! - `testkit` (tests only): an in-process cluster — in-memory registry, scripted workers
//!   that can be killed or made to misbehave, coordinators built from the parts above —
//!   on which the control plane is tested without processes.

pub mod api;
pub mod batch;
pub mod control;
pub mod frontend;
pub mod node;
pub mod request;
pub mod routing;
pub mod tenant;
#[cfg(test)]
pub mod testkit;
