//! The process's metrics: one registry every crate registers into, and its text
//! exposition (OpenMetrics, which Prometheus scrapes).
//!
//! Metrics live next to what they measure (the coordinator's request metrics in its
//! request path, the engine's in the engine); they register here on first use under the
//! `strata_` prefix. The `prometheus-client` crate does the types and the encoding.

use std::sync::{Mutex, OnceLock};

use prometheus_client::registry::{Metric, Registry};

static REGISTRY: OnceLock<Mutex<Registry>> = OnceLock::new();

fn registry() -> &'static Mutex<Registry> {
    REGISTRY.get_or_init(|| Mutex::new(Registry::with_prefix("strata")))
}

/// Registers `metric` as `strata_<name>` (counters get `_total` in the exposition).
pub fn register(name: &str, help: &str, metric: impl Metric) {
    registry().lock().unwrap_or_else(|p| p.into_inner()).register(name, help, metric);
}

/// The exposition's content type.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Every registered metric in the OpenMetrics text format.
pub fn encode() -> String {
    let mut out = String::new();
    let registry = registry().lock().unwrap_or_else(|p| p.into_inner());
    if prometheus_client::encoding::text::encode(&mut out, &registry).is_err() {
        out.clear();
    }
    out
}

/// Time to first token (seconds): vLLM's buckets, with finer ones below 10 ms for small
/// models on fast hardware.
pub const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];

/// Inter-token latency (seconds): vLLM's buckets, finer below 10 ms.
pub const ITL_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
];

/// End-to-end request latency (seconds): vLLM's buckets, finer below 0.3 s.
pub const E2E_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
];
