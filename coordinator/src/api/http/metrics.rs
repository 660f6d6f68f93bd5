//! The HTTP API's own metrics: requests by route, method and status, and the time to the
//! response's head (a stream's tokens are timed by the request metrics). Routes are the
//! router's templates (`/v1/batches/{id}`), so callers cannot grow the label set.

use std::sync::OnceLock;
use std::time::Instant;

use axum::extract::{MatchedPath, Request};
use axum::middleware::Next;
use axum::response::Response;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use strata_common::metrics::register;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    route: String,
    method: String,
    status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteLabels {
    route: String,
}

struct HttpMetrics {
    requests: Family<RequestLabels, Counter>,
    duration: Family<RouteLabels, Histogram, fn() -> Histogram>,
}

fn duration() -> Histogram {
    Histogram::new([
        0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    ])
}

fn metrics() -> &'static HttpMetrics {
    static METRICS: OnceLock<HttpMetrics> = OnceLock::new();
    METRICS.get_or_init(|| {
        let m = HttpMetrics { requests: Family::default(), duration: Family::new_with_constructor(duration) };
        register("http_requests", "HTTP API requests, by route, method and status", m.requests.clone());
        register(
            "http_request_duration_seconds",
            "Time from an HTTP API request's arrival to its response's head, by route",
            m.duration.clone(),
        );
        m
    })
}

/// Middleware: counts and times every request.
pub async fn track(request: Request, next: Next) -> Response {
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "(unmatched)".to_string(), |p| p.as_str().to_string());
    let method = request.method().as_str().to_string();
    let method = if matches!(method.as_str(), "GET" | "POST" | "DELETE") { method } else { "other".into() };
    let started = Instant::now();
    let response = next.run(request).await;
    let m = metrics();
    m.duration.get_or_create(&RouteLabels { route: route.clone() }).observe(started.elapsed().as_secs_f64());
    m.requests.get_or_create(&RequestLabels { route, method, status: response.status().as_u16() }).inc();
    response
}
