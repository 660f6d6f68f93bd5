//! The HTTP API's connection loop: hyper's HTTP/1 server over [`LimitedListener`], with a
//! deadline for every request head.
//!
//! `axum::serve` gives hyper no timer, so hyper's header-read timeout never ran: a client
//! that sent half a request line — or opened a keep-alive connection and went quiet — held
//! its connection for as long as it liked. Here each connection has
//! [`HEADER_READ_TIMEOUT`] to send each request head (the first, and every next one on a
//! kept-alive connection), after the listener's own caps and first-bytes deadline.

use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;

use strata_common::conn_limits::LimitedListener;

/// How long a connection has to send a whole request head, counted from when the server
/// starts waiting for it (after accepting, and after each response on a kept-alive one).
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves `app` on `listener` until `stop` resolves, then lets in-flight requests finish
/// (idle connections close at once).
pub async fn serve(
    listener: LimitedListener,
    app: Router,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let graceful = GracefulShutdown::new();
    let mut stop = std::pin::pin!(stop);
    loop {
        let (io, peer) = tokio::select! {
            accepted = listener.accept() => accepted,
            () = &mut stop => break,
        };
        let mut builder = hyper::server::conn::http1::Builder::new();
        builder.timer(TokioTimer::new()).header_read_timeout(HEADER_READ_TIMEOUT);
        let conn = builder.serve_connection(TokioIo::new(io), TowerToHyperService::new(app.clone()));
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(%peer, error = %e, "HTTP connection ended with an error");
            }
        });
    }
    graceful.shutdown().await;
    Ok(())
}
