//! W3C trace context (`traceparent`, `tracestate`) carried across processes, so one
//! request is one trace: caller → coordinator → worker → every rank.
//!
//! Every crate calls these helpers; they do their work when the process's telemetry
//! (feature `telemetry`, which the `strata` binary enables) is compiled in, and nothing
//! otherwise (the engine's own tests, say). What a peer sends is checked before use: a
//! `traceparent` that is not the W3C format is ignored, a `tracestate` is capped.

use tracing::Span;

/// Longest `tracestate` carried (W3C allows 32 members of up to 256 bytes; 512 bytes
/// keeps the common cases and bounds what a caller can make us copy).
pub const MAX_TRACESTATE: usize = 512;

/// A span's context as W3C headers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TraceContext {
    pub traceparent: String,
    pub tracestate: String,
}

impl TraceContext {
    /// The context a peer sent, if `traceparent` is well-formed (`00-<32 hex>-<16 hex>-<2 hex>`,
    /// trace and parent ids not all zero).
    pub fn from_headers(traceparent: Option<&str>, tracestate: Option<&str>) -> Option<TraceContext> {
        let tp = traceparent?.trim();
        let parts: Vec<&str> = tp.split('-').collect();
        let hex = |s: &str, n: usize| {
            s.len() == n && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        };
        let [version, trace, parent, flags] = parts.as_slice() else { return None };
        let ok = hex(version, 2)
            && *version != "ff"
            && hex(trace, 32)
            && hex(parent, 16)
            && hex(flags, 2)
            && trace.bytes().any(|b| b != b'0')
            && parent.bytes().any(|b| b != b'0');
        if !ok {
            return None;
        }
        let state = tracestate.unwrap_or("").trim();
        let state = if state.len() <= MAX_TRACESTATE && state.is_ascii() { state } else { "" };
        Some(TraceContext { traceparent: tp.to_string(), tracestate: state.to_string() })
    }

    /// The 32-hex trace id.
    pub fn trace_id(&self) -> &str {
        self.traceparent.split('-').nth(1).unwrap_or("")
    }
}

/// The context a gRPC caller sent in its metadata, if well-formed.
#[cfg(feature = "grpc")]
pub fn from_metadata(m: &tonic::metadata::MetadataMap) -> Option<TraceContext> {
    let get = |k: &str| m.get(k).and_then(|v| v.to_str().ok());
    TraceContext::from_headers(get("traceparent"), get("tracestate"))
}

/// Puts `span`'s context into outgoing gRPC metadata (when spans are recorded).
#[cfg(feature = "grpc")]
pub fn inject(span: &Span, m: &mut tonic::metadata::MetadataMap) {
    let Some(cx) = context_of(span) else { return };
    if let Ok(v) = cx.traceparent.parse() {
        m.insert("traceparent", v);
    }
    if let Ok(v) = cx.tracestate.parse() {
        if !cx.tracestate.is_empty() {
            m.insert("tracestate", v);
        }
    }
}

/// Makes `span` a child of the remote context `cx` (no-op without telemetry).
pub fn set_parent(span: &Span, cx: &TraceContext) {
    #[cfg(feature = "telemetry")]
    {
        use opentelemetry::propagation::TextMapPropagator;
        use tracing_opentelemetry::OpenTelemetrySpanExt;
        let mut carrier = std::collections::HashMap::new();
        carrier.insert("traceparent".to_string(), cx.traceparent.clone());
        if !cx.tracestate.is_empty() {
            carrier.insert("tracestate".to_string(), cx.tracestate.clone());
        }
        let parent = opentelemetry_sdk::propagation::TraceContextPropagator::new().extract(&carrier);
        let _ = span.set_parent(parent);
    }
    #[cfg(not(feature = "telemetry"))]
    let _ = (span, cx);
}

/// `span`'s context to send to a peer, when spans are being recorded.
pub fn context_of(span: &Span) -> Option<TraceContext> {
    #[cfg(feature = "telemetry")]
    {
        use opentelemetry::propagation::TextMapPropagator;
        use opentelemetry::trace::TraceContextExt;
        use tracing_opentelemetry::OpenTelemetrySpanExt;
        if span.is_disabled() {
            return None;
        }
        let cx = span.context();
        if !cx.span().span_context().is_valid() {
            return None;
        }
        let mut carrier = std::collections::HashMap::new();
        opentelemetry_sdk::propagation::TraceContextPropagator::new().inject_context(&cx, &mut carrier);
        let traceparent = carrier.remove("traceparent")?;
        Some(TraceContext { traceparent, tracestate: carrier.remove("tracestate").unwrap_or_default() })
    }
    #[cfg(not(feature = "telemetry"))]
    {
        let _ = span;
        None
    }
}

/// The trace id `span` belongs to (32 hex digits), when spans are recorded.
pub fn trace_id(span: &Span) -> Option<String> {
    context_of(span).map(|cx| cx.trace_id().to_string())
}

/// Sets a string-array attribute of `span` (the GenAI conventions' finish reasons); no-op
/// without telemetry.
pub fn set_strings(span: &Span, key: &'static str, values: &[&str]) {
    #[cfg(feature = "telemetry")]
    {
        use tracing_opentelemetry::OpenTelemetrySpanExt;
        let values: Vec<opentelemetry::StringValue> = values.iter().map(|v| v.to_string().into()).collect();
        span.set_attribute(key, opentelemetry::Value::Array(values.into()));
    }
    #[cfg(not(feature = "telemetry"))]
    let _ = (span, key, values);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_well_formed_traceparents_are_taken() {
        let good = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let cx = TraceContext::from_headers(Some(good), Some("vendor=1")).unwrap();
        assert_eq!(cx.trace_id(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(cx.tracestate, "vendor=1");
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e47-00f067aa0ba902b7-01",
        ] {
            assert!(TraceContext::from_headers(Some(bad), None).is_none(), "{bad:?}");
        }
        let long = "k=".to_string() + &"v".repeat(MAX_TRACESTATE);
        assert_eq!(TraceContext::from_headers(Some(good), Some(&long)).unwrap().tracestate, "");
    }
}
