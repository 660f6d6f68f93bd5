//! Revisions of a deployment and rolling from one to the next.
//!
//! A deployment ([`ModelSpec`]) serves one *revision* — what its replicas are built from:
//! model directory, dtype, device, tp/pp and engine limits — numbered by the spec's
//! `generation` (a revision's number never names anything else, so responses cached for
//! one revision are never served for another). A rollout puts a second revision beside it
//! as a [`Canary`]: replicas of both run, and a share of requests (sticky per prompt
//! prefix, see the coordinator's routing) goes to the canary. Promoting makes the canary
//! the deployment's revision (its replicas are kept; the old revision's are replaced, make
//! before break); rolling back drops the canary, or, with none, returns to the revision
//! served before. Every revision that stops serving goes to the deployment's history.
//!
//! These are plain state transitions on the spec; the admin API writes their result with
//! compare-and-set and the leader's planner builds and drains replicas to match.

use serde::{Deserialize, Serialize};

use crate::build::Build;
use crate::cluster::{now_ms, ModelSpec};
use crate::error::{Error, Result};

/// Most past revisions a deployment keeps.
pub const MAX_HISTORY: usize = 32;
/// A canary's whole share of traffic, in basis points (100%).
pub const FULL_WEIGHT: u32 = 10_000;

/// A revision: what its replicas are built from, numbered.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Revision {
    /// The revision's number (the spec generation its replicas carry).
    pub generation: u64,
    /// Flat fields in the record, as a spec's.
    #[serde(flatten)]
    pub build: Build,
    /// Derived from the build when it was made; never makes a revision of its own.
    #[serde(default)]
    pub weight_bytes_per_rank: u64,
    /// Unix milliseconds when it was created (0: before revisions were recorded).
    #[serde(default)]
    pub created_ms: u64,
}

impl Revision {
    /// A revision of `build` not yet numbered (the spec numbers it when it takes it).
    pub fn of(build: Build, weight_bytes_per_rank: u64) -> Revision {
        Revision { generation: 0, build, weight_bytes_per_rank, created_ms: 0 }
    }
}

/// A revision taking a share of a deployment's traffic beside the serving one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Canary {
    pub revision: Revision,
    /// Its share of requests in basis points (1000 = 10%).
    pub weight_bp: u32,
    /// Replicas of it to run.
    pub replicas: u32,
}

/// Why a revision stopped serving.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// A later revision replaced it (a deploy or a promoted canary).
    Replaced,
    /// It was rolled back.
    RolledBack,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Replaced => "replaced",
            Outcome::RolledBack => "rolled_back",
        }
    }
}

/// A revision that no longer serves.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Retired {
    pub revision: Revision,
    pub outcome: Outcome,
    /// Unix milliseconds when it stopped serving.
    pub ended_ms: u64,
}

/// A deployment's rollout state: the canary, if one runs, and past revisions, newest last.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rollout {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub canary: Option<Canary>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub history: Vec<Retired>,
}

impl Rollout {
    pub fn is_empty(&self) -> bool {
        self.canary.is_none() && self.history.is_empty()
    }
}

/// What a rollback did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RolledBack {
    /// The canary was dropped; the serving revision was never touched.
    Canary(u64),
    /// The serving revision was replaced by the one before it.
    Serving { from: u64, to: u64 },
}

impl ModelSpec {
    /// The revision it serves.
    pub fn revision(&self) -> Revision {
        Revision {
            generation: self.generation,
            build: self.build.clone(),
            weight_bytes_per_rank: self.weight_bytes_per_rank,
            created_ms: self.created_ms,
        }
    }

    /// Makes `r` the revision it serves (replica count and rollout state unchanged).
    fn serve(&mut self, r: Revision) {
        self.generation = r.generation;
        self.build = r.build;
        self.weight_bytes_per_rank = r.weight_bytes_per_rank;
        self.created_ms = r.created_ms;
    }

    /// What replicas of `generation` are built from, as a spec of its own (the serving
    /// revision's or the canary's, with that revision's replica count); None for any other.
    pub fn build_spec(&self, generation: u64) -> Option<ModelSpec> {
        if generation == self.generation {
            return Some(ModelSpec { rollout: Rollout::default(), ..self.clone() });
        }
        let c = self.rollout.canary.as_ref().filter(|c| c.revision.generation == generation)?;
        let mut spec = ModelSpec { rollout: Rollout::default(), replicas: c.replicas, ..self.clone() };
        spec.serve(c.revision.clone());
        Some(spec)
    }

    /// The canary's build spec, when one runs.
    pub fn canary_spec(&self) -> Option<ModelSpec> {
        self.build_spec(self.rollout.canary.as_ref()?.revision.generation)
    }

    /// A number no revision of this deployment has had.
    pub fn next_generation(&self) -> u64 {
        let canary = self.rollout.canary.iter().map(|c| c.revision.generation);
        let past = self.rollout.history.iter().map(|h| h.revision.generation);
        canary.chain(past).fold(self.generation, u64::max) + 1
    }

    fn retire(&mut self, revision: Revision, outcome: Outcome) {
        self.rollout.history.push(Retired { revision, outcome, ended_ms: now_ms() });
        let excess = self.rollout.history.len().saturating_sub(MAX_HISTORY);
        self.rollout.history.drain(..excess);
    }

    fn no_canary(&self) -> Result<()> {
        match &self.rollout.canary {
            Some(c) => Err(Error::FailedPrecondition(format!(
                "model {:?} has revision {} in canary; promote or roll it back first",
                self.name.as_str(),
                c.revision.generation
            ))),
            None => Ok(()),
        }
    }

    /// Redeploys: `next` (its generation is assigned here) replaces the serving revision
    /// unless it builds the same replicas. Refused while a canary runs.
    pub fn redeploy(&mut self, mut next: Revision) -> Result<()> {
        self.no_canary()?;
        if next.build == self.build {
            // Derived fields (the weight estimate) may change without a new revision.
            self.weight_bytes_per_rank = next.weight_bytes_per_rank;
            return Ok(());
        }
        next.generation = self.next_generation();
        next.created_ms = now_ms();
        let old = self.revision();
        self.retire(old, Outcome::Replaced);
        self.serve(next);
        Ok(())
    }

    /// Starts a canary of `next` (its generation is assigned here) taking `weight_bp` of
    /// the traffic on `replicas` replicas.
    pub fn start_canary(&mut self, mut next: Revision, weight_bp: u32, replicas: u32) -> Result<u64> {
        self.no_canary()?;
        if next.build == self.build {
            return Err(Error::invalid(
                "model_dir",
                format!("revision {} already serves this model, dtype, tp/pp and limits", self.generation),
            ));
        }
        check_weight(weight_bp)?;
        next.generation = self.next_generation();
        next.created_ms = now_ms();
        let generation = next.generation;
        self.rollout.canary = Some(Canary { revision: next, weight_bp, replicas: replicas.max(1) });
        Ok(generation)
    }

    /// Changes the running canary's share of traffic.
    pub fn set_canary_weight(&mut self, weight_bp: u32) -> Result<()> {
        check_weight(weight_bp)?;
        let name = self.name.to_string();
        let c = self.rollout.canary.as_mut().ok_or_else(|| no_rollout(&name))?;
        c.weight_bp = weight_bp;
        Ok(())
    }

    /// The canary becomes the serving revision; the one it replaces goes to history.
    /// Returns (old, new) generations.
    pub fn promote(&mut self) -> Result<(u64, u64)> {
        let c = self.rollout.canary.take().ok_or_else(|| no_rollout(self.name.as_str()))?;
        let old = self.revision();
        let from = old.generation;
        self.retire(old, Outcome::Replaced);
        self.serve(c.revision);
        Ok((from, self.generation))
    }

    /// Drops the canary; with none, returns to the revision served before this one
    /// (the newest replaced one in history), which keeps its number.
    pub fn rollback(&mut self) -> Result<RolledBack> {
        if let Some(c) = self.rollout.canary.take() {
            let generation = c.revision.generation;
            self.retire(c.revision, Outcome::RolledBack);
            return Ok(RolledBack::Canary(generation));
        }
        let i =
            self.rollout.history.iter().rposition(|h| h.outcome == Outcome::Replaced).ok_or_else(|| {
                Error::FailedPrecondition(format!(
                    "model {:?} has no canary and no earlier revision to roll back to",
                    self.name.as_str()
                ))
            })?;
        let previous = self.rollout.history.remove(i).revision;
        let current = self.revision();
        let from = current.generation;
        self.retire(current, Outcome::RolledBack);
        self.serve(previous);
        Ok(RolledBack::Serving { from, to: self.generation })
    }

    /// Checks the rollout state a spec read from the registry carries.
    pub(crate) fn validate_rollout(&self) -> Result<()> {
        if let Some(c) = &self.rollout.canary {
            check_weight(c.weight_bp)?;
            if c.replicas == 0 || c.replicas > 1024 {
                return Err(Error::invalid("canary_replicas", format!("{} is not in 1..=1024", c.replicas)));
            }
            if c.revision.generation == self.generation {
                return Err(Error::invalid("canary", "has the serving revision's number"));
            }
            self.build_spec(c.revision.generation).map_or(Ok(()), |s| s.build.validate())?;
        }
        if self.rollout.history.len() > 4 * MAX_HISTORY {
            return Err(Error::invalid("history", format!("{} entries", self.rollout.history.len())));
        }
        Ok(())
    }
}

fn check_weight(weight_bp: u32) -> Result<()> {
    if weight_bp > FULL_WEIGHT {
        return Err(Error::invalid(
            "canary_percent",
            format!("{}% is more than 100%", weight_bp as f64 / 100.0),
        ));
    }
    Ok(())
}

fn no_rollout(name: &str) -> Error {
    Error::FailedPrecondition(format!("model {name:?} has no canary (start one with a rollout)"))
}

/// Parses a traffic share: "10%", "10", "2.5%" → basis points.
pub fn parse_percent(s: &str) -> Result<u32> {
    let t = s.trim().trim_end_matches('%').trim();
    let v: f64 = t
        .parse()
        .map_err(|_| Error::invalid("canary_percent", format!("{s:?}: expected a percentage like 10%")))?;
    percent_to_weight(v)
}

/// A traffic share in percent (0 to 100) → basis points.
pub fn percent_to_weight(percent: f64) -> Result<u32> {
    if !(0.0..=100.0).contains(&percent) {
        return Err(Error::invalid("canary_percent", format!("{percent}% is not between 0% and 100%")));
    }
    Ok((percent * 100.0).round() as u32)
}

#[cfg(test)]
mod tests;
