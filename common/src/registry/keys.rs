//! Strata's key space, under a configurable prefix so two clusters can share one etcd.
//!
//! ```text
//! <prefix>/workers/<worker-id>              WorkerRecord, bound to the worker's lease
//! <prefix>/models/<model-name>              ModelSpec: desired state (admin API)
//! <prefix>/replicas/<model-name>/<replica>  ReplicaRecord: actual state (leader coordinator)
//! <prefix>/drain/<worker-id>                a worker an operator drained (persistent)
//! <prefix>/leader                           the leader coordinator's id, bound to its lease
//! <prefix>/tenants/<name>                   TenantRecord: a tenant made through the admin API
//! <prefix>/coordinators/<id>                a live coordinator, bound to its lease
//! <prefix>.usage/<tenant>/<model>/<hour>/<instance>
//!                                           UsageCounts one coordinator process counted in
//!                                           one hour (outside the watched tree)
//! <prefix>.audit/<ms>-<coordinator>-<n>      AuditEntry of one admin action (outside the
//!                                           watched tree: coordinators never load it)
//! ```

/// Builds and parses keys under one prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Keys {
    prefix: String,
}

impl Keys {
    /// `prefix` without a trailing slash, e.g. "/strata".
    pub fn new(prefix: &str) -> Self {
        let p = prefix.trim_end_matches('/');
        let p = if p.starts_with('/') { p.to_string() } else { format!("/{p}") };
        Keys { prefix: p }
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Everything of this cluster (one watch covers it all).
    pub fn root(&self) -> String {
        format!("{}/", self.prefix)
    }

    pub fn workers(&self) -> String {
        format!("{}/workers/", self.prefix)
    }

    pub fn worker(&self, id: &str) -> String {
        format!("{}/workers/{id}", self.prefix)
    }

    pub fn models(&self) -> String {
        format!("{}/models/", self.prefix)
    }

    pub fn model(&self, name: &str) -> String {
        format!("{}/models/{name}", self.prefix)
    }

    pub fn replicas(&self) -> String {
        format!("{}/replicas/", self.prefix)
    }

    pub fn replica(&self, model: &str, id: &str) -> String {
        format!("{}/replicas/{model}/{id}", self.prefix)
    }

    pub fn drains(&self) -> String {
        format!("{}/drain/", self.prefix)
    }

    pub fn drain(&self, worker: &str) -> String {
        format!("{}/drain/{worker}", self.prefix)
    }

    pub fn leader(&self) -> String {
        format!("{}/leader", self.prefix)
    }

    pub fn tenants(&self) -> String {
        format!("{}/tenants/", self.prefix)
    }

    pub fn tenant(&self, name: &str) -> String {
        format!("{}/tenants/{name}", self.prefix)
    }

    pub fn coordinator(&self, id: &str) -> String {
        format!("{}/coordinators/{id}", self.prefix)
    }

    /// Usage records, beside (not under) [`Keys::root`]; `tenant` None: every tenant's.
    pub fn usages(&self, tenant: Option<&str>) -> String {
        match tenant {
            Some(t) => format!("{}.usage/{t}/", self.prefix),
            None => format!("{}.usage/", self.prefix),
        }
    }

    /// One process's usage of `model` by `tenant` in the hour starting at `hour_s`
    /// (Unix seconds; zero-padded so keys sort by time).
    pub fn usage(&self, tenant: &str, model: &str, hour_s: u64, instance: &str) -> String {
        format!("{}.usage/{tenant}/{model}/{hour_s:012}/{instance}", self.prefix)
    }

    /// The audit log, beside (not under) [`Keys::root`].
    pub fn audits(&self) -> String {
        format!("{}.audit/", self.prefix)
    }

    pub fn audit(&self, id: &str) -> String {
        format!("{}.audit/{id}", self.prefix)
    }

    /// What a key under this prefix names.
    pub fn parse<'a>(&self, key: &'a str) -> Option<KeyKind<'a>> {
        let rest = key.strip_prefix(self.prefix.as_str())?.strip_prefix('/')?;
        let (kind, name) = rest.split_once('/').unwrap_or((rest, ""));
        match kind {
            "workers" if !name.is_empty() => Some(KeyKind::Worker(name)),
            "models" if !name.is_empty() => Some(KeyKind::Model(name)),
            "replicas" => {
                let (model, id) = name.split_once('/')?;
                (!model.is_empty() && !id.is_empty()).then_some(KeyKind::Replica { model, id })
            }
            "drain" if !name.is_empty() => Some(KeyKind::Drain(name)),
            "leader" if name.is_empty() => Some(KeyKind::Leader),
            "tenants" if !name.is_empty() => Some(KeyKind::Tenant(name)),
            "coordinators" if !name.is_empty() => Some(KeyKind::Coordinator(name)),
            _ => None,
        }
    }
}

/// A parsed key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyKind<'a> {
    Worker(&'a str),
    Model(&'a str),
    Replica { model: &'a str, id: &'a str },
    Drain(&'a str),
    Leader,
    Tenant(&'a str),
    Coordinator(&'a str),
}

/// Names (model names, worker ids) end up inside keys: no slashes, no spaces, not empty.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 128
        && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip_through_parse() {
        let k = Keys::new("strata/");
        assert_eq!(k.worker("w1"), "/strata/workers/w1");
        assert_eq!(k.parse(&k.worker("w1")), Some(KeyKind::Worker("w1")));
        assert_eq!(k.parse(&k.model("m")), Some(KeyKind::Model("m")));
        assert_eq!(k.parse(&k.replica("m", "r-1")), Some(KeyKind::Replica { model: "m", id: "r-1" }));
        assert_eq!(k.parse(&k.drain("w2")), Some(KeyKind::Drain("w2")));
        assert_eq!(k.parse(&k.leader()), Some(KeyKind::Leader));
        assert_eq!(k.parse(&k.tenant("t")), Some(KeyKind::Tenant("t")));
        assert_eq!(k.parse(&k.coordinator("c1")), Some(KeyKind::Coordinator("c1")));
        assert_eq!(k.parse(&k.usage("t", "m", 3600, "c1")), None, "usage is outside the watched tree");
        assert!(k.usage("t", "m", 3600, "c1").starts_with(&k.usages(Some("t"))));
        assert_eq!(k.parse("/other/workers/w1"), None);
        assert_eq!(k.parse("/strataX/workers/w1"), None);
        assert_eq!(k.parse("/strata/replicas/m"), None);
        // Two clusters under different prefixes never see each other's keys.
        let other = Keys::new("/strata-b");
        assert_eq!(other.parse(&k.worker("w1")), None);
    }

    #[test]
    fn names_that_would_break_keys_are_rejected() {
        assert!(valid_name("llama-3.2_1b"));
        assert!(!valid_name(""));
        assert!(!valid_name("a/b"));
        assert!(!valid_name("a b"));
    }
}
