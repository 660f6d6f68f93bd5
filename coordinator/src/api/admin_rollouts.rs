//! admin.v1 rollouts: a new revision beside the serving one as a canary, its share of
//! requests, promote and rollback (the state transitions are `strata_common::rollout`'s;
//! this file checks requests, writes specs by compare-and-set and reports revisions).
//!
//! A canary must tokenize as the serving revision does: the coordinator tokenizes before
//! the split picks a revision, so a rollout whose tokenizer or vocabulary differs is
//! refused (deploy it under a new name instead).

use std::time::Duration;

use strata_common::cluster::ModelSpec;
use strata_common::rollout::{percent_to_weight, Revision, FULL_WEIGHT};
use strata_common::status::to_status;
use strata_common::{Error, ErrorClass, ModelConfig, Result};
use strata_proto::admin::v1 as pb;
use tonic::{Request, Response, Status};
use tracing::info;

use super::admin::ClusterAdmin;
use super::build_pb::{self, build_to_pb, flat_status};

impl ClusterAdmin {
    /// Applies `change` to the model's spec (None: not deployed) by compare-and-set,
    /// checks and writes the result, then waits until this coordinator's view has it.
    pub(super) async fn update_spec(
        &self,
        name: &str,
        change: impl Fn(Option<ModelSpec>) -> Result<ModelSpec>,
    ) -> Result<ModelSpec> {
        if name.is_empty() {
            return Err(Error::invalid("name", "must name a deployed model"));
        }
        let key = self.keys().model(name);
        let written = self
            .compare_and_set(&key, &format!("model {name:?}"), |old| {
                let new = change(old)?;
                new.validate()?;
                Ok(Some(new))
            })
            .await?;
        let new = written.ok_or_else(|| Error::Internal(format!("model {name:?}: nothing written")))?;
        self.await_spec(&new).await;
        Ok(new)
    }

    /// Applies `f` to a deployed model's spec (NotFound when none), as `update_spec`.
    pub(super) async fn change_spec(
        &self,
        name: &str,
        f: impl Fn(&mut ModelSpec) -> Result<()>,
    ) -> Result<ModelSpec> {
        self.update_spec(name, |old| {
            let mut spec = old.ok_or_else(|| not_deployed(name))?;
            f(&mut spec)?;
            Ok(spec)
        })
        .await
    }

    /// Waits (briefly) for this coordinator's view to show `spec`, so that its own
    /// routing follows the change before the call returns.
    async fn await_spec(&self, spec: &ModelSpec) {
        let mut view = self.view_rx();
        let _ = tokio::time::timeout(Duration::from_secs(5), async {
            while view.borrow_and_update().models.get(spec.name.as_str()) != Some(spec) {
                if view.changed().await.is_err() {
                    return;
                }
            }
        })
        .await;
    }

    /// Refuses a canary that would tokenize differently from the serving revision (when
    /// both directories can be read here or fetched from a worker).
    async fn check_compatible(&self, serving: &ModelSpec, canary: &ModelSpec) -> Result<()> {
        if serving.build.model_dir == canary.build.model_dir {
            return Ok(());
        }
        let view = self.view_rx().borrow().clone();
        let files = self.catalog().files();
        let (a, b) = match (
            files.locate(&serving.build.model_dir, &view).await,
            files.locate(&canary.build.model_dir, &view).await,
        ) {
            (Ok(a), Ok(b)) => (a, b),
            (Err(e), _) | (_, Err(e)) if e.class() == ErrorClass::Unavailable => return Ok(()),
            (Err(e), _) | (_, Err(e)) => return Err(e),
        };
        tokio::task::spawn_blocking(move || -> Result<()> {
            let (ca, cb) = (ModelConfig::from_dir(&a)?, ModelConfig::from_dir(&b)?);
            let read = |d: &std::path::Path| {
                strata_common::files::read_bounded(
                    &d.join("tokenizer.json"),
                    strata_common::files::MAX_TOKENIZER_FILE,
                )
            };
            if ca.vocab_size != cb.vocab_size || read(&a)? != read(&b)? {
                return Err(Error::invalid(
                    "model_dir",
                    "its tokenizer or vocabulary differs from the serving revision's; a rollout \
                     must tokenize the same (deploy it under a new name instead)",
                ));
            }
            Ok(())
        })
        .await
        .map_err(|e| Error::Internal(format!("comparing tokenizers: {e}")))?
    }

    pub(super) async fn do_start_rollout(
        &self,
        request: Request<pb::StartRolloutRequest>,
    ) -> Result<Response<pb::RolloutResponse>, Status> {
        let r = request.into_inner();
        let bp = percent_to_weight(r.canary_percent).map_err(to_status)?;
        let serving = self.spec(&r.name).await.map_err(to_status)?;
        let change = build_pb::requested(r.build.as_ref(), build_pb::rollout_flat(&r)).map_err(to_status)?;
        if let Some(dir) = &change.model_dir {
            self.model_roots().check(dir).map_err(to_status)?;
        }
        // Check the new revision as a deployment of its own before writing anything.
        let mut next = Revision::of(serving.build.changed(change), 0);
        let probe = {
            let mut s = serving.clone();
            s.rollout = Default::default();
            s.start_canary(next.clone(), bp, 1).map_err(to_status)?;
            s.canary_spec().expect("a canary was just started")
        };
        probe.validate().map_err(to_status)?;
        next.weight_bytes_per_rank = self.check_model(&probe).await.map_err(to_status)?;
        self.check_compatible(&serving, &probe).await.map_err(to_status)?;
        let replicas = match r.canary_replicas {
            0 => ((serving.replicas as u64 * bp as u64).div_ceil(FULL_WEIGHT as u64) as u32).max(1),
            n => n,
        };
        let spec = self
            .change_spec(&r.name, |spec| spec.start_canary(next.clone(), bp, replicas).map(drop))
            .await
            .map_err(to_status)?;
        let canary = spec.rollout.canary.as_ref().map_or(0, |c| c.revision.generation);
        info!(model = %spec.name, revision = canary, serving = spec.generation, percent = bp as f64 / 100.0, replicas, dir = %next.build.model_dir, "rollout started");
        Ok(Response::new(self.rollout(&spec)))
    }

    pub(super) async fn do_set_rollout_weight(
        &self,
        request: Request<pb::SetRolloutWeightRequest>,
    ) -> Result<Response<pb::RolloutResponse>, Status> {
        let r = request.into_inner();
        let bp = percent_to_weight(r.canary_percent).map_err(to_status)?;
        let spec = self.change_spec(&r.name, |spec| spec.set_canary_weight(bp)).await.map_err(to_status)?;
        info!(model = %spec.name, percent = bp as f64 / 100.0, "canary weight changed");
        Ok(Response::new(self.rollout(&spec)))
    }

    pub(super) async fn do_promote_rollout(
        &self,
        request: Request<pb::PromoteRolloutRequest>,
    ) -> Result<Response<pb::RolloutResponse>, Status> {
        let name = request.into_inner().name;
        let spec = self.change_spec(&name, |spec| spec.promote().map(drop)).await.map_err(to_status)?;
        info!(model = %spec.name, revision = spec.generation, "canary promoted; the old revision drains once replaced");
        Ok(Response::new(self.rollout(&spec)))
    }

    pub(super) async fn do_rollback_rollout(
        &self,
        request: Request<pb::RollbackRolloutRequest>,
    ) -> Result<Response<pb::RolloutResponse>, Status> {
        let name = request.into_inner().name;
        let spec = self.change_spec(&name, |spec| spec.rollback().map(drop)).await.map_err(to_status)?;
        let dropped = spec.rollout.history.last().map_or(0, |h| h.revision.generation);
        info!(model = %spec.name, rolled_back = dropped, serving = spec.generation, "rolled back");
        Ok(Response::new(self.rollout(&spec)))
    }

    pub(super) async fn do_get_rollout(
        &self,
        request: Request<pb::GetRolloutRequest>,
    ) -> Result<Response<pb::RolloutResponse>, Status> {
        self.auth().check(&request)?;
        let spec = self.spec(&request.into_inner().name).await.map_err(to_status)?;
        Ok(Response::new(self.rollout(&spec)))
    }

    /// A deployment's revisions: serving, canary, then past ones newest first.
    fn rollout(&self, spec: &ModelSpec) -> pb::RolloutResponse {
        let view = self.view_rx().borrow().clone();
        let ready = |g: u64| view.ready_replicas(&spec.name).filter(|r| r.generation == g).count() as u32;
        let status = |r: &Revision, state: &str, percent: f64, desired: u32, ended_ms: u64| {
            let (b, flat) = (&r.build, flat_status(&r.build));
            pb::RevisionStatus {
                revision: r.generation,
                state: state.to_string(),
                build: Some(build_to_pb(b)),
                model_dir: flat.model_dir,
                dtype: flat.dtype,
                device: flat.device,
                tp: b.tp,
                pp: b.pp,
                ep: b.ep,
                scheduler: flat.scheduler,
                traffic_percent: percent,
                desired_replicas: desired,
                ready_replicas: ready(r.generation),
                created_ms: r.created_ms,
                ended_ms,
            }
        };
        let canary_bp = spec.rollout.canary.as_ref().map_or(0, |c| c.weight_bp);
        let pct = |bp: u32| bp as f64 / 100.0;
        let mut revisions =
            vec![status(&spec.revision(), "serving", pct(FULL_WEIGHT - canary_bp), spec.replicas, 0)];
        if let Some(c) = &spec.rollout.canary {
            revisions.push(status(&c.revision, "canary", pct(c.weight_bp), c.replicas, 0));
        }
        for h in spec.rollout.history.iter().rev() {
            revisions.push(status(&h.revision, h.outcome.as_str(), 0.0, 0, h.ended_ms));
        }
        pb::RolloutResponse { name: spec.name.to_string(), revisions }
    }
}

fn not_deployed(name: &str) -> Error {
    Error::NotFound(format!("model {name:?} is not deployed"))
}
