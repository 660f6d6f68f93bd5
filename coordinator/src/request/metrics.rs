//! What the coordinator measures of each request, by model: latency histograms (time to
//! first token, inter-token, end to end), requests by finish reason and errors by status
//! code, prompt and generated tokens, and failovers (streams resumed on another replica).

use std::sync::OnceLock;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use strata_common::metrics::{register, E2E_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS};
use strata_common::{Error, FinishReason};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelLabel {
    pub model: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FinishLabels {
    pub model: String,
    pub finish_reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    pub model: String,
    pub code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RevisionLabels {
    pub model: String,
    pub revision: String,
}

type Histograms = Family<ModelLabel, Histogram, fn() -> Histogram>;

pub struct RequestMetrics {
    pub requests: Family<FinishLabels, Counter>,
    pub errors: Family<ErrorLabels, Counter>,
    pub time_to_first_token: Histograms,
    pub inter_token_latency: Histograms,
    pub e2e_latency: Histograms,
    pub prompt_tokens: Family<ModelLabel, Counter>,
    pub generation_tokens: Family<ModelLabel, Counter>,
    pub failovers: Family<ModelLabel, Counter>,
    pub revisions: Family<RevisionLabels, Counter>,
    /// The revisions each model was served by (to forget their series with the model).
    revisions_seen: std::sync::Mutex<std::collections::HashMap<String, std::collections::BTreeSet<u64>>>,
}

fn ttft() -> Histogram {
    Histogram::new(TTFT_BUCKETS.iter().copied())
}

fn itl() -> Histogram {
    Histogram::new(ITL_BUCKETS.iter().copied())
}

fn e2e() -> Histogram {
    Histogram::new(E2E_BUCKETS.iter().copied())
}

/// The coordinator's request metrics, registered on first use.
pub fn metrics() -> &'static RequestMetrics {
    static METRICS: OnceLock<RequestMetrics> = OnceLock::new();
    METRICS.get_or_init(|| {
        let m = RequestMetrics {
            requests: Family::default(),
            errors: Family::default(),
            time_to_first_token: Family::new_with_constructor(ttft as fn() -> Histogram),
            inter_token_latency: Family::new_with_constructor(itl as fn() -> Histogram),
            e2e_latency: Family::new_with_constructor(e2e as fn() -> Histogram),
            prompt_tokens: Family::default(),
            generation_tokens: Family::default(),
            failovers: Family::default(),
            revisions: Family::default(),
            revisions_seen: Default::default(),
        };
        register("requests", "Requests finished, by model and finish reason", m.requests.clone());
        register(
            "request_errors",
            "Requests that ended in an error, by model and status code",
            m.errors.clone(),
        );
        register(
            "time_to_first_token_seconds",
            "Time from admission to the first token",
            m.time_to_first_token.clone(),
        );
        register(
            "inter_token_latency_seconds",
            "Time between consecutive tokens of a stream",
            m.inter_token_latency.clone(),
        );
        register(
            "e2e_request_latency_seconds",
            "Time from admission to the last token",
            m.e2e_latency.clone(),
        );
        register("prompt_tokens", "Prompt tokens of admitted requests", m.prompt_tokens.clone());
        register("generation_tokens", "Tokens generated and delivered", m.generation_tokens.clone());
        register(
            "failovers",
            "Streams resumed on another replica after theirs was lost",
            m.failovers.clone(),
        );
        register(
            "revision_requests",
            "Requests (and failover attempts) by the model revision that served them",
            m.revisions.clone(),
        );
        strata_common::metrics::on_forget_model(forget);
        m
    })
}

/// Counts a request (or a failover attempt) served by `revision` of `model` (a cached
/// response counts for the revision that made it).
pub fn served_by(model: &str, revision: u64) {
    let labels = RevisionLabels { model: model.to_string(), revision: revision.to_string() };
    let m = metrics();
    m.revisions.get_or_create(&labels).inc();
    let mut seen = m.revisions_seen.lock().unwrap_or_else(|p| p.into_inner());
    if !seen.get(model).is_some_and(|s| s.contains(&revision)) {
        seen.entry(model.to_string()).or_default().insert(revision);
    }
}

/// Every status code the `code` label takes.
const CODES: [&str; 9] = [
    "INVALID_ARGUMENT",
    "NOT_FOUND",
    "RESOURCE_EXHAUSTED",
    "UNAVAILABLE",
    "FAILED_PRECONDITION",
    "DEADLINE_EXCEEDED",
    "UNAUTHENTICATED",
    "PERMISSION_DENIED",
    "INTERNAL",
];

/// Removes the series of an undeployed model, so dashboards show what is served (a model
/// deployed again starts from zero, as a restarted process would).
fn forget(name: &str) {
    let m = metrics();
    let label = model(name);
    for h in [&m.time_to_first_token, &m.inter_token_latency, &m.e2e_latency] {
        h.remove(&label);
    }
    for c in [&m.prompt_tokens, &m.generation_tokens, &m.failovers] {
        c.remove(&label);
    }
    use FinishReason::*;
    for reason in [Length, Stop, Eos, Cancelled] {
        m.requests.remove(&FinishLabels { model: name.to_string(), finish_reason: reason.as_str().into() });
    }
    for code in CODES {
        m.errors.remove(&ErrorLabels { model: name.to_string(), code: code.into() });
    }
    let seen = m.revisions_seen.lock().unwrap_or_else(|p| p.into_inner()).remove(name).unwrap_or_default();
    for revision in seen {
        m.revisions.remove(&RevisionLabels { model: name.to_string(), revision: revision.to_string() });
    }
}

fn model(name: &str) -> ModelLabel {
    ModelLabel { model: name.to_string() }
}

/// The gRPC code name of an error's class, as the `code` label spells it.
fn code(e: &Error) -> &'static str {
    use strata_common::ErrorClass::*;
    // Each of these is in CODES.
    match e.class() {
        InvalidInput => "INVALID_ARGUMENT",
        NotFound => "NOT_FOUND",
        Overloaded => "RESOURCE_EXHAUSTED",
        Unavailable => "UNAVAILABLE",
        FailedPrecondition => "FAILED_PRECONDITION",
        DeadlineExceeded => "DEADLINE_EXCEEDED",
        Unauthenticated => "UNAUTHENTICATED",
        PermissionDenied => "PERMISSION_DENIED",
        Internal => "INTERNAL",
    }
}

/// One request's timeline, reported as it goes. The per-token metrics of its model are
/// looked up once, when it starts, not on every token.
pub struct RequestTimer {
    model: String,
    started: tokio::time::Instant,
    last_token: Option<tokio::time::Instant>,
    time_to_first_token: Histogram,
    inter_token_latency: Histogram,
    generation_tokens: Counter,
}

impl RequestTimer {
    /// Starts timing an admitted request of `prompt_tokens` tokens.
    pub fn start(model_name: &str, prompt_tokens: usize) -> Self {
        let m = metrics();
        let label = model(model_name);
        m.prompt_tokens.get_or_create(&label).inc_by(prompt_tokens as u64);
        // Present (at zero) from a model's first request, so dashboards and alerts see a
        // series before the first failover.
        m.failovers.get_or_create(&label).inc_by(0);
        RequestTimer {
            model: model_name.to_string(),
            started: tokio::time::Instant::now(),
            last_token: None,
            time_to_first_token: m.time_to_first_token.get_or_create(&label).clone(),
            inter_token_latency: m.inter_token_latency.get_or_create(&label).clone(),
            generation_tokens: m.generation_tokens.get_or_create(&label).clone(),
        }
    }

    /// A token reached the caller.
    pub fn token(&mut self) {
        let now = tokio::time::Instant::now();
        match self.last_token {
            None => self.time_to_first_token.observe(secs(now - self.started)),
            Some(prev) => self.inter_token_latency.observe(secs(now - prev)),
        }
        self.generation_tokens.inc();
        self.last_token = Some(now);
    }

    /// Time since admission.
    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    pub fn failover(&self) {
        metrics().failovers.get_or_create(&model(&self.model)).inc();
    }

    pub fn finished(&self, reason: FinishReason) {
        let m = metrics();
        let labels = FinishLabels { model: self.model.clone(), finish_reason: reason.as_str().to_string() };
        m.requests.get_or_create(&labels).inc();
        m.e2e_latency.get_or_create(&model(&self.model)).observe(secs(self.started.elapsed()));
    }

    pub fn failed(&self, e: &Error) {
        failed(&self.model, e);
    }
}

/// A request of `model_name` that ended in `e` (before or after admission).
pub fn failed(model_name: &str, e: &Error) {
    let labels = ErrorLabels { model: model_name.to_string(), code: code(e).to_string() };
    metrics().errors.get_or_create(&labels).inc();
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}
