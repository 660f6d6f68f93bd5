//! An OTLP/gRPC trace receiver for tests: the collector's `TraceService` (from the
//! OpenTelemetry project's own proto definitions) on a free loopback port, keeping every
//! span it is sent with the `service.name` of the process that sent it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue};

/// One received span, flattened.
#[derive(Debug, Clone)]
pub struct ReceivedSpan {
    pub service: String,
    pub name: String,
    pub trace_id: String,
    pub span_id: String,
    /// Empty for a root span.
    pub parent_span_id: String,
    pub attributes: HashMap<String, Value>,
}

impl ReceivedSpan {
    pub fn str(&self, key: &str) -> Option<&str> {
        match self.attributes.get(key)? {
            Value::StringValue(s) => Some(s),
            _ => None,
        }
    }

    pub fn int(&self, key: &str) -> Option<i64> {
        match self.attributes.get(key)? {
            Value::IntValue(i) => Some(*i),
            _ => None,
        }
    }

    pub fn float(&self, key: &str) -> Option<f64> {
        match self.attributes.get(key)? {
            Value::DoubleValue(f) => Some(*f),
            _ => None,
        }
    }

    /// A string-array attribute.
    pub fn strings(&self, key: &str) -> Option<Vec<String>> {
        let Value::ArrayValue(a) = self.attributes.get(key)? else { return None };
        a.values
            .iter()
            .map(|v| match &v.value {
                Some(Value::StringValue(s)) => Some(s.clone()),
                _ => None,
            })
            .collect()
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn attributes(kvs: &[KeyValue]) -> HashMap<String, Value> {
    kvs.iter()
        .filter_map(|kv| Some((kv.key.clone(), kv.value.as_ref().and_then(|v: &AnyValue| v.value.clone())?)))
        .collect()
}

#[derive(Clone, Default)]
struct Store(Arc<Mutex<Vec<ReceivedSpan>>>);

#[tonic::async_trait]
impl TraceService for Store {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut spans = self.0.lock().unwrap();
        for rs in request.into_inner().resource_spans {
            let resource = rs.resource.map(|r| attributes(&r.attributes)).unwrap_or_default();
            let service = match resource.get("service.name") {
                Some(Value::StringValue(s)) => s.clone(),
                _ => String::new(),
            };
            for span in rs.scope_spans.into_iter().flat_map(|s| s.spans) {
                spans.push(ReceivedSpan {
                    service: service.clone(),
                    name: span.name,
                    trace_id: hex(&span.trace_id),
                    span_id: hex(&span.span_id),
                    parent_span_id: hex(&span.parent_span_id),
                    attributes: attributes(&span.attributes),
                });
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse { partial_success: None }))
    }
}

/// The receiver; stops when dropped.
pub struct OtlpReceiver {
    pub endpoint: String,
    store: Store,
    task: tokio::task::JoinHandle<()>,
}

impl OtlpReceiver {
    pub async fn start() -> OtlpReceiver {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind the OTLP receiver");
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        let store = Store::default();
        let server = tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(store.clone()))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener));
        let task = tokio::spawn(async move {
            let _ = server.await;
        });
        OtlpReceiver { endpoint, store, task }
    }

    /// Every span received so far.
    pub fn all(&self) -> Vec<ReceivedSpan> {
        self.store.0.lock().unwrap().clone()
    }

    /// Every span received so far of trace `trace_id`.
    pub fn trace(&self, trace_id: &str) -> Vec<ReceivedSpan> {
        self.store.0.lock().unwrap().iter().filter(|s| s.trace_id == trace_id).cloned().collect()
    }
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}
