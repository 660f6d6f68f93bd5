//! `strata admin rollout`: a new revision beside the serving one, its share of requests,
//! promote and rollback (docs/ROLLOUTS.md).

use anyhow::bail;
use serde_json::json;
use strata_proto::admin::v1 as pb;
use strata_proto::admin::v1::admin_client::AdminClient;
use tonic::transport::Channel;

use crate::admin_cli::{request, status_error};
use crate::build_args::{BuildArgs, Shown};

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
    /// The new revision's build (each flag left out: the serving revision's).
    #[command(flatten)]
    pub build: BuildArgs,
}

#[derive(clap::Subcommand, Debug)]
pub enum RolloutStep {
    /// The canary becomes the serving revision; the old one drains once replaced.
    Promote {
        /// The deployed model's name.
        #[arg(long)]
        name: String,
    },
    /// Drop the canary; with none, return to the revision served before.
    Rollback {
        /// The deployed model's name.
        #[arg(long)]
        name: String,
    },
    /// The serving revision, the canary and past revisions.
    Status {
        /// The deployed model's name.
        #[arg(long)]
        name: String,
    },
}

impl RolloutArgs {
    /// Whether any flag describes a new revision (otherwise `--canary` reweights).
    fn builds(&self) -> bool {
        self.model.is_some() || self.build.any() || self.canary_replicas.is_some()
    }

    fn start(&self, name: String, percent: f64) -> anyhow::Result<pb::StartRolloutRequest> {
        Ok(pb::StartRolloutRequest {
            name,
            build: Some(self.build.to_pb(self.model.clone())?),
            canary_percent: percent,
            canary_replicas: self.canary_replicas.unwrap_or(0),
            ..Default::default()
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
                let b = Shown::revision(v);
                json!({
                    "revision": v.revision, "state": v.state, "model_dir": b.model_dir, "dtype": b.dtype,
                    "device": b.device, "tp": b.tp, "pp": b.pp, "ep": b.ep, "traffic_percent": v.traffic_percent,
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
        let b = Shown::revision(v);
        println!(
            "{:<8} {:<12} {:>7}% {:>8} {:>5} {:>3} {:>3}  {}",
            v.revision, v.state, v.traffic_percent, replicas, v.ready_replicas, b.tp, b.pp, b.model_dir
        );
    }
}
