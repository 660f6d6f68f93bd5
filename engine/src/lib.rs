//! Strata's engine: the math, and nothing that talks to the network's control side.
//!
//! One decoder, assembled from parts that config.json chooses, is written once in
//! [`model`] against the [`backend`] traits; [`backend::cpu`] and [`backend::cuda`]
//! implement them. A replica's ranks talk through [`comm`]'s seams. One [`step::Step`]
//! value carries a step from the scheduler to every rank's model call. The paged KV
//! cache's bookkeeping lives in [`kv`], token selection in [`sampler`], and
//! [`engine::Engine`] ties them together: sequences join and leave between steps, and
//! every step runs one batched forward pass over all of them. The engine knows nothing of
//! gRPC or etcd (the compiler keeps it so: this crate does not depend on tonic, prost or
//! etcd-client).
//!
//! The modules form a graph without loops (`tests/module_graph.rs` checks it): the leaves
//! [`tensor`], [`logits`] and [`step`] name the vocabulary everyone shares; [`backend`]
//! and [`kv`] build on them; [`comm`] on [`backend`]; [`model`] on both; [`dist`],
//! [`engine`], [`runner`] and [`replica`] on top.

pub mod backend;
pub mod comm;
pub mod dist;
pub mod engine;
pub mod guide;
pub mod kv;
pub mod logits;
pub mod metrics;
pub mod model;
pub mod replica;
pub mod runner;
pub mod sampler;
pub mod scheduler;
pub mod step;
pub mod tensor;

pub use engine::{Engine, EngineConfig, StepEvent, TokenLogprobs};
pub use runner::{EngineHandle, RunnerLimits, SequenceStream};
pub use step::SeqId;
pub use strata_common::{EngineStats, Error, Result, SeqEvent};
