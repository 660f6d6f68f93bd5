//! A process's telemetry: its `tracing` subscriber (logs on stderr as text or JSON) and,
//! when `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set, the
//! export of its spans over OTLP/gRPC.
//!
//! The standard OpenTelemetry environment variables apply: `OTEL_SERVICE_NAME` and
//! `OTEL_RESOURCE_ATTRIBUTES` name the process, `OTEL_BSP_*` tune batching,
//! `OTEL_TRACES_SAMPLER` / `OTEL_TRACES_SAMPLER_ARG` sample. `RUST_LOG` filters the logs;
//! `STRATA_TRACES_FILTER` (default [`TRACES_FILTER`]) filters the spans exported. The
//! request path's inner spans (attempts, the sequence's stages, steps, ranks' steps) are
//! at debug level: exported by default, but never made at all when nothing exports them
//! (the logs at `info` do not need them). The exporter runs
//! on a one-thread runtime of its own, so the process's own runtime (if any) does not
//! need to exist yet, and a stalled collector never blocks a request: spans wait in a
//! bounded queue and are dropped when it is full.

use std::io::IsTerminal;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// How log lines are written.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines (coloured on a terminal).
    #[default]
    Text,
    /// One JSON object per line, with the current span and its parents (whose fields
    /// include `trace_id` on request spans).
    Json,
}

impl std::str::FromStr for LogFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "text" => Ok(LogFormat::Text),
            "json" => Ok(LogFormat::Json),
            other => Err(format!("log format {other:?}: use text or json")),
        }
    }
}

/// The spans exported unless `STRATA_TRACES_FILTER` says otherwise: every process's info
/// spans and the request path's debug ones (not the per-all-reduce trace spans).
pub const TRACES_FILTER: &str = "info,strata_coordinator=debug,strata_worker=debug,strata_engine=debug";

/// Keeps the exporter running; flushes the spans still queued when dropped.
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Some(p) = self.provider.take() {
            let _ = p.shutdown();
        }
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_timeout(std::time::Duration::from_secs(2));
        }
    }
}

/// Whether the environment asks for span export.
pub fn export_requested() -> bool {
    ["OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
        .iter()
        .any(|v| std::env::var(v).is_ok_and(|s| !s.trim().is_empty()))
}

/// Installs the process's subscriber. `service` names the process when
/// `OTEL_SERVICE_NAME` does not. Errors name what to fix (a bad filter, an exporter that
/// cannot be built).
pub fn init(service: &str, format: LogFormat) -> Result<Telemetry, String> {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let logs = match format {
        LogFormat::Text => tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(std::io::stderr().is_terminal())
            .with_filter(filter)
            .boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .json()
            .with_current_span(true)
            .with_span_list(true)
            .with_writer(std::io::stderr)
            .with_filter(filter)
            .boxed(),
    };
    let mut telemetry = Telemetry { provider: None, runtime: None };
    let traces = if export_requested() {
        let (provider, runtime) = exporter(service)?;
        let filter = std::env::var("STRATA_TRACES_FILTER").unwrap_or_else(|_| TRACES_FILTER.into());
        let filter =
            EnvFilter::try_new(&filter).map_err(|e| format!("STRATA_TRACES_FILTER {filter:?}: {e}"))?;
        let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("strata")).with_filter(filter);
        telemetry.provider = Some(provider);
        telemetry.runtime = Some(runtime);
        Some(layer)
    } else {
        None
    };
    opentelemetry::global::set_text_map_propagator(
        opentelemetry_sdk::propagation::TraceContextPropagator::new(),
    );
    tracing_subscriber::registry()
        .with(logs)
        .with(traces)
        .try_init()
        .map_err(|e| format!("installing the tracing subscriber: {e}"))?;
    Ok(telemetry)
}

fn exporter(service: &str) -> Result<(SdkTracerProvider, tokio::runtime::Runtime), String> {
    use opentelemetry_sdk::trace::span_processor_with_async_runtime::BatchSpanProcessor;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("otlp-export")
        .enable_all()
        .build()
        .map_err(|e| format!("starting the span exporter's runtime: {e}"))?;
    let _entered = runtime.enter();
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .build()
        .map_err(|e| format!("the OTLP span exporter (OTEL_EXPORTER_OTLP_ENDPOINT): {e}"))?;
    let processor = BatchSpanProcessor::builder(exporter, opentelemetry_sdk::runtime::Tokio).build();
    let mut resource = opentelemetry_sdk::Resource::builder();
    if std::env::var("OTEL_SERVICE_NAME").is_err() {
        resource = resource.with_service_name(service.to_string());
    }
    let provider =
        SdkTracerProvider::builder().with_span_processor(processor).with_resource(resource.build()).build();
    Ok((provider, runtime))
}
