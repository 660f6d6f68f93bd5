//! The models this coordinator serves and the replicas behind each.
//!
//! In `strata serve` every replica is an in-process engine runner; routing picks the
//! replica with the least outstanding work (a pure function, tested without a network).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use strata_common::{Error, ModelConfig, Parallelism, Result, ShardPlan};
use strata_worker::replica::{leader_with_external_ranks, local_replica};
use strata_worker::{EngineConfig, EngineHandle, EngineStats, RunnerLimits};
use tracing::info;

use crate::tokenizer::Tokenizer;

/// One served model: its tokenizer, its shape, and its replicas.
pub struct ServedModel {
    pub name: String,
    pub config: ModelConfig,
    pub tokenizer: Tokenizer,
    pub replicas: Vec<EngineHandle>,
}

impl ServedModel {
    /// Loads `replicas` engines of the model in `dir`, each a `par` replica whose ranks
    /// are threads of this process; or, with `rendezvous`, one replica whose other ranks are
    /// `strata worker` processes joining there.
    pub fn load_local(
        name: &str,
        dir: &Path,
        replicas: usize,
        par: Parallelism,
        rendezvous: Option<std::net::TcpListener>,
        engine: &EngineConfig,
        limits: &RunnerLimits,
    ) -> Result<Self> {
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
            handles.push(EngineHandle::spawn(engine, limits.clone(), &format!("{name}-{r}"))?);
        }
        Ok(ServedModel { name: name.to_string(), config, tokenizer, replicas: handles })
    }

    /// The replica that should take the next request.
    pub fn route(&self) -> &EngineHandle {
        let loads: Vec<usize> = self.replicas.iter().map(EngineHandle::load).collect();
        &self.replicas[least_loaded(&loads)]
    }

    /// Load summed over replicas.
    pub fn stats(&self) -> EngineStats {
        self.replicas.iter().map(EngineHandle::stats).fold(EngineStats::default(), |a, s| EngineStats {
            running: a.running + s.running,
            waiting: a.waiting + s.waiting,
            kv_blocks_free: a.kv_blocks_free + s.kv_blocks_free,
            kv_blocks_total: a.kv_blocks_total + s.kv_blocks_total,
        })
    }
}

/// Index of the smallest load; the first on ties. `loads` must not be empty.
pub fn least_loaded(loads: &[usize]) -> usize {
    loads.iter().enumerate().min_by_key(|(i, l)| (**l, *i)).map(|(i, _)| i).unwrap_or(0)
}

/// Served models by name.
#[derive(Default, Clone)]
pub struct ModelSet {
    models: BTreeMap<String, Arc<ServedModel>>,
}

impl ModelSet {
    pub fn insert(&mut self, model: ServedModel) -> Result<()> {
        if self.models.contains_key(&model.name) {
            return Err(Error::invalid("name", format!("model name {:?} is used twice", model.name)));
        }
        self.models.insert(model.name.clone(), Arc::new(model));
        Ok(())
    }

    pub fn get(&self, name: &str) -> Result<Arc<ServedModel>> {
        if name.is_empty() {
            return Err(Error::invalid("model", "must name a served model"));
        }
        self.models
            .get(name)
            .cloned()
            .ok_or_else(|| Error::NotFound(format!("model {name:?}; served: {}", self.names().join(", "))))
    }

    pub fn names(&self) -> Vec<String> {
        self.models.keys().cloned().collect()
    }

    pub fn iter(&self) -> impl Iterator<Item = &Arc<ServedModel>> {
        self.models.values()
    }
}

#[cfg(test)]
mod tests {
    use super::least_loaded;

    #[test]
    fn least_loaded_prefers_idle_then_first() {
        assert_eq!(least_loaded(&[3, 1, 2]), 1);
        assert_eq!(least_loaded(&[2, 0, 0]), 1);
        assert_eq!(least_loaded(&[5]), 0);
    }
}
