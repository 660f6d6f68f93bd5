//! Plain data every Strata process shares.
//!
//! The vocabulary the coordinator, the worker process and the engine speak: the model's
//! configuration, the shard plan, sampling parameters and finish reasons, a sequence's
//! events and a replica's load, the classified error type, the cluster's records and the
//! [`registry::Registry`] seam, and the [`worker_api::WorkerApi`] seam. Nothing here
//! knows tensors. Two features add edges the engine never enables: `etcd` (the etcd
//! registry) and `grpc` (status codes and proto conversions in [`status`] and [`wire`]).

pub mod build;
pub mod cluster;
pub mod config;
#[cfg(feature = "grpc")]
pub mod conn_calls;
#[cfg(feature = "grpc")]
pub mod conn_limits;
pub mod constraint;
pub mod device;
pub mod error;
pub mod events;
pub mod files;
#[cfg(feature = "grpc")]
pub mod grpc_metrics;
pub mod host;
pub mod ids;
pub mod metrics;
pub mod model_config;
pub mod model_roots;
pub mod prefix;
pub mod ready;
pub mod registry;
pub mod rollout;
pub mod sampling;
pub mod shard;
pub mod shutdown;
pub mod stats;
#[cfg(feature = "grpc")]
pub mod status;
#[cfg(feature = "telemetry")]
pub mod telemetry;
pub mod tenant;
#[cfg(feature = "grpc")]
pub mod tls;
pub mod trace;
#[cfg(feature = "grpc")]
pub mod wire;
pub mod worker_api;

pub use build::{Build, BuildChange, EngineLimits};
pub use constraint::Constraint;
pub use device::{DType, Device, DeviceKind};
pub use error::{Error, ErrorClass, Result};
pub use events::{EngineStats, SeqEvent, TokenLogprobs};
pub use ids::{ModelName, ReplicaId, WorkerId};
pub use model_config::{
    Activation, Architecture, ExpertNames, GroupedRouting, Latent, ModelConfig, Moe, RopeScaling,
};
pub use sampling::{Embed, FinishReason, Pooling, SamplingParams};
pub use shard::{Parallelism, RankShard, ShardPlan, WeightBytes};
