//! `strata model bench`: prefill and decode speed of the in-process engine, beside the
//! machine's measured memory bandwidth and the decode roofline it implies.
//!
//! Decode at batch 1 reads every weight once per token, so `bandwidth / bytes per token`
//! bounds it; the bandwidth is measured in the same run (the best multi-threaded read of a
//! large array on huge pages, [`roofline::read_bandwidth`]), because on a shared machine it moves
//! between runs. Prefill is compute-bound: its roofline is the peak multiply-add rate of
//! the unit its matmuls run on ([`roofline::peak_gflops`]), measured in the same run too.
//! Figures are medians.
//!
//! `--kernels-ab A,B` ([`kernels_ab`]) alternates two kernel levels inside one process,
//! round by round, so a comparison does not rest on two whole-process runs of a noisy
//! machine.

use std::time::Instant;

use serde::Serialize;
use strata_common::ModelConfig;
use strata_common::{Result, SamplingParams};
use strata_engine::backend::cpu::roofline::{self, Compute, PrefillWeights};
use strata_engine::backend::cpu::CpuBackend;
use strata_engine::Engine;
use tracing::info;

#[derive(Debug, Serialize)]
pub struct EngineBenchReport {
    pub threads: usize,
    pub weight_bytes: usize,
    pub decode_bytes_per_token: usize,
    pub prompt_len: usize,
    pub prefill_tokens_per_s: f64,
    pub decode_tokens_per_s: f64,
    /// Median decode step time, and the share of it the leader spent communicating.
    pub decode_step_ms: f64,
    pub decode_comm_share: f64,
    /// The CPU kernels that ran (`avx512`, `avx2`, `portable`; see `STRATA_CPU_KERNELS`).
    pub cpu_kernels: &'static str,
    /// The kernels of the prefill GEMM of unpacked weights (the `gemm` crate), which
    /// `STRATA_CPU_KERNELS` does not cap (`CpuBackend::prefill_gemm_kernels`).
    pub prefill_gemm_kernels: &'static str,
    /// `[batch, output tokens/s]` of batched decode steps, per requested batch size.
    pub batched_decode: Vec<(usize, f64)>,
    pub bandwidth_gb_per_s: f64,
    /// What the batch-1 matmul alone streams, bytes/s: one activation row against a
    /// 256 MiB bf16 weight in the backend's decode layout (packed on AVX512-BF16). Its ratio
    /// to `bandwidth_gb_per_s` is the decode kernel's efficiency, apart from the rest of a
    /// step.
    pub gemv_gb_per_s: f64,
    /// f32 GEMM throughput of the CPU backend's matmul (prefill path), 256×2048 · 2048×8192.
    pub gemm_gflops: f64,
    pub roofline_decode_tokens_per_s: f64,
    pub decode_share_of_roofline: f64,
    /// The unit prefill's matmuls run on (`amx-bf16`, `amx-int8`, `avx512-bf16`,
    /// `avx512-f32`, `avx2-f32`, `portable`).
    pub compute_unit: Compute,
    /// Its peak rate on every thread at once: prefill's compute roofline.
    pub compute_peak_gflops: f64,
    /// The prompt's matmul and attention FLOPs over the median prefill time.
    pub prefill_gflops: f64,
    pub prefill_share_of_compute_roofline: f64,
}

pub struct EngineBenchConfig {
    pub batch_sizes: Vec<usize>,
    pub prompt_len: usize,
    pub decode_tokens: usize,
    pub repeats: usize,
    /// The weights the model's prefill matmuls read (what decides the unit they run on).
    pub weights: PrefillWeights,
}

pub fn run(engine: &mut Engine, cfg: &EngineBenchConfig) -> Result<EngineBenchReport> {
    let vocab = engine.executor().config().vocab_size as u32;
    let prompt: Vec<u32> = (0..cfg.prompt_len as u32).map(|i| (i * 7919 + 13) % vocab).collect();

    // Warm-up, as llama-bench's: one prompt of the measured length pages the weights in
    // from the mapping and the activations' buffers in from the allocator, so the
    // measured prompts see the steady state a server runs in.
    info!("warm-up");
    engine.prompt_logits(&prompt)?;

    let mut prefill = Vec::new();
    for r in 0..cfg.repeats {
        let t = Instant::now();
        engine.prompt_logits(&prompt)?;
        let secs = t.elapsed().as_secs_f64();
        info!(repeat = r + 1, of = cfg.repeats, tokens_per_s = cfg.prompt_len as f64 / secs, "prefill");
        prefill.push(cfg.prompt_len as f64 / secs);
    }

    let params = SamplingParams {
        max_new_tokens: cfg.decode_tokens as u32 + 1,
        ignore_eos: true,
        ..Default::default()
    };
    engine.add(strata_engine::SeqId(u64::MAX), prompt[..16.min(prompt.len())].to_vec(), params)?;
    engine.step()?; // the prefill step
    let mut steps = Vec::new();
    let comm_start = engine.executor().comm_stats().map(|c| c.busy_ns).unwrap_or(0);
    let decode_start = Instant::now();
    while engine.num_running() > 0 {
        let t = Instant::now();
        engine.step()?;
        steps.push(t.elapsed().as_secs_f64());
        if steps.len() % 8 == 0 {
            info!(
                tokens = steps.len(),
                of = cfg.decode_tokens,
                tokens_per_s = 1.0 / median(&steps),
                "decode"
            );
        }
    }
    let decode = 1.0 / median(&steps);
    let comm_ns = engine.executor().comm_stats().map(|c| c.busy_ns).unwrap_or(0) - comm_start;
    let decode_comm_share = comm_ns as f64 / 1e9 / decode_start.elapsed().as_secs_f64();

    let mut batched_decode = Vec::new();
    for &batch in &cfg.batch_sizes {
        batched_decode.push((batch, batched_decode_rate(engine, batch, cfg.decode_tokens, vocab)?));
        info!(batch, tokens_per_s = batched_decode.last().map(|b| b.1), "batched decode");
    }

    info!("measuring memory bandwidth");
    let bandwidth = roofline::read_bandwidth(cfg.repeats.max(5));
    info!("measuring the batch-1 matmul");
    let gemv = roofline::gemv_bandwidth(cfg.repeats.max(5));
    info!("measuring GEMM peak");
    let gemm = roofline::gemm_gflops(cfg.repeats.max(3));
    let compute_unit = Compute::for_prefill(cfg.weights);
    info!(unit = ?compute_unit, "measuring the compute peak");
    let peak = roofline::peak_gflops(compute_unit, cfg.repeats.max(3));
    let prefill_gflops = prefill_flops(engine.executor().config(), cfg.prompt_len) / 1e9 * median(&prefill)
        / cfg.prompt_len as f64;
    let bytes = engine.executor().decode_bytes_per_token();
    let roofline = bandwidth / bytes as f64;
    Ok(EngineBenchReport {
        threads: rayon::current_num_threads(),
        weight_bytes: engine.executor().weight_bytes(),
        decode_bytes_per_token: bytes,
        prompt_len: cfg.prompt_len,
        prefill_tokens_per_s: median(&prefill),
        decode_tokens_per_s: decode,
        decode_step_ms: 1e3 / decode,
        decode_comm_share,
        cpu_kernels: CpuBackend::kernels(),
        prefill_gemm_kernels: CpuBackend::prefill_gemm_kernels(),
        batched_decode,
        bandwidth_gb_per_s: bandwidth / 1e9,
        gemv_gb_per_s: gemv / 1e9,
        gemm_gflops: gemm,
        roofline_decode_tokens_per_s: roofline,
        decode_share_of_roofline: decode / roofline,
        compute_unit,
        compute_peak_gflops: peak,
        prefill_gflops,
        prefill_share_of_compute_roofline: prefill_gflops / peak,
    })
}

/// FLOPs of a prompt of `len` tokens: two per weight of each matmul a token passes
/// (attention projections, the MLP or its routed and shared experts), and the attention
/// scores and sums over the positions before it. The LM head (one row of a prompt) and
/// the elementwise work are left out, so the figure is a floor.
pub fn prefill_flops(c: &ModelConfig, len: usize) -> f64 {
    let (h, q, kv) =
        (c.hidden_size as f64, (c.num_heads * c.head_dim) as f64, (c.num_kv_heads * c.head_dim) as f64);
    let projections = 2.0 * (h * q + 2.0 * h * kv + q * h);
    let gated = |inter: usize| 2.0 * 3.0 * h * inter as f64;
    let mlp = |layer: usize| match &c.moe {
        Some(m) if m.layers.get(layer).copied().unwrap_or(true) => {
            m.top_k as f64 * gated(m.expert_intermediate)
                + gated(m.shared_intermediate)
                + 2.0 * h * m.num_experts as f64
        }
        _ => gated(c.intermediate_size),
    };
    let per_token: f64 = (0..c.num_layers).map(|l| projections + mlp(l)).sum();
    // Position t attends to t + 1 positions: QKᵀ and PV, two FLOPs a multiply-add each.
    let positions = (len * (len + 1) / 2) as f64;
    per_token * len as f64 + c.num_layers as f64 * 4.0 * q * positions
}

/// One level's figures in a [`kernels_ab`] run.
#[derive(Debug, Serialize)]
pub struct AbSide {
    pub kernels: String,
    /// Medians over the rounds.
    pub prefill_tokens_per_s: f64,
    /// `[batch, output tokens/s]` per requested batch size.
    pub batched_decode: Vec<(usize, f64)>,
}

/// Two kernel levels measured in alternation on one loaded model.
#[derive(Debug, Serialize)]
pub struct AbReport {
    pub threads: usize,
    pub prompt_len: usize,
    pub rounds: usize,
    pub a: AbSide,
    pub b: AbSide,
    /// `b / a` of the prefill medians, and per batch size of batched decode.
    pub prefill_ratio: f64,
    pub batched_decode_ratio: Vec<(usize, f64)>,
}

/// Measures prefill (and batched decode at `cfg.batch_sizes`) under kernel levels `a`
/// and `b` in turn, `cfg.repeats` rounds, each round a then b.
pub fn kernels_ab(engine: &mut Engine, cfg: &EngineBenchConfig, [a, b]: [&str; 2]) -> Result<AbReport> {
    let vocab = engine.executor().config().vocab_size as u32;
    let prompt: Vec<u32> = (0..cfg.prompt_len as u32).map(|i| (i * 7919 + 13) % vocab).collect();
    let mut prefill = [Vec::new(), Vec::new()];
    let mut batched: [Vec<Vec<f64>>; 2] = Default::default();
    for round in 0..cfg.repeats + 1 {
        for (side, name) in [a, b].into_iter().enumerate() {
            CpuBackend::set_kernels(name)?;
            let t = Instant::now();
            engine.prompt_logits(&prompt)?;
            let rate = cfg.prompt_len as f64 / t.elapsed().as_secs_f64();
            let rates = cfg
                .batch_sizes
                .iter()
                .map(|&n| batched_decode_rate(engine, n, cfg.decode_tokens, vocab))
                .collect::<Result<Vec<_>>>()?;
            // Round 0 warms both levels up (pages, buffers, caches) and is not counted.
            if round > 0 {
                info!(round, of = cfg.repeats, kernels = name, prefill_tokens_per_s = rate, "A/B");
                prefill[side].push(rate);
                batched[side].push(rates);
            }
        }
    }
    CpuBackend::set_kernels("native")?;
    let side = |i: usize, name: &str| AbSide {
        kernels: name.to_string(),
        prefill_tokens_per_s: median(&prefill[i]),
        batched_decode: cfg
            .batch_sizes
            .iter()
            .enumerate()
            .map(|(j, &n)| (n, median(&batched[i].iter().map(|r| r[j]).collect::<Vec<_>>())))
            .collect(),
    };
    let (sa, sb) = (side(0, a), side(1, b));
    Ok(AbReport {
        threads: rayon::current_num_threads(),
        prompt_len: cfg.prompt_len,
        rounds: cfg.repeats,
        prefill_ratio: sb.prefill_tokens_per_s / sa.prefill_tokens_per_s,
        batched_decode_ratio: sa
            .batched_decode
            .iter()
            .zip(&sb.batched_decode)
            .map(|(x, y)| (x.0, y.1 / x.1))
            .collect(),
        a: sa,
        b: sb,
    })
}

/// Output tokens/s of decode steps with `batch` sequences running (prefill excluded).
fn batched_decode_rate(engine: &mut Engine, batch: usize, steps: usize, vocab: u32) -> Result<f64> {
    for b in 0..batch {
        let prompt: Vec<u32> = (0..16u32).map(|i| (i * 31 + b as u32 * 7 + 5) % vocab).collect();
        let params =
            SamplingParams { max_new_tokens: steps as u32 + 1, ignore_eos: true, ..Default::default() };
        engine.add(strata_engine::SeqId(1_000_000 + b as u64), prompt, params)?;
    }
    let mut times = Vec::new();
    while engine.has_work() {
        let t = Instant::now();
        let events = engine.step()?;
        if events.len() == batch && times.len() < steps {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    // The first full step still includes the prefill of every prompt.
    let decode = if times.len() > 1 { &times[1..] } else { &times[..] };
    Ok(batch as f64 / median(decode))
}

use strata_common::stats::median;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_flops_count_each_matmul_and_the_attention_over_earlier_positions() {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/models/llama_bf16");
        let c = ModelConfig::from_dir(&dir).expect("fixture config");
        let (h, heads, kv_heads, d, inter) = (64.0, 4.0, 2.0, 16.0, 160.0);
        // q, k, v, o; gate, up, down: (inputs, outputs) of each of a layer's matmuls.
        let shapes = [
            (h, heads * d),
            (h, kv_heads * d),
            (h, kv_heads * d),
            (heads * d, h),
            (h, inter),
            (h, inter),
            (inter, h),
        ];
        let per_token: f64 = shapes.iter().map(|(i, o)| 2.0 * i * o).sum();
        let len = 5;
        // Token t (1-based) scores t positions and sums t values, per head.
        let attention: f64 = (1..=len).map(|t| 2.0 * 2.0 * heads * d * t as f64).sum();
        let want = 2.0 * (per_token * len as f64 + attention);
        assert_eq!(prefill_flops(&c, len), want);
    }
}
