//! The records the cluster keeps in its registry (JSON values under [`Keys`]).
//!
//! Who writes what:
//! - a worker writes its own [`WorkerRecord`], bound to its lease;
//! - the admin API writes [`ModelSpec`]s (desired state) and drain marks;
//! - only the leader coordinator writes [`ReplicaRecord`]s (actual state), each write
//!   guarded by its leadership key.
//!
//! [`Keys`]: crate::registry::keys::Keys

use crate::ids::{ModelName, ReplicaId, WorkerId};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::rollout::Rollout;
use crate::shard::Parallelism;

pub use crate::build::{Build, EngineLimits};
pub use crate::device::DeviceKind;

/// What a worker offers. A worker process drives one device (a machine with several GPUs
/// runs one worker per GPU), so each placement slot is one registration.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Capacity {
    pub device_kind: DeviceKind,
    /// Devices the worker drives (1).
    pub device_count: u32,
    /// Device memory free for weights and KV cache when the worker registered, bytes
    /// (host memory for a CPU worker; the driver's free memory for a GPU).
    pub memory_bytes: u64,
    /// The device's total memory, bytes (0: unknown).
    #[serde(default)]
    pub memory_total_bytes: u64,
    /// The machine the worker runs on (Kubernetes: the node): ranks of one tensor-parallel
    /// group prefer one machine. Empty: unknown.
    #[serde(default)]
    pub node: String,
    /// The KV cache a shard gets here unless its deployment sets one, bytes.
    #[serde(default)]
    pub kv_cache_bytes: u64,
}

/// Where a worker's loaded shard stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ShardState {
    /// Reading weights or waiting for the replica's other ranks.
    Loading,
    /// Loaded and joined to its replica.
    Ready,
    /// Loading or the replica's communication failed; the reason is in `error`.
    Failed,
}

/// The replica rank a worker serves.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Assignment {
    pub replica: ReplicaId,
    pub model: ModelName,
    pub rank: u32,
    pub state: ShardState,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub error: String,
    /// A failed rank that lost its connection to another rank says which: the leader
    /// then blames that one (a rank 0 killed once left the surviving rank named).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lost_rank: Option<u32>,
}

/// `<prefix>/workers/<id>`, written by the worker with its lease.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerRecord {
    pub id: WorkerId,
    /// worker.v1 address coordinators call ("host:port").
    pub address: String,
    pub capacity: Capacity,
    /// The shard it holds, if any; kept across re-registration so a worker whose lease
    /// lapsed is re-adopted with what it has loaded.
    #[serde(default)]
    pub assignment: Option<Assignment>,
    /// Unix milliseconds when the process started (tells a restart from a re-registration).
    pub started_ms: u64,
    /// It is shutting down (SIGTERM): its replica moves elsewhere now, and nothing new is
    /// placed on it. Written before it lets go of its shard, so the leader blames no rank.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub leaving: bool,
}

/// `<prefix>/models/<name>`: what an operator asked for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelSpec {
    pub name: ModelName,
    /// What the serving revision's replicas are built from (flat fields in the record).
    #[serde(flatten)]
    pub build: Build,
    /// Estimated weight bytes of the largest rank (0: unknown, the model's files could not
    /// be read when it was deployed); placement adds the KV cache to it.
    #[serde(default)]
    pub weight_bytes_per_rank: u64,
    pub replicas: u32,
    /// The serving revision's number: changes with every change of its build (not the
    /// replica count), so replicas know which revision they were built from.
    #[serde(default)]
    pub generation: u64,
    /// Unix milliseconds when the serving revision was created (0: unknown).
    #[serde(default)]
    pub created_ms: u64,
    /// A canary revision beside the serving one, and past revisions.
    #[serde(default, skip_serializing_if = "Rollout::is_empty")]
    pub rollout: Rollout,
}

impl ModelSpec {
    pub fn parallelism(&self) -> Parallelism {
        self.build.parallelism()
    }

    pub fn world(&self) -> usize {
        self.build.world()
    }

    /// Checks the fields a deployment must get right; names the bad one.
    pub fn validate(&self) -> Result<()> {
        if !crate::registry::keys::valid_name(&self.name) {
            return Err(Error::invalid(
                "name",
                format!("{:?}: use 1-128 letters, digits, '-', '_', '.' or ':'", self.name),
            ));
        }
        self.build.validate()?;
        if self.replicas > 1024 {
            return Err(Error::invalid("replicas", format!("{} is more than 1024", self.replicas)));
        }
        self.validate_rollout()
    }
}

/// Where a replica stands, as `ListReplicas` reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReplicaState {
    /// Waiting for free workers.
    Pending,
    /// Workers assigned; shards loading, ranks joining, canary not yet through.
    Loading,
    /// Serving: its canary went through every rank.
    Ready,
    /// Taking no new requests; in-flight ones finish, then it is unloaded.
    Draining,
    /// A rank died, its canary failed, or loading failed; being torn down.
    Failed,
}

impl ReplicaState {
    pub fn as_str(self) -> &'static str {
        match self {
            ReplicaState::Pending => "pending",
            ReplicaState::Loading => "loading",
            ReplicaState::Ready => "ready",
            ReplicaState::Draining => "draining",
            ReplicaState::Failed => "failed",
        }
    }

    /// Counts toward the desired number of replicas.
    pub fn is_live(self) -> bool {
        matches!(self, ReplicaState::Pending | ReplicaState::Loading | ReplicaState::Ready)
    }
}

/// `<prefix>/replicas/<model>/<id>`, written by the leader coordinator.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaRecord {
    pub id: ReplicaId,
    pub model: ModelName,
    pub state: ReplicaState,
    /// Why it is in this state ("waiting for 2 free workers (1 free)", "rank 1 ...").
    #[serde(default)]
    pub reason: String,
    /// Worker id of each rank, in rank order; empty while pending.
    #[serde(default)]
    pub workers: Vec<WorkerId>,
    /// worker.v1 address of rank 0, where requests go.
    #[serde(default)]
    pub leader_address: String,
    /// The spec generation it was built from.
    #[serde(default)]
    pub generation: u64,
    /// Unix milliseconds of the last state change.
    #[serde(default)]
    pub since_ms: u64,
    /// Unix milliseconds when the replica was created (newest are drained first).
    #[serde(default)]
    pub created_ms: u64,
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Serialises a record for the registry.
pub fn encode<T: Serialize>(v: &T) -> Vec<u8> {
    serde_json::to_vec(v).expect("cluster records serialise")
}

/// Parses a record; a malformed value is reported with its key.
pub fn decode<T: for<'de> Deserialize<'de>>(key: &str, bytes: &[u8]) -> Result<T> {
    serde_json::from_slice(bytes).map_err(|e| Error::Internal(format!("registry value at {key}: {e}")))
}

/// Longest address a record may carry ("host:port").
const MAX_ADDRESS: usize = 256;
/// Most ranks a replica may have (as `ModelSpec::validate` allows).
const MAX_RANKS: usize = 1024;

fn check_address(field: &str, address: &str) -> Result<()> {
    let port = address.rsplit_once(':').and_then(|(host, port)| (!host.is_empty()).then_some(port));
    if address.len() > MAX_ADDRESS || port.and_then(|p| p.parse::<u16>().ok()).is_none() {
        let shown: String = address.chars().take(64).collect();
        return Err(Error::invalid(field, format!("{shown:?} is not a host:port address")));
    }
    Ok(())
}

/// Checks on records read back from the registry: anyone who can write to it could have
/// written anything, so a record is used only if it is well-formed and filed under its
/// own key.
impl WorkerRecord {
    pub fn check(&self, key_id: &str) -> Result<()> {
        if self.id.as_str() != key_id {
            return Err(Error::invalid(
                "id",
                format!("{:?} is filed under workers/{key_id}", self.id.as_str()),
            ));
        }
        check_address("address", &self.address)?;
        if self.capacity.node.len() > 253 {
            return Err(Error::invalid("capacity.node", "longer than 253 bytes"));
        }
        if let Some(a) = &self.assignment {
            if a.rank as usize >= MAX_RANKS {
                return Err(Error::invalid("assignment.rank", format!("{} is out of range", a.rank)));
            }
        }
        Ok(())
    }
}

impl ModelSpec {
    /// [`ModelSpec::validate`], and the name matches the key.
    pub fn check(&self, key_name: &str) -> Result<()> {
        if self.name.as_str() != key_name {
            return Err(Error::invalid(
                "name",
                format!("{:?} is filed under models/{key_name}", self.name.as_str()),
            ));
        }
        self.validate()
    }
}

impl ReplicaRecord {
    pub fn check(&self, key_model: &str, key_id: &str) -> Result<()> {
        if self.id.as_str() != key_id || self.model.as_str() != key_model {
            return Err(Error::invalid(
                "id",
                format!(
                    "replica {}/{} is filed under {key_model}/{key_id}",
                    self.model.as_str(),
                    self.id.as_str()
                ),
            ));
        }
        if self.workers.len() > MAX_RANKS {
            return Err(Error::invalid(
                "workers",
                format!("{} ranks is more than {MAX_RANKS}", self.workers.len()),
            ));
        }
        if !self.leader_address.is_empty() {
            check_address("leader_address", &self.leader_address)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> ModelSpec {
        ModelSpec {
            name: "m".into(),
            build: Build {
                model_dir: "/models/m".into(),
                dtype: None,
                device: Some(DeviceKind::Cpu),
                tp: 1,
                pp: 1,
                ep: 1,
                limits: EngineLimits::default(),
                chat: Default::default(),
                quantize: String::new(),
            },
            weight_bytes_per_rank: 0,
            replicas: 1,
            generation: 1,
            created_ms: 0,
            rollout: Rollout::default(),
        }
    }

    #[test]
    fn spec_validation_names_the_field() {
        assert!(spec().validate().is_ok());
        let bad = |f: fn(&mut ModelSpec), field: &str| {
            let mut s = spec();
            f(&mut s);
            let e = s.validate().unwrap_err().to_string();
            assert!(e.contains(field), "{e}");
        };
        bad(|s| s.name = "a/b".into(), "name");
        bad(
            |s| {
                s.build.tp = 2;
                s.build.ep = 4
            },
            "ep",
        );
        bad(|s| s.build.model_dir.clear(), "model_dir");
        bad(|s| s.build.dtype = Some(crate::DType::I8), "dtype");
        bad(|s| s.build.tp = 0, "tp");
        bad(|s| s.build.pp = 0, "pp");
        bad(|s| s.replicas = 5000, "replicas");
    }

    #[test]
    fn records_round_trip_as_json() {
        let w = WorkerRecord {
            id: "w1".into(),
            address: "127.0.0.1:1".into(),
            capacity: Capacity {
                device_kind: DeviceKind::Cpu,
                device_count: 1,
                memory_bytes: 1 << 30,
                node: "host-a".into(),
                ..Capacity::default()
            },
            assignment: Some(Assignment {
                replica: "m-1".into(),
                model: "m".into(),
                rank: 0,
                state: ShardState::Ready,
                error: String::new(),
                lost_rank: None,
            }),
            started_ms: 5,
            leaving: false,
        };
        assert_eq!(decode::<WorkerRecord>("k", &encode(&w)).unwrap(), w);
        let e = decode::<WorkerRecord>("/strata/workers/w1", b"{").unwrap_err().to_string();
        assert!(e.contains("/strata/workers/w1"), "{e}");
    }
}
