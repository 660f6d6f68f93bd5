//! `strata serve`'s catalog: models loaded in this process, replicas as engine runners.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use strata_common::{Error, ModelConfig, Parallelism, Result, ShardPlan};
use strata_worker::replica::{leader_with_external_ranks, local_replica};
use strata_worker::{EngineConfig, EngineHandle, RunnerLimits};
use tracing::info;

use crate::routing::{not_found, Catalog, LocalReplica, LocalRoutes, ModelEntry};
use crate::tokenizer::Tokenizer;

/// Loads `replicas` engines of the model in `dir`, each a `par` replica whose ranks are
/// threads of this process; or, with `rendezvous`, one replica whose other ranks are
/// `strata worker` processes joining there.
pub fn load_local(
    name: &str,
    dir: &Path,
    replicas: usize,
    par: Parallelism,
    rendezvous: Option<std::net::TcpListener>,
    engine: &EngineConfig,
    limits: &RunnerLimits,
) -> Result<ModelEntry> {
    if replicas == 0 {
        return Err(Error::invalid("replicas", "must be at least 1"));
    }
    let tokenizer = Tokenizer::from_dir(dir)?;
    let config = ModelConfig::from_dir(dir)?;
    ShardPlan::new(&config, par)?; // rejects impossible splits before loading anything
    let mut handles = Vec::with_capacity(replicas);
    let mut rendezvous = rendezvous;
    for r in 0..replicas {
        info!(model = name, replica = r, tp = par.tp, pp = par.pp, dir = %dir.display(), "loading replica");
        let engine = match rendezvous.take() {
            Some(listener) => leader_with_external_ranks(dir, par, engine, listener)?,
            None => local_replica(dir, par, engine)?,
        };
        let id = format!("{name}-{r}");
        let handle = EngineHandle::spawn(engine, limits.clone(), &id)?;
        handles.push(Arc::new(LocalReplica { id, handle }));
    }
    Ok(ModelEntry {
        name: name.to_string(),
        config,
        tokenizer,
        routes: Arc::new(LocalRoutes { replicas: handles }),
    })
}

/// Served models by name.
#[derive(Default, Clone)]
pub struct ModelSet {
    models: BTreeMap<String, Arc<ModelEntry>>,
}

impl ModelSet {
    pub fn insert(&mut self, model: ModelEntry) -> Result<()> {
        if self.models.contains_key(&model.name) {
            return Err(Error::invalid("name", format!("model name {:?} is used twice", model.name)));
        }
        self.models.insert(model.name.clone(), Arc::new(model));
        Ok(())
    }

    pub fn names(&self) -> Vec<String> {
        self.models.keys().cloned().collect()
    }
}

impl Catalog for ModelSet {
    fn get(&self, name: &str) -> Result<Arc<ModelEntry>> {
        self.models.get(name).cloned().ok_or_else(|| not_found(name, &self.names()))
    }

    fn all(&self) -> Vec<Arc<ModelEntry>> {
        self.models.values().cloned().collect()
    }
}
