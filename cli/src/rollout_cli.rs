//! `strata admin rollout`: a new revision beside the serving one, its share of requests,
//! promote and rollback (docs/ROLLOUTS.md).

use anyhow::{bail, Context};
use serde_json::json;
use strata_proto::admin::v1 as pb;
use strata_proto::admin::v1::admin_client::AdminClient;
use tonic::transport::Channel;

use crate::admin_cli::{request, status_error};

/// Start a rollout (`--model` or any build flag: a new revision in canary), change the
/// canary's share (`--canary` alone), or act on a running one.
#[derive(clap::Args, Debug)]
#[command(args_conflicts_with_subcommands = true)]
pub struct RolloutArgs {
    #[command(subcommand)]
    pub step: Option<RolloutStep>,
    /// The deployed model.
    #[arg(long)]
    pub name: Option<String>,
    /// The new revision's model directory, as the workers see it (default: the serving
    /// revision's).
    #[arg(long)]
    pub model: Option<String>,
    /// Share of requests the new revision takes: "10%", "2.5" [default: 10%].
    #[arg(long)]
    pub canary: Option<String>,
    /// Replicas of the new revision (default: its share of the deployment's, at least 1).
    #[arg(long)]
    pub canary_replicas: Option<u32>,
    /// bf16, f16 or f32 (default: the serving revision's).
    #[arg(long)]
    pub dtype: Option<String>,
    #[arg(long)]
    pub tp: Option<u32>,
    #[arg(long)]
    pub pp: Option<u32>,
    #[arg(long, value_parser = ["cpu", "cuda"])]
    pub device: Option<String>,
    /// Most sequences per engine step (default: the serving revision's).
    #[arg(long)]
    pub max_num_seqs: Option<u32>,
    /// Most tokens per engine step (default: the serving revision's).
    #[arg(long)]
    pub max_batched_tokens: Option<u32>,
    /// KV cache per rank, e.g. 512MiB (default: the serving revision's).
    #[arg(long)]
    pub kv_cache_memory: Option<String>,
}

#[derive(clap::Subcommand, Debug)]
pub enum RolloutStep {
    /// The canary becomes the serving revision; the old one drains once replaced.
    Promote {
        #[arg(long)]
        name: String,
    },
    /// Drop the canary; with none, return to the revision served before.
    Rollback {
        #[arg(long)]
        name: String,
    },
    /// The serving revision, the canary and past revisions.
    Status {
        #[arg(long)]
        name: String,
    },
}

impl RolloutArgs {
    /// Whether any flag describes a new revision (otherwise `--canary` reweights).
    fn builds(&self) -> bool {
        self.model.is_some()
            || self.dtype.is_some()
            || self.tp.is_some()
            || self.pp.is_some()
            || self.device.is_some()
            || self.max_num_seqs.is_some()
            || self.max_batched_tokens.is_some()
            || self.kv_cache_memory.is_some()
            || self.canary_replicas.is_some()
    }

    fn start(&self, name: String, percent: f64) -> anyhow::Result<pb::StartRolloutRequest> {
        let kv_cache_bytes = match &self.kv_cache_memory {
            Some(m) => strata_common::config::parse_memory(m).context("--kv-cache-memory")? as u64,
            None => 0,
        };
        Ok(pb::StartRolloutRequest {
            name,
            model_dir: self.model.clone().unwrap_or_default(),
            dtype: self.dtype.clone().unwrap_or_default(),
            tp: self.tp.unwrap_or(0),
            pp: self.pp.unwrap_or(0),
            device: self.device.clone().unwrap_or_default(),
            scheduler: Some(pb::SchedulerLimits {
                max_num_seqs: self.max_num_seqs.unwrap_or(0),
                max_batched_tokens: self.max_batched_tokens.unwrap_or(0),
                kv_cache_bytes,
                max_waiting: 0,
            }),
            canary_percent: percent,
            canary_replicas: self.canary_replicas.unwrap_or(0),
        })
    }
}

/// `--canary` as a percentage.
fn percent(s: &str) -> anyhow::Result<f64> {
    let bp = strata_common::rollout::parse_percent(s).map_err(|e| anyhow::anyhow!("--canary: {e}"))?;
    Ok(bp as f64 / 100.0)
}

pub async fn run(
    c: &mut AdminClient<Channel>,
    t: &Option<String>,
    j: bool,
    a: RolloutArgs,
) -> anyhow::Result<()> {
    let r = match a.step {
        Some(RolloutStep::Promote { name }) => {
            c.promote_rollout(request(t, pb::PromoteRolloutRequest { name })?).await
        }
        Some(RolloutStep::Rollback { name }) => {
            c.rollback_rollout(request(t, pb::RollbackRolloutRequest { name })?).await
        }
        Some(RolloutStep::Status { ref name }) => {
            c.get_rollout(request(t, pb::GetRolloutRequest { name: name.clone() })?).await
        }
        None => {
            let Some(name) = a.name.clone() else {
                bail!(
                    "--name: name the deployed model to roll out (or use `rollout promote|rollback|status`)"
                )
            };
            if a.builds() {
                let p = percent(a.canary.as_deref().unwrap_or("10%"))?;
                c.start_rollout(request(t, a.start(name, p)?)?).await
            } else if let Some(share) = &a.canary {
                let req = pb::SetRolloutWeightRequest { name, canary_percent: percent(share)? };
                c.set_rollout_weight(request(t, req)?).await
            } else {
                bail!("give --model (or another build flag) to start a rollout, or --canary to change its share")
            }
        }
    };
    print(&r.map_err(status_error)?.into_inner(), j);
    Ok(())
}

fn print(r: &pb::RolloutResponse, j: bool) {
    if j {
        let revisions: Vec<_> = r
            .revisions
            .iter()
            .map(|v| {
                json!({
                    "revision": v.revision, "state": v.state, "model_dir": v.model_dir, "dtype": v.dtype,
                    "device": v.device, "tp": v.tp, "pp": v.pp, "traffic_percent": v.traffic_percent,
                    "desired_replicas": v.desired_replicas, "ready_replicas": v.ready_replicas,
                    "created_ms": v.created_ms, "ended_ms": v.ended_ms,
                })
            })
            .collect();
        println!("{}", json!({ "name": r.name, "revisions": revisions }));
        return;
    }
    println!(
        "{:<8} {:<12} {:>8} {:>8} {:>5} {:>3} {:>3}  DIR",
        "REVISION", "STATE", "TRAFFIC", "REPLICAS", "READY", "TP", "PP"
    );
    for v in &r.revisions {
        let replicas = if v.desired_replicas == 0 { "-".to_string() } else { v.desired_replicas.to_string() };
        println!(
            "{:<8} {:<12} {:>7}% {:>8} {:>5} {:>3} {:>3}  {}",
            v.revision, v.state, v.traffic_percent, replicas, v.ready_replicas, v.tp, v.pp, v.model_dir
        );
    }
}
