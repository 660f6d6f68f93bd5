//! `strata.admin.v1.Admin` as static mode (`strata serve --worker-rendezvous`) answers it.
//!
//! The embedded server's models are fixed by its command line, so every admin method
//! answers UNIMPLEMENTED with a message saying where it is served (cluster mode).

use strata_proto::admin::v1 as pb;
use strata_proto::admin::v1::admin_server::Admin;
use tonic::{Request, Response, Status};

#[derive(Debug, Default)]
pub struct EmbeddedAdmin;

fn cluster_only<T>(method: &str) -> Result<Response<T>, Status> {
    Err(Status::unimplemented(format!(
        "Admin/{method} is served by `strata coordinator` (cluster mode); `strata serve` runs the models its command line names"
    )))
}

#[tonic::async_trait]
impl Admin for EmbeddedAdmin {
    async fn deploy_model(
        &self,
        _: Request<pb::DeployModelRequest>,
    ) -> Result<Response<pb::DeployModelResponse>, Status> {
        cluster_only("DeployModel")
    }
    async fn undeploy_model(
        &self,
        _: Request<pb::UndeployModelRequest>,
    ) -> Result<Response<pb::UndeployModelResponse>, Status> {
        cluster_only("UndeployModel")
    }
    async fn scale_replicas(
        &self,
        _: Request<pb::ScaleReplicasRequest>,
    ) -> Result<Response<pb::ScaleReplicasResponse>, Status> {
        cluster_only("ScaleReplicas")
    }
    async fn list_models(
        &self,
        _: Request<pb::ListModelsRequest>,
    ) -> Result<Response<pb::ListModelsResponse>, Status> {
        cluster_only("ListModels")
    }
    async fn list_replicas(
        &self,
        _: Request<pb::ListReplicasRequest>,
    ) -> Result<Response<pb::ListReplicasResponse>, Status> {
        cluster_only("ListReplicas")
    }
    async fn list_workers(
        &self,
        _: Request<pb::ListWorkersRequest>,
    ) -> Result<Response<pb::ListWorkersResponse>, Status> {
        cluster_only("ListWorkers")
    }
    async fn drain_worker(
        &self,
        _: Request<pb::DrainWorkerRequest>,
    ) -> Result<Response<pb::DrainWorkerResponse>, Status> {
        cluster_only("DrainWorker")
    }
    async fn get_leader(
        &self,
        _: Request<pb::GetLeaderRequest>,
    ) -> Result<Response<pb::GetLeaderResponse>, Status> {
        cluster_only("GetLeader")
    }
    async fn list_audit(
        &self,
        _: Request<pb::ListAuditRequest>,
    ) -> Result<Response<pb::ListAuditResponse>, Status> {
        cluster_only("ListAudit")
    }
    async fn set_tenant(
        &self,
        _: Request<pb::SetTenantRequest>,
    ) -> Result<Response<pb::SetTenantResponse>, Status> {
        cluster_only("SetTenant")
    }
    async fn delete_tenant(
        &self,
        _: Request<pb::DeleteTenantRequest>,
    ) -> Result<Response<pb::DeleteTenantResponse>, Status> {
        cluster_only("DeleteTenant")
    }
    async fn list_tenants(
        &self,
        _: Request<pb::ListTenantsRequest>,
    ) -> Result<Response<pb::ListTenantsResponse>, Status> {
        cluster_only("ListTenants")
    }
    async fn create_api_key(
        &self,
        _: Request<pb::CreateApiKeyRequest>,
    ) -> Result<Response<pb::CreateApiKeyResponse>, Status> {
        cluster_only("CreateApiKey")
    }
    async fn revoke_api_key(
        &self,
        _: Request<pb::RevokeApiKeyRequest>,
    ) -> Result<Response<pb::RevokeApiKeyResponse>, Status> {
        cluster_only("RevokeApiKey")
    }
    async fn get_usage(
        &self,
        _: Request<pb::GetUsageRequest>,
    ) -> Result<Response<pb::GetUsageResponse>, Status> {
        cluster_only("GetUsage")
    }
    async fn start_rollout(
        &self,
        _: Request<pb::StartRolloutRequest>,
    ) -> Result<Response<pb::RolloutResponse>, Status> {
        cluster_only("StartRollout")
    }
    async fn set_rollout_weight(
        &self,
        _: Request<pb::SetRolloutWeightRequest>,
    ) -> Result<Response<pb::RolloutResponse>, Status> {
        cluster_only("SetRolloutWeight")
    }
    async fn promote_rollout(
        &self,
        _: Request<pb::PromoteRolloutRequest>,
    ) -> Result<Response<pb::RolloutResponse>, Status> {
        cluster_only("PromoteRollout")
    }
    async fn rollback_rollout(
        &self,
        _: Request<pb::RollbackRolloutRequest>,
    ) -> Result<Response<pb::RolloutResponse>, Status> {
        cluster_only("RollbackRollout")
    }
    async fn get_rollout(
        &self,
        _: Request<pb::GetRolloutRequest>,
    ) -> Result<Response<pb::RolloutResponse>, Status> {
        cluster_only("GetRollout")
    }
}
