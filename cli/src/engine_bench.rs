//! `strata model bench`: prefill and decode speed of the in-process engine, beside the
//! machine's measured memory bandwidth and the decode roofline it implies.
//!
//! Decode at batch 1 reads every weight once per token, so `bandwidth / bytes per token`
//! bounds it; the bandwidth is measured in the same run (the best multi-threaded read of a
//! large array on huge pages, [`roofline::read_bandwidth`]), because on a shared machine it moves
//! between runs. Figures are medians.

use std::time::Instant;

use serde::Serialize;
use strata_common::{Result, SamplingParams};
use strata_engine::backend::cpu::{roofline, CpuBackend};
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
}

pub struct EngineBenchConfig {
    pub batch_sizes: Vec<usize>,
    pub prompt_len: usize,
    pub decode_tokens: usize,
    pub repeats: usize,
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
