//! Which [`WorkerApi`] reaches the worker at an address: one per address, shared by
//! routing and reconciling.
//!
//! By default a worker is reached over worker.v1 ([`GrpcWorker`]). A process that hosts
//! workers itself (`strata serve`) registers their in-process implementations, so its
//! requests reach their engines without a loopback hop; every caller goes through the same
//! seam either way.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use strata_common::tls::{ClusterTls, Role};
use strata_common::worker_api::WorkerApi;
use strata_common::Result;
use tonic::transport::ClientTlsConfig;

use super::grpc_worker::GrpcWorker;

#[derive(Default)]
pub struct WorkerClients {
    by_address: Mutex<HashMap<String, Arc<dyn WorkerApi>>>,
    /// Cluster credentials: workers are dialled over mutual TLS.
    tls: Option<ClientTlsConfig>,
}

impl WorkerClients {
    /// Clients that dial workers over plain HTTP/2 (a loopback development cluster).
    pub fn new() -> Self {
        Self::default()
    }

    /// Clients that dial workers over mutual TLS with this process's cluster credentials.
    pub fn with_tls(tls: Option<&ClusterTls>) -> Self {
        WorkerClients { by_address: Mutex::default(), tls: tls.map(|t| t.client(Role::Worker)) }
    }

    /// Declares that the worker at `address` is reached through `worker` (one of this
    /// process's own).
    pub fn register(&self, address: &str, worker: Arc<dyn WorkerApi>) {
        self.by_address.lock().unwrap_or_else(|p| p.into_inner()).insert(address.to_string(), worker);
    }

    /// The worker at `address` ("host:port").
    pub fn get(&self, address: &str) -> Result<Arc<dyn WorkerApi>> {
        let mut map = self.by_address.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = map.get(address) {
            return Ok(c.clone());
        }
        let worker: Arc<dyn WorkerApi> = Arc::new(GrpcWorker::connect_lazy(address, self.tls.as_ref())?);
        map.insert(address.to_string(), worker.clone());
        Ok(worker)
    }
}
