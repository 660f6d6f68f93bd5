//! `strata worker --etcd`: the worker process wired from its parts — the agent, its
//! worker.v1 server and its leased registration.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use strata_common::conn_limits::ConnLimits;
use strata_common::ready::announce;
use strata_common::registry::keys::Keys;
use strata_common::registry::Registry;
use strata_proto::worker::v1::worker_server::WorkerServer;
use tokio::net::TcpListener;
use tonic_health::pb::health_server::{Health, HealthServer};
use tracing::{info, warn};

use strata_common::tls::ClusterTls;

use crate::agent::{AgentConfig, WorkerAgent};
use crate::gate::RoleGateLayer;
use crate::in_process::InProcessWorker;
use crate::membership::{Announcement, Membership};
use crate::service::WorkerService;

/// Largest worker.v1 request a worker accepts (a resumed sequence's token ids).
pub const MAX_REQUEST_BYTES: usize = 64 << 20;
/// Largest worker.v1 response (tokenizer.json of a large vocabulary is several MiB).
pub const MAX_RESPONSE_BYTES: usize = 256 << 20;

/// Most concurrent calls on one connection (a coordinator multiplexes all its streams
/// to a worker over one).
pub const MAX_CONCURRENT_STREAMS: u32 = 4096;

/// worker.v1 for `agent`, with the message limits every worker uses.
pub fn worker_server(agent: Arc<WorkerAgent>) -> WorkerServer<WorkerService> {
    WorkerServer::new(WorkerService::new(InProcessWorker(agent)))
        .max_decoding_message_size(MAX_REQUEST_BYTES)
        .max_encoding_message_size(MAX_RESPONSE_BYTES)
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
    /// Cluster credentials: worker.v1 then accepts only clients with a certificate from
    /// the cluster CA, and only coordinators may drive it. None: every caller is trusted.
    pub tls: Option<ClusterTls>,
    /// Plaintext grpc.health.v1 (only) for probes without a cluster certificate.
    pub health_listen: Option<SocketAddr>,
    /// The machine, as placement groups workers (default: the host name).
    pub node: Option<String>,
}

/// Serves grpc.health.v1 alone, in plaintext, on `addr` (announced on stdout as
/// `{"event":"health","address":…}`): the kubelet's gRPC probes carry no client certificate.
async fn serve_health<T: Health>(addr: SocketAddr, health: HealthServer<T>) -> anyhow::Result<()> {
    let listener = TcpListener::bind(addr).await.with_context(|| format!("--health-listen {addr}"))?;
    let bound = listener.local_addr()?;
    tokio::spawn(async move {
        // The same caps and opening deadline as every other listener: the probe port must
        // keep answering however many idle connections arrive.
        // Only health is served here, and health calls keep no connection: each is closed
        // within the first-call bound (the kubelet opens one a probe).
        let listener = strata_common::conn_limits::LimitedListener::new(listener, ConnLimits::grpc());
        let served = tonic::transport::Server::builder()
            .layer(listener.calls_layer())
            .add_service(health)
            .serve_with_incoming(listener.incoming());
        if let Err(e) = served.await {
            warn!(error = %e, "the health endpoint stopped");
        }
    });
    let address = bound.to_string();
    announce(&strata_common::ready::Announcement {
        event: "health",
        role: "worker",
        address: &address,
        id: "",
    });
    Ok(())
}

/// How long a leaving worker whose sequences are done waits for the leader coordinator to
/// take its replica off it (drain and release every rank) before letting go itself.
const HANDOVER: Duration = Duration::from_secs(3);

/// SIGTERM: says in its record that it is leaving (the leader drains its replica, blaming
/// no rank, and builds a replacement), lets the held replica's sequences finish (up to
/// `timeout`), and unloads the shard unless the leader released it first.
async fn drain(agent: &Arc<WorkerAgent>, membership: &Membership, timeout: Duration) {
    info!("shutting down: finishing in-flight sequences");
    agent.begin_leaving();
    let started = tokio::time::Instant::now();
    if !membership.published(agent, HANDOVER).await {
        warn!("could not record that this worker is leaving; its replica may be reported failed");
    }
    let Some(a) = agent.status().assignment else { return };
    let _ = agent.drain(&a.replica);
    let until = started + timeout;
    let mut idle_since: Option<tokio::time::Instant> = None;
    while tokio::time::Instant::now() < until {
        let status = agent.status();
        if status.assignment.is_none() {
            return; // released by the leader: the replica moved without blame
        }
        let idle = status.stats.running + status.stats.waiting == 0;
        let since = match (idle, idle_since) {
            (false, _) => None,
            (true, None) => Some(tokio::time::Instant::now()),
            (true, s) => s,
        };
        idle_since = since;
        if since.is_some_and(|s| s.elapsed() >= HANDOVER) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let replica = a.replica.clone();
    let unloading = agent.clone();
    let _ = tokio::task::spawn_blocking(move || unloading.unload(&replica)).await;
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
    let id =
        opts.id.clone().unwrap_or_else(|| format!("{}-{}", strata_common::host::hostname(), bound.port()));
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
    let capacity = agent
        .config()
        .capacity(opts.node.as_deref())
        .map_err(|e| anyhow::anyhow!("--device {device}: {e}"))?;
    // Ready (worker.v1 SERVING) once registered in the registry; the process itself
    // (service "") is healthy from the start.
    let (health_reporter, health) = tonic_health::server::health_reporter();
    health_reporter.set_not_serving::<WorkerServer<WorkerService>>().await;
    if let Some(addr) = opts.health_listen {
        serve_health(addr, health.clone()).await?;
    }
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let mut builder =
        tonic::transport::Server::builder().max_concurrent_streams(Some(MAX_CONCURRENT_STREAMS));
    if let Some(tls) = &opts.tls {
        builder = builder.tls_config(tls.server()).context("cluster TLS")?;
    } else {
        warn!("worker.v1 accepts calls from anyone who can reach {bound}: no cluster credentials");
    }
    let listener = strata_common::conn_limits::LimitedListener::new(listener, ConnLimits::grpc());
    let server = builder
        .layer(strata_common::grpc_metrics::GrpcMetricsLayer)
        .layer(listener.calls_layer())
        .layer(RoleGateLayer)
        .add_service(health)
        .add_service(worker_server(agent.clone()))
        .serve_with_incoming_shutdown(listener.incoming(), async {
            let _ = stop_rx.await;
        });
    let membership = Membership::start(
        registry.clone(),
        opts.keys.clone(),
        agent.clone(),
        Announcement { address: advertise.clone(), capacity, ttl: opts.lease_ttl, keepalive: opts.keepalive },
    );
    let mut registered = membership.registered();
    tokio::spawn(async move {
        if registered.wait_for(|r| *r).await.is_ok() {
            health_reporter.set_serving::<WorkerServer<WorkerService>>().await;
        }
    });
    info!(id = %id, device = %device, address = %advertise, registry = registry.kind(), "strata worker ready, listening on {bound}");
    announce(&strata_common::ready::Announcement {
        event: "ready",
        role: "worker",
        address: &advertise,
        id: &id,
    });
    let mut server = std::pin::pin!(server);
    tokio::select! {
        res = &mut server => {
            membership.leave().await;
            return res.context("worker.v1 server failed");
        }
        _ = strata_common::shutdown::signal() => {}
    }
    // Finish what is running, then leave: coordinators move new requests elsewhere.
    drain(&agent, &membership, opts.drain_timeout).await;
    membership.leave().await;
    let _ = stop_tx.send(());
    if tokio::time::timeout(Duration::from_secs(5), server).await.is_err() {
        warn!("closing the remaining worker.v1 calls");
    }
    info!("stopped");
    Ok(())
}
