//! The etcd registry, through `etcd-client` (etcd's v3 gRPC API).
//!
//! Each call has a timeout, so an etcd that went away turns into a prompt `Unavailable`
//! error instead of a hang; callers keep their last known state and retry. The client
//! reconnects by itself when etcd returns. Create-if-absent and guarded commits are etcd
//! transactions (`create_revision == 0`, `value == guard`); a lease refresh is one
//! round-trip on a keep-alive stream, and a refresh answered with TTL 0 means the lease
//! lapsed.

use std::time::Duration;

use etcd_client::{
    Certificate, Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, Identity, PutOptions,
    TlsOptions, Txn, TxnOp, WatchOptions,
};
use futures::StreamExt;

use super::{Entry, Event, EventStream, Guard, LeaseId, Listing, Op, Registry};
use crate::config::EtcdSecurity;
use crate::error::{Error, Result};

/// How long one etcd call may take before it counts as unreachable.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(3);

pub struct EtcdRegistry {
    client: Client,
    endpoints: Vec<String>,
}

fn unavailable(endpoints: &[String], what: &str) -> impl FnOnce(etcd_client::Error) -> Error {
    let endpoints = endpoints.join(",");
    let what = what.to_string();
    move |e| Error::Unavailable(format!("etcd {endpoints} ({what}): {}", brief(&e)))
}

/// One line for an etcd client error: a gRPC status's code and message (tonic's own text
/// adds its metadata and details), a transport error with its causes.
fn brief(e: &etcd_client::Error) -> String {
    match e {
        etcd_client::Error::GRpcStatus(s) => {
            let message = s.message().lines().next().unwrap_or("").trim();
            match message.is_empty() {
                true => format!("{:?}", s.code()),
                false => format!("{:?}: {message}", s.code()),
            }
        }
        etcd_client::Error::TransportError(t) => {
            let mut text = t.to_string();
            let mut cause = std::error::Error::source(t);
            while let Some(c) = cause {
                text = format!("{text}: {c}");
                cause = c.source();
            }
            text
        }
        other => other.to_string().lines().next().unwrap_or("").to_string(),
    }
}

fn entry(kv: &etcd_client::KeyValue) -> Entry {
    Entry {
        key: String::from_utf8_lossy(kv.key()).into_owned(),
        value: kv.value().to_vec(),
        mod_revision: kv.mod_revision(),
        lease: (kv.lease() != 0).then_some(kv.lease()),
    }
}

impl EtcdRegistry {
    /// Connects to `endpoints` ("http://127.0.0.1:2379", or host:port). Fails only on a
    /// malformed endpoint; an etcd that is down is reported by the first call.
    pub async fn connect(endpoints: &[String]) -> Result<Self> {
        Self::connect_with(endpoints, &EtcdSecurity::default()).await
    }

    /// [`EtcdRegistry::connect`] over TLS (a CA for `https://` endpoints, a client
    /// certificate for `--client-cert-auth`) and with etcd's user authentication, whose
    /// token the client refreshes when it expires.
    pub async fn connect_with(endpoints: &[String], security: &EtcdSecurity) -> Result<Self> {
        if endpoints.is_empty() {
            return Err(Error::invalid("etcd", "no endpoint given"));
        }
        let mut opts = ConnectOptions::new()
            .with_timeout(CALL_TIMEOUT)
            .with_connect_timeout(CALL_TIMEOUT)
            .with_keep_alive(Duration::from_secs(2), Duration::from_secs(2))
            .with_keep_alive_while_idle(true);
        if security.ca.is_some() || security.cert.is_some() {
            let read = |p: &std::path::Path, field: &str| {
                std::fs::read(p).map_err(|e| Error::invalid(field, format!("{}: {e}", p.display())))
            };
            let mut tls = TlsOptions::new();
            if let Some(ca) = &security.ca {
                tls = tls.ca_certificate(Certificate::from_pem(read(ca, "registry.etcd_ca")?));
            }
            if let (Some(cert), Some(key)) = (&security.cert, &security.key) {
                tls = tls.identity(Identity::from_pem(
                    read(cert, "registry.etcd_cert")?,
                    read(key, "registry.etcd_key")?,
                ));
            }
            opts = opts.with_tls(tls);
        }
        if let Some((user, password)) = &security.user {
            opts = opts.with_user(user.clone(), password.clone()).with_auto_token_refresh(true);
        }
        let client = Client::connect(endpoints, Some(opts))
            .await
            .map_err(|e| Error::invalid("etcd", format!("{}: {e}", endpoints.join(","))))?;
        Ok(EtcdRegistry { client, endpoints: endpoints.to_vec() })
    }

    fn err(&self, what: &str) -> impl FnOnce(etcd_client::Error) -> Error {
        unavailable(&self.endpoints, what)
    }

    fn txn_op(op: Op) -> TxnOp {
        match op {
            Op::Put { key, value, lease } => {
                TxnOp::put(key, value, lease.map(|l| PutOptions::new().with_lease(l)))
            }
            Op::Delete { key } => TxnOp::delete(key, None),
        }
    }
}

#[async_trait::async_trait]
impl Registry for EtcdRegistry {
    fn kind(&self) -> &'static str {
        "etcd"
    }

    async fn grant_lease(&self, ttl: Duration) -> Result<LeaseId> {
        let secs = ttl.as_secs().max(1) as i64;
        let r = self.client.lease_client().grant(secs, None).await.map_err(self.err("lease grant"))?;
        Ok(r.id())
    }

    async fn keep_alive(&self, lease: LeaseId) -> Result<()> {
        match self.client.lease_client().keep_alive(lease).await {
            Ok(_) => Ok(()),
            Err(etcd_client::Error::LeaseKeepAliveError(m)) if m.contains("not found") => {
                Err(Error::NotFound(format!("lease {lease:x} has lapsed")))
            }
            Err(etcd_client::Error::GRpcStatus(s)) if s.message().contains("lease not found") => {
                Err(Error::NotFound(format!("lease {lease:x} has lapsed")))
            }
            Err(e) => Err(self.err("lease keep-alive")(e)),
        }
    }

    async fn revoke_lease(&self, lease: LeaseId) -> Result<()> {
        match self.client.lease_client().revoke(lease).await {
            Ok(_) => Ok(()),
            Err(etcd_client::Error::GRpcStatus(s)) if s.message().contains("lease not found") => Ok(()),
            Err(e) => Err(self.err("lease revoke")(e)),
        }
    }

    async fn put(&self, key: &str, value: Vec<u8>, lease: Option<LeaseId>) -> Result<()> {
        let opts = lease.map(|l| PutOptions::new().with_lease(l));
        match self.client.kv_client().put(key, value, opts).await {
            Ok(_) => Ok(()),
            Err(etcd_client::Error::GRpcStatus(s)) if s.message().contains("lease not found") => {
                Err(Error::NotFound(format!("lease {:x} has lapsed", lease.unwrap_or(0))))
            }
            Err(e) => Err(self.err("put")(e)),
        }
    }

    async fn get(&self, key: &str) -> Result<Option<Entry>> {
        let r = self.client.kv_client().get(key, None).await.map_err(self.err("get"))?;
        Ok(r.kvs().first().map(entry))
    }

    async fn list(&self, prefix: &str) -> Result<Listing> {
        let r = self
            .client
            .kv_client()
            .get(prefix, Some(GetOptions::new().with_prefix()))
            .await
            .map_err(self.err("list"))?;
        let revision = r.header().map(|h| h.revision()).unwrap_or(0);
        Ok(Listing { entries: r.kvs().iter().map(entry).collect(), revision })
    }

    async fn delete(&self, key: &str) -> Result<()> {
        self.client.kv_client().delete(key, None).await.map_err(self.err("delete"))?;
        Ok(())
    }

    async fn create(&self, key: &str, value: Vec<u8>, lease: Option<LeaseId>) -> Result<bool> {
        let txn = Txn::new()
            .when([Compare::create_revision(key, CompareOp::Equal, 0)])
            .and_then([Self::txn_op(Op::Put { key: key.to_string(), value, lease })]);
        match self.client.kv_client().txn(txn).await {
            Ok(r) => Ok(r.succeeded()),
            Err(etcd_client::Error::GRpcStatus(s)) if s.message().contains("lease not found") => {
                Err(Error::NotFound(format!("lease {:x} has lapsed", lease.unwrap_or(0))))
            }
            Err(e) => Err(self.err("create")(e)),
        }
    }

    async fn commit_if(&self, guard: &Guard, ops: Vec<Op>) -> Result<bool> {
        let txn = Txn::new()
            .when([Compare::value(guard.key.as_str(), CompareOp::Equal, guard.value.clone())])
            .and_then(ops.into_iter().map(Self::txn_op).collect::<Vec<_>>());
        let r = self.client.kv_client().txn(txn).await.map_err(self.err("guarded commit"))?;
        Ok(r.succeeded())
    }

    async fn watch(&self, prefix: &str, from: i64) -> Result<EventStream> {
        let opts = WatchOptions::new().with_prefix().with_start_revision(from).with_progress_notify();
        let stream = self.client.watch_client().watch(prefix, Some(opts)).await.map_err(self.err("watch"))?;
        let endpoints = self.endpoints.join(",");
        let out = futures::stream::unfold(Some(stream), move |stream| {
            let endpoints = endpoints.clone();
            async move {
                let mut stream = stream?;
                loop {
                    match stream.message().await {
                        Ok(Some(resp)) => {
                            if resp.canceled() {
                                let why = if resp.compact_revision() > 0 {
                                    format!("revision compacted (now {})", resp.compact_revision())
                                } else {
                                    resp.cancel_reason().to_string()
                                };
                                return Some((
                                    Err(Error::Unavailable(format!("etcd watch cancelled: {why}"))),
                                    None,
                                ));
                            }
                            let events: Vec<Event> = resp
                                .events()
                                .iter()
                                .filter_map(|ev| {
                                    let kv = ev.kv()?;
                                    Some(match ev.event_type() {
                                        EventType::Put => Event::Put(entry(kv)),
                                        EventType::Delete => Event::Delete {
                                            key: String::from_utf8_lossy(kv.key()).into_owned(),
                                            mod_revision: kv.mod_revision(),
                                        },
                                    })
                                })
                                .collect();
                            if !events.is_empty() {
                                return Some((Ok(events), Some(stream)));
                            }
                        }
                        Ok(None) => return None,
                        Err(e) => {
                            let e = Error::Unavailable(format!("etcd {endpoints} watch broke: {e}"));
                            return Some((Err(e), None));
                        }
                    }
                }
            }
        });
        Ok(out.boxed())
    }
}

// tonic comes with the gRPC edge's feature (a workspace build has both).
#[cfg(all(test, feature = "grpc"))]
mod tests {
    use super::*;

    #[test]
    fn an_etcd_error_is_one_line_without_tonics_debug_text() {
        let mut status = tonic::Status::unavailable("etcdserver: leader changed\nmore");
        status.metadata_mut().insert("x-trace", "abc".parse().unwrap());
        let e = unavailable(&["http://127.0.0.1:2379".into()], "put")(etcd_client::Error::GRpcStatus(status));
        let text = e.to_string();
        assert!(text.contains("Unavailable: etcdserver: leader changed"), "{text}");
        assert!(
            !text.contains("metadata") && !text.contains('\n') && !text.contains("MetadataMap"),
            "{text}"
        );
    }
}
