//! Cluster mode's catalog: the deployed models, from the registry view.
//!
//! A coordinator needs each model's config (context length, vocabulary) and tokenizer to
//! admit requests. It reads them from the model directory when it can see it (a shared
//! volume), and otherwise asks a live worker for the files (`WorkerApi::model_files`) and keeps them
//! in a private cache directory — so coordinators need not mount the models. A
//! background task loads entries as models are deployed and polls replica load.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use strata_common::build::ChatOverrides;
use strata_common::worker_api::ModelFiles;
use strata_common::{Error, ErrorClass, ModelConfig, ModelName, Result};
use tokio::sync::watch;
use tracing::{info, warn};

use super::clients::WorkerClients;
use super::cluster::ClusterRoutes;
use super::policy::PolicyKind;
use crate::control::view::ClusterView;
use crate::request::chat::ChatSettings;
use crate::request::tokenizer::Tokenizer;
use crate::routing::{not_found, Catalog, ModelEntry};

/// Finds a model's small files: the local directory, or a copy fetched from a worker.
pub struct ModelFileCache {
    clients: Arc<WorkerClients>,
    cache: tempfile::TempDir,
}

impl ModelFileCache {
    pub fn new(clients: Arc<WorkerClients>) -> Result<Self> {
        let cache = tempfile::Builder::new()
            .prefix("strata-model-files-")
            .tempdir()
            .map_err(|e| Error::Internal(format!("cannot create the model file cache: {e}")))?;
        Ok(ModelFileCache { clients, cache })
    }

    /// A local directory holding `model_dir`'s config.json and tokenizer.json.
    pub async fn locate(&self, model_dir: &str, view: &ClusterView) -> Result<PathBuf> {
        let local = Path::new(model_dir);
        if local.join("config.json").is_file() && local.join("tokenizer.json").is_file() {
            return Ok(local.to_path_buf());
        }
        let mut last = None;
        for w in view.workers.values() {
            let Ok(worker) = self.clients.get(&w.address) else { continue };
            match worker.model_files(model_dir).await {
                Ok(files) => return self.store(model_dir, files),
                Err(e) if e.class() == ErrorClass::InvalidInput => {
                    return Err(Error::invalid("model_dir", format!("{model_dir} on worker {}: {e}", w.id)))
                }
                Err(e) => last = Some(format!("worker {}: {e}", w.id)),
            }
        }
        Err(Error::Unavailable(match last {
            Some(e) => {
                format!("model_dir {model_dir}: not readable here, and no worker could send its files ({e})")
            }
            None => {
                format!("model_dir {model_dir}: not readable here, and no worker is registered to read it")
            }
        }))
    }

    fn store(&self, model_dir: &str, files: ModelFiles) -> Result<PathBuf> {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        model_dir.hash(&mut h);
        let dir = self.cache.path().join(format!("{:016x}", h.finish()));
        let io = |e: std::io::Error| Error::Internal(format!("model file cache: {e}"));
        std::fs::create_dir_all(&dir).map_err(io)?;
        for (name, bytes) in files.named() {
            if !bytes.is_empty() {
                std::fs::write(dir.join(name), bytes).map_err(io)?;
            }
        }
        Ok(dir)
    }
}

struct Loaded {
    model_dir: String,
    /// The deployment's chat settings the entry was loaded under.
    chat: ChatOverrides,
    entry: Arc<ModelEntry>,
    routes: Arc<ClusterRoutes>,
}

pub struct ClusterCatalog {
    view: watch::Receiver<Arc<ClusterView>>,
    clients: Arc<WorkerClients>,
    files: ModelFileCache,
    entries: Mutex<HashMap<String, Loaded>>,
    /// Why a deployed model has no entry yet.
    errors: Mutex<HashMap<String, String>>,
    /// How each model's router picks a replica.
    policy: PolicyKind,
    /// The operator's chat template and tool-call format over each model's own.
    chat: ChatSettings,
}

impl ClusterCatalog {
    /// Starts loading entries as models appear in the view.
    /// Each model's router picks replicas by `policy`.
    pub fn start(
        view: watch::Receiver<Arc<ClusterView>>,
        clients: Arc<WorkerClients>,
        policy: PolicyKind,
    ) -> Result<Arc<Self>> {
        Self::start_with(view, clients, policy, ChatSettings::default())
    }

    /// [`ClusterCatalog::start`], every model's chat template read under `chat`.
    pub fn start_with(
        view: watch::Receiver<Arc<ClusterView>>,
        clients: Arc<WorkerClients>,
        policy: PolicyKind,
        chat: ChatSettings,
    ) -> Result<Arc<Self>> {
        let files = ModelFileCache::new(clients.clone())?;
        let catalog = Arc::new(ClusterCatalog {
            view,
            clients,
            files,
            entries: Mutex::new(HashMap::new()),
            errors: Mutex::new(HashMap::new()),
            policy,
            chat,
        });
        let weak = Arc::downgrade(&catalog);
        let mut view = catalog.view.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(500));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            let mut polls = 0u64;
            // Replicas' stats every fourth tick, and at once when the view changed (a new
            // replica's context limit is known before requests rely on it).
            let mut changed = true;
            loop {
                let Some(c) = weak.upgrade() else { return };
                view.borrow_and_update();
                c.refresh().await;
                if changed || polls.is_multiple_of(4) {
                    let routes: Vec<Arc<ClusterRoutes>> = c
                        .entries
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .values()
                        .map(|l| l.routes.clone())
                        .collect();
                    for r in routes {
                        r.poll_stats().await;
                    }
                }
                polls += 1;
                drop(c);
                changed = tokio::select! {
                    _ = tick.tick() => false,
                    _ = view.changed() => true,
                };
            }
        });
        Ok(catalog)
    }

    pub fn files(&self) -> &ModelFileCache {
        &self.files
    }

    /// Loads entries of newly deployed models; drops those of undeployed ones.
    async fn refresh(&self) {
        let view = self.view.borrow().clone();
        let wanted: Vec<(String, String, ChatOverrides)> = view
            .models
            .values()
            .map(|m| (m.name.to_string(), m.build.model_dir.clone(), m.build.chat.clone()))
            .collect();
        self.entries.lock().unwrap_or_else(|p| p.into_inner()).retain(|name, _| {
            let kept = view.models.contains_key(name.as_str());
            if !kept {
                strata_common::metrics::forget_model(name);
            }
            kept
        });
        for (name, dir, chat) in wanted {
            // A model whose directory or chat settings changed (a redeploy, a promoted
            // rollout) keeps its entry and routes until the new files are loaded: requests
            // never find it missing.
            let routes = match self.entries.lock().unwrap_or_else(|p| p.into_inner()).get(&name) {
                Some(l) if l.model_dir == dir && l.chat == chat => continue,
                Some(l) => Some(l.routes.clone()),
                None => None,
            };
            match self.load(&name, (&dir, &chat), &view, routes).await {
                Ok(l) => {
                    info!(model = %name, dir = %dir, "model files loaded");
                    self.errors.lock().unwrap_or_else(|p| p.into_inner()).remove(&name);
                    self.entries.lock().unwrap_or_else(|p| p.into_inner()).insert(name, l);
                }
                Err(e) => {
                    let mut errors = self.errors.lock().unwrap_or_else(|p| p.into_inner());
                    if errors.get(&name) != Some(&e.to_string()) {
                        warn!(model = %name, error = %e, "cannot load model files yet");
                    }
                    errors.insert(name, e.to_string());
                }
            }
        }
    }

    async fn load(
        &self,
        name: &str,
        (model_dir, over): (&str, &ChatOverrides),
        view: &ClusterView,
        routes: Option<Arc<ClusterRoutes>>,
    ) -> Result<Loaded> {
        let dir = self.files.locate(model_dir, view).await?;
        // The deployment's settings over the process's over the model's own.
        let mut chat = self.chat.clone();
        if !over.template.is_empty() {
            chat.template = Some(over.template.clone());
        }
        if let Some(format) = crate::request::tools::ToolFormat::parse(&over.tool_call_parser) {
            chat.tool_format = Some(format);
        }
        let (config, tokenizer) = tokio::task::spawn_blocking(move || -> Result<(ModelConfig, Tokenizer)> {
            Ok((ModelConfig::from_dir(&dir)?, Tokenizer::from_dir_with(&dir, &chat)?))
        })
        .await
        .map_err(|e| Error::Internal(format!("loading model files: {e}")))??;
        let routes = routes.unwrap_or_else(|| {
            Arc::new(ClusterRoutes::new(name, self.view.clone(), self.clients.clone(), self.policy))
        });
        let entry =
            Arc::new(ModelEntry { name: name.to_string(), config, tokenizer, routes: routes.clone() });
        Ok(Loaded { model_dir: model_dir.to_string(), chat: over.clone(), entry, routes })
    }
}

impl Catalog for ClusterCatalog {
    fn get(&self, name: &str) -> Result<Arc<ModelEntry>> {
        let view = self.view.borrow().clone();
        if !view.models.contains_key(name) {
            return Err(not_found(name, &view.models.keys().map(ModelName::to_string).collect::<Vec<_>>()));
        }
        if let Some(l) = self.entries.lock().unwrap_or_else(|p| p.into_inner()).get(name) {
            return Ok(l.entry.clone());
        }
        let why = self.errors.lock().unwrap_or_else(|p| p.into_inner()).get(name).cloned();
        Err(Error::Unavailable(format!(
            "model {name:?} is deployed but its tokenizer is not loaded yet{}",
            why.map(|w| format!(": {w}")).unwrap_or_default()
        )))
    }

    fn all(&self) -> Vec<Arc<ModelEntry>> {
        let mut v: Vec<Arc<ModelEntry>> = self
            .entries
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .map(|l| l.entry.clone())
            .collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
    }
}
