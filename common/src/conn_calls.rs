//! Which of a gRPC listener's connections are in use, for [`crate::conn_limits`]: a
//! connection that has made no call within [`ConnLimits::first_call`] of being accepted,
//! or none for [`ConnLimits::idle`] since its last one, is closed; and a listener at its
//! cap closes its least useful idle connection to make room for a new one.
//!
//! 4,200 HTTP/2 connections with no key and no stream that only answered the server's
//! keepalive PINGs once held a coordinator's connection cap, and every gRPC call timed out
//! for as long as they stayed. A call counts when it is one of the server's own methods
//! (not health or reflection, which anyone may call) and is not refused for its
//! credentials or its path (`UNAUTHENTICATED`, `PERMISSION_DENIED`, `UNIMPLEMENTED`): a
//! stranger cannot keep a connection by calling.
//!
//! [`CallsLayer`] sits in front of the tonic server and finds each call's connection by
//! its peer address (tonic's `TcpConnectInfo`, under TLS too); the connection's reader
//! ([`crate::conn_limits::Limited`]) watches its [`Activity`] and ends the connection when
//! its time is up (a hard close: only connections with no call in flight are closed).
//!
//! [`ConnLimits::first_call`]: crate::conn_limits::ConnLimits::first_call
//! [`ConnLimits::idle`]: crate::conn_limits::ConnLimits::idle

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use futures::future::BoxFuture;
use futures::task::AtomicWaker;
use tokio::time::{Instant, Sleep};
use tonic::body::Body;
use tonic::codegen::http;
use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};

/// One connection's use.
#[derive(Debug)]
pub struct Activity {
    accepted: Instant,
    /// When its last counted call ended; None before any did.
    used: Mutex<Option<Instant>>,
    /// Counted calls in flight.
    busy: AtomicUsize,
    /// Set to close it (to make room for another connection).
    closing: AtomicBool,
    /// The connection's reader, woken when a call ends or it is to close.
    reader: AtomicWaker,
}

impl Activity {
    fn new() -> Self {
        Activity {
            accepted: Instant::now(),
            used: Mutex::new(None),
            busy: AtomicUsize::new(0),
            closing: AtomicBool::new(false),
            reader: AtomicWaker::new(),
        }
    }

    fn used(&self) -> Option<Instant> {
        *self.used.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// When the connection is to close if it makes no call: `first_call` after it was
    /// accepted, `idle` after its last call ended.
    fn deadline(&self, first_call: Duration, idle: Duration) -> Instant {
        match self.used() {
            None => self.accepted + first_call,
            Some(t) => t + idle,
        }
    }

    fn begin(self: &Arc<Self>) -> CallGuard {
        self.busy.fetch_add(1, Ordering::SeqCst);
        CallGuard { activity: self.clone(), counts: true }
    }
}

/// A counted call in flight; when it ends (its response body is dropped) the connection's
/// idle time starts again, unless the call was refused for its credentials.
struct CallGuard {
    activity: Arc<Activity>,
    counts: bool,
}

impl Drop for CallGuard {
    fn drop(&mut self) {
        if self.counts {
            *self.activity.used.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
        }
        self.activity.busy.fetch_sub(1, Ordering::SeqCst);
        self.activity.reader.wake();
    }
}

/// The open connections of one listener, by peer address.
#[derive(Debug, Clone, Default)]
pub struct Connections {
    open: Arc<Mutex<HashMap<SocketAddr, Arc<Activity>>>>,
}

impl Connections {
    pub(crate) fn opened(&self, peer: SocketAddr) -> Arc<Activity> {
        let activity = Arc::new(Activity::new());
        self.lock().insert(peer, activity.clone());
        activity
    }

    pub(crate) fn closed(&self, peer: SocketAddr) {
        self.lock().remove(&peer);
    }

    fn get(&self, peer: SocketAddr) -> Option<Arc<Activity>> {
        self.lock().get(&peer).cloned()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<SocketAddr, Arc<Activity>>> {
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Closes the least useful connection with no call in flight — one that never made a
    /// call before any that did, the longest idle first. False when every one is busy.
    pub(crate) fn evict_one(&self) -> bool {
        let open = self.lock();
        let idlest = open
            .values()
            .filter(|a| a.busy.load(Ordering::SeqCst) == 0 && !a.closing.load(Ordering::SeqCst))
            .min_by_key(|a| match a.used() {
                None => (0, a.accepted),
                Some(t) => (1, t),
            });
        match idlest {
            Some(a) => {
                a.closing.store(true, Ordering::SeqCst);
                a.reader.wake();
                true
            }
            None => false,
        }
    }

    /// The layer that counts these connections' calls (in front of the tonic server).
    pub fn layer(&self) -> CallsLayer {
        CallsLayer { connections: self.clone() }
    }
}

/// Watches one connection for the reader ([`crate::conn_limits::Limited`]).
pub(crate) struct IdleWatch {
    pub activity: Arc<Activity>,
    pub first_call: Duration,
    pub idle: Duration,
    pub timer: Pin<Box<Sleep>>,
}

impl IdleWatch {
    /// Why the connection must close now, if it must; otherwise arranges to be woken when
    /// that may change.
    pub fn expired(&mut self, cx: &mut Context<'_>) -> Option<std::io::Error> {
        let a = &self.activity;
        a.reader.register(cx.waker());
        if a.closing.load(Ordering::SeqCst) {
            return Some(std::io::Error::new(
                std::io::ErrorKind::ConnectionAborted,
                "closed to make room for another connection (the listener is at its cap)",
            ));
        }
        if a.busy.load(Ordering::SeqCst) > 0 {
            return None; // the call's end wakes the reader
        }
        let deadline = a.deadline(self.first_call, self.idle);
        if self.timer.deadline() != deadline {
            self.timer.as_mut().reset(deadline);
        }
        self.timer.as_mut().poll(cx).is_ready().then(|| {
            let what = if a.used().is_none() { "no call" } else { "no call since its last" };
            std::io::Error::new(std::io::ErrorKind::TimedOut, format!("the connection made {what} in time"))
        })
    }
}

/// Counts each call against its connection's [`Activity`] (see the module).
#[derive(Debug, Clone)]
pub struct CallsLayer {
    connections: Connections,
}

impl<S> tower::Layer<S> for CallsLayer {
    type Service = Counted<S>;
    fn layer(&self, inner: S) -> Counted<S> {
        Counted { inner, connections: self.connections.clone() }
    }
}

#[derive(Debug, Clone)]
pub struct Counted<S> {
    inner: S,
    connections: Connections,
}

/// The peer address tonic recorded for the request's connection.
fn peer_of<B>(req: &http::Request<B>) -> Option<SocketAddr> {
    let ext = req.extensions();
    ext.get::<TcpConnectInfo>()
        .and_then(TcpConnectInfo::remote_addr)
        .or_else(|| ext.get::<TlsConnectInfo<TcpConnectInfo>>().and_then(|t| t.get_ref().remote_addr()))
}

/// Whether a call to `path` can keep a connection: anyone may call health and reflection.
fn counts(path: &str) -> bool {
    !(path.starts_with("/grpc.health.") || path.starts_with("/grpc.reflection."))
}

impl<S, B> tower::Service<http::Request<B>> for Counted<S>
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
        let guard = match peer_of(&req) {
            Some(peer) if counts(req.uri().path()) => self.connections.get(peer).map(|a| a.begin()),
            _ => None,
        };
        let response = self.inner.call(req);
        Box::pin(async move {
            let response = response.await?;
            let Some(mut guard) = guard else { return Ok(response) };
            let refused = matches!(
                crate::grpc_metrics::status_in(response.headers()),
                Some(
                    tonic::Code::Unauthenticated | tonic::Code::PermissionDenied | tonic::Code::Unimplemented
                )
            );
            guard.counts = !refused;
            Ok(response.map(|inner| Body::new(GuardedBody { inner, _guard: guard })))
        })
    }
}

/// A response body that holds its call's place until it is dropped.
struct GuardedBody {
    inner: Body,
    _guard: CallGuard,
}

impl http_body::Body for GuardedBody {
    type Data = bytes::Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conn_limits::{CallBounds, ConnLimits, LimitedListener};
    use tokio::net::TcpStream;

    /// A gRPC service with one method, `/test.Svc/Call`, answered OK at once.
    #[derive(Clone)]
    struct Svc;

    impl tonic::server::NamedService for Svc {
        const NAME: &'static str = "test.Svc";
    }

    impl tower::Service<http::Request<Body>> for Svc {
        type Response = http::Response<Body>;
        type Error = std::convert::Infallible;
        type Future = std::future::Ready<Result<Self::Response, Self::Error>>;
        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
            Poll::Ready(Ok(()))
        }
        fn call(&mut self, _: http::Request<Body>) -> Self::Future {
            let response = http::Response::builder()
                .header("content-type", "application/grpc")
                .header("grpc-status", "0")
                .body(Body::empty())
                .unwrap();
            std::future::ready(Ok(response))
        }
    }

    /// A tonic server (the test service and gRPC health) over a listener with `limits`.
    async fn server(limits: ConnLimits) -> SocketAddr {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let listener = LimitedListener::new(l, limits);
        let (_reporter, health) = tonic_health::server::health_reporter();
        let server = tonic::transport::Server::builder()
            .layer(listener.calls_layer())
            .add_service(health)
            .add_service(Svc)
            .serve_with_incoming(listener.incoming());
        tokio::spawn(server);
        addr
    }

    /// An HTTP/2 connection that answers the server's PINGs (its driver runs in a task)
    /// and is closed when `closed` resolves.
    struct Conn {
        send: h2::client::SendRequest<bytes::Bytes>,
        closed: tokio::task::JoinHandle<()>,
    }

    async fn connect(addr: SocketAddr) -> Conn {
        let tcp = TcpStream::connect(addr).await.unwrap();
        let (send, conn) = h2::client::handshake(tcp).await.unwrap();
        let closed = tokio::spawn(async move {
            let _ = conn.await;
        });
        Conn { send, closed }
    }

    /// Calls `path` on `conn`; the response's grpc-status.
    async fn call(conn: &mut Conn, path: &str) -> Option<String> {
        let req = http::Request::post(format!("http://test{path}"))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(())
            .unwrap();
        let mut send = conn.send.clone().ready().await.ok()?;
        let (response, mut stream) = send.send_request(req, false).ok()?;
        // An empty message: the 5-byte gRPC frame header of a zero-length message.
        stream.send_data(bytes::Bytes::from_static(&[0, 0, 0, 0, 0]), true).ok()?;
        let response = response.await.ok()?;
        let status = response.headers().get("grpc-status").map(|v| v.to_str().unwrap().to_string());
        let mut body = response.into_body();
        while let Some(chunk) = body.data().await {
            chunk.ok()?;
        }
        let trailers = body.trailers().await.ok().flatten();
        status.or_else(|| trailers?.get("grpc-status").map(|v| v.to_str().unwrap().to_string()))
    }

    /// Whether the server closed `conn` within `limit`.
    async fn closed_within(conn: &mut Conn, limit: Duration) -> bool {
        tokio::time::timeout(limit, &mut conn.closed).await.is_ok()
    }

    fn limits(first_call_ms: u64, idle_ms: u64) -> ConnLimits {
        ConnLimits {
            calls: Some(CallBounds {
                first_call: Duration::from_millis(first_call_ms),
                idle: Duration::from_millis(idle_ms),
            }),
            ..ConnLimits::grpc()
        }
    }

    #[tokio::test]
    async fn connections_without_calls_are_closed_and_calls_keep_them() {
        let addr = server(limits(400, 1200)).await;
        // Open, answering PINGs, no stream: closed at the first-call bound.
        let mut silent = connect(addr).await;
        // Health checks anyone may make do not keep a connection either.
        let mut prober = connect(addr).await;
        assert_eq!(call(&mut prober, "/grpc.health.v1.Health/Check").await.as_deref(), Some("0"));
        // A call to one of the server's methods keeps it, for the idle bound after each.
        let mut user = connect(addr).await;
        assert_eq!(call(&mut user, "/test.Svc/Call").await.as_deref(), Some("0"));
        // So do calls the server does not have: they are UNIMPLEMENTED, refused.
        let mut prober2 = connect(addr).await;
        assert_eq!(call(&mut prober2, "/junk.Svc/Call").await.as_deref(), Some("12"));
        assert!(closed_within(&mut silent, Duration::from_secs(3)).await, "a silent connection stayed");
        assert!(closed_within(&mut prober, Duration::from_secs(3)).await, "health calls kept it");
        assert!(closed_within(&mut prober2, Duration::from_secs(3)).await, "junk calls kept it");
        for _ in 0..3 {
            tokio::time::sleep(Duration::from_millis(300)).await;
            assert_eq!(
                call(&mut user, "/test.Svc/Call").await.as_deref(),
                Some("0"),
                "a used connection closed"
            );
        }
        assert!(closed_within(&mut user, Duration::from_secs(5)).await, "idle past the bound, it stays");
    }

    #[tokio::test]
    async fn a_listener_at_its_cap_makes_room_from_idle_connections() {
        let addr = server(ConnLimits { max_connections: 4, ..limits(60_000, 60_000) }).await;
        let mut user = connect(addr).await;
        assert_eq!(call(&mut user, "/test.Svc/Call").await.as_deref(), Some("0"));
        let mut idle = Vec::new();
        for _ in 0..3 {
            idle.push(connect(addr).await);
        }
        // The cap is full of connections that made no call: a new caller gets in at once,
        // pushing out one of those, never the connection that made calls.
        for _ in 0..3 {
            let mut newcomer =
                tokio::time::timeout(Duration::from_secs(3), connect(addr)).await.expect("room");
            let got =
                tokio::time::timeout(Duration::from_secs(3), call(&mut newcomer, "/test.Svc/Call")).await;
            assert_eq!(got.expect("answered in time").as_deref(), Some("0"));
            idle.push(newcomer);
        }
        assert_eq!(call(&mut user, "/test.Svc/Call").await.as_deref(), Some("0"), "the used one stayed");
    }
}
