//! Strata's coordinator: everything between a caller and the workers, and no tensor math
//! (this crate does not link the engine).
//!
//! - [`api`]: inference.v1 and admin.v1 over gRPC, auth, the server's lifecycle;
//! - [`request`]: admission (a domain request in, token ids and sampling out), the
//!   tokenizer, the incremental detokenizer with stop strings, the generation path with
//!   failover;
//! - [`routing`]: the Catalog/Routes/Replica seam, routing policy, the `WorkerApi` clients;
//! - [`control`]: the registry view, leader election and the reconciler;
//! - [`tenant`]: who a key belongs to, the tenant's limits, usage accounting;
//! - [`node`]: `strata coordinator` wired from those parts.

pub mod api;
pub mod batch;
pub mod control;
pub mod node;
pub mod request;
pub mod routing;
pub mod tenant;
