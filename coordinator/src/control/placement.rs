//! Which free workers a replica's ranks go to (pure; [`plan`](super::plan) calls it).
//!
//! A worker drives one device, so a rank needs one worker that
//! - is of the deployment's device kind (`cpu` or `cuda`; a spec with none takes any),
//! - has the memory its shard needs free: the spec's estimated weight bytes of the
//!   largest rank plus the KV cache (the deployment's, else the worker's own default);
//!   a worker that reports no memory, or a spec whose weights are unknown, is checked on
//!   what is known.
//!
//! The ranks of one tensor-parallel group (one pipeline stage) exchange activations twice
//! per layer, so they go to one machine (node) when some node has enough fitting workers —
//! the one with the fewest that suffice, leaving larger nodes for larger groups; pipeline
//! stages exchange one hidden state per step and may span machines. When no node can
//! hold a group, its ranks span nodes rather than wait.
//!
//! Memory is what a worker reported when it registered. A GPU worker's device is its own,
//! so that figure holds while it is free; CPU workers of one machine share its memory,
//! and placement does not add up what their shards take.

use std::collections::BTreeMap;

use strata_common::cluster::{ModelSpec, WorkerRecord};
use strata_common::WorkerId;

/// The workers for every rank of a replica of `spec` (rank order), chosen from `free`
/// (most memory first), or why there are not enough.
pub fn choose(spec: &ModelSpec, free: &[&WorkerRecord]) -> Result<Vec<WorkerId>, String> {
    let world = spec.world();
    let fitting: Vec<&WorkerRecord> = free.iter().copied().filter(|w| fits(spec, w)).collect();
    if fitting.len() < world {
        return Err(waiting_reason(spec, free, fitting.len()));
    }
    let tp = spec.tp as usize;
    let mut left = fitting;
    let mut chosen = Vec::with_capacity(world);
    for _ in 0..spec.pp {
        let group = tp_group(&left, tp);
        left.retain(|w| !group.contains(&w.id));
        chosen.extend(group);
    }
    Ok(chosen)
}

/// Whether worker `w` can hold a rank of `spec`.
fn fits(spec: &ModelSpec, w: &WorkerRecord) -> bool {
    let kind_ok = spec.device.is_empty() || spec.device == w.capacity.device_kind;
    let memory_ok = w.capacity.memory_bytes == 0 || needed(spec, w) <= w.capacity.memory_bytes;
    kind_ok && memory_ok
}

/// Bytes a rank of `spec` needs on worker `w`: weights and KV cache.
fn needed(spec: &ModelSpec, w: &WorkerRecord) -> u64 {
    let kv = match spec.limits.kv_cache_bytes {
        0 => w.capacity.kv_cache_bytes,
        kv => kv,
    };
    spec.weight_bytes_per_rank.saturating_add(kv)
}

/// `tp` workers from `candidates` (in their order), on one node when a node has enough:
/// the node with the fewest candidates that suffice (then the first such by name).
/// Workers with no node each count as a node of their own.
fn tp_group(candidates: &[&WorkerRecord], tp: usize) -> Vec<WorkerId> {
    if tp > 1 {
        let mut by_node: BTreeMap<&str, Vec<&WorkerRecord>> = BTreeMap::new();
        for w in candidates.iter().filter(|w| !w.capacity.node.is_empty()) {
            by_node.entry(w.capacity.node.as_str()).or_default().push(w);
        }
        let best = by_node.values().filter(|ws| ws.len() >= tp).min_by_key(|ws| ws.len());
        if let Some(ws) = best {
            return ws[..tp].iter().map(|w| w.id.clone()).collect();
        }
    }
    candidates[..tp].iter().map(|w| w.id.clone()).collect()
}

/// "waiting for 2 free cuda workers with ≥ 17.3 GiB free (4 free: 1 fits, 2 with too
/// little memory, 1 of another kind (cpu))".
fn waiting_reason(spec: &ModelSpec, free: &[&WorkerRecord], fitting: usize) -> String {
    let world = spec.world();
    let plural = if world == 1 { "" } else { "s" };
    let kind = if spec.device.is_empty() { String::new() } else { format!("{} ", spec.device) };
    let gib = |b: u64| match b {
        b if b >= 1 << 30 => format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64),
        b => format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64),
    };
    let memory = match (spec.weight_bytes_per_rank, spec.limits.kv_cache_bytes) {
        (0, 0) => String::new(),
        (w, 0) => format!(" with ≥ {} free besides their KV cache", gib(w)),
        (w, kv) => format!(" with ≥ {} free", gib(w.saturating_add(kv))),
    };
    let n = free.len();
    let head = format!("waiting for {world} free {kind}worker{plural}{memory} ({n} free");
    if fitting == n {
        return format!("{head})");
    }
    let mut other_kinds: Vec<&str> = free
        .iter()
        .map(|w| w.capacity.device_kind.as_str())
        .filter(|k| !spec.device.is_empty() && *k != spec.device)
        .collect();
    let other = other_kinds.len();
    other_kinds.sort_unstable();
    other_kinds.dedup();
    let mut why = vec![format!("{fitting} {}", if fitting == 1 { "fits" } else { "fit" })];
    if n - other - fitting > 0 {
        why.push(format!("{} with too little memory", n - other - fitting));
    }
    if other > 0 {
        why.push(format!("{other} of another kind ({})", other_kinds.join(", ")));
    }
    format!("{head}: {})", why.join(", "))
}

#[cfg(test)]
mod tests;
