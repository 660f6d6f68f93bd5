//! Usage accounting: what each tenant used of each model, as metrics and as durable
//! hourly records.
//!
//! Every request ends in one [`Account`] record: one request, its prompt tokens, the tokens
//! delivered to the caller, the prompt tokens answered from the response cache, and
//! whether it failed. Requests refused before admission (a rate limit, a bad field) count
//! as errors. The [`Ledger`] adds records into hourly buckets and exports them as
//! `strata_tenant_*_total{tenant,model}` counters.
//!
//! **Durability.** Each coordinator *process* writes the totals of the buckets it touched
//! to `<prefix>.usage/<tenant>/<model>/<hour>/<instance>` (instance: the coordinator's id
//! and its start time, so a restarted process never overwrites its predecessor's records)
//! every [`FLUSH_EVERY`] and when it shuts down. A query adds up every instance's records
//! of the hours asked for, with this process's own counts taken fresh. A process killed
//! without a shutdown loses at most its last [`FLUSH_EVERY`] of counts; in `strata serve`
//! the registry lives in memory, so records last as long as the process.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use strata_common::cluster::{decode, encode, now_ms};
use strata_common::registry::keys::Keys;
use strata_common::registry::Registry;
use strata_common::tenant::{UsageCounts, USAGE_BUCKET_S};
use strata_common::{Error, Result};
use tracing::warn;

use super::limits::Permit;
use super::Caller;

/// How often a coordinator writes its usage records.
pub const FLUSH_EVERY: Duration = Duration::from_secs(2);

#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
struct TenantModel {
    tenant: String,
    model: String,
}

struct Metrics {
    requests: Family<TenantModel, Counter>,
    prompt_tokens: Family<TenantModel, Counter>,
    generated_tokens: Family<TenantModel, Counter>,
    cached_prompt_tokens: Family<TenantModel, Counter>,
    errors: Family<TenantModel, Counter>,
    rate_limited: Family<TenantModel, Counter>,
    /// Every (tenant, model) with series, to remove a model's when it is undeployed.
    seen: Mutex<std::collections::BTreeSet<TenantModel>>,
}

impl Metrics {
    fn families(&self) -> [&Family<TenantModel, Counter>; 6] {
        [
            &self.requests,
            &self.prompt_tokens,
            &self.generated_tokens,
            &self.cached_prompt_tokens,
            &self.errors,
            &self.rate_limited,
        ]
    }
}

fn metrics() -> &'static Metrics {
    static METRICS: OnceLock<Metrics> = OnceLock::new();
    METRICS.get_or_init(|| {
        let m = Metrics {
            requests: Family::default(),
            prompt_tokens: Family::default(),
            generated_tokens: Family::default(),
            cached_prompt_tokens: Family::default(),
            errors: Family::default(),
            rate_limited: Family::default(),
            seen: Default::default(),
        };
        use strata_common::metrics::register;
        register("tenant_requests", "Admitted requests that ended, by tenant and model", m.requests.clone());
        register("tenant_prompt_tokens", "Prompt tokens of admitted requests", m.prompt_tokens.clone());
        register("tenant_generated_tokens", "Tokens delivered to callers", m.generated_tokens.clone());
        register(
            "tenant_cached_prompt_tokens",
            "Prompt tokens answered from the response cache",
            m.cached_prompt_tokens.clone(),
        );
        register("tenant_errors", "Requests that ended in an error, refusals included", m.errors.clone());
        register("tenant_rate_limited", "Requests a tenant's limit refused", m.rate_limited.clone());
        strata_common::metrics::on_forget_model(|model| {
            let m = metrics();
            let mut seen = m.seen.lock().unwrap_or_else(|p| p.into_inner());
            let gone: Vec<TenantModel> = seen.iter().filter(|l| l.model == model).cloned().collect();
            for label in gone {
                for family in m.families() {
                    family.remove(&label);
                }
                seen.remove(&label);
            }
        });
        m
    })
}

/// One row of a usage query.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsageRow {
    pub tenant: String,
    pub model: String,
    pub counts: UsageCounts,
}

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Bucket {
    tenant: String,
    model: String,
    hour_s: u64,
}

struct Store {
    registry: Arc<dyn Registry>,
    keys: Keys,
    instance: String,
}

/// A front end's usage (see [`crate::frontend::FrontEnd::ledger`]): totals per
/// tenant, model and hour, and where they are kept.
#[derive(Default)]
pub struct Ledger {
    /// Totals, and whether they changed since the last flush.
    buckets: Mutex<BTreeMap<Bucket, (UsageCounts, bool)>>,
    store: Mutex<Option<Arc<Store>>>,
}

fn hour_of(unix_s: u64) -> u64 {
    unix_s - unix_s % USAGE_BUCKET_S
}

impl Ledger {
    /// Keeps this process's records in `registry` as coordinator `id`, and writes them
    /// every [`FLUSH_EVERY`] until the task is aborted (call [`Ledger::flush`] at shutdown).
    pub fn attach(
        self: &Arc<Self>,
        registry: Arc<dyn Registry>,
        keys: Keys,
        id: &str,
    ) -> tokio::task::JoinHandle<()> {
        let instance = format!("{id}-{}-{:04x}", now_ms(), rand::random::<u16>());
        *self.store.lock().unwrap_or_else(|p| p.into_inner()) =
            Some(Arc::new(Store { registry, keys, instance }));
        let ledger = self.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(FLUSH_EVERY).await;
                if let Err(e) = ledger.flush().await {
                    warn!(error = %e, "usage records not written; retrying");
                }
            }
        })
    }

    /// Adds one request's record (or a refusal's) to the current hour.
    pub fn record(&self, tenant: &str, model: &str, c: &UsageCounts) {
        let m = metrics();
        let label = TenantModel { tenant: tenant.to_string(), model: model.to_string() };
        {
            let mut seen = m.seen.lock().unwrap_or_else(|p| p.into_inner());
            if !seen.contains(&label) {
                seen.insert(label.clone());
            }
        }
        for (family, v) in [
            (&m.requests, c.requests),
            (&m.prompt_tokens, c.prompt_tokens),
            (&m.generated_tokens, c.generated_tokens),
            (&m.cached_prompt_tokens, c.cached_prompt_tokens),
            (&m.errors, c.errors),
            (&m.rate_limited, c.rate_limited),
        ] {
            family.get_or_create(&label).inc_by(v);
        }
        let bucket = Bucket { tenant: label.tenant, model: label.model, hour_s: hour_of(now_ms() / 1000) };
        let mut buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        let entry = buckets.entry(bucket).or_default();
        entry.0.add(c);
        entry.1 = true;
    }

    fn store(&self) -> Option<Arc<Store>> {
        self.store.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Writes every bucket that changed; forgets written buckets older than an hour.
    pub async fn flush(&self) -> Result<()> {
        let Some(store) = self.store() else { return Ok(()) };
        let dirty: Vec<(Bucket, UsageCounts)> = {
            let buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
            buckets.iter().filter(|(_, (_, d))| *d).map(|(b, (c, _))| (b.clone(), *c)).collect()
        };
        for (b, counts) in dirty {
            let key = store.keys.usage(&b.tenant, &b.model, b.hour_s, &store.instance);
            store.registry.put(&key, encode(&counts), None).await?;
            let mut buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(e) = buckets.get_mut(&b) {
                // Clean only if nothing was added while it was being written.
                e.1 &= e.0 != counts;
            }
        }
        let current = hour_of(now_ms() / 1000);
        let mut buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        buckets.retain(|b, (_, dirty)| *dirty || b.hour_s + USAGE_BUCKET_S >= current);
        Ok(())
    }

    /// Usage of `tenant` (None: all) and `model` (None: all) in the hours that overlap
    /// `[since_s, until_s)` (Unix seconds), summed over every coordinator process.
    pub async fn query(
        &self,
        tenant: Option<&str>,
        model: Option<&str>,
        since_s: u64,
        until_s: u64,
    ) -> Result<Vec<UsageRow>> {
        let mut sums: BTreeMap<(String, String), UsageCounts> = BTreeMap::new();
        let wanted = |t: &str, m: &str, hour: u64| {
            tenant.is_none_or(|x| x == t)
                && model.is_none_or(|x| x == m)
                && hour + USAGE_BUCKET_S > since_s
                && hour < until_s
        };
        let store = self.store();
        if let Some(store) = &store {
            let prefix = store.keys.usages(tenant);
            let listing = store.registry.list(&prefix).await?;
            let root = store.keys.usages(None);
            for e in &listing.entries {
                let parts: Vec<&str> = e.key.strip_prefix(&root).unwrap_or("").split('/').collect();
                let [t, m, hour, instance] = parts[..] else { continue };
                let Ok(hour) = hour.parse::<u64>() else { continue };
                if instance == store.instance || !wanted(t, m, hour) {
                    continue; // this process's own counts come fresh below
                }
                match decode::<UsageCounts>(&e.key, &e.value) {
                    Ok(c) => sums.entry((t.to_string(), m.to_string())).or_default().add(&c),
                    Err(err) => warn!(error = %err, "ignoring a malformed usage record"),
                }
            }
        }
        let buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        for (b, (c, _)) in buckets.iter() {
            if wanted(&b.tenant, &b.model, b.hour_s) {
                sums.entry((b.tenant.clone(), b.model.clone())).or_default().add(c);
            }
        }
        Ok(sums.into_iter().map(|((tenant, model), counts)| UsageRow { tenant, model, counts }).collect())
    }
}

/// One admitted request's usage, recorded when it is dropped (finished, failed or
/// cancelled alike); it also holds what the request holds while it lives: its tenant's
/// [`Permit`] and its slot of the model's fair-admission gate.
pub struct Account {
    ledger: Arc<Ledger>,
    tenant: String,
    model: String,
    counts: UsageCounts,
    permit: Permit,
    slot: Option<crate::frontend::fair::Slot>,
}

impl Account {
    /// The tenant it is billed to ("" without tenants).
    pub fn tenant(&self) -> &str {
        &self.tenant
    }

    pub fn open(
        ledger: Arc<Ledger>,
        caller: &Caller,
        model: &str,
        prompt_tokens: usize,
        mut permit: Permit,
    ) -> Account {
        permit.consumed(prompt_tokens as u64);
        let counts = UsageCounts { requests: 1, prompt_tokens: prompt_tokens as u64, ..Default::default() };
        let (tenant, model) = (caller.tenant().to_string(), model.to_string());
        Account { ledger, tenant, model, counts, permit, slot: None }
    }

    /// The request got a slot of the model's gate: held until the request ends.
    pub fn hold(&mut self, slot: crate::frontend::fair::Slot) {
        self.slot = Some(slot);
    }

    /// The whole prompt was answered from the response cache.
    pub fn cached(&mut self) {
        self.counts.cached_prompt_tokens = self.counts.prompt_tokens;
    }

    /// `n` tokens reached the caller.
    pub fn delivered(&mut self, n: usize) {
        self.counts.generated_tokens += n as u64;
        self.permit.consumed(n as u64);
    }

    pub fn failed(&mut self) {
        self.counts.errors = 1;
    }
}

impl Drop for Account {
    fn drop(&mut self) {
        self.ledger.record(&self.tenant, &self.model, &self.counts);
    }
}

impl Ledger {
    /// A request of `caller` for `model` refused before admission.
    pub fn refused(&self, caller: &Caller, model: &str, e: &Error) {
        let limited = matches!(e, Error::RateLimited { .. }) as u64;
        let counts = UsageCounts { errors: 1, rate_limited: limited, ..Default::default() };
        self.record(caller.tenant(), model, &counts);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use strata_common::registry::memory::MemoryRegistry;

    #[tokio::test]
    async fn records_add_up_across_instances_and_survive_a_restart() {
        let registry: Arc<dyn Registry> = Arc::new(MemoryRegistry::new());
        let keys = Keys::new("/u");
        let now = now_ms() / 1000;
        // An earlier process of the same coordinator left its records.
        let old = UsageCounts { requests: 2, prompt_tokens: 10, generated_tokens: 7, ..Default::default() };
        registry.put(&keys.usage("t", "m", hour_of(now), "c-1"), encode(&old), None).await.unwrap();
        registry.put(&keys.usage("t", "m", hour_of(now) - 7200, "c-1"), encode(&old), None).await.unwrap();
        let ledger: Arc<Ledger> = Arc::default();
        let flusher = ledger.attach(registry.clone(), keys.clone(), "c");
        ledger.record(
            "t",
            "m",
            &UsageCounts { requests: 1, prompt_tokens: 3, generated_tokens: 4, ..Default::default() },
        );
        ledger.record("u", "m", &UsageCounts { errors: 1, rate_limited: 1, ..Default::default() });
        let rows = ledger.query(Some("t"), None, now - 60, now + 60).await.unwrap();
        assert_eq!(rows.len(), 1);
        assert_eq!(
            (rows[0].counts.requests, rows[0].counts.prompt_tokens, rows[0].counts.generated_tokens),
            (3, 13, 11)
        );
        let all = ledger.query(None, None, now - 3 * 3600, now + 60).await.unwrap();
        assert_eq!(all.iter().map(|r| r.counts.requests).sum::<u64>(), 5, "{all:?}");
        ledger.flush().await.unwrap();
        flusher.abort();
        // A new process reads what this one wrote.
        let next: Arc<Ledger> = Arc::default();
        let _f = next.attach(registry, keys, "c");
        let rows = next.query(None, Some("m"), now - 60, now + 60).await.unwrap();
        let t = rows.iter().find(|r| r.tenant == "t").unwrap();
        assert_eq!(t.counts.requests, 3);
        let u = rows.iter().find(|r| r.tenant == "u").unwrap();
        assert_eq!((u.counts.errors, u.counts.rate_limited), (1, 1));
    }
}
