//! A request's span: the root of its trace in this process (or a child of the caller's
//! `traceparent`), with the OpenTelemetry GenAI semantic-convention attributes (operation,
//! request model and sampling settings, usage, finish reasons, response id) and ours
//! (tenant, replica, ranks, failovers, whether it streams). Each attempt on a replica is a child
//! span; the worker's and every rank's spans hang below it.

use strata_common::trace::{self, TraceContext};
use strata_common::{FinishReason, SamplingParams};
use tracing::field::Empty;
use tracing::{debug_span, info_span, Span};

// Numbers are recorded as i64: the OpenTelemetry bridge exports i64 as integers (and
// unsigned values as text).

/// Longest model name put in a span name (the caller chose it; it may be no model at all).
const MAX_NAME: usize = 128;

/// The span of one generate call for `model` (as the caller named it).
pub fn request_span(model: &str, request_id: &str, stream: bool, caller: Option<&TraceContext>) -> Span {
    let mut name = model;
    if name.len() > MAX_NAME {
        let mut cut = MAX_NAME;
        while !name.is_char_boundary(cut) {
            cut -= 1;
        }
        name = &name[..cut];
    }
    let span = info_span!(
        "gen_ai.request",
        otel.name = %format_args!("text_completion {name}"),
        otel.kind = "server",
        otel.status_code = Empty,
        otel.status_message = Empty,
        request_id = %request_id,
        trace_id = Empty,
        gen_ai.operation.name = "text_completion",
        gen_ai.provider.name = "strata",
        gen_ai.request.model = %name,
        gen_ai.request.max_tokens = Empty,
        gen_ai.request.temperature = Empty,
        gen_ai.request.top_p = Empty,
        gen_ai.request.seed = Empty,
        gen_ai.response.id = %request_id,
        gen_ai.response.model = Empty,
        gen_ai.usage.input_tokens = Empty,
        gen_ai.usage.output_tokens = Empty,
        strata.stream = stream,
        strata.tenant = Empty,
        strata.replica = Empty,
        strata.ranks = Empty,
        strata.failovers = Empty,
    );
    if let Some(cx) = caller {
        trace::set_parent(&span, cx);
    }
    // The exported trace's id; without export, the caller's (logs still correlate).
    if let Some(id) = trace::trace_id(&span).or_else(|| caller.map(|c| c.trace_id().to_string())) {
        span.record("trace_id", id);
    }
    span
}

/// Records what admission settled: the served model, the sampling settings, prompt tokens.
pub fn admitted(span: &Span, model: &str, params: &SamplingParams, prompt_tokens: usize) {
    span.record("gen_ai.response.model", model);
    span.record("gen_ai.request.max_tokens", i64::from(params.max_new_tokens));
    span.record("gen_ai.request.temperature", f64::from(params.temperature));
    span.record("gen_ai.request.top_p", f64::from(params.top_p));
    if let Some(seed) = params.seed.and_then(|s| i64::try_from(s).ok()) {
        span.record("gen_ai.request.seed", seed);
    }
    span.record("gen_ai.usage.input_tokens", prompt_tokens as i64);
}

/// The span of one attempt on `replica` (a failover starts another).
pub fn attempt_span(parent: &Span, replica: &str, ranks: usize, attempt: usize) -> Span {
    if parent.is_none() {
        return Span::none();
    }
    debug_span!(parent: parent, "attempt", strata.replica = %replica, strata.ranks = ranks as i64, strata.attempt = attempt as i64)
}

/// Records the outcome: the replica that finished it, failovers, output tokens, and the
/// finish reason (or the error).
pub fn finished(
    span: &Span,
    replica: &str,
    ranks: usize,
    failovers: usize,
    output_tokens: usize,
    end: Result<FinishReason, &strata_common::Error>,
) {
    span.record("strata.replica", replica);
    span.record("strata.ranks", ranks as i64);
    span.record("strata.failovers", failovers as i64);
    span.record("gen_ai.usage.output_tokens", output_tokens as i64);
    match end {
        Ok(reason) => trace::set_strings(span, "gen_ai.response.finish_reasons", &[reason.as_str()]),
        Err(e) => {
            span.record("otel.status_code", "ERROR");
            span.record("otel.status_message", e.to_string());
        }
    }
}
