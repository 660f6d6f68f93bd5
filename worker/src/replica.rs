//! Building a replica's engine: one rank, or `tp × pp` ranks as threads of this process
//! joined by the TCP communicator on loopback, or a leader whose other ranks are separate
//! `strata worker` processes that join through a rendezvous address.

use std::net::{SocketAddr, TcpListener};
use std::path::Path;
use std::time::Duration;

use strata_common::{Error, Parallelism, Result};
use tracing::{error, info};

use crate::backend::cpu::CpuBackend;
use crate::comm::tcp::{local_group, TcpComm, TcpCommConfig};
use crate::dist::{follower_loop, LeaderExecutor};
use crate::engine::{Engine, EngineConfig};
use crate::model::Model;

/// How long a replica waits for all its ranks to connect.
pub const SETUP_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a rank waits for a peer inside a step before failing it.
pub const STEP_TIMEOUT: Duration = Duration::from_secs(120);

/// An engine for the model in `dir`: in-process ranks when `par` has more than one.
pub fn local_replica(dir: &Path, par: Parallelism, config: &EngineConfig) -> Result<Engine> {
    if par.world() == 1 {
        return Engine::new(
            Model::load(dir, CpuBackend::new().with_bf16_prefill(config.bf16_prefill))?,
            config,
        );
    }
    let mut comms = local_group(par.world(), SETUP_TIMEOUT)?.into_iter();
    let leader_comm = comms.next().expect("world >= 1");
    let mut followers = Vec::new();
    for (i, comm) in comms.enumerate() {
        let rank = i + 1;
        let dir = dir.to_owned();
        let bf16_prefill = config.bf16_prefill;
        let (tx, rx) = std::sync::mpsc::channel::<Result<()>>();
        let handle = std::thread::Builder::new()
            .name(format!("rank-{rank}"))
            .spawn(move || {
                let run = || -> Result<()> {
                    let backend = CpuBackend::new().with_bf16_prefill(bf16_prefill);
                    let model = Model::load_shard(&dir, backend, par, rank)?;
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
    let model = Model::load_shard(dir, CpuBackend::new().with_bf16_prefill(config.bf16_prefill), par, 0)?;
    info!(tp = par.tp, pp = par.pp, "replica ranks ready (threads)");
    Engine::with_executor(Box::new(LeaderExecutor::new(model, Box::new(leader_comm))), par, config)
}

/// The leader of a replica whose other ranks are `strata worker` processes joining at
/// `rendezvous` (already bound by the caller, so port 0 works).
pub fn leader_with_external_ranks(
    dir: &Path,
    par: Parallelism,
    config: &EngineConfig,
    rendezvous: TcpListener,
) -> Result<Engine> {
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
    let model = Model::load_shard(dir, CpuBackend::new().with_bf16_prefill(config.bf16_prefill), par, 0)?;
    Engine::with_executor(Box::new(LeaderExecutor::new(model, Box::new(comm))), par, config)
}

/// Runs rank `rank` (> 0) of a replica until the leader shuts it down or a peer fails.
pub fn run_worker_rank(
    dir: &Path,
    par: Parallelism,
    rank: usize,
    rendezvous: SocketAddr,
    bf16_prefill: bool,
) -> Result<()> {
    if rank == 0 || rank >= par.world() {
        return Err(Error::invalid("rank", format!("must be in 1..{} (rank 0 is the leader)", par.world())));
    }
    let cfg = TcpCommConfig {
        rank,
        world: par.world(),
        rendezvous,
        setup_timeout: SETUP_TIMEOUT,
        recv_timeout: STEP_TIMEOUT,
    };
    let comm = TcpComm::connect(&cfg, None)?;
    let model = Model::load_shard(dir, CpuBackend::new().with_bf16_prefill(bf16_prefill), par, rank)?;
    info!(rank, "worker rank ready");
    follower_loop(model, Box::new(comm))
}
