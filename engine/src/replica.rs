//! Building a replica's engine: one rank, or `tp × pp` ranks as threads of this process
//! joined by the TCP communicator on loopback, or a leader whose other ranks are separate
//! processes (`strata worker`) that join through a rendezvous address.
//!
//! The backend is chosen here, once, from [`BackendOptions::device`]; everything below
//! (model, executors, engine) is written against the `Backend` trait. On CUDA, each rank
//! drives its own GPU (in-process ranks take consecutive devices from the given one) and
//! TP collectives go through NCCL, bootstrapped over the TCP mesh. A device this build or
//! this machine cannot drive is an error that says what is missing.

use std::net::{SocketAddr, TcpListener};
use std::path::Path;
use std::time::Duration;

use strata_common::{Error, Parallelism, Result};
use tracing::{error, info};

use crate::backend::cpu::CpuBackend;
use crate::backend::cuda::driver::{probe, CudaGpu, CUBLAS, CUBLASLT, DRIVER, NVRTC};
use crate::backend::cuda::CudaBackend;
use crate::backend::{on_device, Backend, BackendOptions, Device};
use crate::comm::nccl::{replica_groups, NcclComm};
use crate::comm::tcp::{local_group, TcpComm, TcpCommConfig};
use crate::comm::{DeviceCollectives, HostStaged};
use crate::dist::{follower_loop, rank_pool, LeaderExecutor};
use crate::engine::{Engine, EngineConfig};
use crate::metrics::ReplicaLabels;
use crate::model::Model;
use crate::tensor::DType;

/// How long a replica waits for all its ranks to connect.
pub const SETUP_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a rank waits for a peer inside a step before failing it.
pub const STEP_TIMEOUT: Duration = Duration::from_secs(120);

/// The CPU backend `opts` describe.
fn cpu_backend(opts: &BackendOptions) -> CpuBackend {
    // f32 widens the stored weights in the matmul: the same numbers as upcasting them.
    let (weights, bf16_compute) = match opts.dtype {
        Some(DType::F32) => (None, false),
        other => (other, true),
    };
    static SAID: std::sync::Once = std::sync::Once::new();
    SAID.call_once(|| {
        tracing::info!(
            kernels = CpuBackend::kernels(),
            bf16_dot_products = CpuBackend::bf16_compute_available(),
            unpacked_prefill_gemm = CpuBackend::prefill_gemm_kernels(),
            "CPU kernels (STRATA_CPU_KERNELS caps them)"
        )
    });
    CpuBackend::new().with_weight_dtype(weights).with_bf16_compute(bf16_compute).with_quantize(opts.quantize)
}

/// Checks that this build and machine can drive `device`, before anything is loaded (a
/// build without CUDA says so).
pub fn check_device(device: Device) -> Result<()> {
    match device {
        Device::Cpu => Ok(()),
        Device::Cuda(_) => probe(&[DRIVER, NVRTC, CUBLAS, CUBLASLT]).map_err(on_device(device)),
    }
}

pub use crate::backend::device_memory;

/// A CPU rank's collectives: its TCP mesh endpoint, tensors staged through host memory.
fn host_staged(mesh: TcpComm) -> Result<Box<dyn DeviceCollectives<CpuBackend>>> {
    Ok(Box::new(HostStaged::new(Box::new(mesh))))
}

/// A GPU rank's collectives: NCCL on GPU `ordinal` for the TP groups and the stage-to-stage
/// pairs, bootstrapped over the rank's TCP mesh endpoint (every rank calls this at the
/// same time, as NCCL's set-up is collective).
fn nccl(
    mesh: TcpComm,
    ordinal: usize,
    par: Parallelism,
) -> Result<Box<dyn DeviceCollectives<CudaBackend<CudaGpu>>>> {
    Ok(Box::new(NcclComm::new(ordinal, Box::new(mesh), &replica_groups(par.tp, par.pp))?))
}

/// Runs `$body` with `$make` bound to a `Fn(offset) -> Result<backend>` for `$opts.device`
/// and `$comm` to a `Fn(mesh, offset, par) -> Result<collectives>` for the same backend,
/// where `offset` is added to the device index (on CUDA, rank r of an in-process replica
/// uses device `base + r`; a worker process passes 0 for its own device).
macro_rules! with_backend {
    ($opts:expr, |$make:ident, $comm:ident| $body:expr) => {{
        let opts: BackendOptions = $opts.clone();
        check_device(opts.device)?;
        if opts.quantize.is_some() && opts.device != Device::Cpu {
            return Err(Error::Unsupported(format!(
                "--quantize on {}: only the CPU backend quantizes",
                opts.device
            )));
        }
        match opts.device {
            Device::Cpu => {
                let $make = move |_: usize| -> Result<CpuBackend> { Ok(cpu_backend(&opts)) };
                let $comm = |mesh: TcpComm, _: usize, _: Parallelism| host_staged(mesh);
                $body
            }
            Device::Cuda(base) => {
                let eager = opts.enforce_eager;
                let $make = move |offset: usize| -> Result<CudaBackend<CudaGpu>> {
                    Ok(CudaBackend::with_graphs(CudaGpu::open(base + offset)?, !eager))
                };
                let $comm =
                    move |mesh: TcpComm, offset: usize, par: Parallelism| nccl(mesh, base + offset, par);
                $body
            }
        }
    }};
}

/// An engine for the model in `dir`: in-process ranks when `par` has more than one.
pub fn local_replica(dir: &Path, par: Parallelism, config: &EngineConfig) -> Result<Engine> {
    with_backend!(config.backend, |make, comm| {
        local_replica_on(dir, par, config, make, move |mesh, rank| comm(mesh, rank, par))
    })
}

/// The engines built from a model directory compile constraints with its tokenizer.
fn with_grammars(engine: Result<Engine>, dir: &Path) -> Result<Engine> {
    engine.map(|e| e.with_grammars_from(dir).with_embed_defaults_from(dir))
}

/// `local_replica` on backends made by `backend(rank)`, each rank's TCP mesh endpoint
/// made its collectives by `communicator(mesh, rank)`.
pub fn local_replica_on<B, F, C>(
    dir: &Path,
    par: Parallelism,
    config: &EngineConfig,
    backend: F,
    communicator: C,
) -> Result<Engine>
where
    B: Backend,
    F: Fn(usize) -> Result<B> + Clone + Send + 'static,
    C: Fn(TcpComm, usize) -> Result<Box<dyn DeviceCollectives<B>>> + Clone + Send + 'static,
{
    if par.world() == 1 {
        return with_grammars(Engine::new(Model::load(dir, backend(0)?)?, config), dir);
    }
    let mut comms = local_group(par.world(), SETUP_TIMEOUT)?.into_iter();
    let leader_comm = comms.next().expect("world >= 1");
    let mut followers = Vec::new();
    for (i, comm) in comms.enumerate() {
        let rank = i + 1;
        let dir = dir.to_owned();
        let make = backend.clone();
        let labels = config.labels.clone();
        let communicator = communicator.clone();
        let (tx, rx) = std::sync::mpsc::channel::<Result<()>>();
        let handle = std::thread::Builder::new()
            .name(format!("rank-{rank}"))
            .spawn(move || {
                let run = || -> Result<()> {
                    let comm = communicator(comm, rank)?;
                    let mut model = Model::load_shard(&dir, make(rank)?, par, rank)?;
                    model.label(&labels);
                    let pool = model
                        .backend()
                        .uses_thread_pool()
                        .then(|| rank_pool(rank, par.world()))
                        .transpose()?;
                    let _ = tx.send(Ok(()));
                    follower_loop(model, comm, pool)
                };
                if let Err(e) = run() {
                    error!(rank, error = %e, "rank stopped");
                    let _ = tx.send(Err(e));
                }
            })
            .map_err(|e| Error::Internal(format!("cannot start rank {rank}: {e}")))?;
        followers.push((rank, rx, handle));
    }
    let leader_comm = communicator(leader_comm, 0)?;
    for (rank, rx, _) in &followers {
        match rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(e),
            Err(_) => return Err(Error::Internal(format!("rank {rank} died while loading"))),
        }
    }
    let mut model = Model::load_shard(dir, backend(0)?, par, 0)?;
    model.label(&config.labels);
    let pool = model.backend().uses_thread_pool().then(|| rank_pool(0, par.world())).transpose()?;
    info!(tp = par.tp, pp = par.pp, "replica ranks ready (threads)");
    let engine = Engine::with_executor(Box::new(LeaderExecutor::new(model, leader_comm, pool)), par, config);
    with_grammars(engine, dir)
}

/// Whose threads a rank's parallel loops run on.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum RankThreads {
    /// The process's pool: the rank is the only one in its process.
    #[default]
    Process,
    /// A pool of its own (the process's threads divided among its replica's ranks): other
    /// ranks share the process (`strata serve`'s in-process workers), and a rank blocked in
    /// a collective on a pool thread must not hold a thread its peers need — with more
    /// ranks than threads, the replica's first step never came back.
    Own,
}

impl RankThreads {
    fn pool(self, rank: usize, world: usize) -> Result<Option<rayon::ThreadPool>> {
        match self {
            RankThreads::Process => Ok(None),
            RankThreads::Own => rank_pool(rank, world).map(Some),
        }
    }
}

/// The leader of a replica whose other ranks are worker processes joining at
/// `rendezvous` (already bound by the caller, so port 0 works) and proving `secret`; its
/// parallel loops run on `threads`.
pub fn leader_with_external_ranks(
    dir: &Path,
    par: Parallelism,
    config: &EngineConfig,
    (rendezvous, secret): (TcpListener, &[u8]),
    threads: RankThreads,
) -> Result<Engine> {
    let addr = rendezvous.local_addr().map_err(|e| Error::Internal(format!("rendezvous address: {e}")))?;
    info!(%addr, world = par.world(), "waiting for worker ranks at the rendezvous");
    let cfg = TcpCommConfig {
        rank: 0,
        world: par.world(),
        rendezvous: addr,
        setup_timeout: SETUP_TIMEOUT,
        recv_timeout: STEP_TIMEOUT,
        secret: secret.to_vec(),
    };
    with_backend!(config.backend, |make, comm| {
        let comm = comm(TcpComm::connect(&cfg, Some(rendezvous))?, 0, par)?;
        let mut model = Model::load_shard(dir, make(0)?, par, 0)?;
        model.label(&config.labels);
        let pool = if crate::backend::Tensors::uses_thread_pool(model.backend()) {
            threads.pool(0, par.world())?
        } else {
            None
        };
        let engine = Engine::with_executor(Box::new(LeaderExecutor::new(model, comm, pool)), par, config);
        with_grammars(engine, dir)
    })
}

/// Where a worker rank joins its replica.
pub struct RankJoin<'a> {
    pub par: Parallelism,
    /// This rank (> 0).
    pub rank: usize,
    /// The leader's rendezvous address.
    pub rendezvous: SocketAddr,
    /// The replica's group secret, proved at the rendezvous.
    pub secret: &'a [u8],
    /// The model and replica its metrics are filed under.
    pub labels: ReplicaLabels,
    /// Whose threads its parallel loops run on.
    pub threads: RankThreads,
}

/// Runs rank `join.rank` (> 0) of a replica until the leader shuts it down or a peer
/// fails. `joined` is called once the shard is loaded and the rank has joined its
/// replica. On CUDA, `opts.device` is this process's own GPU.
pub fn run_worker_rank(
    dir: &Path,
    join: RankJoin<'_>,
    opts: &BackendOptions,
    joined: impl FnOnce(),
) -> Result<()> {
    let RankJoin { par, rank, rendezvous, secret, labels, threads } = join;
    if rank == 0 || rank >= par.world() {
        return Err(Error::invalid("rank", format!("must be in 1..{} (rank 0 is the leader)", par.world())));
    }
    let cfg = TcpCommConfig {
        rank,
        world: par.world(),
        rendezvous,
        setup_timeout: SETUP_TIMEOUT,
        recv_timeout: STEP_TIMEOUT,
        secret: secret.to_vec(),
    };
    with_backend!(opts, |make, comm| {
        let comm = comm(TcpComm::connect(&cfg, None)?, 0, par)?;
        let mut model = Model::load_shard(dir, make(0)?, par, rank)?;
        model.label(&labels);
        let pool = if crate::backend::Tensors::uses_thread_pool(model.backend()) {
            threads.pool(rank, par.world())?
        } else {
            None
        };
        info!(rank, device = %opts.device, "worker rank ready");
        joined();
        follower_loop(model, comm, pool)
    })
}
