//! Tenants: whose API key a caller bears, what that tenant may use, what it used.
//!
//! [`Tenants`] is the directory every front end asks ([`Tenants::authenticate`]); it is
//! built from three sources and rebuilt whenever one changes:
//! - the configuration's plain `api_keys` (and `api_key_file`, re-read on SIGHUP), which
//!   belong to the tenant [`DEFAULT_TENANT`];
//! - `[[coordinator.tenants]]` in the configuration file (read-only through the admin API);
//! - tenants made through the admin API, from the registry (every coordinator sees them).
//!
//! Every key is held as its SHA-256 only — a plain key in the configuration is hashed when
//! it is read — and a presented key is looked up by its digest. With no key anywhere,
//! inference is open and every caller is the default tenant (whose limits, if the
//! configuration declares a tenant named `default`, apply to all). Once any key exists,
//! every inference call needs one.
//!
//! Limits are enforced by [`limits`]; usage is counted by [`usage`].

pub mod limits;
pub mod usage;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, RwLock};

use sha2::{Digest, Sha256};
use strata_common::tenant::{KeyRecord, TenantConfig, TenantLimits, TenantRecord, DEFAULT_TENANT};
use strata_common::{Error, Result};

use limits::{Ask, Limiter, Permit};

/// SHA-256 of a key.
pub fn digest(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A configured key: the key, or `sha256:<64 hex digits>` of it; `field` names where it
/// came from in errors.
pub fn parse_key(entry: &str, field: &str) -> Result<[u8; 32]> {
    let Some(h) = entry.strip_prefix("sha256:") else { return Ok(digest(entry)) };
    let record = KeyRecord::from_digest(h, 0)
        .map_err(|_| Error::invalid(field, "a sha256: entry needs 64 hex digits after the colon"))?;
    record.digest().ok_or_else(|| Error::invalid(field, "a sha256: entry needs 64 hex digits"))
}

/// Where a tenant is declared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// The configuration file (or the plain `api_keys`, for the default tenant).
    Config,
    /// The admin API (the registry).
    Admin,
}

/// One tenant as this coordinator knows it now.
#[derive(Debug)]
pub struct Tenant {
    pub name: String,
    pub weight: f64,
    pub source: Source,
    /// Ids of its keys (never the keys).
    pub key_ids: Vec<String>,
    pub limits: TenantLimits,
    /// Which creation of the name (see [`TenantRecord::incarnation`]; empty for configured
    /// tenants, whose name is theirs for as long as the configuration says so).
    pub incarnation: String,
    limiter: Arc<Limiter>,
}

/// Whose a stored object (a batch file, a batch) is: a tenant's name and which creation
/// of that name. A tenant deleted and made again is another owner.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Owner {
    pub tenant: String,
    pub incarnation: String,
}

/// Who is calling: the tenant its key belongs to.
#[derive(Debug, Clone)]
pub struct Caller {
    tenant: Arc<Tenant>,
    /// An online caller: `max_concurrent` applies (batch work is paced by the batch
    /// runner's one budget instead); rates apply either way.
    online: bool,
}

impl Caller {
    pub fn tenant(&self) -> &str {
        &self.tenant.name
    }

    /// What the caller stores is owned as.
    pub fn owner(&self) -> Owner {
        Owner { tenant: self.tenant.name.clone(), incarnation: self.tenant.incarnation.clone() }
    }

    /// The tenant's share under overload, relative to others.
    pub fn weight(&self) -> f64 {
        self.tenant.weight
    }

    /// The same tenant for batch work: held to its rates (requests per second, tokens per
    /// minute: a batch spends the tenant's quota like any call, the runner waiting when
    /// refused), its models and `max_tokens_per_request`, but not to `max_concurrent` —
    /// the batch runner paces batches with one budget of its own.
    pub fn for_batch(mut self) -> Caller {
        self.online = false;
        self
    }

    /// The most requests the tenant may have in flight at once, if it is capped.
    pub fn max_concurrent(&self) -> Option<u32> {
        self.online.then_some(self.tenant.limits.max_concurrent).flatten()
    }

    /// The most tokens a request may generate, if the tenant caps it.
    pub fn max_tokens_cap(&self) -> Option<u32> {
        self.tenant.limits.max_tokens_per_request
    }

    /// Whether the tenant may call `model` (PERMISSION_DENIED naming it if not).
    pub fn may_use(&self, model: &str) -> Result<()> {
        let limits = &self.tenant.limits;
        if limits.models.is_empty() || limits.models.iter().any(|m| m == model) {
            return Ok(());
        }
        Err(Error::PermissionDenied(format!(
            "tenant {:?} may not use model {model:?} (its models: {})",
            self.tenant.name,
            limits.models.join(", ")
        )))
    }

    /// Takes what an admitted request needs from the tenant's limits.
    pub fn admit(&self, ask: Ask) -> Result<Permit> {
        self.tenant.limiter.admit(ask, self.online)
    }
}

/// What the directory is built from.
#[derive(Debug, Default)]
struct Sources {
    /// Digests of the plain `api_keys` (the default tenant's).
    default_keys: Vec<[u8; 32]>,
    /// The configured tenants, their keys parsed.
    config: Vec<Entry>,
    admin: BTreeMap<String, TenantRecord>,
    coordinators: usize,
    /// One limiter per tenant name, kept across rebuilds so buckets keep their levels.
    limiters: HashMap<String, Arc<Limiter>>,
}

#[derive(Debug, Default)]
struct Directory {
    by_digest: HashMap<[u8; 32], Arc<Tenant>>,
    by_name: BTreeMap<String, Arc<Tenant>>,
}

/// The tenant directory. Clones share it.
#[derive(Debug, Clone)]
pub struct Tenants {
    sources: Arc<Mutex<Sources>>,
    directory: Arc<RwLock<Arc<Directory>>>,
}

impl Tenants {
    /// The directory of `default_keys` (each a key or `sha256:<hex>`) and the configured
    /// tenants; fails naming the first bad entry or a key two tenants share.
    pub fn new(default_keys: Vec<String>, config: Vec<TenantConfig>) -> Result<Tenants> {
        let mut sources = Sources { coordinators: 1, ..Default::default() };
        sources.default_keys = parse_keys(&default_keys, "api_keys")?;
        for (i, t) in config.into_iter().enumerate() {
            t.validate(i)?;
            let keys = parse_keys(&t.keys, &format!("coordinator.tenants[{i}].keys"))?;
            let (name, weight, limits) = (t.name, t.weight, t.limits);
            let incarnation = String::new();
            sources.config.push(Entry { name, weight, source: Source::Config, limits, keys, incarnation });
        }
        let directory = build(&mut sources)?;
        Ok(Tenants {
            sources: Arc::new(Mutex::new(sources)),
            directory: Arc::new(RwLock::new(Arc::new(directory))),
        })
    }

    fn current(&self) -> Arc<Directory> {
        self.directory.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn rebuild(&self, change: impl FnOnce(&mut Sources)) -> Result<()> {
        let mut sources = self.sources.lock().unwrap_or_else(|p| p.into_inner());
        let before = (sources.default_keys.clone(), sources.admin.clone(), sources.coordinators);
        change(&mut sources);
        match build(&mut sources) {
            Ok(d) => {
                *self.directory.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(d);
                Ok(())
            }
            Err(e) => {
                (sources.default_keys, sources.admin, sources.coordinators) = before;
                Err(e)
            }
        }
    }

    /// New plain `api_keys` (a SIGHUP reload); the old ones stay on an error.
    pub fn set_default_keys(&self, keys: Vec<String>) -> Result<usize> {
        let parsed = parse_keys(&keys, "api_keys")?;
        let n = parsed.len();
        self.rebuild(|s| s.default_keys = parsed)?;
        Ok(n)
    }

    /// The registry's tenants and live coordinators, as the view last saw them. A tenant
    /// whose key another tenant already holds is left out (and logged).
    pub fn follow(&self, admin: &BTreeMap<String, TenantRecord>, coordinators: usize) {
        let (admin, n) = (admin.clone(), coordinators.max(1));
        if let Err(e) = self.rebuild(|s| {
            s.admin = admin;
            s.coordinators = n;
        }) {
            tracing::warn!(error = %e, "ignoring the registry's tenants");
        }
    }

    /// Follows the registry's tenants and live coordinators through `view` until aborted.
    pub fn follow_view(
        &self,
        mut view: tokio::sync::watch::Receiver<Arc<crate::control::view::ClusterView>>,
    ) -> tokio::task::JoinHandle<()> {
        let tenants = self.clone();
        tokio::spawn(async move {
            let mut seen = (BTreeMap::new(), 0);
            loop {
                let now = {
                    let v = view.borrow_and_update();
                    (v.tenants.clone(), v.coordinators.len())
                };
                if now != seen {
                    tenants.follow(&now.0, now.1);
                    seen = now;
                }
                if view.changed().await.is_err() {
                    return;
                }
            }
        })
    }

    /// Whether `key` (a key's digest) would pass as some tenant's key.
    pub fn holds_digest(&self, key: &[u8; 32]) -> bool {
        self.current().by_digest.contains_key(key)
    }

    /// Whether any key exists (inference is closed).
    pub fn closed(&self) -> bool {
        !self.current().by_digest.is_empty()
    }

    /// The caller bearing `token` (None: it sent none); `carrier` names where a caller
    /// puts its key ("metadata" for gRPC, "header" for HTTP).
    pub fn authenticate(&self, token: Option<&str>, carrier: &str) -> Result<Caller> {
        let d = self.current();
        if d.by_digest.is_empty() {
            let open = d.by_name.get(DEFAULT_TENANT).expect("the default tenant always exists");
            return Ok(Caller { tenant: open.clone(), online: true });
        }
        let Some(token) = token else {
            return Err(Error::Unauthenticated(format!(
                "missing API key: send {carrier} \"authorization: Bearer <key>\""
            )));
        };
        // A lookup by digest: what a caller can learn from its timing is about digests,
        // which say nothing of the keys.
        match d.by_digest.get(&digest(token)) {
            Some(t) => Ok(Caller { tenant: t.clone(), online: true }),
            None => Err(Error::Unauthenticated("the API key is not valid".into())),
        }
    }

    /// The caller `owner` is now (batch work runs as the tenant that submitted it): none
    /// once that tenant is gone, even if its name was made again.
    pub fn caller(&self, owner: &Owner) -> Result<Caller> {
        match self.current().by_name.get(&owner.tenant) {
            Some(t) if t.incarnation == owner.incarnation => Ok(Caller { tenant: t.clone(), online: true }),
            _ => Err(Error::PermissionDenied(format!("tenant {:?} no longer exists", owner.tenant))),
        }
    }

    /// Every tenant, by name.
    pub fn list(&self) -> Vec<Arc<Tenant>> {
        self.current().by_name.values().cloned().collect()
    }

    /// Whether `name` is declared in the configuration (the admin API may not change it).
    pub fn configured(&self, name: &str) -> bool {
        self.current().by_name.get(name).is_some_and(|t| t.source == Source::Config)
    }
}

impl Default for Tenants {
    /// Open: no keys, the unlimited default tenant.
    fn default() -> Self {
        Tenants::new(Vec::new(), Vec::new()).expect("an empty directory builds")
    }
}

fn parse_keys(keys: &[String], field: &str) -> Result<Vec<[u8; 32]>> {
    keys.iter().map(|k| k.trim()).filter(|k| !k.is_empty()).map(|k| parse_key(k, field)).collect()
}

/// One tenant's entry before it is shared.
#[derive(Debug, Clone)]
struct Entry {
    name: String,
    weight: f64,
    source: Source,
    limits: TenantLimits,
    keys: Vec<[u8; 32]>,
    incarnation: String,
}

fn entries(s: &Sources) -> Vec<Entry> {
    let mut out = s.config.clone();
    match out.iter_mut().find(|e| e.name == DEFAULT_TENANT) {
        Some(d) => d.keys.extend(s.default_keys.iter().copied()),
        None => out.push(Entry {
            name: DEFAULT_TENANT.into(),
            weight: 1.0,
            source: Source::Config,
            limits: TenantLimits::default(),
            keys: s.default_keys.clone(),
            incarnation: String::new(),
        }),
    }
    for (name, r) in &s.admin {
        if out.iter().any(|e| &e.name == name) {
            tracing::warn!(tenant = %name, "a tenant in the registry has a configured tenant's name; the configuration wins");
            continue;
        }
        let keys = r.keys.iter().filter_map(KeyRecord::digest).collect();
        out.push(Entry {
            name: name.clone(),
            weight: r.weight,
            source: Source::Admin,
            limits: r.limits.clone(),
            keys,
            incarnation: r.incarnation.clone(),
        });
    }
    out
}

fn build(s: &mut Sources) -> Result<Directory> {
    let mut d = Directory::default();
    for e in entries(s) {
        let taken =
            e.keys.iter().find_map(|k| d.by_digest.get(k).filter(|t| t.name != e.name).map(|t| (k, t)));
        if let Some((k, other)) = taken {
            let clash = format!("key {} belongs to both {:?} and {:?}", &hex(k)[..12], other.name, e.name);
            if e.source == Source::Config {
                return Err(Error::invalid("keys", clash));
            }
            // Only an admin could have written it; the tenant waits until that is fixed.
            tracing::warn!(tenant = %e.name, "{clash}; ignoring the tenant");
            continue;
        }
        let limiter =
            s.limiters.entry(e.name.clone()).or_insert_with(|| Limiter::new(&e.name, e.limits.clone()));
        limiter.update(&e.limits, s.coordinators);
        let key_ids = e.keys.iter().map(|k| hex(k)[..12].to_string()).collect();
        let tenant = Arc::new(Tenant {
            name: e.name.clone(),
            weight: e.weight,
            source: e.source,
            key_ids,
            limits: e.limits,
            incarnation: e.incarnation,
            limiter: limiter.clone(),
        });
        for k in &e.keys {
            d.by_digest.insert(*k, tenant.clone());
        }
        d.by_name.insert(e.name, tenant);
    }
    s.limiters.retain(|name, _| d.by_name.contains_key(name));
    Ok(d)
}

#[cfg(test)]
mod tests;
