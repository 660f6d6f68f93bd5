//! Types shared by every Strata process.
//!
//! Nothing here does I/O beyond reading small JSON files, and nothing here knows about
//! gRPC, etcd or tensors: the coordinator and the worker both depend on this crate, so it
//! holds the vocabulary they speak — the model's configuration, sampling parameters, and
//! the classified error type whose class the gRPC edge maps to a status code.

pub mod cluster;
pub mod error;
pub mod model_config;
pub mod registry;
pub mod sampling;
pub mod shard;

pub use error::{Error, ErrorClass, Result};
pub use model_config::{Architecture, ModelConfig, RopeScaling};
pub use sampling::{FinishReason, SamplingParams};
pub use shard::{Parallelism, RankShard, ShardPlan};
