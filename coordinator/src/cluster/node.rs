//! The two cluster-mode processes, wired from their seams: `strata coordinator` and
//! `strata worker --etcd`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use strata_common::cluster::Capacity;
use strata_common::registry::keys::Keys;
use strata_common::registry::Registry;
use strata_proto::worker::v1::worker_server::WorkerServer;
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tracing::{info, warn};

use super::agent::{AgentConfig, WorkerAgent};
use super::catalog::ClusterCatalog;
use super::clients::WorkerClients;
use super::leader::{Election, LeaderConfig};
use super::membership::{Announcement, Membership};
use super::view::Watcher;
use super::worker_service::WorkerService;
use crate::auth::{AdminAuth, ClientAuth};
use crate::generation::RouteLimits;
use crate::serve::{serve, shutdown_signal, ServeOptions};

/// Everything `strata coordinator` runs with.
pub struct CoordinatorOptions {
    pub keys: Keys,
    pub listen: SocketAddr,
    pub leader: LeaderConfig,
    pub route: RouteLimits,
    pub client_auth: ClientAuth,
    pub admin_auth: AdminAuth,
    /// SIGTERM: how long in-flight calls get to finish.
    pub drain_timeout: Duration,
}

/// Routes inference traffic from the registry's view, serves the admin API, and
/// campaigns for leadership (reconciling while it leads) until SIGTERM.
pub async fn run_coordinator(registry: Arc<dyn Registry>, opts: CoordinatorOptions) -> anyhow::Result<()> {
    let watcher = Watcher::start(registry.clone(), opts.keys.clone());
    let clients = Arc::new(WorkerClients::new());
    let catalog = ClusterCatalog::start(watcher.subscribe(), clients.clone())?;
    let election = Election::start(
        registry.clone(),
        opts.keys.clone(),
        watcher.subscribe(),
        clients.clone(),
        opts.leader.clone(),
    );
    let admin = super::admin::ClusterAdmin::new(
        registry.clone(),
        opts.keys.clone(),
        watcher.subscribe(),
        catalog.clone(),
        opts.admin_auth,
    );
    info!(id = %opts.leader.id, registry = registry.kind(), prefix = opts.keys.prefix(), "coordinator starting");
    let served = serve(
        catalog,
        admin,
        ServeOptions {
            listen: opts.listen,
            drain_timeout: opts.drain_timeout,
            route: opts.route,
            client_auth: opts.client_auth,
            role: "strata coordinator",
        },
    )
    .await;
    election.resign().await;
    drop(watcher);
    served
}

/// Everything `strata worker --etcd` runs with.
pub struct WorkerOptions {
    pub keys: Keys,
    pub listen: SocketAddr,
    /// Address coordinators reach this worker at; defaults to the bound listen address.
    pub advertise: Option<String>,
    pub id: Option<String>,
    pub lease_ttl: Duration,
    /// How often the lease is refreshed.
    pub keepalive: Duration,
    pub agent: AgentConfig,
    /// SIGTERM: how long in-flight sequences get to finish.
    pub drain_timeout: Duration,
}

/// Memory available for weights and KV cache on this machine (CPU workers).
pub fn available_memory() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("MemAvailable:"))
                .and_then(|l| l.split_whitespace().next())
                .and_then(|n| n.parse::<u64>().ok())
        })
        .map(|kib| kib * 1024)
        .unwrap_or(0)
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| std::fs::read_to_string("/etc/hostname"))
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "worker".into())
}

/// Serves worker.v1, registers with a lease, and holds whatever shard the leader
/// coordinator assigns, until SIGTERM.
pub async fn run_worker(registry: Arc<dyn Registry>, mut opts: WorkerOptions) -> anyhow::Result<()> {
    let listener =
        TcpListener::bind(opts.listen).await.with_context(|| format!("cannot listen on {}", opts.listen))?;
    let bound = listener.local_addr()?;
    let advertise = match opts.advertise.clone() {
        Some(a) => a,
        None if bound.ip().is_unspecified() => anyhow::bail!(
            "--listen {bound} binds every interface: give --advertise HOST:PORT, the address coordinators reach this worker at"
        ),
        None => bound.to_string(),
    };
    let id = opts.id.clone().unwrap_or_else(|| format!("{}-{}", hostname(), bound.port()));
    if !strata_common::registry::keys::valid_name(&id) {
        anyhow::bail!("--id {id:?}: use letters, digits, '-', '_', '.' or ':'");
    }
    opts.agent.id = id.clone();
    // Replica rendezvous listeners bind where the gRPC listener does and are announced
    // under the advertised host.
    opts.agent.bind_ip = bound.ip();
    opts.agent.advertise_host =
        advertise.rsplit_once(':').map(|(h, _)| h.to_string()).unwrap_or(advertise.clone());
    let device = opts.agent.backend.device;
    let agent = WorkerAgent::new(opts.agent).map_err(|e| anyhow::anyhow!("--device {device}: {e}"))?;
    let capacity = Capacity {
        device_kind: device.kind().to_string(),
        device_count: 1,
        memory_bytes: available_memory(),
    };
    let (health_reporter, health) = tonic_health::server::health_reporter();
    health_reporter.set_serving::<WorkerServer<WorkerService>>().await;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tonic::transport::Server::builder()
        .add_service(health)
        .add_service(
            WorkerServer::new(WorkerService::new(agent.clone()))
                .max_decoding_message_size(64 << 20)
                .max_encoding_message_size(256 << 20),
        )
        .serve_with_incoming_shutdown(TcpListenerStream::new(listener), async {
            let _ = stop_rx.await;
        });
    let membership = Membership::start(
        registry.clone(),
        opts.keys.clone(),
        agent.clone(),
        Announcement { address: advertise.clone(), capacity, ttl: opts.lease_ttl, keepalive: opts.keepalive },
    );
    info!(id = %id, device = %device, address = %advertise, registry = registry.kind(), "strata worker ready, listening on {bound}");
    let mut server = std::pin::pin!(server);
    tokio::select! {
        res = &mut server => {
            membership.leave().await;
            return res.context("worker.v1 server failed");
        }
        _ = shutdown_signal() => {}
    }
    // Finish what is running, then leave: coordinators move new requests elsewhere.
    info!("shutting down: finishing in-flight sequences");
    if let Some(a) = agent.status().assignment {
        let _ = agent.drain(&a.replica);
        let until = tokio::time::Instant::now() + opts.drain_timeout;
        while tokio::time::Instant::now() < until {
            let s = agent.status().stats;
            if s.running + s.waiting == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let replica = a.replica.clone();
        let unloading = agent.clone();
        let _ = tokio::task::spawn_blocking(move || unloading.unload(&replica)).await;
    }
    membership.leave().await;
    let _ = stop_tx.send(());
    if tokio::time::timeout(Duration::from_secs(5), server).await.is_err() {
        warn!("closing the remaining worker.v1 calls");
    }
    info!("stopped");
    Ok(())
}
