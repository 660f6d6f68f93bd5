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
        let mut fields = Vec::new();
        if let Some(w) = self.weight {
            fields.push(format!("weight={w}"));
        }
        if let Some(l) = &self.limits {
            let mut put = |k: &str, v: Option<String>| {
                if let Some(v) = v {
                    fields.push(format!("{k}={v}"));
                }
            };
            put("requests_per_second", l.requests_per_second.map(|v| v.to_string()));
            put("tokens_per_minute", l.tokens_per_minute.map(|v| v.to_string()));
            put("max_concurrent", l.max_concurrent.map(|v| v.to_string()));
            put("max_tokens_per_request", l.max_tokens_per_request.map(|v| v.to_string()));
            put("models", (!l.models.is_empty()).then(|| l.models.join(",")));
        }
        fields.join(" ")
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn details_are_key_value_fields_without_debug_text() {
        let set = pb::SetTenantRequest {
            name: "acme".into(),
            weight: Some(2.0),
            limits: Some(pb::TenantLimits {
                tokens_per_minute: Some(1000),
                models: vec!["a".into(), "b".into()],
                ..Default::default()
            }),
        };
        assert_eq!(set.detail(), "weight=2 tokens_per_minute=1000 models=a,b");
        let bare = pb::SetTenantRequest { name: "acme".into(), ..Default::default() };
        assert_eq!(bare.detail(), "");
        let deploy = pb::DeployModelRequest {
            name: "m".into(),
            build: Some(pb::Build {
                model_dir: "/m".into(),
                chat_template: "{{ x }}".into(),
                ..Default::default()
            }),
            replicas: 1,
            ..Default::default()
        };
        let d = deploy.detail();
        assert!(d.contains("chat_template_bytes=7") && !d.contains("{{"), "{d}");
    }
}
