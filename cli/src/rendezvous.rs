//! Static mode (deprecated; removed in the next release), `strata serve --worker-rendezvous
//! ADDR`: one replica whose rank 0 runs in this process and whose other ranks are
//! `strata worker --rank R --rendezvous ADDR` processes started by hand. No registry, no
//! reconciler: the replica is fixed for the life of the process (cluster mode is the way
//! to scale, replace or drain).
//!
//! The coordinator's request path is reused unchanged: the engine is one [`Replica`]
//! behind a one-model [`Catalog`].

use std::path::Path;
use std::sync::Arc;

use strata_common::worker_api::{EventStream, Job};
use strata_common::{EngineStats, ModelConfig, Parallelism, Result, ShardPlan};
use strata_coordinator::api::server::{serve, ServeOptions};
use strata_coordinator::frontend::{FrontEnd, FrontEndOptions};
use strata_coordinator::request::tokenizer::Tokenizer;
use strata_coordinator::routing::{not_found, Catalog, ModelEntry, Replica, Routes};
use strata_engine::metrics::ReplicaLabels;
use strata_engine::replica::leader_with_external_ranks;
use strata_engine::{EngineConfig, EngineHandle, RunnerLimits};
use strata_worker::in_process::sequence_events;
use tracing::info;

use crate::unimplemented_admin::EmbeddedAdmin;

/// Static mode is deprecated: cluster mode runs the same multi-process replicas (and
/// replaces, scales and drains them), and this second way to form a replica goes in the
/// next release.
pub fn warn_deprecated(how: &str) {
    tracing::warn!(
        deprecated = "static mode",
        "{how}: static mode is deprecated and will be removed in the next release; run the \
         replica in cluster mode instead (`strata coordinator --etcd URL`, `strata worker --etcd URL`, \
         `strata admin deploy --tp N --pp M`)"
    );
}

/// The group secret of a static replica: the one given, or none on loopback.
pub fn secret(given: Option<&str>, rendezvous: std::net::SocketAddr) -> anyhow::Result<Vec<u8>> {
    match given {
        Some(s) if s.len() < 16 => anyhow::bail!("--rendezvous-secret: use at least 16 characters"),
        Some(s) => Ok(s.as_bytes().to_vec()),
        None if rendezvous.ip().is_loopback() => Ok(Vec::new()),
        None => anyhow::bail!(
            "the rendezvous {rendezvous} is reachable from other machines: give every rank the same --rendezvous-secret (or STRATA_RENDEZVOUS_SECRET), at least 16 characters"
        ),
    }
}

/// Everything static mode runs with.
pub struct StaticReplica<'a> {
    pub name: &'a str,
    pub dir: &'a Path,
    pub par: Parallelism,
    pub listener: std::net::TcpListener,
    pub secret: Vec<u8>,
    pub engine: &'a EngineConfig,
    pub limits: &'a RunnerLimits,
}

/// Loads the replica (waiting for every rank to join), then serves until SIGTERM.
pub fn run(
    replica: StaticReplica<'_>,
    front: FrontEndOptions,
    opts: ServeOptions,
    rt: tokio::runtime::Runtime,
) -> anyhow::Result<()> {
    let name = replica.name;
    let entry = load(replica).map_err(|e| anyhow::anyhow!("loading model {name:?}: {e}"))?;
    let _runtime = rt.enter();
    let front = FrontEnd::new(Arc::new(OneModel(Arc::new(entry))), front);
    rt.block_on(serve(front, EmbeddedAdmin, opts))
}

fn load(r: StaticReplica<'_>) -> Result<ModelEntry> {
    let tokenizer = Tokenizer::from_dir(r.dir)?;
    let config = ModelConfig::from_dir(r.dir)?;
    ShardPlan::new(&config, r.par)?; // rejects impossible splits before loading anything
    info!(model = r.name, tp = r.par.tp, pp = r.par.pp, dir = %r.dir.display(), "loading replica");
    let id = format!("{}-0", r.name);
    let mut engine_config = r.engine.clone();
    engine_config.labels = ReplicaLabels { model: r.name.to_string(), replica: id.clone() };
    let threads = strata_engine::replica::RankThreads::Process;
    let engine = leader_with_external_ranks(r.dir, r.par, &engine_config, (r.listener, &r.secret), threads)?;
    let handle = EngineHandle::spawn(engine, r.limits.clone(), &id)?;
    Ok(ModelEntry {
        name: r.name.to_string(),
        config,
        tokenizer,
        routes: Arc::new(EngineReplica { id, handle, ranks: r.par.world() }),
    })
}

/// The in-process engine: the only replica, so also its own routes.
struct EngineReplica {
    id: String,
    handle: EngineHandle,
    ranks: usize,
}

#[async_trait::async_trait]
impl Replica for EngineReplica {
    fn id(&self) -> &str {
        &self.id
    }

    fn ranks(&self) -> usize {
        self.ranks
    }

    async fn submit(&self, job: &Job) -> Result<EventStream> {
        let seq =
            self.handle.submit_resumed(job.prompt.clone(), job.generated.clone(), job.params.clone())?;
        Ok(sequence_events(seq))
    }
}

#[async_trait::async_trait]
impl Routes for EngineReplica {
    fn pick(&self, _prompt: &[u32], _revision: u64, exclude: &[String]) -> Option<Arc<dyn Replica>> {
        let usable = !exclude.contains(&self.id) && self.handle.broken().is_none();
        usable.then(|| {
            Arc::new(EngineReplica { id: self.id.clone(), handle: self.handle.clone(), ranks: self.ranks })
                as _
        })
    }

    fn ready(&self) -> usize {
        usize::from(self.handle.broken().is_none())
    }

    async fn stats(&self) -> EngineStats {
        self.handle.stats()
    }

    fn max_context(&self) -> Option<usize> {
        Some(self.handle.stats().max_context)
    }
}

/// A catalog of one model.
struct OneModel(Arc<ModelEntry>);

impl Catalog for OneModel {
    fn get(&self, name: &str) -> Result<Arc<ModelEntry>> {
        if name == self.0.name {
            return Ok(self.0.clone());
        }
        Err(not_found(name, std::slice::from_ref(&self.0.name)))
    }

    fn all(&self) -> Vec<Arc<ModelEntry>> {
        vec![self.0.clone()]
    }
}
