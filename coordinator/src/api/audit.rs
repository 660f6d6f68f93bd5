//! The audit log: who did what to the cluster, when, and what came of it.
//!
//! Every admin action — deploy, undeploy, scale, drain — is recorded whether it was
//! allowed, refused or failed: as a structured log line (target `strata::audit`) and as a
//! registry entry under `<prefix>.audit/`, beside the watched tree so coordinators never
//! load it. `ListAudit` (`strata admin audit`) reads it back, newest first.
//!
//! Refused calls (no or a wrong credential) cannot crowd out the record of what was done:
//! allowed actions keep the newest [`RETAINED`] entries, refused ones their own newest
//! [`RETAINED_REFUSED`]; and each caller address (not port, whatever credential it sends) has at most
//! [`REFUSED_PER_MINUTE`] refused entries written a minute — the rest are counted, and the
//! caller's next written entry says how many were left out. A write that finds more than
//! a kind keeps prunes its oldest.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use strata_common::registry::keys::Keys;
use strata_common::registry::Registry;
use strata_common::Result;
use strata_proto::admin::v1 as pb;
use tonic::{Request, Status};
use tracing::{info, warn};

/// Entries of allowed actions kept in the registry.
pub const RETAINED: usize = 10_000;
/// Entries of refused calls kept in the registry, apart from the allowed ones.
pub const RETAINED_REFUSED: usize = 2_000;
/// Refused entries written per caller a minute.
pub const REFUSED_PER_MINUTE: u32 = 10;
/// Callers whose refused calls are counted at once (the map is cleared past this).
const TRACKED_CALLERS: usize = 4096;
/// Key prefix of refused entries' ids (allowed ones start with their time's digits).
const REFUSED: &str = "r";
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

/// Whether an outcome is a refusal: the caller was not let in.
fn refused<T>(result: &std::result::Result<T, Status>) -> bool {
    matches!(result, Err(s) if matches!(s.code(), tonic::Code::Unauthenticated | tonic::Code::PermissionDenied))
}

/// Whom a refused call's limit counts: its address without the port or the credential
/// it presented — one client reconnecting, or rotating wrong tokens (each a new
/// fingerprint), is one caller.
fn caller_key(caller: &str) -> String {
    match caller.rsplit_once(" from ") {
        Some((_, addr)) => match addr.parse::<std::net::SocketAddr>() {
            Ok(a) => format!("from {}", a.ip()),
            Err(_) => caller.to_string(),
        },
        None => caller.to_string(),
    }
}

/// Per caller: when its minute began, refused entries written in it, and left out.
#[derive(Default)]
struct RefusedCounts {
    by_caller: HashMap<String, (Option<Instant>, u32, u64)>,
}

impl RefusedCounts {
    /// Whether to write this refused entry, and how many before it were left out (to say
    /// in it).
    fn admit(&mut self, caller: &str, now: Instant) -> (bool, u64) {
        if self.by_caller.len() >= TRACKED_CALLERS && !self.by_caller.contains_key(caller) {
            self.by_caller.clear();
        }
        let (start, written, left_out) = self.by_caller.entry(caller.to_string()).or_default();
        if start.is_none_or(|s| now.duration_since(s) >= Duration::from_secs(60)) {
            (*start, *written) = (Some(now), 0);
        }
        if *written < REFUSED_PER_MINUTE {
            *written += 1;
            (true, std::mem::take(left_out))
        } else {
            *left_out += 1;
            (false, 0)
        }
    }
}

pub struct AuditLog {
    registry: Arc<dyn Registry>,
    keys: Keys,
    coordinator: String,
    written: AtomicU64,
    refused: Mutex<RefusedCounts>,
}

impl AuditLog {
    pub fn new(registry: Arc<dyn Registry>, keys: Keys, coordinator: String) -> Self {
        AuditLog { registry, keys, coordinator, written: AtomicU64::new(0), refused: Mutex::default() }
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
        let is_refused = refused(result);
        if is_refused {
            let (write, left_out) = self
                .refused
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .admit(&caller_key(&caller), Instant::now());
            if !write {
                return;
            }
            if left_out > 0 {
                detail =
                    format!("({left_out} refused calls of this caller not recorded before this) {detail}");
            }
        }
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
        let kind = if is_refused { REFUSED } else { "" };
        let id = format!("{kind}{at_ms:013}-{}-{n:08}", self.coordinator);
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

    /// The newest `limit` entries, allowed and refused together, newest first.
    pub async fn list(&self, limit: usize) -> Result<Vec<AuditEntry>> {
        let entries = self.registry.list(&self.keys.audits()).await?.entries;
        let mut parsed: Vec<(String, AuditEntry)> = entries
            .into_iter()
            .filter_map(|e| {
                let id = e.key.rsplit('/').next().unwrap_or_default().trim_start_matches(REFUSED).to_string();
                Some((id, serde_json::from_slice::<AuditEntry>(&e.value).ok()?))
            })
            .collect();
        parsed.sort_by(|a, b| b.0.cmp(&a.0));
        Ok(parsed.into_iter().map(|(_, e)| e).take(limit).collect())
    }

    /// Keeps each kind's newest entries: [`RETAINED`] allowed, [`RETAINED_REFUSED`] refused.
    async fn prune(&self) -> Result<()> {
        let dir = self.keys.audits();
        let keys: Vec<String> = self.registry.list(&dir).await?.entries.into_iter().map(|e| e.key).collect();
        let (mut refused, mut allowed): (Vec<String>, Vec<String>) =
            keys.into_iter().partition(|k| k[dir.len()..].starts_with(REFUSED));
        for (keys, keep) in [(&mut allowed, RETAINED), (&mut refused, RETAINED_REFUSED)] {
            if keys.len() > keep {
                keys.sort();
                let excess = keys.len() - keep;
                for key in &keys[..excess] {
                    self.registry.delete(key).await?;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use strata_common::registry::memory::MemoryRegistry;

    fn denied() -> std::result::Result<(), Status> {
        Err(Status::unauthenticated("no admin token"))
    }

    /// Probed: 10,400 anonymous refused calls pushed every genuine entry out of the log.
    /// Refused calls are written at most REFUSED_PER_MINUTE a caller a minute (the next
    /// says how many were left out) and kept apart, so allowed actions stay.
    #[tokio::test]
    async fn refused_calls_cannot_push_allowed_actions_out_of_the_log() {
        let log = AuditLog::new(Arc::new(MemoryRegistry::new()), Keys::new("t"), "c1".into());
        for i in 0..3 {
            log.record(
                "Deploy",
                "admin-token sha256:ab".into(),
                &format!("m{i}"),
                String::new(),
                &Ok::<_, Status>(()),
            )
            .await;
        }
        for port in 0..10_400u32 {
            let caller = format!("anonymous from 10.0.0.9:{}", 1000 + port % 50_000);
            log.record("Drain", caller, "r1", String::new(), &denied()).await;
        }
        let entries = log.list(usize::MAX).await.unwrap();
        let from_one = entries.iter().filter(|e| e.caller.contains("10.0.0.9")).count();
        assert_eq!(from_one, REFUSED_PER_MINUTE as usize);
        // Probed: rotating wrong tokens made each call a new caller. The address counts.
        for token in 0..500u32 {
            let caller = format!("admin-token sha256:{token:08x} from 10.0.0.8:4000");
            log.record("Drain", caller, "r1", String::new(), &denied()).await;
        }
        let entries = log.list(usize::MAX).await.unwrap();
        let rotating = entries.iter().filter(|e| e.caller.contains("10.0.0.8")).count();
        assert_eq!(rotating, REFUSED_PER_MINUTE as usize, "rotating tokens from one address");
        // 2,500 callers, one refused call each: their entries are pruned among themselves.
        for ip in 0..2_500u32 {
            let caller = format!("anonymous from 10.1.{}.{}:5000", ip / 250, ip % 250);
            log.record("Drain", caller, "r1", String::new(), &denied()).await;
        }
        log.prune().await.unwrap();
        let entries = log.list(usize::MAX).await.unwrap();
        let allowed: Vec<_> = entries.iter().filter(|e| e.outcome == "ok").collect();
        assert_eq!(allowed.len(), 3, "every allowed action is still there");
        assert!(entries.len() - 3 <= RETAINED_REFUSED, "{} refused entries kept", entries.len() - 3);
        // A minute on, the caller's next entry says how many were left out.
        let mut counts = RefusedCounts::default();
        let t = Instant::now();
        for _ in 0..REFUSED_PER_MINUTE + 7 {
            counts.admit("x", t);
        }
        assert_eq!(counts.admit("x", t + Duration::from_secs(61)), (true, 7));
    }
}
