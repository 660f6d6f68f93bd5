//! `strata admin`: the admin.v1 client. Human-readable tables by default, `--json` for
//! scripts (one JSON document per command).

use anyhow::{anyhow, Context};
use clap::{Args, Subcommand};
use serde_json::json;
use strata_proto::admin::v1 as pb;
use strata_proto::admin::v1::admin_client::AdminClient;
use tonic::transport::Channel;

use crate::build_args::{BuildArgs, Shown};

#[derive(Args, Debug)]
pub struct AdminArgs {
    /// A coordinator's address, e.g. http://127.0.0.1:50051 (HOST:PORT alone is plaintext).
    #[arg(long, env = "STRATA_ENDPOINT", default_value = "http://127.0.0.1:50051")]
    pub endpoint: String,
    /// The admin token (sent as "authorization: Bearer <token>"); also --admin-token, as
    /// serve and coordinator call it.
    #[arg(long, alias = "admin-token", env = "STRATA_ADMIN_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// Print JSON instead of a table.
    #[arg(long, global = true)]
    pub json: bool,
    #[command(subcommand)]
    pub command: AdminCommand,
}

#[derive(Subcommand, Debug)]
pub enum AdminCommand {
    /// Deploy a model (or change a deployed model's spec).
    Deploy(DeployArgs),
    /// Change a model's replica count (scale-down drains first).
    Scale {
        /// The deployed model's name.
        #[arg(long)]
        name: String,
        /// Replicas wanted (0 keeps the model deployed with none).
        #[arg(long)]
        replicas: u32,
    },
    /// Drain and remove every replica of a model.
    Undeploy {
        /// The deployed model's name.
        #[arg(long)]
        name: String,
    },
    /// Deployed models.
    Models,
    /// The audit log of admin actions, newest first.
    Audit {
        /// Most entries shown.
        #[arg(long, default_value_t = 50)]
        limit: u32,
    },
    /// Replicas and their state (pending, loading, ready, draining, failed).
    Replicas {
        /// Only this model's replicas.
        #[arg(long)]
        name: Option<String>,
    },
    /// Registered workers.
    Workers,
    /// Stop placing work on a worker and move its replica elsewhere.
    Drain {
        /// The worker's id (as `strata admin workers` lists it).
        #[arg(long)]
        worker: String,
        /// Clear the drain instead.
        #[arg(long)]
        undo: bool,
    },
    /// Which coordinator leads (reconciles).
    Leader,
    /// Tenants: their limits and keys (docs/TENANTS.md).
    #[command(subcommand)]
    Tenant(crate::tenant_cli::TenantCommand),
    /// A tenant's API keys.
    #[command(subcommand)]
    Key(crate::tenant_cli::KeyCommand),
    /// What tenants used, by tenant and model, over all coordinators.
    Usage(crate::tenant_cli::UsageArgs),
    /// Roll out a new revision as a canary; promote or roll back (docs/ROLLOUTS.md).
    Rollout(crate::rollout_cli::RolloutArgs),
}

#[derive(clap::Args, Debug)]
pub struct DeployArgs {
    /// The name clients use in requests.
    #[arg(long)]
    pub name: String,
    /// Model directory as the workers see it.
    #[arg(long)]
    pub model: String,
    /// Replicas to run.
    #[arg(long, default_value_t = 1)]
    pub replicas: u32,
    #[command(flatten)]
    pub build: BuildArgs,
}

impl DeployArgs {
    fn request(self) -> anyhow::Result<pb::DeployModelRequest> {
        Ok(pb::DeployModelRequest {
            name: self.name,
            build: Some(self.build.to_pb(Some(self.model))?),
            replicas: self.replicas,
            ..Default::default()
        })
    }
}

pub fn request<T>(token: &Option<String>, msg: T) -> anyhow::Result<tonic::Request<T>> {
    let mut r = tonic::Request::new(msg);
    if let Some(t) = token {
        r.metadata_mut().insert(
            "authorization",
            format!("Bearer {t}").parse().map_err(|_| anyhow!("--token: not a valid header value"))?,
        );
    }
    Ok(r)
}

/// A refused call as one line: its code and message.
pub fn status_error(s: tonic::Status) -> anyhow::Error {
    let message: Vec<&str> = s.message().lines().map(str::trim).filter(|l| !l.is_empty()).collect();
    anyhow!("{:?}: {}", s.code(), message.join("; "))
}

/// Says on stderr (stdout stays the listing) that the answering coordinator has not
/// reached the registry since `since_ms`, so what it lists may be out of date.
fn warn_stale(since_ms: u64) {
    if since_ms == 0 {
        return;
    }
    let secs = strata_common::cluster::now_ms().saturating_sub(since_ms) / 1000;
    eprintln!(
        "stale: the coordinator has not reached the registry since {} ({secs}s ago); this is what it knew then",
        rfc3339_ms(since_ms)
    );
}

fn state_name(v: i32) -> &'static str {
    match pb::ReplicaState::try_from(v) {
        Ok(pb::ReplicaState::Pending) => "pending",
        Ok(pb::ReplicaState::Loading) => "loading",
        Ok(pb::ReplicaState::Ready) => "ready",
        Ok(pb::ReplicaState::Draining) => "draining",
        Ok(pb::ReplicaState::Failed) => "failed",
        _ => "unknown",
    }
}

fn model_json(m: &pb::ModelStatus) -> serde_json::Value {
    let b = Shown::model(m);
    let s = b.scheduler;
    json!({
        "name": m.name, "model_dir": b.model_dir, "dtype": b.dtype, "tp": b.tp, "pp": b.pp, "ep": b.ep,
        "desired_replicas": m.desired_replicas, "ready_replicas": m.ready_replicas,
        "max_num_seqs": s.max_num_seqs, "max_batched_tokens": s.max_batched_tokens,
        "kv_cache_bytes": s.kv_cache_bytes, "max_waiting": s.max_waiting,
        "generation": m.generation, "device": b.device, "quantize": b.quantize,
        "weight_bytes_per_rank": m.weight_bytes_per_rank,
        "canary_revision": m.canary_revision, "canary_percent": m.canary_percent,
    })
}

fn print_models(models: &[pb::ModelStatus], as_json: bool) {
    if as_json {
        println!("{}", json!(models.iter().map(model_json).collect::<Vec<_>>()));
        return;
    }
    println!(
        "{:<24} {:<6} {:>5} {:>3} {:>3} {:>8} {:>5} {:>9} {:>8} {:>12}  DIR",
        "NAME", "DEVICE", "DTYPE", "TP", "PP", "REPLICAS", "READY", "GiB/RANK", "REVISION", "CANARY"
    );
    let dash = |s: &str| if s.is_empty() { "-".to_string() } else { s.to_string() };
    for m in models {
        let b = Shown::model(m);
        let per_rank = match m.weight_bytes_per_rank {
            0 => "-".to_string(),
            b => format!("{:.2}", b as f64 / (1u64 << 30) as f64),
        };
        let canary = match m.canary_revision {
            0 => "-".to_string(),
            r => format!("r{r} {}%", m.canary_percent),
        };
        println!(
            "{:<24} {:<6} {:>5} {:>3} {:>3} {:>8} {:>5} {:>9} {:>8} {:>12}  {}",
            m.name,
            dash(&b.device),
            dash(&b.dtype),
            b.tp,
            b.pp,
            m.desired_replicas,
            m.ready_replicas,
            per_rank,
            format!("r{}", m.generation),
            canary,
            b.model_dir
        );
    }
}

pub async fn run(args: AdminArgs) -> anyhow::Result<()> {
    let mut c: AdminClient<Channel> = AdminClient::connect(crate::client::endpoint_url(&args.endpoint))
        .await
        .with_context(|| format!("cannot connect to --endpoint {}", args.endpoint))?;
    let t = &args.token;
    let j = args.json;
    match args.command {
        AdminCommand::Deploy(d) => {
            let r = c.deploy_model(request(t, d.request()?)?).await.map_err(status_error)?;
            print_models(&r.into_inner().model.into_iter().collect::<Vec<_>>(), j);
        }
        AdminCommand::Scale { name, replicas } => {
            let r = c
                .scale_replicas(request(t, pb::ScaleReplicasRequest { name, replicas })?)
                .await
                .map_err(status_error)?;
            print_models(&r.into_inner().model.into_iter().collect::<Vec<_>>(), j);
        }
        AdminCommand::Undeploy { name } => {
            let req = request(t, pb::UndeployModelRequest { name: name.clone() })?;
            c.undeploy_model(req).await.map_err(status_error)?;
            match j {
                true => println!("{}", json!({ "undeployed": name })),
                false => println!("undeployed {name}; its replicas drain"),
            }
        }
        AdminCommand::Models => {
            let r = c.list_models(request(t, pb::ListModelsRequest {})?).await.map_err(status_error)?;
            let r = r.into_inner();
            warn_stale(r.stale_since_ms);
            print_models(&r.models, j);
        }
        AdminCommand::Replicas { name } => {
            let r = c
                .list_replicas(request(t, pb::ListReplicasRequest { name: name.unwrap_or_default() })?)
                .await
                .map_err(status_error)?
                .into_inner();
            warn_stale(r.stale_since_ms);
            print_replicas(&r.replicas, j);
        }
        AdminCommand::Workers => {
            let r = c
                .list_workers(request(t, pb::ListWorkersRequest {})?)
                .await
                .map_err(status_error)?
                .into_inner();
            warn_stale(r.stale_since_ms);
            print_workers(&r.workers, j);
        }
        AdminCommand::Drain { worker, undo } => {
            c.drain_worker(request(t, pb::DrainWorkerRequest { worker_id: worker.clone(), undrain: undo })?)
                .await
                .map_err(status_error)?;
            if j {
                println!("{}", json!({ "worker": worker, "draining": !undo }));
            } else if undo {
                println!("worker {worker} takes placements again");
            } else {
                println!("worker {worker} drained: its replica moves elsewhere");
            }
        }
        AdminCommand::Audit { limit } => {
            let r = c
                .list_audit(request(t, pb::ListAuditRequest { limit })?)
                .await
                .map_err(status_error)?
                .into_inner();
            print_audit(&r.entries, j);
        }
        AdminCommand::Tenant(cmd) => crate::tenant_cli::tenant(&mut c, t, j, cmd).await?,
        AdminCommand::Key(cmd) => crate::tenant_cli::key(&mut c, t, j, cmd).await?,
        AdminCommand::Usage(a) => crate::tenant_cli::usage(&mut c, t, j, a).await?,
        AdminCommand::Rollout(a) => crate::rollout_cli::run(&mut c, t, j, a).await?,
        AdminCommand::Leader => {
            let r =
                c.get_leader(request(t, pb::GetLeaderRequest {})?).await.map_err(status_error)?.into_inner();
            warn_stale(r.stale_since_ms);
            if j {
                println!("{}", json!({ "leader": r.leader_id, "answered_by": r.coordinator_id }));
            } else if r.leader_id.is_empty() {
                println!("no leader (answered by {})", r.coordinator_id);
            } else {
                println!("{} (answered by {})", r.leader_id, r.coordinator_id);
            }
        }
    }
    Ok(())
}

fn print_audit(entries: &[pb::AuditEntry], j: bool) {
    if j {
        for e in entries {
            println!(
                "{}",
                json!({ "at_ms": e.at_ms, "coordinator": e.coordinator, "caller": e.caller, "action": e.action,
                        "target": e.target, "detail": e.detail, "outcome": e.outcome })
            );
        }
        return;
    }
    if entries.is_empty() {
        println!("no entries");
        return;
    }
    println!(
        "{:<24}  {:<14}  {:<20}  {:<16}  {:<16}  {:<8}  detail",
        "time", "coordinator", "caller", "action", "target", "outcome"
    );
    for e in entries {
        println!(
            "{:<24}  {:<14}  {:<20}  {:<16}  {:<16}  {:<8}  {}",
            rfc3339_ms(e.at_ms),
            e.coordinator,
            e.caller,
            e.action,
            e.target,
            e.outcome,
            e.detail
        );
    }
}

/// Milliseconds since the Unix epoch as RFC 3339 UTC (`2026-12-06T22:49:44.123Z`).
fn rfc3339_ms(ms: u64) -> String {
    chrono::DateTime::from_timestamp_millis(ms as i64)
        .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true))
        .unwrap_or_else(|| ms.to_string())
}

fn print_replicas(replicas: &[pb::ReplicaStatus], j: bool) {
    if j {
        let v: Vec<_> = replicas
            .iter()
            .map(|x| {
                json!({
                    "id": x.id, "model": x.model, "state": state_name(x.state), "reason": x.reason,
                    "workers": x.workers, "leader_address": x.leader_address,
                    "generation": x.generation, "since_ms": x.since_ms,
                })
            })
            .collect();
        println!("{}", json!(v));
        return;
    }
    println!("{:<28} {:<20} {:<9} {:<30} REASON", "REPLICA", "MODEL", "STATE", "WORKERS");
    for x in replicas {
        println!(
            "{:<28} {:<20} {:<9} {:<30} {}",
            x.id,
            x.model,
            state_name(x.state),
            x.workers.join(","),
            x.reason
        );
    }
}

fn print_workers(workers: &[pb::WorkerStatus], j: bool) {
    if j {
        let v: Vec<_> = workers
            .iter()
            .map(|w| {
                json!({
                    "id": w.id, "address": w.address, "device_kind": w.device_kind,
                    "device_count": w.device_count, "memory_bytes": w.memory_bytes,
                    "memory_total_bytes": w.memory_total_bytes, "node": w.node,
                    "kv_cache_bytes": w.kv_cache_bytes,
                    "replica": w.replica, "rank": w.rank, "shard_state": w.shard_state,
                    "draining": w.draining, "started_ms": w.started_ms,
                    "state": w.state, "state_since_ms": w.state_since_ms, "reason": w.reason,
                })
            })
            .collect();
        println!("{}", json!(v));
        return;
    }
    println!(
        "{:<24} {:<22} {:<16} {:<6} {:>9} {:<28} {:<8} {:<9} SINCE",
        "WORKER", "ADDRESS", "NODE", "DEVICE", "FREE GiB", "REPLICA", "SHARD", "STATE"
    );
    for w in workers {
        let replica =
            if w.replica.is_empty() { "-".to_string() } else { format!("{} #{}", w.replica, w.rank) };
        // Older coordinators send no state: their workers are up, or drained.
        let state = match (w.state.as_str(), w.draining) {
            ("", true) => "draining",
            ("", false) => "up",
            (s, _) => s,
        };
        let since = match w.state_since_ms {
            0 => "-".to_string(),
            ms => format!("{} ({})", rfc3339_ms(ms), w.reason),
        };
        println!(
            "{:<24} {:<22} {:<16} {:<6} {:>9.1} {:<28} {:<8} {:<9} {}",
            w.id,
            w.address,
            if w.node.is_empty() { "-" } else { &w.node },
            w.device_kind,
            w.memory_bytes as f64 / (1u64 << 30) as f64,
            replica,
            if w.shard_state.is_empty() { "-" } else { &w.shard_state },
            state,
            since
        );
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn audit_times_are_rfc3339() {
        assert_eq!(super::rfc3339_ms(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(super::rfc3339_ms(1_796_600_477_123), "2026-12-06T23:41:17.123Z");
    }
}
