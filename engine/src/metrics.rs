//! What the engine measures, next to where it happens: the runner's scheduling (running
//! and waiting sequences, KV blocks, preemptions, prefix-cache tokens, queue / prefill /
//! decode time per sequence) and every rank's step and all-reduce time.
//!
//! Handles are resolved once per replica (or rank) from their label set, so the hot path
//! only times and observes: no map lookups per token or per collective.

use std::sync::OnceLock;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use strata_common::metrics::{register, E2E_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS};

/// Which model and replica a runner's or rank's metrics belong to. Empty strings when the
/// caller names neither (tests, benchmarks).
#[derive(Clone, Debug, Default, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReplicaLabels {
    pub model: String,
    pub replica: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RankLabels {
    model: String,
    replica: String,
    rank: usize,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ExpertLabels {
    model: String,
    replica: String,
    layer: usize,
    expert: usize,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LayerLabels {
    model: String,
    replica: String,
    layer: usize,
}

type Histograms<L> = Family<L, Histogram, fn() -> Histogram>;

/// How many live handles hold each label set: its series are removed when the last goes
/// (two engines may share labels — tests, benchmarks — and one's end must not take the
/// other's series).
struct Holders<L>(std::sync::Mutex<std::collections::HashMap<L, usize>>);

impl<L: std::hash::Hash + Eq + Clone> Holders<L> {
    fn new() -> Self {
        Holders(std::sync::Mutex::new(std::collections::HashMap::new()))
    }

    fn acquire(&self, l: &L) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()).entry(l.clone()).or_default() += 1;
    }

    /// Whether this was the last holder of `l`.
    fn release(&self, l: &L) -> bool {
        let mut held = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let last = match held.get_mut(l) {
            Some(n) if *n > 1 => {
                *n -= 1;
                false
            }
            _ => true,
        };
        if last {
            held.remove(l);
        }
        last
    }
}

fn replica_holders() -> &'static Holders<ReplicaLabels> {
    static H: OnceLock<Holders<ReplicaLabels>> = OnceLock::new();
    H.get_or_init(Holders::new)
}

fn rank_holders() -> &'static Holders<RankLabels> {
    static H: OnceLock<Holders<RankLabels>> = OnceLock::new();
    H.get_or_init(Holders::new)
}

/// Step and collective time: 50 µs to 20 s.
const STEP_BUCKETS: &[f64] = &[
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
    10.0, 20.0,
];

/// Tokens in one step: powers of two up to 8192.
const BATCH_BUCKETS: &[f64] =
    &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0];

fn latency() -> Histogram {
    Histogram::new(E2E_BUCKETS.iter().copied())
}
fn queue() -> Histogram {
    Histogram::new(TTFT_BUCKETS.iter().copied())
}
fn per_token() -> Histogram {
    Histogram::new(ITL_BUCKETS.iter().copied())
}
fn step() -> Histogram {
    Histogram::new(STEP_BUCKETS.iter().copied())
}
fn batch() -> Histogram {
    Histogram::new(BATCH_BUCKETS.iter().copied())
}

struct Families {
    running: Family<ReplicaLabels, Gauge>,
    waiting: Family<ReplicaLabels, Gauge>,
    kv_used: Family<ReplicaLabels, Gauge>,
    kv_total: Family<ReplicaLabels, Gauge>,
    kv_usage: Family<ReplicaLabels, Gauge<f64, std::sync::atomic::AtomicU64>>,
    preemptions: Family<ReplicaLabels, Counter>,
    prefix_queries: Family<ReplicaLabels, Counter>,
    prefix_hits: Family<ReplicaLabels, Counter>,
    window_released: Family<ReplicaLabels, Counter>,
    queue_time: Histograms<ReplicaLabels>,
    prefill_time: Histograms<ReplicaLabels>,
    decode_time: Histograms<ReplicaLabels>,
    time_per_output_token: Histograms<ReplicaLabels>,
    batch_tokens: Histograms<ReplicaLabels>,
    rank_step: Histograms<RankLabels>,
    all_reduce: Histograms<RankLabels>,
    all_reduce_bytes: Family<RankLabels, Counter>,
    graph_steps: Family<RankLabels, Counter>,
    all_to_all: Histograms<RankLabels>,
    all_to_all_bytes: Family<RankLabels, Counter>,
    rank_expert_tokens: Family<RankLabels, Counter>,
    expert_tokens: Family<ExpertLabels, Counter>,
    expert_imbalance: Family<LayerLabels, Gauge<f64, std::sync::atomic::AtomicU64>>,
}

fn families() -> &'static Families {
    static FAMILIES: OnceLock<Families> = OnceLock::new();
    FAMILIES.get_or_init(|| {
        let f = Families {
            running: Family::default(),
            waiting: Family::default(),
            kv_used: Family::default(),
            kv_total: Family::default(),
            kv_usage: Family::default(),
            preemptions: Family::default(),
            prefix_queries: Family::default(),
            prefix_hits: Family::default(),
            window_released: Family::default(),
            queue_time: Family::new_with_constructor(queue),
            prefill_time: Family::new_with_constructor(latency),
            decode_time: Family::new_with_constructor(latency),
            time_per_output_token: Family::new_with_constructor(per_token),
            batch_tokens: Family::new_with_constructor(batch),
            rank_step: Family::new_with_constructor(step),
            all_reduce: Family::new_with_constructor(step),
            all_reduce_bytes: Family::default(),
            graph_steps: Family::default(),
            all_to_all: Family::new_with_constructor(step),
            all_to_all_bytes: Family::default(),
            rank_expert_tokens: Family::default(),
            expert_tokens: Family::default(),
            expert_imbalance: Family::default(),
        };
        register("num_requests_running", "Sequences the scheduler is running", f.running.clone());
        register("num_requests_waiting", "Sequences queued for the scheduler", f.waiting.clone());
        register("kv_blocks_used", "KV cache blocks held by sequences", f.kv_used.clone());
        register("kv_blocks_total", "KV cache blocks of the replica", f.kv_total.clone());
        register(
            "kv_cache_usage",
            "Fraction of the replica's KV cache blocks held by sequences (0 to 1; vLLM's kv_cache_usage_perc)",
            f.kv_usage.clone(),
        );
        register("preemptions", "Sequences preempted for recompute (KV cache full)", f.preemptions.clone());
        register(
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            f.prefix_queries.clone(),
        );
        register("prefix_cache_hits", "Prompt tokens whose KV the prefix cache held", f.prefix_hits.clone());
        register(
            "kv_blocks_released_by_window",
            "KV blocks given back while their sequences ran, behind every layer's sliding window",
            f.window_released.clone(),
        );
        register(
            "request_queue_time_seconds",
            "Time from submission to first scheduled",
            f.queue_time.clone(),
        );
        register(
            "request_prefill_time_seconds",
            "Time from first scheduled to first token",
            f.prefill_time.clone(),
        );
        register("request_decode_time_seconds", "Time from first token to last", f.decode_time.clone());
        register(
            "time_per_output_token_seconds",
            "Decode time over output tokens after the first, per sequence",
            f.time_per_output_token.clone(),
        );
        register("batch_tokens", "Tokens computed per engine step", f.batch_tokens.clone());
        register("rank_step_seconds", "One rank's share of an engine step", f.rank_step.clone());
        register("all_reduce_seconds", "Tensor-parallel all-reduce time on one rank", f.all_reduce.clone());
        register("all_reduce_bytes", "Bytes all-reduced by one rank", f.all_reduce_bytes.clone());
        register("graph_steps", "Engine steps replayed from a captured CUDA graph", f.graph_steps.clone());
        register("all_to_all_seconds", "Expert-parallel all-to-all time on one rank", f.all_to_all.clone());
        register(
            "all_to_all_bytes",
            "Bytes one rank sent in expert-parallel all-to-alls",
            f.all_to_all_bytes.clone(),
        );
        register(
            "rank_expert_tokens",
            "Token-expert pairs one rank's experts computed (expert parallelism's load per rank)",
            f.rank_expert_tokens.clone(),
        );
        register("expert_tokens", "Tokens routed to each expert of each MoE layer", f.expert_tokens.clone());
        register(
            "expert_imbalance",
            "The last step's most loaded expert of a layer over the mean (1: even)",
            f.expert_imbalance.clone(),
        );
        f
    })
}

/// A runner's metrics, resolved for its replica. Dropping it removes its gauges, so an
/// unloaded replica does not linger on dashboards.
pub struct RunnerMetrics {
    labels: ReplicaLabels,
    pub running: Gauge,
    pub waiting: Gauge,
    pub kv_used: Gauge,
    pub kv_total: Gauge,
    pub kv_usage: Gauge<f64, std::sync::atomic::AtomicU64>,
    pub preemptions: Counter,
    pub prefix_queries: Counter,
    pub prefix_hits: Counter,
    pub window_released: Counter,
    pub queue_time: Histogram,
    pub prefill_time: Histogram,
    pub decode_time: Histogram,
    pub time_per_output_token: Histogram,
    pub batch_tokens: Histogram,
}

impl RunnerMetrics {
    pub fn new(labels: &ReplicaLabels) -> Self {
        let f = families();
        replica_holders().acquire(labels);
        RunnerMetrics {
            running: f.running.get_or_create_owned(labels),
            waiting: f.waiting.get_or_create_owned(labels),
            kv_used: f.kv_used.get_or_create_owned(labels),
            kv_total: f.kv_total.get_or_create_owned(labels),
            kv_usage: f.kv_usage.get_or_create_owned(labels),
            preemptions: f.preemptions.get_or_create_owned(labels),
            prefix_queries: f.prefix_queries.get_or_create_owned(labels),
            prefix_hits: f.prefix_hits.get_or_create_owned(labels),
            window_released: f.window_released.get_or_create_owned(labels),
            queue_time: f.queue_time.get_or_create_owned(labels),
            prefill_time: f.prefill_time.get_or_create_owned(labels),
            decode_time: f.decode_time.get_or_create_owned(labels),
            time_per_output_token: f.time_per_output_token.get_or_create_owned(labels),
            batch_tokens: f.batch_tokens.get_or_create_owned(labels),
            labels: labels.clone(),
        }
    }
}

impl RunnerMetrics {
    /// Blocks held out of `total`: the count and the fraction.
    pub fn kv_blocks(&self, used: usize, total: usize) {
        self.kv_used.set(used as i64);
        self.kv_usage.set(if total == 0 { 0.0 } else { used as f64 / total as f64 });
    }
}

impl Drop for RunnerMetrics {
    /// An unloaded replica's series go with it, counters and histograms too: a model that
    /// is undeployed (or a replica replaced) leaves nothing behind on dashboards.
    fn drop(&mut self) {
        let f = families();
        let l = &self.labels;
        if !replica_holders().release(l) {
            return;
        }
        for g in [&f.running, &f.waiting, &f.kv_used, &f.kv_total] {
            g.remove(l);
        }
        f.kv_usage.remove(l);
        for c in [&f.preemptions, &f.prefix_queries, &f.prefix_hits, &f.window_released] {
            c.remove(l);
        }
        for h in [&f.queue_time, &f.prefill_time, &f.decode_time, &f.time_per_output_token, &f.batch_tokens] {
            h.remove(l);
        }
    }
}

/// One rank's step and all-reduce metrics.
#[derive(Clone)]
pub struct RankMetrics {
    labels: ReplicaLabels,
    rank: usize,
    step: Histogram,
    all_reduce: Histogram,
    all_reduce_bytes: Counter,
    graph_steps: Counter,
    all_to_all: Histogram,
    all_to_all_bytes: Counter,
    expert_tokens: Counter,
    /// Removes the rank's series when the last clone goes (its shard unloaded).
    series: std::sync::Arc<RankSeries>,
}

/// A rank's label sets, and its MoE layers' (layer, experts).
struct RankSeries {
    labels: RankLabels,
    moe_layers: std::sync::Mutex<Vec<(usize, usize)>>,
}

impl Drop for RankSeries {
    fn drop(&mut self) {
        let f = families();
        let l = &self.labels;
        if !rank_holders().release(l) {
            return;
        }
        for h in [&f.rank_step, &f.all_reduce, &f.all_to_all] {
            h.remove(l);
        }
        for c in [&f.all_reduce_bytes, &f.graph_steps, &f.all_to_all_bytes, &f.rank_expert_tokens] {
            c.remove(l);
        }
        let layers = std::mem::take(&mut *self.moe_layers.lock().unwrap_or_else(|p| p.into_inner()));
        for (layer, experts) in layers {
            let (model, replica) = (l.model.clone(), l.replica.clone());
            for expert in 0..experts {
                f.expert_tokens.remove(&ExpertLabels {
                    model: model.clone(),
                    replica: replica.clone(),
                    layer,
                    expert,
                });
            }
            f.expert_imbalance.remove(&LayerLabels { model, replica, layer });
        }
    }
}

/// What one MoE layer's routing is counted under: tokens per expert, and how uneven the
/// last step was.
pub struct ExpertMetrics {
    tokens: Vec<Counter>,
    imbalance: Gauge<f64, std::sync::atomic::AtomicU64>,
}

impl ExpertMetrics {
    /// A step's routing: `counts[e]` tokens went to expert `e`.
    pub fn routed(&self, counts: &[usize]) {
        for (c, &n) in self.tokens.iter().zip(counts) {
            c.inc_by(n as u64);
        }
        let total: usize = counts.iter().sum();
        if total > 0 {
            let mean = total as f64 / counts.len().max(1) as f64;
            self.imbalance.set(*counts.iter().max().unwrap_or(&0) as f64 / mean);
        }
    }
}

impl RankMetrics {
    pub fn new(labels: &ReplicaLabels, rank: usize) -> Self {
        let f = families();
        let l = RankLabels { model: labels.model.clone(), replica: labels.replica.clone(), rank };
        RankMetrics {
            labels: labels.clone(),
            rank,
            step: f.rank_step.get_or_create_owned(&l),
            all_reduce: f.all_reduce.get_or_create_owned(&l),
            all_reduce_bytes: f.all_reduce_bytes.get_or_create_owned(&l),
            graph_steps: f.graph_steps.get_or_create_owned(&l),
            all_to_all: f.all_to_all.get_or_create_owned(&l),
            all_to_all_bytes: f.all_to_all_bytes.get_or_create_owned(&l),
            expert_tokens: f.rank_expert_tokens.get_or_create_owned(&l),
            series: {
                rank_holders().acquire(&l);
                std::sync::Arc::new(RankSeries { labels: l, moe_layers: Default::default() })
            },
        }
    }

    pub fn step(&self, took: Duration) {
        self.step.observe(took.as_secs_f64());
    }

    /// A step replayed from a captured graph.
    pub fn graph_step(&self) {
        self.graph_steps.inc();
    }

    pub fn all_reduce(&self, took: Duration, bytes: usize) {
        self.all_reduce.observe(took.as_secs_f64());
        self.all_reduce_bytes.inc_by(bytes as u64);
    }

    /// An expert-parallel exchange of `bytes` and the token-expert pairs this rank's
    /// experts computed in the step it served.
    pub fn all_to_all(&self, took: Duration, bytes: usize) {
        self.all_to_all.observe(took.as_secs_f64());
        self.all_to_all_bytes.inc_by(bytes as u64);
    }

    /// Token-expert pairs this rank's experts computed.
    pub fn expert_pairs(&self, pairs: usize) {
        self.expert_tokens.inc_by(pairs as u64);
    }

    /// The routing counters of MoE layer `layer` with `experts` experts (this rank's
    /// model and replica).
    pub fn experts(&self, layer: usize, experts: usize) -> ExpertMetrics {
        let f = families();
        self.series.moe_layers.lock().unwrap_or_else(|p| p.into_inner()).push((layer, experts));
        let (model, replica) = (self.labels.model.clone(), self.labels.replica.clone());
        let tokens = (0..experts)
            .map(|expert| {
                f.expert_tokens.get_or_create_owned(&ExpertLabels {
                    model: model.clone(),
                    replica: replica.clone(),
                    layer,
                    expert,
                })
            })
            .collect();
        ExpertMetrics {
            tokens,
            imbalance: f.expert_imbalance.get_or_create_owned(&LayerLabels { model, replica, layer }),
        }
    }

    /// The rank these metrics are filed under.
    pub fn rank(&self) -> usize {
        self.rank
    }
}
