//! Strata's engine: the math, and nothing that talks to the network's control side.
//!
//! The forward pass of the Llama family is written once in [`model`] against the
//! [`backend::Backend`] trait; [`backend::cpu`] implements it for CPUs. The paged KV cache's
//! bookkeeping lives in [`kv`], token selection in [`sampler`], and [`engine::Engine`]
//! ties them together: sequences join and leave between steps, and every step runs one
//! batched forward pass over all of them. The engine knows nothing of gRPC or etcd (the compiler keeps it so: this crate does
//! not depend on tonic, prost or etcd-client).

pub mod backend;
pub mod comm;
pub mod dist;
pub mod engine;
pub mod kv;
pub mod logits;
pub mod metrics;
pub mod model;
pub mod replica;
pub mod runner;
pub mod sampler;
pub mod scheduler;

pub use engine::{Engine, EngineConfig, SeqId, StepEvent, TokenLogprobs};
pub use runner::{EngineHandle, RunnerLimits, SequenceStream};
pub use strata_common::{EngineStats, Error, Result, SeqEvent};
