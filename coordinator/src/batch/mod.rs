//! Batch jobs in the shape of OpenAI's Batch API: upload a JSONL file of requests, create a
//! batch over it, poll it, download the output and error files; cancel it.
//!
//! Jobs and files live in the coordinator's data directory ([`store`]); a coordinator
//! restarted on the same directory resumes its unfinished batches where they were
//! ([`run`]). Each batch runs its requests through the same admission, routing and
//! failover as online calls, at lower priority, as the tenant that created them (a tenant
//! sees only its own files and batches; its batch requests count in its usage and are
//! held to its models, `max_tokens_per_request` and rates, paced by the batch runner's one
//! budget for all batches rather than its `max_concurrent`). Batches belong to the
//! coordinator whose
//! data directory holds them: with several coordinators, send the batch API to one of them
//! (or give them one shared directory and one batch runner: see docs/HTTP_API.md).

pub mod http;
pub mod index;
pub mod run;
pub mod store;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use serde_json::Value as Json;
use strata_common::{Error, Result};
use tracing::warn;

use self::index::{FileIndex, FileQuery, Reservation};
use self::store::{new_id, now, BatchObject, Counts, FileObject, Store};
use crate::frontend::FrontEnd;
use crate::tenant::{Caller, Owner, Tenants};

/// Largest file one upload may be.
pub const MAX_FILE_BYTES: u64 = 100 << 20;

/// Batches run at once, all tenants together; more wait their turn (each running batch
/// keeps its input's line index in memory and reads its lines from disk).
pub const MAX_RUNNING_BATCHES: usize = 8;

/// Unfinished batches (waiting or running) one tenant may have; more are refused.
pub const MAX_TENANT_UNFINISHED: usize = 16;

/// A batch being run: its object and whether it was cancelled.
pub struct Job {
    object: Mutex<BatchObject>,
    cancelled: AtomicBool,
}

impl Job {
    pub fn snapshot(&self) -> BatchObject {
        self.object.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Relaxed)
    }

    /// Whether `owner` owns the batch and it has not ended.
    fn owned_unfinished(&self, owner: &Owner) -> bool {
        let b = self.object.lock().unwrap_or_else(|p| p.into_inner());
        b.tenant == owner.tenant && b.tenant_incarnation == owner.incarnation && b.unfinished()
    }

    /// Changes the object and writes it to disk.
    fn update(&self, batches: &Batches, f: impl FnOnce(&mut BatchObject)) {
        let b = {
            let mut b = self.object.lock().unwrap_or_else(|p| p.into_inner());
            f(&mut b);
            b.clone()
        };
        if let Err(e) = batches.store.save_batch(&b) {
            warn!(batch = %b.id, "cannot save the batch: {e}");
        }
    }

    /// Counts one ended request (written to disk at the next save).
    fn count(&self, ok: bool) {
        let mut b = self.object.lock().unwrap_or_else(|p| p.into_inner());
        b.runs_without_progress = 0;
        if ok {
            b.request_counts.completed += 1;
        } else {
            b.request_counts.failed += 1;
        }
    }

    fn save(&self, batches: &Batches) {
        self.update(batches, |_| {});
    }
}

/// The batch service of one coordinator.
pub struct Batches {
    store: Store,
    front: Arc<FrontEnd>,
    /// Batch requests in flight at once, all batches together (`--batch-concurrency`).
    concurrency: usize,
    /// Batch requests in flight now, all batches together.
    running: std::sync::atomic::AtomicUsize,
    jobs: Mutex<HashMap<String, Arc<Job>>>,
    tenants: Tenants,
    /// Each tenant's files ([`index`]).
    index: Arc<FileIndex>,
    /// Places among the batches running at once ([`MAX_RUNNING_BATCHES`]).
    runs: Arc<tokio::sync::Semaphore>,
}

impl Batches {
    /// Opens the data directory and resumes every unfinished batch in it.
    pub fn start(
        dir: &std::path::Path,
        front: Arc<FrontEnd>,
        concurrency: usize,
        tenants: Tenants,
    ) -> Result<Arc<Self>> {
        let store = Store::open(dir)?;
        let index = Arc::new(FileIndex::of(store.files()?));
        let mut jobs = HashMap::new();
        for b in store.batches()? {
            jobs.insert(
                b.id.clone(),
                Arc::new(Job { object: Mutex::new(b), cancelled: AtomicBool::new(false) }),
            );
        }
        let batches = Arc::new(Batches {
            store,
            front,
            concurrency,
            running: Default::default(),
            jobs: Mutex::new(jobs),
            tenants,
            index,
            runs: Arc::new(tokio::sync::Semaphore::new(MAX_RUNNING_BATCHES)),
        });
        let unfinished: Vec<Arc<Job>> =
            batches.jobs().into_iter().filter(|j| j.snapshot().unfinished()).collect();
        for job in unfinished {
            let b = job.snapshot();
            tracing::info!(batch = %b.id, status = %b.status, "resuming a batch");
            if b.status == "cancelling" {
                job.cancelled.store(true, Ordering::Relaxed);
            }
            tokio::spawn(run::run(batches.clone(), job));
        }
        Ok(batches)
    }

    fn jobs(&self) -> Vec<Arc<Job>> {
        self.jobs.lock().unwrap_or_else(|p| p.into_inner()).values().cloned().collect()
    }

    /// The batch `id` if `owner` owns it (another tenant's batch is not found).
    fn job(&self, id: &str, owner: &Owner) -> Result<Arc<Job>> {
        store::check_id(id)?;
        self.jobs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(id)
            .filter(|j| &j.snapshot().owner() == owner)
            .cloned()
            .ok_or_else(|| Error::NotFound(format!("no such batch {id:?}")))
    }

    /// The file `id` if `owner` owns it.
    pub fn file(&self, id: &str, owner: &Owner) -> Result<FileObject> {
        store::check_id(id)?;
        self.index.get(owner, id).ok_or_else(|| Error::NotFound(format!("no such file {id:?}")))
    }

    /// A page of `owner`'s files, and whether more follow.
    pub fn files(&self, owner: &Owner, q: &FileQuery) -> (Vec<FileObject>, bool) {
        self.index.page(owner, q)
    }

    /// Deletes `owner`'s file `id`.
    pub fn delete_file(&self, id: &str, owner: &Owner) -> Result<()> {
        self.file(id, owner)?;
        self.store.delete_file(id)?;
        self.index.remove(owner, id);
        Ok(())
    }

    /// A place for one more of `owner`'s files (see [`index`]).
    pub fn reserve_file(&self, owner: &Owner) -> Result<Reservation> {
        self.index.reserve(owner)
    }

    /// The caller a batch's requests run as: its tenant, held to its rates, paced by the
    /// batch runner rather than its `max_concurrent`.
    fn caller(&self, owner: &Owner) -> Result<Caller> {
        self.tenants.caller(owner).map(Caller::for_batch)
    }

    /// Makes the file `id` (its data already written) visible to `owner` as `filename`.
    fn publish(&self, id: &str, filename: &str, owner: &Owner) -> Result<String> {
        let bytes = std::fs::metadata(self.store.data_path(id)).map(|m| m.len()).unwrap_or(0);
        let f = FileObject {
            id: id.to_string(),
            object: "file".into(),
            bytes,
            created_at: now(),
            filename: filename.to_string(),
            purpose: "batch_output".into(),
            status: "processed".into(),
            tenant: owner.tenant.clone(),
            tenant_incarnation: owner.incarnation.clone(),
        };
        self.store.save_file(&f)?;
        self.index.insert(f.clone());
        Ok(f.id)
    }

    /// Registers an uploaded file whose bytes are at `upload` (moved into place), in the
    /// place `reserved` for it.
    pub fn add_file(
        &self,
        upload_id: &str,
        (filename, purpose): (&str, &str),
        bytes: u64,
        reserved: Reservation,
        owner: &Owner,
    ) -> Result<FileObject> {
        let f = FileObject {
            id: upload_id.to_string(),
            object: "file".into(),
            bytes,
            created_at: now(),
            filename: filename.to_string(),
            purpose: purpose.to_string(),
            status: "processed".into(),
            tenant: owner.tenant.clone(),
            tenant_incarnation: owner.incarnation.clone(),
        };
        let (from, to) = (self.store.upload_path(upload_id), self.store.data_path(upload_id));
        std::fs::rename(&from, &to).map_err(|e| Error::Internal(format!("{}: {e}", to.display())))?;
        self.store.save_file(&f)?;
        reserved.commit(f.clone());
        Ok(f)
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Creates a batch over the uploaded file `input_file_id` and starts it.
    pub fn create(
        self: &Arc<Self>,
        input_file_id: &str,
        endpoint: &str,
        completion_window: &str,
        metadata: Option<Json>,
        owner: &Owner,
    ) -> Result<BatchObject> {
        if !matches!(endpoint, "/v1/completions" | "/v1/chat/completions") {
            return Err(Error::invalid("endpoint", "must be /v1/completions or /v1/chat/completions"));
        }
        if completion_window != "24h" {
            return Err(Error::invalid("completion_window", "must be 24h"));
        }
        let file = self
            .file(input_file_id, owner)
            .map_err(|_| Error::invalid("input_file_id", format!("no uploaded file {input_file_id:?}")))?;
        if file.purpose != "batch" {
            return Err(Error::invalid("input_file_id", "the file's purpose must be batch"));
        }
        if let Some(m) = &metadata {
            store::check_metadata(m)?;
        }
        let unfinished = self.jobs().iter().filter(|j| j.owned_unfinished(owner)).count();
        if unfinished >= MAX_TENANT_UNFINISHED {
            return Err(Error::Overloaded(format!(
                "the tenant has {unfinished} unfinished batches, at most {MAX_TENANT_UNFINISHED}: wait for some to end"
            )));
        }
        let created = now();
        let b = BatchObject {
            id: new_id("batch_"),
            object: "batch".into(),
            endpoint: endpoint.to_string(),
            errors: None,
            input_file_id: file.id,
            completion_window: completion_window.to_string(),
            status: "validating".into(),
            output_file_id: None,
            error_file_id: None,
            created_at: created,
            in_progress_at: None,
            expires_at: Some(created + 24 * 3600),
            finalizing_at: None,
            completed_at: None,
            failed_at: None,
            expired_at: None,
            cancelling_at: None,
            cancelled_at: None,
            request_counts: Counts::default(),
            metadata,
            tenant: owner.tenant.clone(),
            tenant_incarnation: owner.incarnation.clone(),
            runs_without_progress: 0,
        };
        self.store.save_batch(&b)?;
        let job = Arc::new(Job { object: Mutex::new(b.clone()), cancelled: AtomicBool::new(false) });
        self.jobs.lock().unwrap_or_else(|p| p.into_inner()).insert(b.id.clone(), job.clone());
        tokio::spawn(run::run(self.clone(), job));
        Ok(b)
    }

    pub fn get(&self, id: &str, owner: &Owner) -> Result<BatchObject> {
        Ok(self.job(id, owner)?.snapshot())
    }

    /// Up to `limit` of `owner`'s batches, newest first, after batch `after` (only the
    /// page is copied); and whether more follow.
    pub fn list(&self, owner: &Owner, after: Option<&str>, limit: usize) -> (Vec<BatchObject>, bool) {
        let mut mine: Vec<(u64, String, Arc<Job>)> = self
            .jobs()
            .into_iter()
            .filter_map(|j| {
                let b = j.object.lock().unwrap_or_else(|p| p.into_inner());
                (b.tenant == owner.tenant && b.tenant_incarnation == owner.incarnation)
                    .then(|| (b.created_at, b.id.clone()))
                    .map(|(at, id)| (at, id, j.clone()))
            })
            .collect();
        mine.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| b.1.cmp(&a.1)));
        index::page_after(&mine, |m| &m.1, (after, limit), |m| m.2.snapshot())
    }

    /// Asks a running batch to stop: it ends as `cancelled`, with the results so far.
    pub fn cancel(&self, id: &str, owner: &Owner) -> Result<BatchObject> {
        let job = self.job(id, owner)?;
        if !job.snapshot().unfinished() {
            return Err(Error::FailedPrecondition(format!("batch {id} has already ended")));
        }
        job.cancelled.store(true, Ordering::Relaxed);
        job.update(self, |b| {
            b.status = "cancelling".into();
            b.cancelling_at = Some(now());
        });
        Ok(job.snapshot())
    }
}
