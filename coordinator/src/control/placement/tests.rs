//! Placement on hand-built worker lists: kinds, memory, nodes.

use strata_common::cluster::{Build, Capacity, DeviceKind, EngineLimits, ModelSpec, WorkerRecord};
use strata_common::WorkerId;

use super::Free;

const GIB: u64 = 1 << 30;

fn worker(id: &str, kind: &str, free_gib: u64, node: &str) -> WorkerRecord {
    WorkerRecord {
        id: id.into(),
        address: format!("{id}:1"),
        capacity: Capacity {
            device_kind: DeviceKind::parse(kind).unwrap(),
            device_count: 1,
            memory_bytes: free_gib * GIB,
            memory_total_bytes: 80 * GIB,
            node: node.into(),
            kv_cache_bytes: 2 * GIB,
        },
        assignment: None,
        started_ms: 0,
        leaving: false,
    }
}

fn spec(device: &str, tp: u32, pp: u32, weight_gib: u64) -> ModelSpec {
    ModelSpec {
        name: "m".into(),
        build: Build {
            model_dir: "/m".into(),
            dtype: None,
            device: (!device.is_empty()).then(|| DeviceKind::parse(device).unwrap()),
            tp,
            pp,
            ep: 1,
            limits: EngineLimits::default(),
            chat: Default::default(),
            quantize: String::new(),
        },
        weight_bytes_per_rank: weight_gib * GIB,
        replicas: 1,
        generation: 1,
        created_ms: 0,
        rollout: Default::default(),
    }
}

/// `choose` over `workers` in the order the planner gives (most memory first, then id).
fn pick(spec: &ModelSpec, workers: &[WorkerRecord]) -> Result<Vec<String>, String> {
    let mut free: Vec<&WorkerRecord> = workers.iter().collect();
    free.sort_by(|a, b| b.capacity.memory_bytes.cmp(&a.capacity.memory_bytes).then(a.id.cmp(&b.id)));
    Free::new(free).take(spec).map(|ws| ws.into_iter().map(|w| w.to_string()).collect())
}

#[test]
fn ranks_go_only_to_workers_of_the_deployments_kind() {
    let ws = [worker("c1", "cpu", 100, "a"), worker("g1", "cuda", 70, "b"), worker("c2", "cpu", 90, "a")];
    assert_eq!(pick(&spec("cuda", 1, 1, 16), &ws).unwrap(), ["g1"]);
    assert_eq!(pick(&spec("cpu", 2, 1, 1), &ws).unwrap(), ["c1", "c2"]);
    let why = pick(&spec("cuda", 2, 1, 16), &ws).unwrap_err();
    assert_eq!(
        why,
        "waiting for 2 free cuda workers with ≥ 16.0 GiB free besides their KV cache \
         (3 free: 1 fits, 2 of another kind (cpu))"
    );
    // A spec from before devices were named takes any kind.
    assert_eq!(pick(&spec("", 3, 1, 0), &ws).unwrap().len(), 3);
}

#[test]
fn a_rank_needs_its_weights_and_kv_cache_free() {
    // 16 GiB of weights + the worker's 2 GiB KV cache = 18 GiB.
    let ws = [worker("g1", "cuda", 17, "a"), worker("g2", "cuda", 18, "b"), worker("g3", "cuda", 40, "c")];
    assert_eq!(pick(&spec("cuda", 2, 1, 16), &ws).unwrap(), ["g3", "g2"]);
    let why = pick(&spec("cuda", 3, 1, 16), &ws).unwrap_err();
    assert!(why.contains("(3 free: 2 fit, 1 with too little memory)"), "{why}");
    // The deployment's own KV cache replaces the worker's default.
    let mut big_kv = spec("cuda", 2, 1, 16);
    big_kv.build.limits.kv_cache_bytes = 8 * GIB;
    let why = pick(&big_kv, &ws).unwrap_err();
    assert_eq!(
        why,
        "waiting for 2 free cuda workers with ≥ 24.0 GiB free (3 free: 1 fits, 2 with too little memory)"
    );
    // A worker that reports no memory is not refused for it.
    let unknown = [worker("g0", "cuda", 0, "a")];
    assert_eq!(pick(&spec("cuda", 1, 1, 16), &unknown).unwrap(), ["g0"]);
}

#[test]
fn a_tp_group_stays_on_one_machine_when_one_can_hold_it() {
    // Node "big" has four GPUs, node "small" two, node "odd" one with the most memory.
    let ws = [
        worker("big-0", "cuda", 70, "big"),
        worker("big-1", "cuda", 70, "big"),
        worker("big-2", "cuda", 70, "big"),
        worker("big-3", "cuda", 70, "big"),
        worker("odd-0", "cuda", 75, "odd"),
        worker("small-0", "cuda", 70, "small"),
        worker("small-1", "cuda", 70, "small"),
    ];
    // TP=2 takes the smallest node that holds it, leaving the 4-GPU node whole.
    assert_eq!(pick(&spec("cuda", 2, 1, 10), &ws).unwrap(), ["small-0", "small-1"]);
    assert_eq!(pick(&spec("cuda", 4, 1, 10), &ws).unwrap(), ["big-0", "big-1", "big-2", "big-3"]);
    // TP=2 × PP=2: each stage on one machine; the stages on different ones.
    let r = pick(&spec("cuda", 2, 2, 10), &ws).unwrap();
    assert_eq!(r, ["small-0", "small-1", "big-0", "big-1"]);
    // TP=1 takes the worker with the most memory.
    assert_eq!(pick(&spec("cuda", 1, 1, 10), &ws).unwrap(), ["odd-0"]);
    // No machine holds 8: the group spans machines rather than wait.
    let all = pick(&spec("cuda", 7, 1, 10), &ws).unwrap();
    assert_eq!(all.len(), 7);
}

#[test]
fn workers_with_unknown_machines_are_never_grouped_as_one() {
    let ws = [
        worker("x", "cuda", 70, ""),
        worker("y", "cuda", 70, ""),
        worker("z1", "cuda", 60, "z"),
        worker("z2", "cuda", 60, "z"),
    ];
    assert_eq!(pick(&spec("cuda", 2, 1, 10), &ws).unwrap(), ["z1", "z2"]);
}

#[test]
fn cpu_workers_of_one_machine_share_its_memory() {
    // Three CPU workers on machine "h", each seeing its 10 GiB free; a rank needs 4 GiB of
    // weights and the worker's 2 GiB KV cache: the machine holds one rank, not three.
    let ws = [worker("a", "cpu", 10, "h"), worker("b", "cpu", 10, "h"), worker("c", "cpu", 10, "h")];
    let why = pick(&spec("cpu", 2, 1, 4), &ws).unwrap_err();
    assert_eq!(
        why,
        "waiting for 2 free cpu workers with ≥ 4.0 GiB free besides their KV cache \
         (3 free, 3 fit one rank each, but their machines' shared memory holds fewer than 2)"
    );
    // Two replicas of one rank in the same pass: the second finds the machine full.
    let mut free = Free::new(ws.iter().collect());
    assert_eq!(free.take(&spec("cpu", 1, 1, 4)).unwrap(), [WorkerId::from("a")]);
    let why = free.take(&spec("cpu", 1, 1, 4)).unwrap_err();
    assert!(why.ends_with("(2 free: 0 fit, 2 with too little memory)"), "{why}");
    // A second machine takes the other rank of a TP group.
    let two = [worker("a", "cpu", 10, "h"), worker("b", "cpu", 10, "h"), worker("x", "cpu", 9, "i")];
    assert_eq!(pick(&spec("cpu", 2, 1, 4), &two).unwrap(), ["a", "x"]);
    // GPUs on one machine each have their own memory.
    let gpus = [worker("g0", "cuda", 10, "h"), worker("g1", "cuda", 10, "h")];
    assert_eq!(pick(&spec("cuda", 2, 1, 4), &gpus).unwrap(), ["g0", "g1"]);
}
