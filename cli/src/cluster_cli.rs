//! Command lines of the cluster roles: `strata coordinator` and `strata worker`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Args;
use strata_common::registry::etcd::EtcdRegistry;
use strata_common::registry::keys::Keys;
use strata_common::registry::Registry;
use strata_engine::backend::{BackendOptions, Device};
use strata_engine::scheduler::SchedulerConfig;
use strata_engine::{EngineConfig, RunnerLimits};

use strata_coordinator::api::auth::{AdminAuth, ClientAuth};
use strata_coordinator::control::leader::LeaderConfig;
use strata_coordinator::control::tasks::Timings;
use strata_coordinator::node::{run_coordinator, CoordinatorOptions};
use strata_coordinator::request::generation::RouteLimits;
use strata_worker::agent::AgentConfig;
use strata_worker::process::{run_worker, WorkerOptions};

/// Where the cluster's state lives.
#[derive(Args, Debug, Clone)]
pub struct RegistryArgs {
    /// etcd endpoints, comma-separated (http://127.0.0.1:2379).
    #[arg(long, env = "STRATA_ETCD", value_delimiter = ',')]
    pub etcd: Vec<String>,
    /// Key prefix of this cluster (two clusters can share one etcd).
    #[arg(long, env = "STRATA_PREFIX", default_value = "/strata")]
    pub prefix: String,
    /// Seconds a lease lives without a refresh (liveness of workers and of the leader).
    #[arg(long, default_value_t = 5.0)]
    pub lease_ttl: f64,
    /// Seconds between lease refreshes (default: a third of --lease-ttl).
    #[arg(long)]
    pub lease_keepalive: Option<f64>,
}

impl RegistryArgs {
    async fn connect(&self) -> anyhow::Result<(Arc<dyn Registry>, Keys)> {
        if self.etcd.is_empty() {
            bail!("--etcd is required: the etcd endpoints (e.g. http://127.0.0.1:2379), or set STRATA_ETCD");
        }
        let reg = EtcdRegistry::connect(&self.etcd).await.context("--etcd")?;
        Ok((Arc::new(reg), Keys::new(&self.prefix)))
    }

    fn ttl(&self) -> anyhow::Result<Duration> {
        seconds("--lease-ttl", self.lease_ttl, 1.0)
    }

    fn keepalive(&self) -> anyhow::Result<Duration> {
        let ttl = self.ttl()?;
        match self.lease_keepalive {
            None => Ok(ttl / 3),
            Some(k) => {
                let k = seconds("--lease-keepalive", k, 0.05)?;
                if k >= ttl {
                    bail!("--lease-keepalive must be shorter than --lease-ttl, or leases lapse between refreshes");
                }
                Ok(k)
            }
        }
    }
}

fn seconds(flag: &str, v: f64, min: f64) -> anyhow::Result<Duration> {
    if !(v.is_finite() && v >= min) {
        bail!("{flag} must be a number of seconds ≥ {min}, got {v}");
    }
    Ok(Duration::from_secs_f64(v))
}

#[derive(Args, Debug)]
pub struct CoordinatorArgs {
    #[command(flatten)]
    pub registry: RegistryArgs,
    /// Address to serve inference.v1 and admin.v1 on; port 0 picks a free port.
    #[arg(long, default_value = "127.0.0.1:50051")]
    pub listen: std::net::SocketAddr,
    /// This coordinator's id (default: host name and port, made unique).
    #[arg(long)]
    pub id: Option<String>,
    /// Token admin calls must bear; without one, admin calls are accepted from loopback only.
    #[arg(long, env = "STRATA_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    /// Client API keys inference calls must bear (repeatable); none: inference is open.
    #[arg(long = "api-key", env = "STRATA_API_KEYS", value_delimiter = ',', hide_env_values = true)]
    pub api_keys: Vec<String>,
    /// Seconds between canaries of each ready replica.
    #[arg(long, default_value_t = 5.0)]
    pub canary_interval: f64,
    /// Seconds a canary may take before its replica stops receiving traffic.
    #[arg(long, default_value_t = 10.0)]
    pub canary_timeout: f64,
    /// Seconds a replica may take to load and pass its first canary.
    #[arg(long, default_value_t = 600.0)]
    pub load_timeout: f64,
    /// Seconds a draining replica waits for its in-flight requests before it is unloaded.
    #[arg(long, default_value_t = 30.0)]
    pub replica_drain_timeout: f64,
    /// Seconds failed replicas stay listed.
    #[arg(long, default_value_t = 30.0)]
    pub failed_retention: f64,
    /// Seconds a request waits for a ready replica (at start or after one failed).
    #[arg(long, default_value_t = 60.0)]
    pub route_wait: f64,
    /// Seconds in-flight calls get to finish after SIGTERM.
    #[arg(long, default_value_t = 30.0)]
    pub drain_timeout: f64,
}

pub fn coordinator(args: CoordinatorArgs, rt: tokio::runtime::Runtime) -> anyhow::Result<()> {
    let ttl = args.registry.ttl()?;
    let timings = Timings {
        canary_interval: seconds("--canary-interval", args.canary_interval, 0.05)?,
        canary_timeout: seconds("--canary-timeout", args.canary_timeout, 0.05)?,
        load_timeout: seconds("--load-timeout", args.load_timeout, 1.0)?,
        drain_timeout: seconds("--replica-drain-timeout", args.replica_drain_timeout, 0.0)?,
        failed_retention: seconds("--failed-retention", args.failed_retention, 0.0)?,
    };
    let client_auth = ClientAuth::with_keys(args.api_keys.clone());
    let admin_auth = AdminAuth::new(args.admin_token.clone(), &client_auth).context("--admin-token")?;
    let id = args.id.clone().unwrap_or_else(|| {
        format!("coordinator-{}-{:06x}", args.listen.port(), rand::random::<u32>() & 0xff_ffff)
    });
    let opts = CoordinatorOptions {
        keys: Keys::new(&args.registry.prefix),
        listen: args.listen,
        leader: LeaderConfig {
            id,
            lease_ttl: ttl,
            keepalive: args.registry.keepalive()?,
            timings,
            tick: Duration::from_millis(250),
        },
        route: RouteLimits { wait: seconds("--route-wait", args.route_wait, 0.0)?, ..Default::default() },
        client_auth,
        admin_auth,
        drain_timeout: seconds("--drain-timeout", args.drain_timeout, 0.0)?,
    };
    rt.block_on(async move {
        let (registry, _) = args.registry.connect().await?;
        run_coordinator(registry, opts).await
    })
}

#[derive(Args, Debug)]
pub struct WorkerArgs {
    /// Cluster mode: register in etcd and hold the shards the leader coordinator assigns.
    #[command(flatten)]
    pub registry: RegistryArgs,
    /// Cluster mode: address to serve worker.v1 on; port 0 picks a free port.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: std::net::SocketAddr,
    /// Cluster mode: address coordinators and other ranks reach this worker at (default:
    /// the bound --listen address).
    #[arg(long)]
    pub advertise: Option<String>,
    /// Cluster mode: this worker's id (default: host name and port).
    #[arg(long)]
    pub id: Option<String>,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Cluster mode: KV cache per shard unless the deployment sets one (512MiB, 0.2).
    #[arg(long, default_value = "512MiB")]
    pub kv_cache_memory: String,
    /// Cluster mode: most sequences per engine step unless the deployment sets it.
    #[arg(long, default_value_t = 64)]
    pub max_num_seqs: usize,
    /// Cluster mode: most tokens per engine step unless the deployment sets it.
    #[arg(long, default_value_t = 512)]
    pub max_batched_tokens: usize,
    /// Cluster mode: most requests waiting; beyond it calls get RESOURCE_EXHAUSTED.
    #[arg(long, default_value_t = 256)]
    pub max_waiting: usize,
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    #[arg(long)]
    pub no_prefix_caching: bool,
    /// Seconds in-flight sequences get to finish after SIGTERM.
    #[arg(long, default_value_t = 30.0)]
    pub drain_timeout: f64,
    /// Static mode: the model directory (the same files the leader loads).
    #[arg(long, conflicts_with = "etcd")]
    pub model: Option<PathBuf>,
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
    #[arg(long, default_value_t = 1)]
    pub pp: usize,
    /// Static mode: this process's rank (1 ..= tp·pp − 1; rank 0 is `strata serve`).
    #[arg(long, conflicts_with = "etcd")]
    pub rank: Option<usize>,
    /// Static mode: the leader's rendezvous address (`strata serve --worker-rendezvous`).
    #[arg(long, conflicts_with = "etcd")]
    pub rendezvous: Option<std::net::SocketAddr>,
    /// Prefill bf16 weights with bf16-rounded activations (must match the leader's).
    #[arg(long)]
    pub bf16_prefill: bool,
}

pub fn worker(
    args: WorkerArgs,
    rt: impl FnOnce() -> anyhow::Result<tokio::runtime::Runtime>,
) -> anyhow::Result<()> {
    let device = Device::parse(&args.device).context("--device")?;
    let backend = BackendOptions { device, bf16_prefill: args.bf16_prefill, weight_dtype: None };
    if args.registry.etcd.is_empty() {
        let (Some(model), Some(rank), Some(rendezvous)) = (&args.model, args.rank, args.rendezvous) else {
            bail!(
                "give --etcd URL (cluster mode), or --model DIR --rank R --rendezvous ADDR (a rank of `strata serve --worker-rendezvous`)"
            );
        };
        let par = strata_common::Parallelism { tp: args.tp, pp: args.pp };
        strata_engine::replica::run_worker_rank(model, par, rank, rendezvous, &backend, || {})
            .with_context(|| format!("worker rank {rank}"))?;
        tracing::info!("leader shut the replica down; exiting");
        return Ok(());
    }
    if args.max_num_seqs == 0 || args.max_batched_tokens == 0 || args.block_size == 0 || args.max_waiting == 0
    {
        bail!("--max-num-seqs, --max-batched-tokens, --max-waiting and --block-size must be at least 1");
    }
    let engine = EngineConfig {
        kv_cache_bytes: crate::cli::parse_memory(&args.kv_cache_memory).context("--kv-cache-memory")?,
        block_size: args.block_size,
        scheduler: SchedulerConfig {
            max_num_seqs: args.max_num_seqs,
            max_batched_tokens: args.max_batched_tokens,
        },
        prefix_caching: !args.no_prefix_caching,
        backend: backend.clone(),
    };
    let opts = WorkerOptions {
        keys: Keys::new(&args.registry.prefix),
        listen: args.listen,
        advertise: args.advertise.clone(),
        id: args.id.clone(),
        lease_ttl: args.registry.ttl()?,
        keepalive: args.registry.keepalive()?,
        agent: AgentConfig {
            id: String::new(),
            bind_ip: args.listen.ip(),
            advertise_host: String::new(),
            backend,
            engine,
            runner: RunnerLimits { max_waiting: args.max_waiting },
        },
        drain_timeout: seconds("--drain-timeout", args.drain_timeout, 0.0)?,
    };
    rt()?.block_on(async move {
        let (registry, _) = args.registry.connect().await?;
        run_worker(registry, opts).await
    })
}
