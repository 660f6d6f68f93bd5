//! The audit log: who did what to the cluster, when, and what came of it.
//!
//! Every admin action — deploy, undeploy, scale, drain — is recorded whether it was
//! allowed, refused or failed: as a structured log line (target `strata::audit`) and as a
//! registry entry under `<prefix>.audit/`, beside the watched tree so coordinators never
//! load it. `ListAudit` (`strata admin audit`) reads it back, newest first. The log keeps
//! the newest [`RETAINED`] entries; a write that finds more prunes the oldest.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use strata_common::registry::keys::Keys;
use strata_common::registry::Registry;
use strata_common::Result;
use strata_proto::admin::v1 as pb;
use tonic::{Request, Status};
use tracing::{info, warn};

/// Entries kept in the registry.
pub const RETAINED: usize = 10_000;
/// Writes between two prunings.
const PRUNE_EVERY: u64 = 200;
/// Longest detail kept (a request's fields as text).
const MAX_DETAIL: usize = 1024;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuditEntry {
    pub at_ms: u64,
    pub coordinator: String,
    pub caller: String,
    pub action: String,
    pub target: String,
    pub detail: String,
    pub outcome: String,
}

impl From<AuditEntry> for pb::AuditEntry {
    fn from(e: AuditEntry) -> Self {
        pb::AuditEntry {
            at_ms: e.at_ms,
            coordinator: e.coordinator,
            caller: e.caller,
            action: e.action,
            target: e.target,
            detail: e.detail,
            outcome: e.outcome,
        }
    }
}

/// A short, non-reversible name of a credential: enough to tell two tokens apart in
/// the log (rotation), never enough to use one.
pub fn fingerprint(secret: &str) -> String {
    let hex = crate::tenant::hex(&crate::tenant::digest(secret)[..8]);
    format!("sha256:{hex}")
}

/// Who sent `req`, as the audit log names them.
pub fn caller<T>(req: &Request<T>, admin_token_valid: Option<bool>) -> String {
    let from = req.remote_addr().map(|a| format!(" from {a}")).unwrap_or_default();
    let bearer = req
        .metadata()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")));
    let who = match (bearer, admin_token_valid) {
        (Some(t), Some(true)) => format!("admin-token {}", fingerprint(t.trim())),
        (Some(t), _) => format!("unknown token {}", fingerprint(t.trim())),
        (None, None) if req.remote_addr().is_some_and(|a| a.ip().is_loopback()) => "loopback".to_string(),
        (None, _) => "anonymous".to_string(),
    };
    format!("{who}{from}")
}

pub struct AuditLog {
    registry: Arc<dyn Registry>,
    keys: Keys,
    coordinator: String,
    written: AtomicU64,
}

impl AuditLog {
    pub fn new(registry: Arc<dyn Registry>, keys: Keys, coordinator: String) -> Self {
        AuditLog { registry, keys, coordinator, written: AtomicU64::new(0) }
    }

    /// Records one action and how it ended. A registry that cannot take the entry is
    /// logged; the action's own result stands.
    pub async fn record<T>(
        &self,
        action: &str,
        caller: String,
        target: &str,
        detail: String,
        result: &std::result::Result<T, Status>,
    ) {
        let outcome = match result {
            Ok(_) => "ok".to_string(),
            Err(s) => format!("{:?}: {}", s.code(), s.message()),
        };
        let mut detail = detail;
        if detail.len() > MAX_DETAIL {
            let mut cut = MAX_DETAIL;
            while !detail.is_char_boundary(cut) {
                cut -= 1;
            }
            detail.truncate(cut);
        }
        let at_ms = strata_common::cluster::now_ms();
        let entry = AuditEntry {
            at_ms,
            coordinator: self.coordinator.clone(),
            caller,
            action: action.to_string(),
            target: target.chars().take(256).collect(),
            detail,
            outcome,
        };
        info!(target: "strata::audit", at_ms, caller = %entry.caller, action, target = %entry.target, detail = %entry.detail, outcome = %entry.outcome, "admin action");
        let n = self.written.fetch_add(1, Ordering::Relaxed);
        let id = format!("{at_ms:013}-{}-{n:08}", self.coordinator);
        let value = serde_json::to_vec(&entry).unwrap_or_default();
        if let Err(e) = self.registry.put(&self.keys.audit(&id), value, None).await {
            warn!(error = %e, action, "could not write the audit entry to the registry");
        }
        if n % PRUNE_EVERY == PRUNE_EVERY - 1 {
            if let Err(e) = self.prune().await {
                warn!(error = %e, "could not prune the audit log");
            }
        }
    }

    /// The newest `limit` entries, newest first.
    pub async fn list(&self, limit: usize) -> Result<Vec<AuditEntry>> {
        let mut entries = self.registry.list(&self.keys.audits()).await?.entries;
        entries.sort_by(|a, b| b.key.cmp(&a.key));
        Ok(entries
            .into_iter()
            .filter_map(|e| serde_json::from_slice::<AuditEntry>(&e.value).ok())
            .take(limit)
            .collect())
    }

    async fn prune(&self) -> Result<()> {
        let mut keys: Vec<String> =
            self.registry.list(&self.keys.audits()).await?.entries.into_iter().map(|e| e.key).collect();
        if keys.len() <= RETAINED {
            return Ok(());
        }
        keys.sort();
        for key in &keys[..keys.len() - RETAINED] {
            self.registry.delete(key).await?;
        }
        Ok(())
    }
}
