//! The `strata` binary: one binary, many roles (see `strata --help`).
//!
//! This crate is the only one that knows every other: it parses the command line and
//! wires each role from its parts (coordinator, worker, engine, registry).

use std::io::IsTerminal;

use clap::Parser;
use tracing_subscriber::EnvFilter;

mod admin_cli;
mod bench;
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
mod model_tools;
mod rendezvous;
mod security_args;
mod serve_cli;
mod unimplemented_admin;

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let cli = cli::Cli::parse();
    match cli::run(cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
