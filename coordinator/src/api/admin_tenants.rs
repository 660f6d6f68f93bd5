//! The tenant half of admin.v1: tenants, their API keys, their usage.
//!
//! Tenants made here are [`TenantRecord`]s under `<prefix>/tenants/`, changed by
//! compare-and-set (two admins on two coordinators cannot lose each other's change), and
//! every coordinator's directory follows them through its registry view. A call returns
//! once this coordinator's own directory has the change, so a key made here works here at
//! once (elsewhere after the registry's watch latency, milliseconds).

use std::time::Duration;

use strata_common::cluster::now_ms;
use strata_common::registry::keys::valid_name;
use strata_common::tenant::{KeyRecord, TenantLimits, TenantRecord, MAX_KEYS_PER_TENANT};
use strata_common::{Error, Result};
use strata_proto::admin::v1 as pb;
use tonic::{Request, Response, Status};

use super::admin::ClusterAdmin;
use crate::tenant::usage::UsageRow;
use crate::tenant::{digest, hex, Source};
use strata_common::status::to_status;

pub fn limits_from_pb(l: pb::TenantLimits) -> TenantLimits {
    TenantLimits {
        requests_per_second: l.requests_per_second,
        tokens_per_minute: l.tokens_per_minute,
        max_concurrent: l.max_concurrent,
        max_tokens_per_request: l.max_tokens_per_request,
        models: l.models,
    }
}

pub fn limits_to_pb(l: &TenantLimits) -> pb::TenantLimits {
    pb::TenantLimits {
        requests_per_second: l.requests_per_second,
        tokens_per_minute: l.tokens_per_minute,
        max_concurrent: l.max_concurrent,
        max_tokens_per_request: l.max_tokens_per_request,
        models: l.models.clone(),
    }
}

fn record_to_pb(t: &TenantRecord) -> pb::Tenant {
    pb::Tenant {
        name: t.name.clone(),
        weight: t.weight,
        limits: Some(limits_to_pb(&t.limits)),
        keys: t
            .keys
            .iter()
            .map(|k| pb::ApiKeyInfo { id: k.id.clone(), created_unix_ms: k.created_ms })
            .collect(),
        source: "admin".into(),
    }
}

fn usage_to_pb(r: UsageRow) -> pb::UsageRow {
    let c = r.counts;
    pb::UsageRow {
        tenant: r.tenant,
        model: r.model,
        requests: c.requests,
        prompt_tokens: c.prompt_tokens,
        generated_tokens: c.generated_tokens,
        cached_prompt_tokens: c.cached_prompt_tokens,
        errors: c.errors,
        rate_limited: c.rate_limited,
    }
}

impl ClusterAdmin {
    /// Checks the tenant name the request's `field` gives: well formed, and not one the
    /// configuration declares.
    fn tenant_name(&self, name: &str, field: &str) -> Result<()> {
        if !valid_name(name) {
            return Err(Error::invalid(field, format!("{name:?} is not a valid tenant name")));
        }
        if self.tenants().configured(name) {
            return Err(Error::FailedPrecondition(format!(
                "tenant {name:?} is declared in the configuration file; change it there"
            )));
        }
        Ok(())
    }

    /// Applies `change` to the tenant's record (None: absent) by compare-and-set, then
    /// waits until this coordinator's directory has the result.
    async fn update_tenant(
        &self,
        name: &str,
        change: impl Fn(Option<TenantRecord>) -> Result<Option<TenantRecord>>,
    ) -> Result<Option<TenantRecord>> {
        let key = self.keys().tenant(name);
        let new = self
            .compare_and_set(&key, &format!("tenant {name:?}"), |old| {
                let new = change(old)?;
                if let Some(n) = &new {
                    n.validate()?;
                }
                Ok(new)
            })
            .await?;
        self.await_tenant(name, new.as_ref()).await;
        Ok(new)
    }

    /// Waits (briefly) for this coordinator's view to show the tenant as written, then
    /// rebuilds its directory from that view.
    async fn await_tenant(&self, name: &str, want: Option<&TenantRecord>) {
        let mut view = self.view_rx();
        let _ = tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                if view.borrow_and_update().tenants.get(name) == want {
                    return;
                }
                if view.changed().await.is_err() {
                    return;
                }
            }
        })
        .await;
        let v = view.borrow().clone();
        self.tenants().follow(&v.tenants, v.coordinators.len());
    }

    pub(super) async fn do_set_tenant(
        &self,
        request: Request<pb::SetTenantRequest>,
    ) -> Result<Response<pb::SetTenantResponse>, Status> {
        let r = request.into_inner();
        self.tenant_name(&r.name, "name").map_err(to_status)?;
        let limits = limits_from_pb(r.limits.unwrap_or_default());
        // A name made (again): a new incarnation, so what a deleted tenant of that name
        // left behind (files, batches) is not this one's.
        let fresh = crate::batch::store::new_id("");
        let set = |old: Option<TenantRecord>| {
            let (keys, incarnation) = match old {
                Some(o) => (o.keys, o.incarnation),
                None => (Vec::new(), fresh.clone()),
            };
            Ok(Some(TenantRecord {
                name: r.name.clone(),
                weight: r.weight.unwrap_or(1.0),
                limits: limits.clone(),
                keys,
                incarnation,
            }))
        };
        let t = self.update_tenant(&r.name, set).await.map_err(to_status)?;
        Ok(Response::new(pb::SetTenantResponse { tenant: t.as_ref().map(record_to_pb) }))
    }

    pub(super) async fn do_delete_tenant(
        &self,
        request: Request<pb::DeleteTenantRequest>,
    ) -> Result<Response<pb::DeleteTenantResponse>, Status> {
        let name = request.into_inner().name;
        self.tenant_name(&name, "name").map_err(to_status)?;
        let delete = |old: Option<TenantRecord>| match old {
            Some(_) => Ok(None),
            None => Err(Error::NotFound(format!("no tenant {name:?}"))),
        };
        self.update_tenant(&name, delete).await.map_err(to_status)?;
        Ok(Response::new(pb::DeleteTenantResponse {}))
    }

    pub(super) async fn do_list_tenants(
        &self,
        request: Request<pb::ListTenantsRequest>,
    ) -> Result<Response<pb::ListTenantsResponse>, Status> {
        self.auth().check(&request)?;
        let view = self.view_rx().borrow().clone();
        let tenants = self
            .tenants()
            .list()
            .iter()
            .map(|t| match (t.source, view.tenants.get(&t.name)) {
                (Source::Admin, Some(r)) => record_to_pb(r),
                _ => pb::Tenant {
                    name: t.name.clone(),
                    weight: t.weight,
                    limits: Some(limits_to_pb(&t.limits)),
                    keys: t
                        .key_ids
                        .iter()
                        .map(|id| pb::ApiKeyInfo { id: id.clone(), created_unix_ms: 0 })
                        .collect(),
                    source: "config".into(),
                },
            })
            .collect();
        Ok(Response::new(pb::ListTenantsResponse { tenants }))
    }

    pub(super) async fn do_create_api_key(
        &self,
        request: Request<pb::CreateApiKeyRequest>,
    ) -> Result<Response<pb::CreateApiKeyResponse>, Status> {
        let tenant = request.into_inner().tenant;
        self.tenant_name(&tenant, "tenant").map_err(to_status)?;
        let key = format!("sk-strata-{}", hex(&rand::random::<[u8; 24]>()));
        let record = KeyRecord::from_digest(&hex(&digest(&key)), now_ms()).map_err(to_status)?;
        let add = |old: Option<TenantRecord>| {
            let mut t = old.ok_or_else(|| Error::NotFound(format!("no tenant {tenant:?}: make it first")))?;
            if t.keys.len() >= MAX_KEYS_PER_TENANT {
                return Err(Error::FailedPrecondition(format!(
                    "tenant {tenant:?} has {MAX_KEYS_PER_TENANT} keys; revoke one first"
                )));
            }
            t.keys.push(record.clone());
            Ok(Some(t))
        };
        self.update_tenant(&tenant, add).await.map_err(to_status)?;
        Ok(Response::new(pb::CreateApiKeyResponse { key_id: record.id, key }))
    }

    pub(super) async fn do_revoke_api_key(
        &self,
        request: Request<pb::RevokeApiKeyRequest>,
    ) -> Result<Response<pb::RevokeApiKeyResponse>, Status> {
        let r = request.into_inner();
        self.tenant_name(&r.tenant, "tenant").map_err(to_status)?;
        let revoke = |old: Option<TenantRecord>| {
            let mut t = old.ok_or_else(|| Error::NotFound(format!("no tenant {:?}", r.tenant)))?;
            let before = t.keys.len();
            t.keys.retain(|k| k.id != r.key_id);
            if t.keys.len() == before {
                return Err(Error::NotFound(format!("tenant {:?} has no key {:?}", r.tenant, r.key_id)));
            }
            Ok(Some(t))
        };
        self.update_tenant(&r.tenant, revoke).await.map_err(to_status)?;
        Ok(Response::new(pb::RevokeApiKeyResponse {}))
    }

    pub(super) async fn do_get_usage(
        &self,
        request: Request<pb::GetUsageRequest>,
    ) -> Result<Response<pb::GetUsageResponse>, Status> {
        self.auth().check(&request)?;
        let r = request.into_inner();
        let until = if r.until_unix_s == 0 { now_ms() / 1000 + 1 } else { r.until_unix_s };
        if r.since_unix_s >= until {
            return Err(to_status(Error::invalid("since_unix_s", "must be before until_unix_s")));
        }
        let (tenant, model) =
            ((!r.tenant.is_empty()).then_some(r.tenant), (!r.model.is_empty()).then_some(r.model));
        let rows = self
            .ledger()
            .query(tenant.as_deref(), model.as_deref(), r.since_unix_s, until)
            .await
            .map_err(to_status)?;
        Ok(Response::new(pb::GetUsageResponse { rows: rows.into_iter().map(usage_to_pb).collect() }))
    }
}
