//! `GET /metrics` over HTTP: the process's metrics for Prometheus to scrape
//! (`--metrics-listen`; `off` disables it).

use std::net::SocketAddr;

use anyhow::Context;
use axum::routing::get;
use strata_common::ready::{announce, Announcement};

/// Where `--metrics-listen` says to serve, or None for `off`.
pub fn parse_listen(value: &str) -> anyhow::Result<Option<SocketAddr>> {
    if value == "off" {
        return Ok(None);
    }
    value.parse().map(Some).with_context(|| format!("--metrics-listen {value:?}: give HOST:PORT or off"))
}

/// Serves `/metrics` on `listen` in the background and announces the bound address on
/// stdout (`{"event":"metrics",…}`). Must run inside the Tokio runtime.
pub async fn serve(listen: SocketAddr, role: &'static str) -> anyhow::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("--metrics-listen {listen}: cannot listen"))?;
    let bound = listener.local_addr()?;
    let app = axum::Router::new().route(
        "/metrics",
        get(|| async {
            (
                [(axum::http::header::CONTENT_TYPE, strata_common::metrics::CONTENT_TYPE)],
                strata_common::metrics::encode(),
            )
        }),
    );
    // The same connection caps and header deadline as the HTTP API: the metrics port must
    // keep answering however many idle connections arrive.
    let listener = strata_common::conn_limits::LimitedListener::new(listener, Default::default());
    tokio::spawn(async move {
        if let Err(e) = strata_coordinator::api::http::serve(listener, app, std::future::pending()).await {
            tracing::warn!("the metrics endpoint stopped: {e}");
        }
    });
    tracing::info!("metrics on http://{bound}/metrics");
    announce(&Announcement { event: "metrics", role, address: &bound.to_string(), id: "" });
    Ok(bound)
}
