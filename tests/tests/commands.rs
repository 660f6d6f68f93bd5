//! The `strata` commands a user runs directly: generate, model tools, model bench, the config tree.
//!
//! One test binary of several modules (one per former file): each binary links the
//! whole dependency graph, so fewer of them build faster.

#[path = "commands_suite/cli_generate.rs"]
mod cli_generate;
#[path = "commands_suite/config.rs"]
mod config;
#[path = "commands_suite/model_bench.rs"]
mod model_bench;
#[path = "commands_suite/model_fetch.rs"]
mod model_fetch;
