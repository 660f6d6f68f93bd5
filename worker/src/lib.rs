//! Strata's worker process: one engine, and everything that makes it a cluster member.
//!
//! - [`agent`]: the shard slot (load, lead or follow, unload, drain), transport-free;
//! - [`in_process`]: the agent as the `WorkerApi` seam (what `strata serve`'s
//!   coordinator calls directly), and the model files a coordinator may ask for;
//! - [`service`]: worker.v1, a thin gRPC adapter over [`in_process`];
//! - [`gate`]: who may call what on worker.v1 (roles read from cluster certificates);
//! - [`membership`]: the leased registration under `<prefix>/workers/<id>`;
//! - [`process`]: `strata worker --etcd` wired from those parts.
//!
//! The worker links the engine and gRPC, never the coordinator.

pub mod agent;
pub mod gate;
pub mod in_process;
pub mod membership;
pub mod process;
pub mod service;
