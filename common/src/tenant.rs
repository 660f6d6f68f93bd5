//! Tenants: who a set of API keys belongs to, what each may use, and what each used.
//!
//! A tenant is declared in the configuration file (`[[coordinator.tenants]]`) or through
//! the admin API (a [`TenantRecord`] in the registry, so every coordinator sees it). Keys
//! are kept as SHA-256 digests only; a key's id is the first 12 hex digits of its digest,
//! which names it in listings and revocations without revealing it.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::registry::keys::valid_name;

/// The tenant of callers that bear a plain `api_keys` key, or of every caller when
/// inference is open (no keys anywhere).
pub const DEFAULT_TENANT: &str = "default";

/// What a tenant may use. Absent: unlimited.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TenantLimits {
    /// Requests admitted per second (a bucket holding one second's worth).
    pub requests_per_second: Option<f64>,
    /// Prompt plus generated tokens per minute. A request reserves its prompt and its
    /// `max_tokens` when admitted; what it does not generate is given back when it ends.
    pub tokens_per_minute: Option<u64>,
    /// Requests (unary or streaming) in flight at once.
    pub max_concurrent: Option<u32>,
    /// Most tokens one request may ask to generate (`max_tokens`); a request that names
    /// none is capped at it.
    pub max_tokens_per_request: Option<u32>,
    /// Models the tenant may call; empty: every model.
    pub models: Vec<String>,
}

impl TenantLimits {
    pub fn validate(&self, field: &str) -> Result<()> {
        if let Some(r) = self.requests_per_second {
            if !(r.is_finite() && r > 0.0) {
                return Err(Error::invalid(
                    format!("{field}.requests_per_second"),
                    "must be a positive number",
                ));
            }
        }
        let positive = [
            ("tokens_per_minute", self.tokens_per_minute.map(|v| v as f64)),
            ("max_concurrent", self.max_concurrent.map(f64::from)),
            ("max_tokens_per_request", self.max_tokens_per_request.map(f64::from)),
        ];
        for (name, v) in positive {
            if v == Some(0.0) {
                return Err(Error::invalid(
                    format!("{field}.{name}"),
                    "must be at least 1 (leave it out for no limit)",
                ));
            }
        }
        if let Some(m) = self.models.iter().find(|m| !valid_name(m)) {
            return Err(Error::invalid(format!("{field}.models"), format!("{m:?} is not a model name")));
        }
        Ok(())
    }
}

/// One API key of a tenant, as stored: never the key itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyRecord {
    /// The first 12 hex digits of the digest.
    pub id: String,
    /// SHA-256 of the key, 64 lowercase hex digits.
    pub sha256: String,
    /// Unix milliseconds when the key was made (0: unknown).
    #[serde(default)]
    pub created_ms: u64,
}

impl KeyRecord {
    /// The record of a key whose SHA-256 is `digest` (64 hex digits).
    pub fn from_digest(digest: &str, created_ms: u64) -> Result<KeyRecord> {
        let hex = digest.to_ascii_lowercase();
        if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(Error::invalid("keys", "a key digest is 64 hex digits"));
        }
        Ok(KeyRecord { id: hex[..12].to_string(), sha256: hex, created_ms })
    }

    /// The digest as bytes.
    pub fn digest(&self) -> Option<[u8; 32]> {
        let mut out = [0u8; 32];
        if self.sha256.len() != 64 {
            return None;
        }
        for (i, b) in out.iter_mut().enumerate() {
            *b = u8::from_str_radix(self.sha256.get(2 * i..2 * i + 2)?, 16).ok()?;
        }
        Some(out)
    }
}

/// A tenant made through the admin API: `<prefix>/tenants/<name>`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TenantRecord {
    pub name: String,
    /// Share of capacity under overload, relative to other tenants (default 1).
    #[serde(default = "one")]
    pub weight: f64,
    #[serde(default)]
    pub limits: TenantLimits,
    #[serde(default)]
    pub keys: Vec<KeyRecord>,
    /// Which creation of the name this is: set when the tenant is made, kept by changes,
    /// new when a deleted name is made again — so files and batches a deleted tenant left
    /// behind are not the new one's. Empty for records older than the field.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub incarnation: String,
}

fn one() -> f64 {
    1.0
}

/// Most keys one tenant may hold (rotation needs two; a few spares are plenty).
pub const MAX_KEYS_PER_TENANT: usize = 64;

impl TenantRecord {
    pub fn validate(&self) -> Result<()> {
        if !valid_name(&self.name) {
            return Err(Error::invalid("name", format!("{:?} is not a valid tenant name", self.name)));
        }
        check_weight(self.weight)?;
        self.limits.validate("limits")?;
        if self.keys.len() > MAX_KEYS_PER_TENANT {
            return Err(Error::invalid("keys", format!("at most {MAX_KEYS_PER_TENANT} keys per tenant")));
        }
        for k in &self.keys {
            let again = KeyRecord::from_digest(&k.sha256, k.created_ms)?;
            if again.id != k.id {
                return Err(Error::invalid("keys", format!("key id {:?} does not match its digest", k.id)));
            }
        }
        Ok(())
    }

    /// [`TenantRecord::validate`], and the name matches the key it is filed under.
    pub fn check(&self, key_name: &str) -> Result<()> {
        if self.name != key_name {
            return Err(Error::invalid("name", format!("{:?} is filed under tenants/{key_name}", self.name)));
        }
        self.validate()
    }
}

pub fn check_weight(weight: f64) -> Result<()> {
    if !(weight.is_finite() && weight > 0.0 && weight <= 1000.0) {
        return Err(Error::invalid("weight", "must be a number above 0 and at most 1000"));
    }
    Ok(())
}

/// A tenant in the configuration file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantConfig {
    pub name: String,
    /// Its API keys: the key, or `sha256:<64 hex digits>` of it.
    #[serde(default)]
    pub keys: Vec<String>,
    #[serde(default = "one")]
    pub weight: f64,
    #[serde(default)]
    pub limits: TenantLimits,
}

impl TenantConfig {
    pub fn validate(&self, index: usize) -> Result<()> {
        let field = format!("coordinator.tenants[{index}]");
        if !valid_name(&self.name) {
            return Err(Error::invalid(
                format!("{field}.name"),
                format!("{:?} is not a valid tenant name", self.name),
            ));
        }
        check_weight(self.weight)
            .map_err(|_| Error::invalid(format!("{field}.weight"), "must be above 0 and at most 1000"))?;
        self.limits.validate(&format!("{field}.limits"))
    }
}

/// What one tenant used of one model over some time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct UsageCounts {
    /// Requests that ended (finished, failed or cancelled) after admission.
    pub requests: u64,
    pub prompt_tokens: u64,
    /// Tokens delivered to the caller.
    pub generated_tokens: u64,
    /// Prompt tokens answered without a forward pass (response-cache hits).
    pub cached_prompt_tokens: u64,
    /// Requests that ended in an error, rate limits included.
    pub errors: u64,
    /// Requests refused by one of the tenant's limits (also counted in `errors`).
    pub rate_limited: u64,
}

impl UsageCounts {
    pub fn add(&mut self, o: &UsageCounts) {
        self.requests += o.requests;
        self.prompt_tokens += o.prompt_tokens;
        self.generated_tokens += o.generated_tokens;
        self.cached_prompt_tokens += o.cached_prompt_tokens;
        self.errors += o.errors;
        self.rate_limited += o.rate_limited;
    }
}

/// Usage is kept in buckets of this many seconds (an hour).
pub const USAGE_BUCKET_S: u64 = 3600;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_and_limits_are_checked() {
        let digest = "015f7e6bc5aeaf483724089e9252cc13b50951a6b69412522765cff4d780306e";
        let k = KeyRecord::from_digest(digest, 1).unwrap();
        assert_eq!(k.id, "015f7e6bc5ae");
        assert_eq!(k.digest().unwrap()[0], 0x01);
        assert!(KeyRecord::from_digest("abc", 1).is_err());
        let mut t = TenantRecord {
            name: "team-a".into(),
            weight: 1.0,
            limits: TenantLimits::default(),
            keys: vec![k],
            incarnation: String::new(),
        };
        assert!(t.check("team-a").is_ok());
        assert!(t.check("team-b").is_err());
        t.keys[0].id = "000000000000".into();
        assert!(t.validate().is_err(), "an id must match its digest");
        t.keys.clear();
        t.weight = 0.0;
        assert!(t.validate().is_err());
        t.weight = 2.0;
        t.limits.requests_per_second = Some(f64::NAN);
        assert!(t.validate().unwrap_err().to_string().contains("requests_per_second"));
        t.limits = TenantLimits { max_concurrent: Some(0), ..Default::default() };
        assert!(t.validate().unwrap_err().to_string().contains("max_concurrent"));
        t.limits = TenantLimits { models: vec!["a/b".into()], ..Default::default() };
        assert!(t.validate().is_err());
    }
}
