//! Building a replica's engine: one rank, or `tp × pp` ranks as threads of this process
//! joined by the TCP communicator on loopback, or a leader whose other ranks are separate
//! processes (`strata worker`) that join through a rendezvous address.
//!
//! The backend is chosen here, once, from [`BackendOptions::device`]; everything below
//! (model, executors, engine) is written against the `Backend` trait. A device this build
//! or this machine cannot drive is an error that says what is missing.

use std::net::{SocketAddr, TcpListener};
use std::path::Path;
use std::time::Duration;

use strata_common::{Error, Parallelism, Result};
use tracing::{error, info};

use crate::backend::cpu::CpuBackend;
use crate::backend::{Backend, BackendOptions, Device};
use crate::comm::tcp::{local_group, TcpComm, TcpCommConfig};
use crate::dist::{follower_loop, LeaderExecutor};
use crate::engine::{Engine, EngineConfig};
use crate::model::Model;

/// How long a replica waits for all its ranks to connect.
pub const SETUP_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a rank waits for a peer inside a step before failing it.
pub const STEP_TIMEOUT: Duration = Duration::from_secs(120);

/// The CPU backend `opts` describe.
pub fn cpu_backend(opts: &BackendOptions) -> CpuBackend {
    CpuBackend::new().with_bf16_prefill(opts.bf16_prefill).with_weight_dtype(opts.weight_dtype)
}

/// Checks that this build and machine can drive `device`, before anything is loaded.
pub fn check_device(device: Device) -> Result<()> {
    match device {
        Device::Cpu => Ok(()),
        Device::Cuda(n) => Err(Error::Unavailable(format!(
            "--device cuda:{n}: this build has no CUDA backend (build with `--features cuda`)"
        ))),
    }
}

/// An engine for the model in `dir`: in-process ranks when `par` has more than one.
pub fn local_replica(dir: &Path, par: Parallelism, config: &EngineConfig) -> Result<Engine> {
    check_device(config.backend.device)?;
    let opts = config.backend.clone();
    local_replica_on(dir, par, config, move |_rank| Ok(cpu_backend(&opts)))
}

/// `local_replica` on backends made by `backend(rank)`.
fn local_replica_on<B, F>(dir: &Path, par: Parallelism, config: &EngineConfig, backend: F) -> Result<Engine>
where
    B: Backend,
    F: Fn(usize) -> Result<B> + Clone + Send + 'static,
{
    if par.world() == 1 {
        return Engine::new(Model::load(dir, backend(0)?)?, config);
    }
    let mut comms = local_group(par.world(), SETUP_TIMEOUT)?.into_iter();
    let leader_comm = comms.next().expect("world >= 1");
    let mut followers = Vec::new();
    for (i, comm) in comms.enumerate() {
        let rank = i + 1;
        let dir = dir.to_owned();
        let make = backend.clone();
        let (tx, rx) = std::sync::mpsc::channel::<Result<()>>();
        let handle = std::thread::Builder::new()
            .name(format!("rank-{rank}"))
            .spawn(move || {
                let run = || -> Result<()> {
                    let model = Model::load_shard(&dir, make(rank)?, par, rank)?;
                    let _ = tx.send(Ok(()));
                    follower_loop(model, Box::new(comm))
                };
                if let Err(e) = run() {
                    error!(rank, error = %e, "rank stopped");
                    let _ = tx.send(Err(e));
                }
            })
            .map_err(|e| Error::Internal(format!("cannot start rank {rank}: {e}")))?;
        followers.push((rank, rx, handle));
    }
    for (rank, rx, _) in &followers {
        match rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(e),
            Err(_) => return Err(Error::Internal(format!("rank {rank} died while loading"))),
        }
    }
    let model = Model::load_shard(dir, backend(0)?, par, 0)?;
    info!(tp = par.tp, pp = par.pp, "replica ranks ready (threads)");
    Engine::with_executor(Box::new(LeaderExecutor::new(model, Box::new(leader_comm))), par, config)
}

/// The leader of a replica whose other ranks are worker processes joining at
/// `rendezvous` (already bound by the caller, so port 0 works).
pub fn leader_with_external_ranks(
    dir: &Path,
    par: Parallelism,
    config: &EngineConfig,
    rendezvous: TcpListener,
) -> Result<Engine> {
    check_device(config.backend.device)?;
    let addr = rendezvous.local_addr().map_err(|e| Error::Internal(format!("rendezvous address: {e}")))?;
    info!(%addr, world = par.world(), "waiting for worker ranks at the rendezvous");
    let cfg = TcpCommConfig {
        rank: 0,
        world: par.world(),
        rendezvous: addr,
        setup_timeout: SETUP_TIMEOUT,
        recv_timeout: STEP_TIMEOUT,
    };
    let comm = TcpComm::connect(&cfg, Some(rendezvous))?;
    let model = Model::load_shard(dir, cpu_backend(&config.backend), par, 0)?;
    Engine::with_executor(Box::new(LeaderExecutor::new(model, Box::new(comm))), par, config)
}

/// Runs rank `rank` (> 0) of a replica until the leader shuts it down or a peer fails.
/// `joined` is called once the shard is loaded and the rank has joined its replica.
pub fn run_worker_rank(
    dir: &Path,
    par: Parallelism,
    rank: usize,
    rendezvous: SocketAddr,
    opts: &BackendOptions,
    joined: impl FnOnce(),
) -> Result<()> {
    if rank == 0 || rank >= par.world() {
        return Err(Error::invalid("rank", format!("must be in 1..{} (rank 0 is the leader)", par.world())));
    }
    check_device(opts.device)?;
    let cfg = TcpCommConfig {
        rank,
        world: par.world(),
        rendezvous,
        setup_timeout: SETUP_TIMEOUT,
        recv_timeout: STEP_TIMEOUT,
    };
    let comm = TcpComm::connect(&cfg, None)?;
    let model = Model::load_shard(dir, cpu_backend(opts), par, rank)?;
    info!(rank, "worker rank ready");
    joined();
    follower_loop(model, Box::new(comm))
}
