//! Engine-level behaviour through the real binary or the engine in-process with the coordinator's parts: HF references, parallelism, int8 checkpoints, chat templates.
//!
//! One test binary of several modules (one per former file): each binary links the
//! whole dependency graph, so fewer of them build faster.

#[path = "engine_suite/chat_templates.rs"]
mod chat_templates;
#[path = "engine_suite/hf_reference.rs"]
mod hf_reference;
#[path = "engine_suite/int8_checkpoint.rs"]
mod int8_checkpoint;
#[path = "engine_suite/parallel.rs"]
mod parallel;
