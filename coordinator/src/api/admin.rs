//! `strata.admin.v1.Admin` in cluster mode: desired state into the registry, actual state
//! out of this coordinator's view.
//!
//! Any coordinator takes admin calls; writes are the desired state (`models/`, `drain/`)
//! that the leader reconciles. A deployment is checked before it is written: the spec's
//! fields, then the model's config.json (read here or fetched from a worker) against the
//! requested split, so `tp = 3` on a model with 8 heads is an INVALID_ARGUMENT naming `tp`
//! rather than a replica that fails later.

use std::sync::Arc;

use serde::{de::DeserializeOwned, Serialize};
use strata_common::cluster::{decode, encode, now_ms, ModelSpec, ReplicaState, ShardState, WorkerRecord};
use strata_common::model_roots::ModelRoots;
use strata_common::registry::keys::Keys;
use strata_common::registry::Registry;
use strata_common::registry::{Entry, Guard, Op};
use strata_common::{
    Build, DeviceKind, Error, ErrorClass, ModelConfig, Result, ShardPlan, WeightBytes, WorkerId,
};
use strata_proto::admin::v1 as pb;
use strata_proto::admin::v1::admin_server::Admin;
use tokio::sync::watch;
use tonic::{Request, Response, Status};
use tracing::info;

use super::audit::{caller, AuditLog};
use super::audited::Audited;
use super::auth::AdminAuth;
use super::build_pb::{self, build_to_pb, flat_status};
use crate::control::view::ClusterView;
use crate::routing::catalog::ClusterCatalog;
use crate::tenant::usage::Ledger;
use crate::tenant::Tenants;
use strata_common::status::to_status;

pub struct ClusterAdmin {
    /// This coordinator's id.
    id: String,
    registry: Arc<dyn Registry>,
    keys: Keys,
    view: watch::Receiver<Arc<ClusterView>>,
    catalog: Arc<ClusterCatalog>,
    auth: AdminAuth,
    /// Where deployments may load models from.
    model_roots: ModelRoots,
    /// The device kind of a deployment that names none.
    default_device: DeviceKind,
    audit: AuditLog,
    /// The tenant directory this coordinator authenticates inference calls with.
    tenants: Tenants,
    /// The usage its front end counts (usage queries add this process's fresh counts to
    /// every process's stored records).
    ledger: Arc<Ledger>,
}

impl ClusterAdmin {
    pub fn new(
        id: String,
        registry: Arc<dyn Registry>,
        keys: Keys,
        view: watch::Receiver<Arc<ClusterView>>,
        catalog: Arc<ClusterCatalog>,
        auth: AdminAuth,
    ) -> Self {
        let audit = AuditLog::new(registry.clone(), keys.clone(), id.clone());
        let (model_roots, default_device) = (ModelRoots::default(), DeviceKind::Cpu);
        let (tenants, ledger) = (Tenants::default(), Arc::default());
        ClusterAdmin {
            id,
            registry,
            keys,
            view,
            catalog,
            auth,
            model_roots,
            default_device,
            audit,
            tenants,
            ledger,
        }
    }

    /// The directory inference calls are checked against (tenants made here join it).
    pub fn with_tenants(mut self, tenants: Tenants) -> Self {
        self.tenants = tenants;
        self
    }

    pub(super) fn tenants(&self) -> &Tenants {
        &self.tenants
    }

    /// Answers usage queries from `ledger` (the front end's).
    pub fn with_ledger(mut self, ledger: Arc<Ledger>) -> Self {
        self.ledger = ledger;
        self
    }

    pub(super) fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    pub(super) fn keys(&self) -> &Keys {
        &self.keys
    }

    pub(super) fn auth(&self) -> &AdminAuth {
        &self.auth
    }

    pub(super) fn catalog(&self) -> &ClusterCatalog {
        &self.catalog
    }

    pub(super) fn model_roots(&self) -> &ModelRoots {
        &self.model_roots
    }

    pub(super) fn view_rx(&self) -> watch::Receiver<Arc<ClusterView>> {
        self.view.clone()
    }

    /// The device kind of a deployment that names none.
    pub fn with_default_device(mut self, device: DeviceKind) -> Self {
        self.default_device = device;
        self
    }

    /// Deployments must name a directory under one of `roots` (none: any absolute path).
    pub fn with_model_roots(mut self, roots: ModelRoots) -> Self {
        self.model_roots = roots;
        self
    }

    fn view(&self) -> Arc<ClusterView> {
        self.view.borrow().clone()
    }

    pub(super) async fn spec(&self, name: &str) -> Result<ModelSpec> {
        if name.is_empty() {
            return Err(Error::invalid("name", "must name a deployed model"));
        }
        let key = self.keys.model(name);
        match self.registry.get(&key).await? {
            Some(e) => decode(&key, &e.value),
            None => Err(Error::NotFound(format!("model {name:?} is not deployed"))),
        }
    }

    fn status(&self, spec: &ModelSpec) -> pb::ModelStatus {
        let ready = self.view().ready_replicas(&spec.name).count();
        let (b, flat) = (&spec.build, flat_status(&spec.build));
        pb::ModelStatus {
            name: spec.name.to_string(),
            build: Some(build_to_pb(b)),
            model_dir: flat.model_dir,
            dtype: flat.dtype,
            tp: b.tp,
            pp: b.pp,
            ep: b.ep,
            desired_replicas: spec.replicas,
            ready_replicas: ready as u32,
            scheduler: flat.scheduler,
            generation: spec.generation,
            device: flat.device,
            weight_bytes_per_rank: spec.weight_bytes_per_rank,
            canary_revision: spec.rollout.canary.as_ref().map_or(0, |c| c.revision.generation),
            canary_percent: spec.rollout.canary.as_ref().map_or(0.0, |c| c.weight_bp as f64 / 100.0),
        }
    }

    /// Checks the model directory and the split, when the files can be reached, and
    /// returns the weight bytes of the largest rank (0 when they cannot be reached).
    pub(super) async fn check_model(&self, spec: &ModelSpec) -> Result<u64> {
        let view = self.view();
        let dir = match self.catalog.files().locate(&spec.build.model_dir, &view).await {
            Ok(d) => d,
            // Nobody can read it right now: the workers check it when they load.
            Err(e) if e.class() == ErrorClass::Unavailable => {
                info!(model = %spec.name, reason = %e, "deploying without checking the model files");
                return Ok(0);
            }
            Err(e) => return Err(e),
        };
        let config = tokio::task::spawn_blocking(move || ModelConfig::from_dir(&dir))
            .await
            .map_err(|e| Error::Internal(format!("reading config.json: {e}")))?
            .map_err(|e| match e {
                Error::ModelFile { path, reason } => {
                    Error::invalid("model_dir", format!("{}: {reason}", path.display()))
                }
                other => other,
            })?;
        let plan = ShardPlan::new(&config, spec.parallelism())?;
        Ok(plan.max_weight_bytes(&config, WeightBytes::of(&config, spec.build.dtype)))
    }
}

/// Most times a compare-and-set is retried when another admin raced it.
const CAS_ATTEMPTS: usize = 8;

impl ClusterAdmin {
    /// Applies `change` to the record at `key` (None: absent; returning None deletes it)
    /// by compare-and-set, retrying when another writer raced it; `what` names the record
    /// in the error when it kept changing.
    pub(super) async fn compare_and_set<T: Serialize + DeserializeOwned>(
        &self,
        key: &str,
        what: &str,
        change: impl Fn(Option<T>) -> Result<Option<T>>,
    ) -> Result<Option<T>> {
        for _ in 0..CAS_ATTEMPTS {
            let current = self.registry.get(key).await?;
            let old = current.as_ref().map(|e| decode::<T>(key, &e.value)).transpose()?;
            let new = change(old)?;
            let guard = |e: &Entry| Guard { key: key.to_string(), value: e.value.clone() };
            let written = match (&current, &new) {
                (None, None) => true,
                (None, Some(n)) => self.registry.create(key, encode(n), None).await?,
                (Some(e), Some(n)) => {
                    let put = Op::Put { key: key.to_string(), value: encode(n), lease: None };
                    self.registry.commit_if(&guard(e), vec![put]).await?
                }
                (Some(e), None) => {
                    self.registry.commit_if(&guard(e), vec![Op::Delete { key: key.to_string() }]).await?
                }
            };
            if written {
                return Ok(new);
            }
        }
        Err(Error::Unavailable(format!("{what} kept changing under this call; try again")))
    }
}

impl ClusterAdmin {
    /// Who sent `request`, as the audit log names them.
    fn caller<T>(&self, request: &Request<T>) -> String {
        caller(request, self.auth.token_valid(request))
    }

    /// Checks the admin credential, runs one admin action and records it in the audit log
    /// and the admin metrics, whatever its outcome: allowed, refused or failed. The one
    /// place every cluster-changing call goes through; the request says what it audits
    /// ([`Audited`]).
    async fn audited<R: Audited, T, F>(
        &self,
        request: Request<R>,
        run: impl FnOnce(Request<R>) -> F,
    ) -> Result<Response<T>, Status>
    where
        F: std::future::Future<Output = Result<Response<T>, Status>>,
    {
        let caller = self.caller(&request);
        let (target, detail) = (request.get_ref().target(), request.get_ref().detail());
        let result = match self.auth.check(&request) {
            Ok(()) => run(request).await,
            Err(refused) => Err(refused),
        };
        crate::control::metrics::admin_action(R::ACTION, result.is_ok());
        self.audit.record(R::ACTION, caller, &target, detail, &result).await;
        result
    }

    async fn do_deploy_model(
        &self,
        request: Request<pb::DeployModelRequest>,
    ) -> Result<Response<pb::DeployModelResponse>, Status> {
        let r = request.into_inner();
        let change = build_pb::requested(r.build.as_ref(), build_pb::deploy_flat(&r)).map_err(to_status)?;
        let build = Build::requested(change, Some(self.default_device));
        self.model_roots.check(&build.model_dir).map_err(to_status)?;
        let mut spec = ModelSpec {
            name: r.name.into(),
            build,
            weight_bytes_per_rank: 0,
            replicas: if r.replicas == 0 { 1 } else { r.replicas },
            generation: 1,
            created_ms: now_ms(),
            rollout: Default::default(),
        };
        spec.validate().map_err(to_status)?;
        // The weight estimate is derived, not asked for: it never makes a new revision.
        spec.weight_bytes_per_rank = self.check_model(&spec).await.map_err(to_status)?;
        let replicas = spec.replicas;
        let spec = self
            .update_spec(&spec.name.clone(), |old| match old {
                Some(mut old) => {
                    old.replicas = replicas;
                    old.redeploy(spec.revision())?;
                    Ok(old)
                }
                None => Ok(spec.clone()),
            })
            .await
            .map_err(to_status)?;
        let b = &spec.build;
        info!(model = %spec.name, dir = %b.model_dir, device = ?b.device, dtype = ?b.dtype, tp = b.tp, pp = b.pp, ep = b.ep, replicas = spec.replicas, weight_bytes_per_rank = spec.weight_bytes_per_rank, generation = spec.generation, "model deployed");
        Ok(Response::new(pb::DeployModelResponse { model: Some(self.status(&spec)) }))
    }

    async fn do_undeploy_model(
        &self,
        request: Request<pb::UndeployModelRequest>,
    ) -> Result<Response<pb::UndeployModelResponse>, Status> {
        let name = request.into_inner().name;
        self.spec(&name).await.map_err(to_status)?;
        self.registry.delete(&self.keys.model(&name)).await.map_err(to_status)?;
        info!(model = %name, "model undeployed; its replicas drain");
        Ok(Response::new(pb::UndeployModelResponse {}))
    }

    async fn do_scale_replicas(
        &self,
        request: Request<pb::ScaleReplicasRequest>,
    ) -> Result<Response<pb::ScaleReplicasResponse>, Status> {
        let r = request.into_inner();
        let spec = self
            .change_spec(&r.name, |spec| {
                spec.replicas = r.replicas;
                Ok(())
            })
            .await
            .map_err(to_status)?;
        info!(model = %spec.name, replicas = spec.replicas, "scaled");
        Ok(Response::new(pb::ScaleReplicasResponse { model: Some(self.status(&spec)) }))
    }

    async fn do_drain_worker(
        &self,
        request: Request<pb::DrainWorkerRequest>,
    ) -> Result<Response<pb::DrainWorkerResponse>, Status> {
        let r = request.into_inner();
        if r.worker_id.is_empty() {
            return Err(to_status(Error::invalid("worker_id", "must name a worker")));
        }
        let key = self.keys.drain(&r.worker_id);
        if r.undrain {
            self.registry.delete(&key).await.map_err(to_status)?;
            info!(worker = %r.worker_id, "worker undrained");
        } else {
            if !self.view().workers.contains_key(r.worker_id.as_str()) {
                return Err(to_status(Error::NotFound(format!(
                    "worker {:?} is not registered",
                    r.worker_id
                ))));
            }
            self.registry.put(&key, Vec::new(), None).await.map_err(to_status)?;
            info!(worker = %r.worker_id, "worker drained: its replica moves elsewhere");
        }
        Ok(Response::new(pb::DrainWorkerResponse {}))
    }
}

#[tonic::async_trait]
impl Admin for ClusterAdmin {
    async fn deploy_model(
        &self,
        request: Request<pb::DeployModelRequest>,
    ) -> Result<Response<pb::DeployModelResponse>, Status> {
        self.audited(request, |r| self.do_deploy_model(r)).await
    }

    async fn undeploy_model(
        &self,
        request: Request<pb::UndeployModelRequest>,
    ) -> Result<Response<pb::UndeployModelResponse>, Status> {
        self.audited(request, |r| self.do_undeploy_model(r)).await
    }

    async fn scale_replicas(
        &self,
        request: Request<pb::ScaleReplicasRequest>,
    ) -> Result<Response<pb::ScaleReplicasResponse>, Status> {
        self.audited(request, |r| self.do_scale_replicas(r)).await
    }

    async fn drain_worker(
        &self,
        request: Request<pb::DrainWorkerRequest>,
    ) -> Result<Response<pb::DrainWorkerResponse>, Status> {
        self.audited(request, |r| self.do_drain_worker(r)).await
    }

    async fn set_tenant(
        &self,
        request: Request<pb::SetTenantRequest>,
    ) -> Result<Response<pb::SetTenantResponse>, Status> {
        self.audited(request, |r| self.do_set_tenant(r)).await
    }

    async fn delete_tenant(
        &self,
        request: Request<pb::DeleteTenantRequest>,
    ) -> Result<Response<pb::DeleteTenantResponse>, Status> {
        self.audited(request, |r| self.do_delete_tenant(r)).await
    }

    async fn list_tenants(
        &self,
        request: Request<pb::ListTenantsRequest>,
    ) -> Result<Response<pb::ListTenantsResponse>, Status> {
        self.do_list_tenants(request).await
    }

    async fn create_api_key(
        &self,
        request: Request<pb::CreateApiKeyRequest>,
    ) -> Result<Response<pb::CreateApiKeyResponse>, Status> {
        self.audited(request, |r| self.do_create_api_key(r)).await
    }

    async fn revoke_api_key(
        &self,
        request: Request<pb::RevokeApiKeyRequest>,
    ) -> Result<Response<pb::RevokeApiKeyResponse>, Status> {
        self.audited(request, |r| self.do_revoke_api_key(r)).await
    }

    async fn get_usage(
        &self,
        request: Request<pb::GetUsageRequest>,
    ) -> Result<Response<pb::GetUsageResponse>, Status> {
        self.do_get_usage(request).await
    }

    async fn start_rollout(
        &self,
        request: Request<pb::StartRolloutRequest>,
    ) -> Result<Response<pb::RolloutResponse>, Status> {
        self.audited(request, |r| self.do_start_rollout(r)).await
    }

    async fn set_rollout_weight(
        &self,
        request: Request<pb::SetRolloutWeightRequest>,
    ) -> Result<Response<pb::RolloutResponse>, Status> {
        self.audited(request, |r| self.do_set_rollout_weight(r)).await
    }

    async fn promote_rollout(
        &self,
        request: Request<pb::PromoteRolloutRequest>,
    ) -> Result<Response<pb::RolloutResponse>, Status> {
        self.audited(request, |r| self.do_promote_rollout(r)).await
    }

    async fn rollback_rollout(
        &self,
        request: Request<pb::RollbackRolloutRequest>,
    ) -> Result<Response<pb::RolloutResponse>, Status> {
        self.audited(request, |r| self.do_rollback_rollout(r)).await
    }

    async fn get_rollout(
        &self,
        request: Request<pb::GetRolloutRequest>,
    ) -> Result<Response<pb::RolloutResponse>, Status> {
        self.do_get_rollout(request).await
    }

    async fn list_audit(
        &self,
        request: Request<pb::ListAuditRequest>,
    ) -> Result<Response<pb::ListAuditResponse>, Status> {
        self.auth.check(&request)?;
        let limit = match request.get_ref().limit {
            0 => 100,
            n => n.min(1000) as usize,
        };
        let entries = self.audit.list(limit).await.map_err(to_status)?;
        Ok(Response::new(pb::ListAuditResponse { entries: entries.into_iter().map(Into::into).collect() }))
    }

    async fn list_models(
        &self,
        request: Request<pb::ListModelsRequest>,
    ) -> Result<Response<pb::ListModelsResponse>, Status> {
        self.auth.check(&request)?;
        let view = self.view();
        let models = view.models.values().map(|s| self.status(s)).collect();
        Ok(Response::new(pb::ListModelsResponse { models, stale_since_ms: view.stale_since_ms.unwrap_or(0) }))
    }

    async fn list_replicas(
        &self,
        request: Request<pb::ListReplicasRequest>,
    ) -> Result<Response<pb::ListReplicasResponse>, Status> {
        self.auth.check(&request)?;
        let name = request.into_inner().name;
        let view = self.view();
        if !name.is_empty()
            && !view.models.contains_key(name.as_str())
            && !view.replicas.contains_key(name.as_str())
        {
            return Err(to_status(Error::NotFound(format!("model {name:?} is not deployed"))));
        }
        let mut replicas: Vec<pb::ReplicaStatus> = view
            .all_replicas()
            .filter(|r| name.is_empty() || r.model == name)
            .map(|r| pb::ReplicaStatus {
                id: r.id.to_string(),
                model: r.model.to_string(),
                state: match r.state {
                    ReplicaState::Pending => pb::ReplicaState::Pending,
                    ReplicaState::Loading => pb::ReplicaState::Loading,
                    ReplicaState::Ready => pb::ReplicaState::Ready,
                    ReplicaState::Draining => pb::ReplicaState::Draining,
                    ReplicaState::Failed => pb::ReplicaState::Failed,
                } as i32,
                reason: r.reason.clone(),
                workers: r.workers.iter().map(WorkerId::to_string).collect(),
                leader_address: r.leader_address.clone(),
                generation: r.generation,
                since_ms: r.since_ms,
            })
            .collect();
        replicas.sort_by(|a, b| (&a.model, &a.id).cmp(&(&b.model, &b.id)));
        Ok(Response::new(pb::ListReplicasResponse {
            replicas,
            stale_since_ms: view.stale_since_ms.unwrap_or(0),
        }))
    }

    async fn get_leader(
        &self,
        request: Request<pb::GetLeaderRequest>,
    ) -> Result<Response<pb::GetLeaderResponse>, Status> {
        self.auth.check(&request)?;
        let view = self.view();
        let leader_id = view.leader.clone().unwrap_or_default();
        Ok(Response::new(pb::GetLeaderResponse {
            leader_id,
            coordinator_id: self.id.clone(),
            stale_since_ms: view.stale_since_ms.unwrap_or(0),
        }))
    }

    async fn list_workers(
        &self,
        request: Request<pb::ListWorkersRequest>,
    ) -> Result<Response<pb::ListWorkersResponse>, Status> {
        self.auth.check(&request)?;
        let view = self.view();
        let mut workers: Vec<pb::WorkerStatus> = view
            .workers
            .values()
            .map(|w| {
                let state = match (w.leaving, view.drained.contains(&w.id)) {
                    (true, _) => "leaving",
                    (false, true) => "draining",
                    (false, false) => "up",
                };
                worker_status(w, &view, state)
            })
            .collect();
        // A departed worker holds no shard, whatever its last registration said (a lost
        // worker was once listed with the shard of the replica it took down).
        workers.extend(view.departed.values().map(|d| {
            let record = WorkerRecord { assignment: None, ..d.record.clone() };
            pb::WorkerStatus {
                state_since_ms: d.since_ms,
                reason: d.reason().into(),
                ..worker_status(&record, &view, d.state())
            }
        }));
        let stale_since_ms = view.stale_since_ms.unwrap_or(0);
        Ok(Response::new(pb::ListWorkersResponse { workers, stale_since_ms }))
    }
}

/// A worker's registration as admin.v1 lists it, in `state`.
fn worker_status(w: &WorkerRecord, view: &ClusterView, state: &str) -> pb::WorkerStatus {
    pb::WorkerStatus {
        id: w.id.to_string(),
        address: w.address.clone(),
        device_kind: w.capacity.device_kind.to_string(),
        device_count: w.capacity.device_count,
        memory_bytes: w.capacity.memory_bytes,
        replica: w.assignment.as_ref().map(|a| a.replica.to_string()).unwrap_or_default(),
        draining: view.drained.contains(&w.id),
        rank: w.assignment.as_ref().map(|a| a.rank).unwrap_or(0),
        shard_state: match w.assignment.as_ref().map(|a| a.state) {
            Some(ShardState::Loading) => "loading",
            Some(ShardState::Ready) => "ready",
            Some(ShardState::Failed) => "failed",
            None => "",
        }
        .to_string(),
        started_ms: w.started_ms,
        memory_total_bytes: w.capacity.memory_total_bytes,
        node: w.capacity.node.clone(),
        kv_cache_bytes: w.capacity.kv_cache_bytes,
        state: state.into(),
        state_since_ms: 0,
        reason: String::new(),
    }
}
