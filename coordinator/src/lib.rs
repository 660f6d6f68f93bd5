//! Strata's coordinator: everything between a caller and the engine.
//!
//! It turns text into token ids ([`tokenizer`]), turns generated ids back into text
//! incrementally and applies stop strings ([`text`]), and drives generations
//! ([`local`] runs them in-process). The `strata` binary's command line is in [`cli`].

pub mod admin;
pub mod admin_cli;
pub mod auth;
pub mod bench;
pub mod cli;
pub mod client;
pub mod cluster;
pub mod cluster_cli;
pub mod comm_bench;
pub mod engine_bench;
pub mod generation;
pub mod gpu_check;
pub mod latency_bench;
pub mod local;
pub mod model_tools;
pub mod models;
pub mod request;
pub mod routing;
pub mod serve;
pub mod server;
pub mod status;
pub mod text;
pub mod tokenizer;
