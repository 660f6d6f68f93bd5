//! The `strata` binary: one binary, many roles (see `strata --help`).
//!
//! This crate is the only one that knows every other: it parses the command line and
//! wires each role from its parts (coordinator, worker, engine, registry).

use clap::Parser;

mod admin_cli;
mod batch_cli;
mod bench;
mod bench_http;
mod build_args;
mod cert_cli;
mod cli;
mod client;
mod cluster_cli;
mod comm_bench;
mod config_args;
mod embedded;
mod engine_bench;
mod gpu_check;
mod latency_bench;
mod local;
mod metrics_http;
mod model_compare;
mod model_fetch;
mod model_tools;
mod rendezvous;
mod rollout_cli;
mod security_args;
mod serve_cli;
mod tenant_cli;
mod unimplemented_admin;

fn main() -> std::process::ExitCode {
    let cli = cli::Cli::parse();
    // Held to the end of main: dropping it flushes the spans still queued for export.
    let _telemetry = match strata_common::telemetry::init(cli.service_name(), cli.log_format) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match cli::run(cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
