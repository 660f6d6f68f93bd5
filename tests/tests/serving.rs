//! `strata serve` end to end: gRPC, the HTTP API with third-party clients, security, tenants, batches, rollouts, metrics, traces.
//!
//! One test binary of several modules (one per former file): each binary links the
//! whole dependency graph, so fewer of them build faster.

#[path = "serving_suite/batch.rs"]
mod batch;
#[path = "serving_suite/embeddings.rs"]
mod embeddings;
#[path = "serving_suite/hardening.rs"]
mod hardening;
#[path = "serving_suite/http_api.rs"]
mod http_api;
#[path = "serving_suite/metrics.rs"]
mod metrics;
#[path = "serving_suite/prompt_logprobs.rs"]
mod prompt_logprobs;
#[path = "serving_suite/rollouts.rs"]
mod rollouts;
#[path = "serving_suite/serve.rs"]
mod serve;
#[path = "serving_suite/serve_security.rs"]
mod serve_security;
#[path = "serving_suite/structured.rs"]
mod structured;
#[path = "serving_suite/tenants.rs"]
mod tenants;
#[path = "serving_suite/traces.rs"]
mod traces;
