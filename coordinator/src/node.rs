//! `strata coordinator`: the coordinator process wired from its seams — the registry view,
//! the routing catalog, the election and the admin and inference APIs.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use strata_common::model_roots::ModelRoots;
use strata_common::registry::keys::Keys;
use strata_common::registry::Registry;
use strata_common::tls::ClusterTls;
use tracing::info;

use crate::api::admin::ClusterAdmin;
use crate::api::auth::{AdminAuth, ClientAuth};
use crate::api::server::{serve, Role, ServeOptions};
use crate::control::leader::{Election, LeaderConfig};
use crate::control::view::Watcher;
use crate::frontend::{FrontEnd, FrontEndOptions};
use crate::routing::catalog::ClusterCatalog;
use crate::routing::clients::WorkerClients;
use crate::routing::policy::PolicyKind;

/// Everything `strata coordinator` runs with.
pub struct CoordinatorOptions {
    pub keys: Keys,
    pub listen: SocketAddr,
    pub leader: LeaderConfig,
    /// Route limits and the response cache's size.
    pub front: FrontEndOptions,
    /// How each model's router picks a replica.
    pub routing_policy: PolicyKind,
    pub client_auth: ClientAuth,
    pub admin_auth: AdminAuth,
    /// SIGTERM: how long in-flight calls get to finish.
    pub drain_timeout: Duration,
    /// Cluster credentials: workers are dialled over mutual TLS as a coordinator.
    pub tls: Option<ClusterTls>,
    /// Where deployments may load models from.
    pub model_roots: ModelRoots,
    /// The device kind of a deployment that names none.
    pub default_device: strata_common::DeviceKind,
    /// TLS for callers of inference.v1 and admin.v1.
    pub caller_tls: Option<tonic::transport::ServerTlsConfig>,
    /// The OpenAI-style HTTP API.
    pub http: Option<crate::api::http::HttpOptions>,
    /// `--chat-template` and `--tool-call-parser` over every model's own.
    pub chat: crate::request::chat::ChatSettings,
}

/// Routes inference traffic from the registry's view, serves the admin API, and
/// campaigns for leadership (reconciling while it leads) until SIGTERM.
pub async fn run_coordinator(registry: Arc<dyn Registry>, opts: CoordinatorOptions) -> anyhow::Result<()> {
    let watcher = Watcher::start(registry.clone(), opts.keys.clone());
    let clients = Arc::new(WorkerClients::with_tls(opts.tls.as_ref()));
    let gauges = tokio::spawn(crate::control::metrics::follow(watcher.subscribe(), opts.leader.id.clone()));
    let catalog = ClusterCatalog::start_with(
        watcher.subscribe(),
        clients.clone(),
        opts.routing_policy,
        opts.chat.clone(),
    )?;
    let front = FrontEnd::new(catalog.clone(), opts.front);
    let tenants = opts.client_auth.tenants().clone();
    let following = tenants.follow_view(watcher.subscribe());
    let flushing = front.ledger().attach(registry.clone(), opts.keys.clone(), &opts.leader.id);
    let election = Election::start(
        registry.clone(),
        opts.keys.clone(),
        watcher.subscribe(),
        clients.clone(),
        opts.leader.clone(),
    );
    let admin = ClusterAdmin::new(
        opts.leader.id.clone(),
        registry.clone(),
        opts.keys.clone(),
        watcher.subscribe(),
        catalog.clone(),
        opts.admin_auth,
    )
    .with_model_roots(opts.model_roots.clone())
    .with_default_device(opts.default_device)
    .with_tenants(tenants)
    .with_ledger(front.ledger().clone());
    if opts.model_roots.is_open() {
        tracing::warn!(
            "no --model-root: deployments may load models from any absolute path the workers can read"
        );
    }
    info!(id = %opts.leader.id, registry = registry.kind(), prefix = opts.keys.prefix(), "coordinator starting");
    let served = serve(
        front.clone(),
        admin,
        ServeOptions {
            listen: opts.listen,
            drain_timeout: opts.drain_timeout,
            client_auth: opts.client_auth,
            role: Role::Coordinator,
            id: opts.leader.id.clone(),
            tls: opts.caller_tls.clone(),
            http: opts.http.clone(),
            bound: None,
        },
    )
    .await;
    election.resign().await;
    gauges.abort();
    following.abort();
    flushing.abort();
    if let Err(e) = front.ledger().flush().await {
        tracing::warn!(error = %e, "the last usage records were not written");
    }
    drop(watcher);
    served
}
