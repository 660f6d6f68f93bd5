//! Command lines of the cluster roles: `strata coordinator` and `strata worker`.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Args;
use strata_common::config::Config;
use strata_common::registry::keys::Keys;
use strata_coordinator::api::auth::{AdminAuth, ClientAuth};
use strata_coordinator::control::leader::LeaderConfig;
use strata_coordinator::control::tasks::Timings;
use strata_coordinator::node::{run_coordinator, CoordinatorOptions};
use strata_worker::agent::AgentConfig;
use strata_worker::process::{run_worker, WorkerOptions};

use strata_common::model_roots::ModelRoots;
use strata_common::tls::Role;

use crate::config_args::{connect, engine_config, lease_timings, set, ConfigArg, EngineArgs, RegistryArgs};
use crate::security_args::{
    caller_tls, client_keys, cluster_tls, http_options, reload_keys_on_sighup, CallerArgs, SecurityArgs,
    TelemetryArgs,
};

#[derive(Args, Debug)]
pub struct CoordinatorArgs {
    #[command(flatten)]
    pub config: ConfigArg,
    #[command(flatten)]
    pub registry: RegistryArgs,
    #[command(flatten)]
    pub security: SecurityArgs,
    #[command(flatten)]
    pub callers: CallerArgs,
    #[command(flatten)]
    pub telemetry: TelemetryArgs,
    /// Address to serve inference.v1 and admin.v1 on; port 0 picks a free port
    /// [default: 127.0.0.1:50051].
    #[arg(long, env = "STRATA_LISTEN")]
    pub listen: Option<std::net::SocketAddr>,
    /// This coordinator's id (default: from the port, made unique).
    #[arg(long, env = "STRATA_ID")]
    pub id: Option<String>,
    /// A Jinja chat template file used instead of each model's own (vLLM's
    /// `--chat-template`).
    #[arg(long, value_name = "FILE")]
    pub chat_template: Option<std::path::PathBuf>,
    /// The format tool calls are read in when a request's tool_choice is auto (hermes,
    /// llama3_json, mistral, deepseek_v3, openai) [default: judged from the chat template].
    #[arg(long, value_name = "NAME")]
    pub tool_call_parser: Option<String>,
    /// Token admin calls must bear; without one, admin calls are accepted from loopback only.
    #[arg(long, env = "STRATA_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    /// Client API keys inference calls must bear (repeatable); none: inference is open.
    #[arg(long = "api-key", env = "STRATA_API_KEYS", value_delimiter = ',', hide_env_values = true)]
    pub api_keys: Vec<String>,
    /// Seconds between canaries of each ready replica [default: 5].
    #[arg(long, env = "STRATA_CANARY_INTERVAL")]
    pub canary_interval: Option<f64>,
    /// Seconds a canary may take before its replica stops receiving traffic [default: 10].
    #[arg(long, env = "STRATA_CANARY_TIMEOUT")]
    pub canary_timeout: Option<f64>,
    /// Seconds a replica may take to load and pass its first canary [default: 600].
    #[arg(long, env = "STRATA_LOAD_TIMEOUT")]
    pub load_timeout: Option<f64>,
    /// Seconds a draining replica waits for its in-flight requests before it is unloaded
    /// [default: 30].
    #[arg(long, env = "STRATA_REPLICA_DRAIN_TIMEOUT")]
    pub replica_drain_timeout: Option<f64>,
    /// Seconds failed replicas stay listed [default: 30].
    #[arg(long, env = "STRATA_FAILED_RETENTION")]
    pub failed_retention: Option<f64>,
    /// Seconds a request waits for a ready replica (at start or after one failed) [default: 60].
    #[arg(long, env = "STRATA_ROUTE_WAIT")]
    pub route_wait: Option<f64>,
    /// Seconds in-flight calls get to finish after SIGTERM [default: 30].
    #[arg(long, env = "STRATA_DRAIN_TIMEOUT")]
    pub drain_timeout: Option<f64>,
    /// The device kind a deployment runs on when it names none: cpu or cuda [default: cpu].
    #[arg(long, env = "STRATA_DEFAULT_DEVICE")]
    pub default_device: Option<String>,
}

impl CoordinatorArgs {
    fn overlay(&self, cfg: &mut Config) -> anyhow::Result<()> {
        self.registry.apply(&mut cfg.registry);
        self.security.apply(&mut cfg.security);
        self.callers.check()?;
        self.callers.apply(&mut cfg.coordinator);
        self.telemetry.apply(&mut cfg.telemetry);
        let c = &mut cfg.coordinator;
        set(&mut c.listen, &self.listen);
        if self.id.is_some() {
            c.id = self.id.clone();
        }
        if self.admin_token.is_some() {
            c.admin_token = self.admin_token.clone();
        }
        if !self.api_keys.is_empty() {
            c.api_keys = self.api_keys.clone();
        }
        set(&mut c.canary_interval_s, &self.canary_interval);
        set(&mut c.canary_timeout_s, &self.canary_timeout);
        set(&mut c.load_timeout_s, &self.load_timeout);
        set(&mut c.replica_drain_timeout_s, &self.replica_drain_timeout);
        set(&mut c.failed_retention_s, &self.failed_retention);
        set(&mut c.route_wait_s, &self.route_wait);
        set(&mut c.drain_timeout_s, &self.drain_timeout);
        set(&mut c.default_device, &self.default_device);
        Ok(())
    }
}

/// The leader's canary and replica timings from the (validated) settings.
pub fn timings(c: &strata_common::config::CoordinatorSettings) -> Timings {
    let secs = Duration::from_secs_f64;
    Timings {
        canary_interval: secs(c.canary_interval_s),
        canary_timeout: secs(c.canary_timeout_s),
        load_timeout: secs(c.load_timeout_s),
        drain_timeout: secs(c.replica_drain_timeout_s),
        failed_retention: secs(c.failed_retention_s),
    }
}

pub fn coordinator(args: CoordinatorArgs, rt: tokio::runtime::Runtime) -> anyhow::Result<()> {
    let cfg = args.config.resolve(|cfg| args.overlay(cfg))?;
    let c = &cfg.coordinator;
    let timings = timings(c);
    let client_auth = ClientAuth::with_tenants(client_keys(c)?, c.tenants.clone())
        .context("--api-key, coordinator.tenants")?;
    let reload = (c.clone(), client_auth.clone());
    let admin_auth = AdminAuth::new(c.admin_token.clone(), &client_auth).context("--admin-token")?;
    let id = c.id.clone().unwrap_or_else(|| {
        format!("coordinator-{}-{:06x}", c.listen.port(), rand::random::<u32>() & 0xff_ffff)
    });
    let (lease_ttl, keepalive) = lease_timings(&cfg.registry)?;
    let tls = cluster_tls(&cfg.security, c.listen, Role::Coordinator)?;
    let opts = CoordinatorOptions {
        keys: Keys::new(&cfg.registry.prefix),
        listen: c.listen,
        leader: LeaderConfig { id, lease_ttl, keepalive, timings, tick: Duration::from_millis(250) },
        front: crate::security_args::front_options(c)?,
        routing_policy: crate::security_args::routing_policy(c)?,
        client_auth,
        admin_auth,
        drain_timeout: Duration::from_secs_f64(c.drain_timeout_s),
        tls,
        model_roots: ModelRoots::new(cfg.security.model_roots.clone()),
        default_device: strata_common::DeviceKind::parse(&c.default_device)
            .context("coordinator.default_device")?,
        caller_tls: caller_tls(c)?,
        http: http_options(c)?,
        chat: crate::serve_cli::chat_settings(
            args.chat_template.as_deref(),
            args.tool_call_parser.as_deref(),
        )?,
    };
    let _runtime = rt.enter();
    reload_keys_on_sighup(reload.0, reload.1, opts.admin_auth.clone(), "coordinator")?;
    if let Some(addr) = crate::metrics_http::parse_listen(&cfg.telemetry.metrics_listen)? {
        rt.block_on(crate::metrics_http::serve(addr, "coordinator"))?;
    }
    rt.block_on(async move {
        let (registry, _) = connect(&cfg.registry).await?;
        run_coordinator(registry, opts).await
    })
}

#[derive(Args, Debug)]
pub struct WorkerArgs {
    #[command(flatten)]
    pub config: ConfigArg,
    /// Cluster mode: register in etcd and hold the shards the leader coordinator assigns.
    #[command(flatten)]
    pub registry: RegistryArgs,
    #[command(flatten)]
    pub security: SecurityArgs,
    #[command(flatten)]
    pub telemetry: TelemetryArgs,
    /// Cluster mode: address to serve worker.v1 on; port 0 picks a free port
    /// [default: 127.0.0.1:0].
    #[arg(long, env = "STRATA_LISTEN")]
    pub listen: Option<std::net::SocketAddr>,
    /// Cluster mode: address coordinators and other ranks reach this worker at (default:
    /// the bound --listen address).
    #[arg(long, env = "STRATA_ADVERTISE")]
    pub advertise: Option<String>,
    /// Cluster mode: this worker's id (default: host name and port).
    #[arg(long, env = "STRATA_ID")]
    pub id: Option<String>,
    /// Cluster mode: also serve grpc.health.v1 (and nothing else) in plaintext here, for
    /// probes that hold no cluster certificate (the kubelet's); port 0 picks a free one.
    #[arg(long, env = "STRATA_HEALTH_LISTEN")]
    pub health_listen: Option<std::net::SocketAddr>,
    /// Cluster mode: the machine this worker runs on, as placement groups workers (ranks
    /// of one TP group prefer one machine; Kubernetes: the node name) [default: host name].
    /// A machine with several GPUs runs one worker per GPU (`--device cuda:N`).
    #[arg(long, env = "STRATA_NODE")]
    pub node: Option<String>,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Seconds in-flight sequences get to finish after SIGTERM [default: 30].
    #[arg(long, env = "STRATA_DRAIN_TIMEOUT")]
    pub drain_timeout: Option<f64>,
    /// Static mode: the model directory (the same files the leader loads).
    #[arg(long, conflicts_with = "etcd")]
    pub model: Option<PathBuf>,
    /// Static mode: tensor-parallel ranks of the replica.
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
    /// Static mode: pipeline stages of the replica.
    #[arg(long, default_value_t = 1)]
    pub pp: usize,
    /// Static mode: expert parallelism (as `strata serve --ep`).
    #[arg(long, default_value_t = 1)]
    pub ep: usize,
    /// Static mode (deprecated; use --etcd): this process's rank (1 ..= tp·pp − 1; rank 0 is `strata serve`).
    #[arg(long, conflicts_with = "etcd")]
    pub rank: Option<usize>,
    /// Static mode: the leader's rendezvous address (`strata serve --worker-rendezvous`).
    #[arg(long, conflicts_with = "etcd")]
    pub rendezvous: Option<std::net::SocketAddr>,
    /// Static mode: the secret the leader's rendezvous expects (its --rendezvous-secret).
    #[arg(long, env = "STRATA_RENDEZVOUS_SECRET", hide_env_values = true, conflicts_with = "etcd")]
    pub rendezvous_secret: Option<String>,
}

impl WorkerArgs {
    fn overlay(&self, cfg: &mut Config) -> anyhow::Result<()> {
        self.registry.apply(&mut cfg.registry);
        self.security.apply(&mut cfg.security);
        self.telemetry.apply(&mut cfg.telemetry);
        self.engine.apply(&mut cfg.engine);
        let w = &mut cfg.worker;
        set(&mut w.listen, &self.listen);
        if self.advertise.is_some() {
            w.advertise = self.advertise.clone();
        }
        if self.id.is_some() {
            w.id = self.id.clone();
        }
        if self.health_listen.is_some() {
            w.health_listen = self.health_listen;
        }
        if self.node.is_some() {
            w.node = self.node.clone();
        }
        set(&mut w.drain_timeout_s, &self.drain_timeout);
        Ok(())
    }
}

pub fn worker(
    args: WorkerArgs,
    rt: impl FnOnce() -> anyhow::Result<tokio::runtime::Runtime>,
) -> anyhow::Result<()> {
    let cfg = args.config.resolve(|cfg| args.overlay(cfg))?;
    let (engine, runner) = engine_config(&cfg.engine)?;
    if cfg.registry.etcd.is_empty() {
        let (Some(model), Some(rank), Some(rendezvous)) = (&args.model, args.rank, args.rendezvous) else {
            bail!(
                "give --etcd URL (cluster mode), or --model DIR --rank R --rendezvous ADDR (a rank of `strata serve --worker-rendezvous`)"
            );
        };
        let par = strata_common::Parallelism::with_ep(args.tp, args.pp, args.ep).context("--ep")?;
        crate::rendezvous::warn_deprecated("strata worker --rank --rendezvous");
        let secret = crate::rendezvous::secret(args.rendezvous_secret.as_deref(), rendezvous)?;
        let join = strata_engine::replica::RankJoin {
            par,
            rank,
            rendezvous,
            secret: &secret,
            labels: engine.labels.clone(),
            threads: strata_engine::replica::RankThreads::Process,
        };
        strata_engine::replica::run_worker_rank(model, join, &engine.backend, || {})
            .with_context(|| format!("worker rank {rank}"))?;
        tracing::info!("leader shut the replica down; exiting");
        return Ok(());
    }
    let w = &cfg.worker;
    let (lease_ttl, keepalive) = lease_timings(&cfg.registry)?;
    let tls = cluster_tls(&cfg.security, w.listen, Role::Worker)?;
    let opts = WorkerOptions {
        keys: Keys::new(&cfg.registry.prefix),
        listen: w.listen,
        advertise: w.advertise.clone(),
        id: w.id.clone(),
        lease_ttl,
        keepalive,
        agent: AgentConfig {
            id: String::new(),
            bind_ip: w.listen.ip(),
            advertise_host: String::new(),
            backend: engine.backend.clone(),
            engine,
            runner,
            model_roots: ModelRoots::new(cfg.security.model_roots.clone()),
            rank_threads: strata_engine::replica::RankThreads::Process,
        },
        drain_timeout: Duration::from_secs_f64(w.drain_timeout_s),
        tls,
        health_listen: w.health_listen,
        node: w.node.clone(),
    };
    let metrics = crate::metrics_http::parse_listen(&cfg.telemetry.metrics_listen)?;
    rt()?.block_on(async move {
        if let Some(addr) = metrics {
            crate::metrics_http::serve(addr, "worker").await?;
        }
        let (registry, _) = connect(&cfg.registry).await?;
        run_worker(registry, opts).await
    })
}
