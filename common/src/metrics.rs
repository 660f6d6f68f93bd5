//! The process's metrics: one registry every crate registers into, and its text
//! exposition (OpenMetrics, which Prometheus scrapes).
//!
//! Metrics live next to what they measure (the coordinator's request metrics in its
//! request path, the engine's in the engine); they register here on first use under the
//! `strata_` prefix; the process's own (CPU, memory, file descriptors) are read on each
//! scrape under the usual unprefixed `process_` names. The `prometheus-client` crate does
//! the types and the encoding.

use std::sync::{Mutex, OnceLock};

use prometheus_client::registry::{Metric, Registry};

pub mod process;

static REGISTRY: OnceLock<Mutex<Registry>> = OnceLock::new();

fn registry() -> &'static Mutex<Registry> {
    REGISTRY.get_or_init(|| Mutex::new(Registry::with_prefix("strata")))
}

/// The unprefixed metrics every Prometheus client library exports: the process's.
fn process_registry() -> &'static Registry {
    static PROCESS: OnceLock<Registry> = OnceLock::new();
    PROCESS.get_or_init(|| {
        let mut r = Registry::default();
        r.register_collector(Box::new(process::ProcessCollector));
        r
    })
}

/// Registers `metric` as `strata_<name>` (counters get `_total` in the exposition).
pub fn register(name: &str, help: &str, metric: impl Metric) {
    registry().lock().unwrap_or_else(|p| p.into_inner()).register(name, help, metric);
}

type Forget = Box<dyn Fn(&str) + Send + Sync>;

fn forgetters() -> &'static Mutex<Vec<Forget>> {
    static FORGET: OnceLock<Mutex<Vec<Forget>>> = OnceLock::new();
    FORGET.get_or_init(Default::default)
}

/// Registers how a family removes the series of one model, for [`forget_model`] (each
/// family labelled by model registers this once, where it is made).
pub fn on_forget_model(forget: impl Fn(&str) + Send + Sync + 'static) {
    forgetters().lock().unwrap_or_else(|p| p.into_inner()).push(Box::new(forget));
}

/// Removes every series of `model` (undeployed), so the exposition lists what is served.
pub fn forget_model(model: &str) {
    for forget in forgetters().lock().unwrap_or_else(|p| p.into_inner()).iter() {
        forget(model);
    }
}

/// The exposition's content type.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Every registered metric in the OpenMetrics text format.
pub fn encode() -> String {
    use prometheus_client::encoding::text::{encode_eof, encode_registry};
    let mut out = String::new();
    let registry = registry().lock().unwrap_or_else(|p| p.into_inner());
    let encoded = encode_registry(&mut out, &registry)
        .and_then(|()| encode_registry(&mut out, process_registry()))
        .and_then(|()| encode_eof(&mut out));
    if encoded.is_err() {
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
