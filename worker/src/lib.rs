//! Strata's engine.
//!
//! The forward pass of the Llama family is written once in [`model`] against the
//! [`backend::Backend`] trait; [`backend::cpu`] implements it for CPUs. The paged KV cache's
//! bookkeeping lives in [`kv`], token selection in [`sampler`], and [`engine::Engine`]
//! ties them together: sequences join and leave between steps, and every step runs one
//! batched forward pass over all of them. The engine knows nothing of gRPC or etcd.

pub mod backend;
pub mod comm;
pub mod dist;
pub mod engine;
pub mod kv;
pub mod logits;
pub mod model;
pub mod replica;
pub mod runner;
pub mod sampler;
pub mod scheduler;

pub use engine::{Engine, EngineConfig, SeqId, StepEvent, TokenLogprobs};
pub use runner::{EngineHandle, EngineStats, RunnerLimits, SeqEvent, SequenceStream};
pub use strata_common::{Error, Result};
