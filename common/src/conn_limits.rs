//! Connection limits for the listeners that face callers (gRPC, the HTTP API): a total and
//! a per-peer cap on open connections, and a deadline for a new connection's first bytes.
//!
//! 21,000 idle TCP connections (no bytes, no key) once used up a coordinator's file
//! descriptors and every listener stopped answering. Now a listener at its total cap stops
//! accepting (new connections wait in the kernel's backlog) while the open ones are
//! served; a peer at its cap has further connections closed at once; and a connection that
//! has not sent its opening bytes ([`ConnLimits::opening_bytes`]: for gRPC, the HTTP/2
//! preface and the first frame's header) within [`ConnLimits::first_bytes`] of being
//! accepted is closed — a preface sent in part and left there holds no slot either.
//!
//! gRPC listeners also watch their connections' calls ([`crate::conn_calls`]): one that
//! makes no call in time is closed, and at the cap the least useful idle one makes room.

use std::collections::HashMap;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::conn_calls::{CallsLayer, Connections, IdleWatch};

/// A listener's bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnLimits {
    /// Open connections at once.
    pub max_connections: usize,
    /// Open connections from one IP address at once.
    pub max_per_peer: usize,
    /// How long a new connection has to send its opening bytes.
    pub first_bytes: Duration,
    /// How many bytes count as the opening (at least 1).
    pub opening_bytes: usize,
    /// How long a connection may go without a call (gRPC listeners; None: no bound, and no
    /// room made at the cap).
    pub calls: Option<CallBounds>,
}

/// How long a connection may go without a call ([`crate::conn_calls`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallBounds {
    /// From being accepted to its first call.
    pub first_call: Duration,
    /// From the end of its last call.
    pub idle: Duration,
}

impl Default for CallBounds {
    fn default() -> Self {
        CallBounds { first_call: Duration::from_secs(20), idle: Duration::from_secs(300) }
    }
}

/// An HTTP/2 connection's opening: the 24-byte client preface, then the 9-byte header of
/// the SETTINGS frame that must follow it (a TLS ClientHello is longer still).
pub const HTTP2_OPENING: usize = 24 + 9;

impl Default for ConnLimits {
    /// Any first bytes (HTTP/1: hyper's header-read timeout bounds the rest of the head).
    fn default() -> Self {
        ConnLimits {
            max_connections: 4096,
            max_per_peer: 512,
            first_bytes: Duration::from_secs(10),
            opening_bytes: 1,
            calls: None,
        }
    }
}

impl ConnLimits {
    /// A gRPC listener's: the whole HTTP/2 opening within the deadline, and calls within
    /// [`CallBounds`].
    pub fn grpc() -> Self {
        ConnLimits { opening_bytes: HTTP2_OPENING, calls: Some(CallBounds::default()), ..Default::default() }
    }
}

/// Open connections per peer address.
type Peers = Arc<Mutex<HashMap<IpAddr, usize>>>;

/// A TCP listener that holds to [`ConnLimits`].
pub struct LimitedListener {
    listener: TcpListener,
    limits: ConnLimits,
    open: Arc<Semaphore>,
    peers: Peers,
    connections: Connections,
}

impl LimitedListener {
    pub fn new(listener: TcpListener, limits: ConnLimits) -> Self {
        let open = Arc::new(Semaphore::new(limits.max_connections.max(1)));
        LimitedListener { listener, limits, open, peers: Arc::default(), connections: Connections::default() }
    }

    /// The layer a tonic server over this listener counts its calls with
    /// ([`crate::conn_calls`]); without it every connection is closed as never used.
    pub fn calls_layer(&self) -> CallsLayer {
        self.connections.layer()
    }

    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// The next connection within the limits (`TCP_NODELAY` set: streams write small
    /// events). Waits while the listener is at its cap ([`Self::room`]); closes a
    /// connection whose peer is at its own; retries after accept errors (out of
    /// descriptors: a moment later).
    pub async fn accept(&self) -> (Limited, SocketAddr) {
        loop {
            let (stream, peer) = match self.listener.accept().await {
                Ok(accepted) => accepted,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            {
                let mut peers = self.peers.lock().unwrap_or_else(|p| p.into_inner());
                let n = peers.entry(peer.ip()).or_default();
                if *n >= self.limits.max_per_peer {
                    tracing::debug!(%peer, "connection refused: the peer is at its connection limit");
                    continue; // dropping the stream closes it
                }
                *n += 1;
            }
            let permit = self.room().await;
            let _ = stream.set_nodelay(true);
            let first = Box::pin(tokio::time::sleep(self.limits.first_bytes));
            let watch = self.limits.calls.map(|b| IdleWatch {
                activity: self.connections.opened(peer),
                first_call: b.first_call,
                idle: b.idle,
                timer: Box::pin(tokio::time::sleep(b.first_call)),
            });
            let held = Held {
                _permit: permit,
                peers: self.peers.clone(),
                peer,
                connections: watch.is_some().then(|| self.connections.clone()),
            };
            let opening = self.limits.opening_bytes.max(1);
            return (Limited { io: stream, first: Some(first), opening, watch, _held: held }, peer);
        }
    }

    /// A place among the open connections. At the cap this waits for one to close (the
    /// new connection is held meanwhile, further ones wait in the kernel's backlog); where
    /// calls are counted, the least useful idle connection is closed to make room.
    async fn room(&self) -> OwnedSemaphorePermit {
        if let Ok(permit) = self.open.clone().try_acquire_owned() {
            return permit;
        }
        if self.limits.calls.is_some() && self.connections.evict_one() {
            tracing::debug!("the listener is at its connection cap: closing an idle connection");
        }
        match self.open.clone().acquire_owned().await {
            Ok(permit) => permit,
            Err(_) => unreachable!("the semaphore is never closed"),
        }
    }

    /// The connections as a stream (tonic's `serve_with_incoming`).
    pub fn incoming(self) -> impl futures::Stream<Item = std::io::Result<Limited>> + Send + 'static {
        futures::stream::unfold(self, |l| async move {
            let (conn, _) = l.accept().await;
            Some((Ok(conn), l))
        })
    }
}

/// A connection's places in its listener's counts.
struct Held {
    _permit: OwnedSemaphorePermit,
    peers: Peers,
    peer: SocketAddr,
    /// Where the connection's calls are counted, when they are.
    connections: Option<Connections>,
}

impl Drop for Held {
    fn drop(&mut self) {
        if let Some(c) = &self.connections {
            c.closed(self.peer);
        }
        let mut peers = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = peers.get_mut(&self.peer.ip()) {
            *n -= 1;
            if *n == 0 {
                peers.remove(&self.peer.ip());
            }
        }
    }
}

/// An accepted connection within its listener's limits.
pub struct Limited {
    io: TcpStream,
    /// Until the opening bytes arrive: when they must have.
    first: Option<Pin<Box<tokio::time::Sleep>>>,
    /// Opening bytes still to come.
    opening: usize,
    /// Its calls, on a listener that bounds the time between them.
    watch: Option<IdleWatch>,
    _held: Held,
}

impl Limited {
    pub fn peer_addr(&self) -> std::io::Result<SocketAddr> {
        self.io.peer_addr()
    }
}

impl AsyncRead for Limited {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let this = &mut *self;
        let read = Pin::new(&mut this.io).poll_read(cx, buf);
        if let Some(first) = this.first.as_mut() {
            let got = if matches!(read, Poll::Ready(Ok(()))) { buf.filled().len() - before } else { 0 };
            this.opening = this.opening.saturating_sub(got);
            if this.opening == 0 {
                this.first = None;
            } else if got == 0 && first.as_mut().poll(cx).is_ready() {
                return Poll::Ready(Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "the connection did not send its opening in time",
                )));
            }
        }
        if read.is_pending() {
            if let Some(e) = this.watch.as_mut().and_then(|w| w.expired(cx)) {
                tracing::debug!(error = %e, "closing a connection");
                return Poll::Ready(Err(e));
            }
        }
        read
    }
}

impl AsyncWrite for Limited {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

impl tonic::transport::server::Connected for Limited {
    type ConnectInfo = tonic::transport::server::TcpConnectInfo;
    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn listener(limits: ConnLimits) -> (Arc<LimitedListener>, SocketAddr) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        (Arc::new(LimitedListener::new(l, limits)), addr)
    }

    /// Echoes what each accepted connection sends, one read at a time.
    fn serve(l: Arc<LimitedListener>) {
        tokio::spawn(async move {
            loop {
                let (mut c, _) = l.accept().await;
                tokio::spawn(async move {
                    let mut buf = [0u8; 64];
                    while let Ok(n) = c.read(&mut buf).await {
                        if n == 0 || c.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                });
            }
        });
    }

    async fn echoes(addr: SocketAddr) -> bool {
        let Ok(mut s) = TcpStream::connect(addr).await else { return false };
        let mut buf = [0u8; 2];
        s.write_all(b"hi").await.is_ok()
            && tokio::time::timeout(Duration::from_secs(2), s.read_exact(&mut buf))
                .await
                .is_ok_and(|r| r.is_ok())
    }

    #[tokio::test]
    async fn silent_connections_are_closed_and_caps_hold() {
        let limits = ConnLimits {
            max_connections: 3,
            max_per_peer: 2,
            first_bytes: Duration::from_millis(300),
            opening_bytes: 1,
            calls: None,
        };
        let (l, addr) = listener(limits).await;
        serve(l);
        // Two silent connections fill the peer's cap: a third is closed at once.
        let mut silent =
            vec![TcpStream::connect(addr).await.unwrap(), TcpStream::connect(addr).await.unwrap()];
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!echoes(addr).await, "past the peer's cap");
        // Sending nothing, they are closed after the first-bytes deadline; then it answers.
        for s in &mut silent {
            let mut buf = [0u8; 1];
            let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await.unwrap();
            assert!(matches!(n, Ok(0) | Err(_)), "closed: {n:?}");
        }
        assert!(echoes(addr).await, "served once the silent ones are gone");
    }

    #[tokio::test]
    async fn an_opening_sent_in_part_is_closed_at_the_deadline() {
        let limits = ConnLimits { first_bytes: Duration::from_millis(300), ..ConnLimits::grpc() };
        let (l, addr) = listener(limits).await;
        serve(l);
        // Half an HTTP/2 preface, then nothing: closed although bytes came.
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"PRI * HTTP/2.0\r\n").await.unwrap();
        let mut buf = [0u8; 64];
        let mut echoed = 0;
        let closed = tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                match s.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => echoed += n,
                }
            }
        })
        .await;
        assert!(closed.is_ok(), "a partial opening was held past its deadline");
        assert_eq!(echoed, 16, "what was sent is read before the close");
        // The whole opening in time: the connection stays and is served.
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(&[b'x'; HTTP2_OPENING]).await.unwrap();
        tokio::time::sleep(Duration::from_millis(600)).await;
        s.write_all(b"hi").await.unwrap();
        let mut got = vec![0u8; HTTP2_OPENING + 2];
        let read = tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut got)).await;
        assert!(read.is_ok_and(|r| r.is_ok()), "an opened connection outlives the deadline");
    }
}
