//! The coordinator's gRPC server, for `strata serve` and `strata coordinator` alike.
//!
//! Serves inference.v1, admin.v1, the standard gRPC health service and server reflection
//! (v1 and v1alpha)
//! on one port. On SIGTERM (or Ctrl-C) it reports NOT_SERVING, stops accepting new
//! calls, lets in-flight calls and streams finish for up to the drain timeout, and
//! returns so the process exits 0.

use std::net::SocketAddr;
use std::time::Duration;

use std::sync::Arc;

use anyhow::Context;
use strata_common::ready::{announce, Announcement};
use strata_proto::admin::v1::admin_server::{Admin, AdminServer};
use strata_proto::inference::v1::inference_server::InferenceServer;
use tokio::net::TcpListener;
use tracing::{info, warn};

use super::auth::{CallerLayer, ClientAuth};
use super::http::{HttpOptions, RunningHttp};
use super::inference::InferenceService;
use crate::frontend::FrontEnd;

/// Most concurrent calls a client may have open on one connection (advertised in the
/// HTTP/2 settings); admission limits bound the work behind them.
pub const MAX_CONCURRENT_STREAMS: u32 = 1024;

pub struct ServeOptions {
    pub listen: SocketAddr,
    pub drain_timeout: Duration,
    pub client_auth: ClientAuth,
    pub role: Role,
    /// This process's id in the cluster (in the ready announcement).
    pub id: String,
    /// TLS for callers (with client certificates when it names a client CA).
    pub tls: Option<tonic::transport::ServerTlsConfig>,
    /// The OpenAI-style HTTP API (None: not served).
    pub http: Option<HttpOptions>,
    /// Listeners bound before the server starts ([`ServeOptions::bind_early`]); None: bound
    /// when it starts.
    pub bound: Option<Listeners>,
}

/// The gRPC and HTTP listeners, bound ahead of serving.
#[derive(Debug)]
pub struct Listeners {
    grpc: std::net::TcpListener,
    http: Option<std::net::TcpListener>,
}

impl ServeOptions {
    /// Binds the listen addresses now, so a port in use fails at once rather than after
    /// the models load; connections wait in the backlog until the server starts.
    pub fn bind_early(&mut self) -> anyhow::Result<()> {
        let bind = |addr: SocketAddr, flag: &str, hint: &str| -> anyhow::Result<std::net::TcpListener> {
            let l = std::net::TcpListener::bind(addr)
                .with_context(|| format!("{flag} {addr}: cannot listen{hint}"))?;
            l.set_nonblocking(true)?;
            Ok(l)
        };
        let grpc = bind(self.listen, "--listen", "")?;
        let http_hint = " (the OpenAI HTTP API: move it with --http-listen HOST:PORT or --port, or turn it off with --http-listen off)";
        let http = self.http.as_ref().map(|h| bind(h.listen, "--http-listen", http_hint)).transpose()?;
        self.bound = Some(Listeners { grpc, http });
        Ok(())
    }
}

/// Which command serves: named in the ready log line and announcement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// `strata serve`: every role in one process.
    Serve,
    /// `strata coordinator`.
    Coordinator,
}

impl Role {
    pub fn name(self) -> &'static str {
        match self {
            Role::Serve => "serve",
            Role::Coordinator => "coordinator",
        }
    }

    fn log_name(self) -> &'static str {
        match self {
            Role::Serve => "strata",
            Role::Coordinator => "strata coordinator",
        }
    }
}

/// Serves inference.v1 (and the HTTP API) through `front` and admin.v1 through `admin`
/// until SIGTERM.
pub async fn serve<A: Admin>(front: Arc<FrontEnd>, admin: A, opts: ServeOptions) -> anyhow::Result<()> {
    let mut opts = opts;
    let (grpc, http_listener) = match opts.bound.take() {
        Some(l) => (Some(l.grpc), l.http),
        None => (None, None),
    };
    let listener = match grpc {
        Some(l) => TcpListener::from_std(l)?,
        None => TcpListener::bind(opts.listen)
            .await
            .with_context(|| format!("cannot listen on {}", opts.listen))?,
    };
    let addr = listener.local_addr()?;
    let names: Vec<String> = front.models().all().iter().map(|m| m.name.clone()).collect();

    let (health_reporter, health) = tonic_health::server::health_reporter();
    health_reporter.set_serving::<InferenceServer<InferenceService>>().await;
    // Reflection in both versions: many clients (Python's official one among them) speak
    // only v1alpha.
    let reflection_builder = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(strata_proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    let reflection = reflection_builder().build_v1().context("building the reflection service")?;
    let reflection_alpha =
        reflection_builder().build_v1alpha().context("building the v1alpha reflection service")?;

    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let http = match &opts.http {
        Some(h) => {
            let auth = opts.client_auth.clone();
            Some(
                RunningHttp::start(h, http_listener, front.clone(), auth, (opts.role.name(), &opts.id))
                    .await?,
            )
        }
        None => None,
    };
    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = opts.tls.clone() {
        builder = builder.tls_config(tls).context("caller TLS (--tls-cert, --tls-key, --tls-client-ca)")?;
    }
    // Connections that make no call in time are closed, and at the cap an idle one makes
    // room (strata_common::conn_calls).
    let listener = strata_common::conn_limits::LimitedListener::new(
        listener,
        strata_common::conn_limits::ConnLimits::grpc(),
    );
    let server = builder
        .max_concurrent_streams(Some(MAX_CONCURRENT_STREAMS))
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(Duration::from_secs(10)))
        .layer(strata_common::grpc_metrics::GrpcMetricsLayer)
        .layer(listener.calls_layer())
        .add_service(health)
        .add_service(reflection)
        .add_service(reflection_alpha)
        .add_service(InferenceServer::with_interceptor(
            InferenceService::new(front.clone()),
            CallerLayer(opts.client_auth),
        ))
        .add_service(AdminServer::new(admin))
        .serve_with_incoming_shutdown(listener.incoming(), async {
            let _ = stop_rx.await;
        });
    info!(address = %addr, models = %names.join(","), "{} ready, listening on {addr}", opts.role.log_name());
    let address = addr.to_string();
    announce(&Announcement { event: "ready", role: opts.role.name(), address: &address, id: &opts.id });

    let mut server = std::pin::pin!(server);
    tokio::select! {
        res = &mut server => return res.context("gRPC server failed"),
        _ = strata_common::shutdown::signal() => {}
    }
    info!(drain_timeout_s = opts.drain_timeout.as_secs_f64(), "shutting down: draining in-flight calls");
    health_reporter.set_not_serving::<InferenceServer<InferenceService>>().await;
    let _ = stop_tx.send(());
    let http_done = async {
        if let Some(h) = http {
            h.drain().await;
        }
    };
    match tokio::time::timeout(opts.drain_timeout, async { tokio::join!(server, http_done).0 }).await {
        Ok(res) => res.context("gRPC server failed while draining")?,
        Err(_) => warn!("drain timeout reached; closing the remaining calls"),
    }
    info!("stopped");
    Ok(())
}
