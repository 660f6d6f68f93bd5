//! One worker.v1 client per worker address, shared by routing and reconciling.
//!
//! Channels connect lazily and reconnect by themselves; a connection that cannot be made
//! within [`CONNECT_TIMEOUT`] fails the call with UNAVAILABLE, which callers treat as a
//! worker that may be gone. Workers living in this process (`strata serve`) are also
//! registered here, so the request path reaches their engines directly instead of through
//! loopback gRPC; the control plane still uses worker.v1 for them, like for any worker.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use strata_common::{Error, Result};
use strata_proto::worker::v1::worker_client::WorkerClient;
use tonic::transport::{Channel, Endpoint};

pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// tokenizer.json of a large vocabulary is several MiB.
const MAX_MESSAGE: usize = 256 << 20;

#[derive(Default)]
pub struct WorkerClients {
    by_address: Mutex<HashMap<String, WorkerClient<Channel>>>,
    local: Mutex<HashMap<String, std::sync::Arc<super::agent::WorkerAgent>>>,
}

impl WorkerClients {
    pub fn new() -> Self {
        Self::default()
    }

    /// Declares that the worker at `address` is `agent`, in this process.
    pub fn register_local(&self, address: &str, agent: std::sync::Arc<super::agent::WorkerAgent>) {
        self.local.lock().unwrap_or_else(|p| p.into_inner()).insert(address.to_string(), agent);
    }

    /// The in-process worker at `address`, if it is one.
    pub fn local(&self, address: &str) -> Option<std::sync::Arc<super::agent::WorkerAgent>> {
        self.local.lock().unwrap_or_else(|p| p.into_inner()).get(address).cloned()
    }

    /// The client for `address` ("host:port").
    pub fn get(&self, address: &str) -> Result<WorkerClient<Channel>> {
        let mut map = self.by_address.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = map.get(address) {
            return Ok(c.clone());
        }
        let endpoint = Endpoint::from_shared(format!("http://{address}"))
            .map_err(|e| Error::Internal(format!("worker address {address:?}: {e}")))?
            .connect_timeout(CONNECT_TIMEOUT)
            .tcp_nodelay(true)
            .http2_keep_alive_interval(Duration::from_secs(5))
            .keep_alive_timeout(Duration::from_secs(5))
            .keep_alive_while_idle(true);
        let client = WorkerClient::new(endpoint.connect_lazy())
            .max_decoding_message_size(MAX_MESSAGE)
            .max_encoding_message_size(MAX_MESSAGE);
        map.insert(address.to_string(), client.clone());
        Ok(client)
    }
}
