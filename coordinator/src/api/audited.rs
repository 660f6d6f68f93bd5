//! What each admin action says of itself in the audit log: one [`Audited`] impl per request
//! that changes the cluster, read by the one place that checks the admin credential and
//! writes the entry ([`super::admin::ClusterAdmin`]'s `audited`) — for allowed, refused
//! and failed calls alike.

use strata_proto::admin::v1 as pb;

use super::build_pb;

/// An admin request that changes the cluster.
pub trait Audited {
    /// The action's name in the log (the RPC's).
    const ACTION: &'static str;
    /// What it acts on: a model, a worker, a tenant.
    fn target(&self) -> String;
    /// The request's fields worth keeping (never a secret).
    fn detail(&self) -> String {
        String::new()
    }
}

impl Audited for pb::DeployModelRequest {
    const ACTION: &'static str = "DeployModel";
    fn target(&self) -> String {
        self.name.clone()
    }
    fn detail(&self) -> String {
        let build = build_pb::describe(self.build.as_ref(), build_pb::deploy_flat(self));
        format!("{build} replicas={}", self.replicas)
    }
}

impl Audited for pb::UndeployModelRequest {
    const ACTION: &'static str = "UndeployModel";
    fn target(&self) -> String {
        self.name.clone()
    }
}

impl Audited for pb::ScaleReplicasRequest {
    const ACTION: &'static str = "ScaleReplicas";
    fn target(&self) -> String {
        self.name.clone()
    }
    fn detail(&self) -> String {
        format!("replicas={}", self.replicas)
    }
}

impl Audited for pb::DrainWorkerRequest {
    const ACTION: &'static str = "DrainWorker";
    fn target(&self) -> String {
        self.worker_id.clone()
    }
    fn detail(&self) -> String {
        format!("undrain={}", self.undrain)
    }
}

impl Audited for pb::SetTenantRequest {
    const ACTION: &'static str = "SetTenant";
    fn target(&self) -> String {
        self.name.clone()
    }
    fn detail(&self) -> String {
        format!("weight={:?} limits={:?}", self.weight, self.limits)
    }
}

impl Audited for pb::DeleteTenantRequest {
    const ACTION: &'static str = "DeleteTenant";
    fn target(&self) -> String {
        self.name.clone()
    }
}

impl Audited for pb::CreateApiKeyRequest {
    const ACTION: &'static str = "CreateApiKey";
    fn target(&self) -> String {
        self.tenant.clone()
    }
}

impl Audited for pb::RevokeApiKeyRequest {
    const ACTION: &'static str = "RevokeApiKey";
    fn target(&self) -> String {
        self.tenant.clone()
    }
    fn detail(&self) -> String {
        format!("key_id={}", self.key_id)
    }
}

impl Audited for pb::StartRolloutRequest {
    const ACTION: &'static str = "StartRollout";
    fn target(&self) -> String {
        self.name.clone()
    }
    fn detail(&self) -> String {
        let build = build_pb::describe(self.build.as_ref(), build_pb::rollout_flat(self));
        format!("{build} canary_percent={} canary_replicas={}", self.canary_percent, self.canary_replicas)
    }
}

impl Audited for pb::SetRolloutWeightRequest {
    const ACTION: &'static str = "SetRolloutWeight";
    fn target(&self) -> String {
        self.name.clone()
    }
    fn detail(&self) -> String {
        format!("canary_percent={}", self.canary_percent)
    }
}

impl Audited for pb::PromoteRolloutRequest {
    const ACTION: &'static str = "PromoteRollout";
    fn target(&self) -> String {
        self.name.clone()
    }
}

impl Audited for pb::RollbackRolloutRequest {
    const ACTION: &'static str = "RollbackRollout";
    fn target(&self) -> String {
        self.name.clone()
    }
}
