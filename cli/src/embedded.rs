//! `strata serve`: a whole cluster in one process, on the in-memory registry.
//!
//! The same parts as cluster mode, minus etcd: one coordinator (always the leader) and
//! enough in-process workers for the models on the command line (`replicas × tp × pp`
//! each, plus `--spare-workers`), each registered with a lease in a [`MemoryRegistry`]
//! and called in-process — no worker.v1 listener, so no local user can reach a worker
//! around the API keys and the admin token (its address, a reserved loopback port, only
//! names it). The command line's models are written
//! as deployments and the reconciler builds them exactly as it would across machines —
//! so `strata serve` also answers the admin API (deploy, scale, drain at run time), its
//! replicas are canaried, and a replica that breaks is rebuilt. Requests reach the
//! engines directly (no loopback gRPC on the request path).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use strata_common::cluster::{encode, Build, EngineLimits, ModelSpec, ReplicaState};
use strata_common::registry::keys::Keys;
use strata_common::registry::memory::MemoryRegistry;
use strata_common::registry::Registry;
use strata_common::{ModelConfig, Parallelism, ShardPlan};
use tokio::net::TcpListener;
use tracing::info;

use strata_coordinator::api::admin::ClusterAdmin;
use strata_coordinator::api::auth::AdminAuth;
use strata_coordinator::api::server::{serve, ServeOptions};
use strata_coordinator::control::leader::{Election, LeaderConfig};
use strata_coordinator::control::tasks::Timings;
use strata_coordinator::control::view::Watcher;
use strata_coordinator::frontend::{FrontEnd, FrontEndOptions};
use strata_coordinator::request::tokenizer::Tokenizer;
use strata_coordinator::routing::catalog::ClusterCatalog;
use strata_coordinator::routing::clients::WorkerClients;
use strata_coordinator::routing::policy::PolicyKind;
use strata_coordinator::routing::Catalog;
use strata_worker::agent::{AgentConfig, WorkerAgent};
use strata_worker::in_process::InProcessWorker;
use strata_worker::membership::{Announcement, Membership};

/// One model of the command line.
#[derive(Debug, Clone)]
pub struct EmbeddedModel {
    pub name: String,
    pub dir: PathBuf,
    pub par: Parallelism,
    pub replicas: usize,
}

pub struct EmbeddedOptions {
    pub models: Vec<EmbeddedModel>,
    /// `--chat-template` and `--tool-call-parser` over every model's own.
    pub chat: strata_coordinator::request::chat::ChatSettings,
    /// Workers beyond what the models need (for deployments at run time).
    pub spare_workers: usize,
    /// Every worker's agent (engine defaults, backend).
    pub agent: AgentConfig,
    pub limits: EngineLimits,
    pub serve: ServeOptions,
    /// Route limits and the response cache's size.
    pub front: FrontEndOptions,
    /// How each model's router picks a replica.
    pub routing_policy: PolicyKind,
    /// Who may call the admin API.
    pub admin_auth: AdminAuth,
    pub timings: Timings,
    /// Where admin deployments may load models from.
    pub model_roots: strata_common::model_roots::ModelRoots,
}

const LEASE_TTL: Duration = Duration::from_secs(5);

/// One in-process worker: its leased registration, and the loopback port that keeps its
/// address unique (bound, never served).
struct LocalWorker {
    membership: Membership,
    _address: TcpListener,
}

/// Starts worker `i`: registered in `registry` and reachable through `clients` directly.
async fn start_worker(
    i: usize,
    agent: &AgentConfig,
    registry: &Arc<dyn Registry>,
    keys: &Keys,
    clients: &WorkerClients,
) -> anyhow::Result<LocalWorker> {
    let mut cfg = agent.clone();
    cfg.id = format!("local-{i}");
    // One in-process worker per GPU: worker i drives the i-th device from the given one.
    if let strata_engine::backend::Device::Cuda(base) = cfg.backend.device {
        cfg.backend.device = strata_engine::backend::Device::Cuda(base + i);
    }
    cfg.bind_ip = std::net::Ipv4Addr::LOCALHOST.into();
    cfg.advertise_host = "127.0.0.1".into();
    let agent = WorkerAgent::new(cfg).map_err(|e| anyhow::anyhow!("{e}"))?;
    let listener = TcpListener::bind("127.0.0.1:0").await.context("binding an in-process worker")?;
    let address = listener.local_addr()?.to_string();
    clients.register(&address, Arc::new(InProcessWorker(agent.clone())));
    let capacity = agent.config().capacity(None).map_err(|e| anyhow::anyhow!("{e}"))?;
    let announcement = Announcement { address, capacity, ttl: LEASE_TTL, keepalive: LEASE_TTL / 3 };
    let membership = Membership::start(registry.clone(), keys.clone(), agent, announcement);
    Ok(LocalWorker { membership, _address: listener })
}

/// Writes the command line's models as deployments.
async fn deploy(opts: &EmbeddedOptions, registry: &Arc<dyn Registry>, keys: &Keys) -> anyhow::Result<()> {
    for m in &opts.models {
        let spec = ModelSpec {
            name: m.name.as_str().into(),
            build: Build {
                chat: Default::default(),
                quantize: String::new(),
                model_dir: m.dir.to_string_lossy().into_owned(),
                dtype: None,
                // The in-process workers are all of the command line's device; they were
                // started for this model, so placement checks neither kind nor memory.
                device: None,
                tp: m.par.tp as u32,
                pp: m.par.pp as u32,
                ep: m.par.ep as u32,
                limits: opts.limits.clone(),
            },
            weight_bytes_per_rank: 0,
            replicas: m.replicas as u32,
            generation: 1,
            created_ms: strata_common::cluster::now_ms(),
            rollout: Default::default(),
        };
        spec.validate().with_context(|| format!("model {:?}", m.name))?;
        registry.put(&keys.model(&m.name), encode(&spec), None).await?;
        info!(model = %m.name, replicas = m.replicas, tp = m.par.tp, pp = m.par.pp, "loading");
    }
    Ok(())
}

/// Waits until every replica is ready and every tokenizer loaded; a replica that fails to
/// load fails start-up with its reason.
async fn wait_loaded(
    models: &[EmbeddedModel],
    watcher: &Watcher,
    catalog: &ClusterCatalog,
) -> anyhow::Result<()> {
    let mut view = watcher.subscribe();
    loop {
        let v = view.borrow_and_update().clone();
        let mut all = true;
        for m in models {
            for r in v.replicas.get(m.name.as_str()).into_iter().flat_map(|rs| rs.values()) {
                if r.state == ReplicaState::Failed {
                    bail!("loading model {:?}: {}", m.name, r.reason);
                }
            }
            all &= v.ready_replicas(&m.name).count() == m.replicas && catalog.get(&m.name).is_ok();
        }
        if all {
            return Ok(());
        }
        let _ = tokio::time::timeout(Duration::from_millis(100), view.changed()).await;
    }
}

/// Starts the in-process cluster, waits for every replica, then serves until SIGTERM.
pub async fn run_embedded(opts: EmbeddedOptions) -> anyhow::Result<()> {
    let registry: Arc<dyn Registry> = Arc::new(MemoryRegistry::new());
    let keys = Keys::new("/strata");
    // Check every model before starting anything: a bad directory or split fails here.
    for m in &opts.models {
        let config = ModelConfig::from_dir(&m.dir).with_context(|| format!("model {:?}", m.name))?;
        ShardPlan::new(&config, m.par).with_context(|| format!("model {:?}", m.name))?;
        let context = config.max_position_embeddings;
        if let Some(n) = opts.agent.engine.max_model_len.filter(|&n| n > context) {
            anyhow::bail!("--max-model-len {n} exceeds model {:?}'s context of {context} tokens", m.name);
        }
        Tokenizer::from_dir_with(&m.dir, &opts.chat).with_context(|| format!("model {:?}", m.name))?;
    }
    let clients = Arc::new(WorkerClients::new());
    let needed: usize =
        opts.models.iter().map(|m| m.replicas * m.par.world()).sum::<usize>() + opts.spare_workers;
    let mut workers = Vec::with_capacity(needed);
    for i in 0..needed {
        workers.push(start_worker(i, &opts.agent, &registry, &keys, &clients).await?);
    }
    let watcher = Watcher::start(registry.clone(), keys.clone());
    // The cluster gauges as a coordinator reports them: the in-memory registry connected,
    // this process the leader, its models, replicas and workers.
    let gauges =
        tokio::spawn(strata_coordinator::control::metrics::follow(watcher.subscribe(), "serve".into()));
    let catalog = ClusterCatalog::start_with(
        watcher.subscribe(),
        clients.clone(),
        opts.routing_policy,
        opts.chat.clone(),
    )?;
    let tenants = opts.serve.client_auth.tenants().clone();
    let following = tenants.follow_view(watcher.subscribe());
    let front = FrontEnd::new(catalog.clone(), opts.front);
    let flushing = front.ledger().attach(registry.clone(), keys.clone(), "serve");
    let leader = LeaderConfig {
        id: "serve".into(),
        lease_ttl: LEASE_TTL,
        keepalive: LEASE_TTL / 3,
        timings: opts.timings.clone(),
        tick: Duration::from_millis(100),
    };
    let election =
        Election::start(registry.clone(), keys.clone(), watcher.subscribe(), clients.clone(), leader);
    deploy(&opts, &registry, &keys).await?;
    wait_loaded(&opts.models, &watcher, &catalog).await?;
    let admin = ClusterAdmin::new(
        "serve".into(),
        registry.clone(),
        keys.clone(),
        watcher.subscribe(),
        catalog.clone(),
        opts.admin_auth.clone(),
    )
    .with_model_roots(opts.model_roots.clone())
    .with_tenants(tenants)
    .with_ledger(front.ledger().clone());
    let served = serve(front.clone(), admin, opts.serve).await;
    election.resign().await;
    gauges.abort();
    following.abort();
    flushing.abort();
    let _ = front.ledger().flush().await;
    for w in workers {
        w.membership.leave().await;
    }
    drop(watcher);
    served
}
