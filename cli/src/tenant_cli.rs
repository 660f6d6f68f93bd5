//! `strata admin tenant|key|usage`: tenants, their API keys and their usage through
//! admin.v1 (docs/TENANTS.md).

use anyhow::{anyhow, bail, Context};
use clap::Subcommand;
use serde_json::json;
use strata_proto::admin::v1 as pb;
use strata_proto::admin::v1::admin_client::AdminClient;
use tonic::transport::Channel;

use crate::admin_cli::{request, status_error};

#[derive(Subcommand, Debug)]
pub enum TenantCommand {
    /// Make a tenant, or change its weight and limits (its keys stay). Limits left out
    /// are no limit.
    Set {
        /// The tenant's name.
        #[arg(long)]
        name: String,
        /// Share of capacity under overload, relative to other tenants.
        #[arg(long)]
        weight: Option<f64>,
        /// Requests admitted per second.
        #[arg(long)]
        requests_per_second: Option<f64>,
        /// Prompt plus generated tokens per minute.
        #[arg(long)]
        tokens_per_minute: Option<u64>,
        /// Requests in flight at once.
        #[arg(long)]
        max_concurrent: Option<u32>,
        /// Largest max_tokens one request may ask for.
        #[arg(long)]
        max_tokens_per_request: Option<u32>,
        /// Models it may call (repeat or comma-separate; none: every model).
        #[arg(long, value_delimiter = ',')]
        models: Vec<String>,
    },
    /// Every tenant, its limits and its keys' ids.
    List,
    /// Remove a tenant made through the admin API, and its keys.
    Delete {
        /// The tenant's name.
        #[arg(long)]
        name: String,
    },
}

#[derive(Subcommand, Debug)]
pub enum KeyCommand {
    /// Make a new API key for a tenant; it is printed once (the cluster keeps its hash).
    Create {
        /// The tenant's name.
        #[arg(long)]
        tenant: String,
    },
    /// Revoke a key by its id (from `strata admin tenant list`).
    Revoke {
        /// The tenant's name.
        #[arg(long)]
        tenant: String,
        /// The key's id.
        #[arg(long)]
        id: String,
    },
}

/// `strata admin usage` arguments.
#[derive(clap::Args, Debug)]
pub struct UsageArgs {
    /// One tenant (default: all).
    #[arg(long)]
    pub tenant: Option<String>,
    /// One model (default: all).
    #[arg(long)]
    pub model: Option<String>,
    /// From: a time ago (30m, 24h, 7d), a date (2026-12-01, UTC) or an RFC 3339 time;
    /// default: the beginning. Usage is kept by the hour, so this widens to whole hours.
    #[arg(long)]
    pub since: Option<String>,
    /// Until (same forms); default: now.
    #[arg(long)]
    pub until: Option<String>,
}

fn now_s() -> u64 {
    strata_common::cluster::now_ms() / 1000
}

/// Unix seconds of `text`: "30m", "24h", "7d", "90s" ago; a date; an RFC 3339 time.
pub fn parse_time(text: &str, now: u64) -> anyhow::Result<u64> {
    let t = text.trim();
    let unit = t.chars().last().ok_or_else(|| anyhow!("empty time"))?;
    if let (Some(secs), Ok(n)) = (
        match unit {
            's' => Some(1),
            'm' => Some(60),
            'h' => Some(3600),
            'd' => Some(86400),
            _ => None,
        },
        t[..t.len() - 1].parse::<u64>(),
    ) {
        return Ok(now.saturating_sub(n.saturating_mul(secs)));
    }
    if let Ok(d) = chrono::NaiveDate::parse_from_str(t, "%Y-%m-%d") {
        let at = d.and_hms_opt(0, 0, 0).expect("midnight exists").and_utc().timestamp();
        return u64::try_from(at).map_err(|_| anyhow!("{t:?} is before 1970"));
    }
    if let Ok(at) = chrono::DateTime::parse_from_rfc3339(t) {
        return u64::try_from(at.timestamp()).map_err(|_| anyhow!("{t:?} is before 1970"));
    }
    bail!("{t:?}: give a time ago (30m, 24h, 7d), a date (2026-12-01) or an RFC 3339 time")
}

fn tenant_json(t: &pb::Tenant) -> serde_json::Value {
    let l = t.limits.clone().unwrap_or_default();
    json!({
        "name": t.name, "source": t.source, "weight": t.weight,
        "requests_per_second": l.requests_per_second, "tokens_per_minute": l.tokens_per_minute,
        "max_concurrent": l.max_concurrent, "max_tokens_per_request": l.max_tokens_per_request,
        "models": l.models,
        "keys": t.keys.iter().map(|k| json!({"id": k.id, "created_unix_ms": k.created_unix_ms})).collect::<Vec<_>>(),
    })
}

fn print_tenants(tenants: &[pb::Tenant], j: bool) {
    if j {
        println!("{}", json!(tenants.iter().map(tenant_json).collect::<Vec<_>>()));
        return;
    }
    println!(
        "{:<20} {:<7} {:>6} {:>8} {:>10} {:>6} {:>8} {:<16} KEYS",
        "TENANT", "SOURCE", "WEIGHT", "REQ/S", "TOK/MIN", "CONC", "MAX_TOK", "MODELS"
    );
    let opt = |v: Option<String>| v.unwrap_or_else(|| "-".into());
    for t in tenants {
        let l = t.limits.clone().unwrap_or_default();
        let models = if l.models.is_empty() { "*".to_string() } else { l.models.join(",") };
        let keys: Vec<&str> = t.keys.iter().map(|k| k.id.as_str()).collect();
        println!(
            "{:<20} {:<7} {:>6} {:>8} {:>10} {:>6} {:>8} {:<16} {}",
            t.name,
            t.source,
            t.weight,
            opt(l.requests_per_second.map(|v| v.to_string())),
            opt(l.tokens_per_minute.map(|v| v.to_string())),
            opt(l.max_concurrent.map(|v| v.to_string())),
            opt(l.max_tokens_per_request.map(|v| v.to_string())),
            models,
            keys.join(",")
        );
    }
}

fn print_usage(rows: &[pb::UsageRow], j: bool) {
    if j {
        let v: Vec<_> = rows
            .iter()
            .map(|r| {
                json!({"tenant": r.tenant, "model": r.model, "requests": r.requests,
                       "prompt_tokens": r.prompt_tokens, "generated_tokens": r.generated_tokens,
                       "cached_prompt_tokens": r.cached_prompt_tokens, "errors": r.errors,
                       "rate_limited": r.rate_limited})
            })
            .collect();
        println!("{}", json!(v));
        return;
    }
    println!(
        "{:<20} {:<20} {:>9} {:>12} {:>12} {:>10} {:>7} {:>8}",
        "TENANT", "MODEL", "REQUESTS", "PROMPT", "GENERATED", "CACHED", "ERRORS", "LIMITED"
    );
    for r in rows {
        println!(
            "{:<20} {:<20} {:>9} {:>12} {:>12} {:>10} {:>7} {:>8}",
            r.tenant,
            r.model,
            r.requests,
            r.prompt_tokens,
            r.generated_tokens,
            r.cached_prompt_tokens,
            r.errors,
            r.rate_limited
        );
    }
}

pub async fn tenant(
    c: &mut AdminClient<Channel>,
    t: &Option<String>,
    j: bool,
    cmd: TenantCommand,
) -> anyhow::Result<()> {
    match cmd {
        TenantCommand::Set {
            name,
            weight,
            requests_per_second,
            tokens_per_minute,
            max_concurrent,
            max_tokens_per_request,
            models,
        } => {
            let limits = pb::TenantLimits {
                requests_per_second,
                tokens_per_minute,
                max_concurrent,
                max_tokens_per_request,
                models,
            };
            let r = c
                .set_tenant(request(t, pb::SetTenantRequest { name, weight, limits: Some(limits) })?)
                .await
                .map_err(status_error)?;
            print_tenants(&r.into_inner().tenant.into_iter().collect::<Vec<_>>(), j);
        }
        TenantCommand::List => {
            let r = c.list_tenants(request(t, pb::ListTenantsRequest {})?).await.map_err(status_error)?;
            print_tenants(&r.into_inner().tenants, j);
        }
        TenantCommand::Delete { name } => {
            c.delete_tenant(request(t, pb::DeleteTenantRequest { name: name.clone() })?)
                .await
                .map_err(status_error)?;
            match j {
                true => println!("{}", json!({ "deleted": name })),
                false => println!("deleted tenant {name}; its keys no longer work"),
            }
        }
    }
    Ok(())
}

pub async fn key(
    c: &mut AdminClient<Channel>,
    t: &Option<String>,
    j: bool,
    cmd: KeyCommand,
) -> anyhow::Result<()> {
    match cmd {
        KeyCommand::Create { tenant } => {
            let r = c
                .create_api_key(request(t, pb::CreateApiKeyRequest { tenant: tenant.clone() })?)
                .await
                .map_err(status_error)?
                .into_inner();
            match j {
                true => println!("{}", json!({ "tenant": tenant, "id": r.key_id, "key": r.key })),
                false => println!(
                    "{}\n(key {} of tenant {tenant}: shown this once, keep it safe)",
                    r.key, r.key_id
                ),
            }
        }
        KeyCommand::Revoke { tenant, id } => {
            let req = pb::RevokeApiKeyRequest { tenant: tenant.clone(), key_id: id.clone() };
            c.revoke_api_key(request(t, req)?).await.map_err(status_error)?;
            match j {
                true => println!("{}", json!({ "tenant": tenant, "revoked": id })),
                false => println!("revoked key {id} of tenant {tenant}"),
            }
        }
    }
    Ok(())
}

pub async fn usage(
    c: &mut AdminClient<Channel>,
    t: &Option<String>,
    j: bool,
    a: UsageArgs,
) -> anyhow::Result<()> {
    let now = now_s();
    let since = a.since.as_deref().map(|s| parse_time(s, now)).transpose().context("--since")?.unwrap_or(0);
    let until = a.until.as_deref().map(|s| parse_time(s, now)).transpose().context("--until")?.unwrap_or(0);
    let req = pb::GetUsageRequest {
        tenant: a.tenant.unwrap_or_default(),
        model: a.model.unwrap_or_default(),
        since_unix_s: since,
        until_unix_s: until,
    };
    let r = c.get_usage(request(t, req)?).await.map_err(status_error)?.into_inner();
    print_usage(&r.rows, j);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_parse_in_every_form() {
        let now = 1_800_000_000;
        assert_eq!(parse_time("30m", now).unwrap(), now - 1800);
        assert_eq!(parse_time("7d", now).unwrap(), now - 7 * 86400);
        assert_eq!(parse_time("2026-12-01", now).unwrap(), 1_796_083_200);
        assert_eq!(parse_time("2026-12-01T01:00:00Z", now).unwrap(), 1_796_086_800);
        assert!(parse_time("yesterday", now).is_err());
        assert!(parse_time("", now).is_err());
    }
}
