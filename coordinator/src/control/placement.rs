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
//! so that figure holds while it is free. CPU workers of one machine share its memory:
//! within one reconcile pass, what their ranks take is added up per machine (a tensor-
//! parallel group goes to one machine only when it has room for all its ranks); shards
//! loaded in earlier passes are in the figure only for workers that registered after.

use std::collections::{BTreeMap, HashMap};

use strata_common::cluster::{ModelSpec, WorkerRecord};
use strata_common::{DeviceKind, WorkerId};

/// The workers free in one reconcile pass, and the host memory the pass has promised on
/// each machine to ranks on CPU workers (the CPU workers of one machine share its memory;
/// a GPU worker's memory is its device's own).
pub struct Free<'v> {
    workers: Vec<&'v WorkerRecord>,
    promised: Promised,
}

/// Bytes promised per machine.
type Promised = HashMap<String, u64>;

impl<'v> Free<'v> {
    /// `workers` in placement order (most memory first, then id).
    pub fn new(workers: Vec<&'v WorkerRecord>) -> Self {
        Free { workers, promised: HashMap::new() }
    }

    /// The workers for every rank of a replica of `spec` (rank order), taken from the free
    /// set, or why there are not enough.
    pub fn take(&mut self, spec: &ModelSpec) -> Result<Vec<WorkerId>, String> {
        let mut promised = self.promised.clone();
        let chosen = choose(spec, &self.workers, &mut promised)?;
        self.promised = promised;
        self.workers.retain(|w| !chosen.contains(&w.id));
        Ok(chosen)
    }
}

/// The machine whose memory `w` shares with other CPU workers, if it does.
fn shared_machine(w: &WorkerRecord) -> Option<&str> {
    let c = &w.capacity;
    (c.device_kind == DeviceKind::Cpu && !c.node.is_empty() && c.memory_bytes > 0).then_some(c.node.as_str())
}

/// Memory `w` has left after what this pass promised on its machine.
fn available(w: &WorkerRecord, promised: &Promised) -> u64 {
    let taken = shared_machine(w).and_then(|m| promised.get(m)).copied().unwrap_or(0);
    w.capacity.memory_bytes.saturating_sub(taken)
}

/// Chooses the workers of a replica from `free`, adding what its ranks take on shared
/// machines to `promised`.
fn choose(
    spec: &ModelSpec,
    free: &[&WorkerRecord],
    promised: &mut Promised,
) -> Result<Vec<WorkerId>, String> {
    let world = spec.world();
    let candidates: Vec<&WorkerRecord> = free.iter().copied().filter(|w| fits(spec, w, promised)).collect();
    let fitting = candidates.len();
    if fitting < world {
        return Err(waiting_reason(spec, free, fitting));
    }
    let tp = spec.build.tp as usize;
    let mut left = candidates;
    let mut chosen = Vec::with_capacity(world);
    for _ in 0..spec.build.pp {
        let Some(group) = tp_group(spec, &left, tp, promised) else {
            return Err(format!(
                "{} ({} free, {fitting} fit one rank each, but their machines' shared memory holds fewer than {world})",
                wanted(spec),
                free.len(),
            ));
        };
        for w in left.iter().filter(|w| group.contains(&w.id)) {
            if let Some(m) = shared_machine(w) {
                *promised.entry(m.to_string()).or_default() += needed(spec, w);
            }
        }
        left.retain(|w| !group.contains(&w.id));
        chosen.extend(group);
    }
    Ok(chosen)
}

/// Whether worker `w` can hold a rank of `spec`.
fn fits(spec: &ModelSpec, w: &WorkerRecord, promised: &Promised) -> bool {
    let kind_ok = spec.build.runs_on(w.capacity.device_kind);
    let memory_ok = w.capacity.memory_bytes == 0 || needed(spec, w) <= available(w, promised);
    kind_ok && memory_ok
}

/// Bytes a rank of `spec` needs on worker `w`: weights and KV cache.
fn needed(spec: &ModelSpec, w: &WorkerRecord) -> u64 {
    let kv = match spec.build.limits.kv_cache_bytes {
        0 => w.capacity.kv_cache_bytes,
        kv => kv,
    };
    spec.weight_bytes_per_rank.saturating_add(kv)
}

/// How many of `ws` (one machine's candidates) can take a rank each at once.
fn room(spec: &ModelSpec, ws: &[&WorkerRecord], promised: &Promised) -> usize {
    let Some(first) = ws.first() else { return 0 };
    if shared_machine(first).is_none() {
        return ws.len();
    }
    let need = needed(spec, first).max(1);
    let least = ws.iter().map(|w| available(w, promised)).min().unwrap_or(0);
    ws.len().min((least / need) as usize)
}

/// `tp` workers from `candidates` (in their order), on one node when a node has room for
/// them all: the node with the least room that suffices (then the first such by name).
/// Otherwise the group spans nodes, never promising a shared machine more memory than it
/// has; None when even that cannot be done. Workers with no node each count as a node of
/// their own.
fn tp_group(
    spec: &ModelSpec,
    candidates: &[&WorkerRecord],
    tp: usize,
    promised: &Promised,
) -> Option<Vec<WorkerId>> {
    let mut by_node: BTreeMap<&str, Vec<&WorkerRecord>> = BTreeMap::new();
    for w in candidates.iter().filter(|w| !w.capacity.node.is_empty()) {
        by_node.entry(w.capacity.node.as_str()).or_default().push(w);
    }
    if tp > 1 {
        let best = by_node
            .values()
            .map(|ws| (room(spec, ws, promised), ws))
            .filter(|(n, _)| *n >= tp)
            .min_by_key(|(n, _)| *n);
        if let Some((_, ws)) = best {
            return Some(ws[..tp].iter().map(|w| w.id.clone()).collect());
        }
    }
    // Span nodes: each shared machine takes at most its room.
    let mut left: HashMap<&str, usize> =
        by_node.iter().map(|(m, ws)| (*m, room(spec, ws, promised))).collect();
    let mut group = Vec::with_capacity(tp);
    for w in candidates {
        if group.len() == tp {
            break;
        }
        if let Some(m) = shared_machine(w) {
            let slots = left.entry(m).or_default();
            if *slots == 0 {
                continue;
            }
            *slots -= 1;
        }
        group.push(w.id.clone());
    }
    (group.len() == tp).then_some(group)
}

/// "waiting for 2 free cuda workers with ≥ 17.3 GiB free": what a replica waits for.
fn wanted(spec: &ModelSpec) -> String {
    let world = spec.world();
    let plural = if world == 1 { "" } else { "s" };
    let kind = spec.build.device.map_or(String::new(), |d| format!("{d} "));
    let gib = |b: u64| match b {
        b if b >= 1 << 30 => format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64),
        b => format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64),
    };
    let memory = match (spec.weight_bytes_per_rank, spec.build.limits.kv_cache_bytes) {
        (0, 0) => String::new(),
        (w, 0) => format!(" with ≥ {} free besides their KV cache", gib(w)),
        (w, kv) => format!(" with ≥ {} free", gib(w.saturating_add(kv))),
    };
    format!("waiting for {world} free {kind}worker{plural}{memory}")
}

/// "waiting for 2 free cuda workers with ≥ 17.3 GiB free (4 free: 1 fits, 2 with too
/// little memory, 1 of another kind (cpu))".
fn waiting_reason(spec: &ModelSpec, free: &[&WorkerRecord], fitting: usize) -> String {
    let head = format!("{} ({} free", wanted(spec), free.len());
    let n = free.len();
    if fitting == n {
        return format!("{head})");
    }
    let mut other_kinds: Vec<&str> = free
        .iter()
        .map(|w| w.capacity.device_kind)
        .filter(|k| !spec.build.runs_on(*k))
        .map(DeviceKind::as_str)
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
