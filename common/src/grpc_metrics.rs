//! gRPC server metrics in the usual shape (go-grpc-prometheus): calls started by service
//! and method, calls handled by service, method and status code, and handling time from
//! the request's arrival to the response's last frame (the whole stream for streaming
//! calls).
//!
//! [`GrpcMetricsLayer`] is a tower layer in front of a tonic server. The status code comes
//! from the response's trailers (or its headers, for a trailers-only error); a response
//! whose caller went away before the end counts as `CANCELLED`. Method names come from
//! the caller's request path, so they are bounded: a path that is not one of Strata's
//! methods (read from its protos' descriptors, plus gRPC health and reflection) is
//! labelled `other` — junk paths from an unauthenticated caller cannot crowd real methods
//! out of their labels.

use std::collections::HashSet;
use std::pin::Pin;
use std::sync::OnceLock;
use std::task::{Context, Poll};
use std::time::Instant;

use futures::future::BoxFuture;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use tonic::body::Body;
use tonic::codegen::http;

use crate::metrics::register;

/// Every method Strata's servers serve, as request paths (`/package.Service/Method`).
fn known_methods() -> &'static HashSet<String> {
    static KNOWN: OnceLock<HashSet<String>> = OnceLock::new();
    KNOWN.get_or_init(|| {
        use prost::Message;
        let mut known: HashSet<String> = [
            "/grpc.health.v1.Health/Check",
            "/grpc.health.v1.Health/Watch",
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
        ]
        .into_iter()
        .map(String::from)
        .collect();
        let set =
            prost_types::FileDescriptorSet::decode(strata_proto::FILE_DESCRIPTOR_SET).unwrap_or_default();
        for file in set.file {
            let package = file.package.unwrap_or_default();
            for service in file.service {
                let name = service.name.unwrap_or_default();
                for method in service.method {
                    known.insert(format!("/{package}.{name}/{}", method.name.unwrap_or_default()));
                }
            }
        }
        known
    })
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MethodLabels {
    grpc_service: String,
    grpc_method: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HandledLabels {
    grpc_service: String,
    grpc_method: String,
    grpc_code: &'static str,
}

struct GrpcMetrics {
    started: Family<MethodLabels, Counter>,
    handled: Family<HandledLabels, Counter>,
    handling: Family<MethodLabels, Histogram, fn() -> Histogram>,
}

fn handling() -> Histogram {
    Histogram::new([
        0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
        300.0,
    ])
}

fn metrics() -> &'static GrpcMetrics {
    static METRICS: OnceLock<GrpcMetrics> = OnceLock::new();
    METRICS.get_or_init(|| {
        let m = GrpcMetrics {
            started: Family::default(),
            handled: Family::default(),
            handling: Family::new_with_constructor(handling),
        };
        register("grpc_server_started", "gRPC calls started, by service and method", m.started.clone());
        register(
            "grpc_server_handled",
            "gRPC calls completed, by service, method and status code",
            m.handled.clone(),
        );
        register(
            "grpc_server_handling_seconds",
            "Time from a gRPC call's arrival to its response's last frame",
            m.handling.clone(),
        );
        m
    })
}

/// The labels for request path `path`, bounded as the module says.
fn method_labels(path: &str) -> MethodLabels {
    let known = known_methods().contains(path);
    match path.strip_prefix('/').and_then(|p| p.split_once('/')).filter(|_| known) {
        Some((service, method)) => MethodLabels { grpc_service: service.into(), grpc_method: method.into() },
        None => MethodLabels { grpc_service: "other".into(), grpc_method: "other".into() },
    }
}

/// The canonical name of a gRPC status code, as the `grpc_code` label spells it.
pub fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match code {
        Ok => "OK",
        Cancelled => "CANCELLED",
        Unknown => "UNKNOWN",
        InvalidArgument => "INVALID_ARGUMENT",
        DeadlineExceeded => "DEADLINE_EXCEEDED",
        NotFound => "NOT_FOUND",
        AlreadyExists => "ALREADY_EXISTS",
        PermissionDenied => "PERMISSION_DENIED",
        ResourceExhausted => "RESOURCE_EXHAUSTED",
        FailedPrecondition => "FAILED_PRECONDITION",
        Aborted => "ABORTED",
        OutOfRange => "OUT_OF_RANGE",
        Unimplemented => "UNIMPLEMENTED",
        Internal => "INTERNAL",
        Unavailable => "UNAVAILABLE",
        DataLoss => "DATA_LOSS",
        Unauthenticated => "UNAUTHENTICATED",
    }
}

/// The status a response carries in its headers (a trailers-only response), if any.
pub(crate) fn status_in(headers: &http::HeaderMap) -> Option<tonic::Code> {
    let v = headers.get("grpc-status")?.to_str().ok()?.parse::<i32>().ok()?;
    Some(tonic::Code::from_i32(v))
}

/// Counts calls and times them; see the module.
#[derive(Clone, Copy, Default)]
pub struct GrpcMetricsLayer;

impl<S> tower::Layer<S> for GrpcMetricsLayer {
    type Service = Metered<S>;
    fn layer(&self, inner: S) -> Metered<S> {
        Metered { inner }
    }
}

#[derive(Clone)]
pub struct Metered<S> {
    inner: S,
}

impl<S, B> tower::Service<http::Request<B>> for Metered<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<Body>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future = BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let labels = method_labels(req.uri().path());
        metrics().started.get_or_create(&labels).inc();
        let call = Call { labels, started: Instant::now(), code: None };
        let response = self.inner.call(req);
        Box::pin(async move {
            let mut call = call;
            let response = response.await?;
            call.code = status_in(response.headers());
            Ok(response.map(|inner| Body::new(MeteredBody { inner, call: Some(call) })))
        })
    }
}

/// One call being measured; recorded once, when its response ends.
struct Call {
    labels: MethodLabels,
    started: Instant,
    /// A status already in the response headers (a trailers-only response).
    code: Option<tonic::Code>,
}

impl Call {
    fn finish(self, code: tonic::Code) {
        let m = metrics();
        m.handling.get_or_create(&self.labels).observe(self.started.elapsed().as_secs_f64());
        let MethodLabels { grpc_service, grpc_method } = self.labels;
        let handled = HandledLabels { grpc_service, grpc_method, grpc_code: code_name(code) };
        m.handled.get_or_create(&handled).inc();
    }
}

/// A response body that records its call when its last frame passes (or when it is
/// dropped before that: the caller went away).
struct MeteredBody {
    inner: Body,
    call: Option<Call>,
}

impl http_body::Body for MeteredBody {
    type Data = bytes::Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        let code = match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                frame.trailers_ref().map(|t| status_in(t).unwrap_or(tonic::Code::Ok))
            }
            Poll::Ready(Some(Err(status))) => Some(status.code()),
            Poll::Ready(None) => Some(self.call.as_ref().and_then(|c| c.code).unwrap_or(tonic::Code::Ok)),
            Poll::Pending => None,
        };
        if let Some(code) = code {
            if let Some(call) = self.call.take() {
                call.finish(code);
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for MeteredBody {
    fn drop(&mut self) {
        if let Some(call) = self.call.take() {
            let code = call.code.unwrap_or(tonic::Code::Cancelled);
            call.finish(code);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn method_labels_are_bounded() {
        let l = method_labels("/strata.inference.v1.Inference/Generate");
        assert_eq!(
            (l.grpc_service.as_str(), l.grpc_method.as_str()),
            ("strata.inference.v1.Inference", "Generate")
        );
        for bad in ["", "/", "/x", "//y", "/a b/c", "/a/b/c", &format!("/{}/m", "s".repeat(200))] {
            assert_eq!(method_labels(bad).grpc_service, "other", "{bad:?}");
        }
        // Junk paths, however many, are `other`; real methods keep their names after them.
        for i in 0..1000 {
            assert_eq!(method_labels(&format!("/flood.Svc/M{i}")).grpc_method, "other");
            assert_eq!(method_labels(&format!("/strata.admin.v1.Admin/Junk{i}")).grpc_method, "other");
        }
        assert_eq!(method_labels("/strata.admin.v1.Admin/ListAudit").grpc_method, "ListAudit");
        assert_eq!(method_labels("/strata.worker.v1.Worker/LoadShard").grpc_method, "LoadShard");
        assert_eq!(method_labels("/grpc.health.v1.Health/Check").grpc_service, "grpc.health.v1.Health");
    }
}
