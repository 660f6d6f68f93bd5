//! `strata model bench`: prefill and decode speed of the in-process engine, beside the
//! machine's measured memory bandwidth and the decode roofline it implies.
//!
//! Decode at batch 1 reads every weight once per token, so `bandwidth / bytes per token`
//! bounds it; the bandwidth is measured in the same run (the best multi-threaded read of a
//! large array on huge pages, [`measure_bandwidth`]), because on a shared machine it moves
//! between runs. Figures are medians.

use std::time::Instant;

use rayon::prelude::*;
use serde::Serialize;
use strata_common::{Result, SamplingParams};
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
    let bandwidth = measure_bandwidth(cfg.repeats.max(5));
    info!("measuring the batch-1 matmul");
    let gemv = measure_gemv_bandwidth(cfg.repeats.max(5));
    info!("measuring GEMM peak");
    let gemm = measure_gemm_gflops(cfg.repeats.max(3));
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

/// Bytes per second of a multi-threaded read of 256 MiB (far past any cache) on huge pages,
/// as the weights lie: the best of `repeats` reads in each of two patterns — one run per
/// thread at a time, and four 4 KiB runs side by side, as the decode kernels read four
/// weight rows at once (on an AVX2 host of this project's machine kind, four streams read
/// a third faster than one: 44 against 33 GB/s). A roofline is an upper bound and this
/// machine's readings are noisy, hence the best.
pub fn measure_bandwidth(repeats: usize) -> f64 {
    use strata_engine::backend::cpu::HugeVec;
    let mut data = HugeVec::<u32>::zeroed(1 << 26);
    data.par_chunks_mut(1 << 16).enumerate().for_each(|(c, d)| {
        d.iter_mut().enumerate().for_each(|(i, v)| *v = (c << 16 | i) as u32);
    });
    let mut best: f64 = 0.0;
    for _ in 0..repeats {
        for read in [read_streams::<1>, read_streams::<4>] {
            let t = Instant::now();
            let sum: u32 = data.par_chunks(1 << 16).map(read).reduce(|| 0, u32::wrapping_add);
            let secs = t.elapsed().as_secs_f64();
            std::hint::black_box(sum);
            best = best.max((data.len() * 4) as f64 / secs);
        }
    }
    best
}

/// The wrapping sum of `c` (a multiple of `S` runs of 4 KiB long), read as `S` runs side by
/// side.
fn read_streams<const S: usize>(c: &[u32]) -> u32 {
    // Integer sums vectorise freely (no float reassociation), so the read is the limit.
    const RUN: usize = 1024;
    let mut acc = [0u32; 16];
    for group in c.chunks_exact(RUN * S) {
        let runs: [&[u32]; S] = std::array::from_fn(|r| &group[r * RUN..(r + 1) * RUN]);
        for i in (0..RUN).step_by(16) {
            for run in runs {
                acc.iter_mut().zip(&run[i..i + 16]).for_each(|(a, &b)| *a = a.wrapping_add(b));
            }
        }
    }
    acc.iter().fold(0, |a, &b| a.wrapping_add(b))
}

/// Bytes per second the CPU backend's batch-1 matmul reads from a 256 MiB bf16 weight
/// (median of `repeats`), in the layout the backend keeps bf16 weights in on this CPU.
pub fn measure_gemv_bandwidth(repeats: usize) -> f64 {
    use strata_engine::backend::cpu::{CpuTensor, CpuWeight};
    use strata_engine::backend::prelude::*;
    let (m, k) = (32768, 4096);
    let w: Vec<half::bf16> =
        (0..m * k).map(|i| half::bf16::from_f32(((i % 89) as f32 - 44.0) / 890.0)).collect();
    let w = CpuWeight::from_bf16(w, m, k);
    // Packed as the backend packs a bf16 model's weights: only where it computes in bf16.
    #[cfg(target_arch = "x86_64")]
    let w = if CpuBackend::bf16_compute_available() { w.packed_bf16() } else { w };
    let bytes = w.bytes();
    let x = CpuTensor::new((0..k).map(|i| ((i % 97) as f32 - 48.0) / 97.0).collect(), 1, k);
    let backend = CpuBackend::new();
    let mut rates = Vec::new();
    for _ in 0..repeats + 1 {
        let t = Instant::now();
        let _ = std::hint::black_box(backend.matmul(&x, &w));
        rates.push(bytes as f64 / t.elapsed().as_secs_f64());
    }
    median(&rates[1..])
}

/// GFLOP/s of the CPU backend's matmul on a prefill-shaped problem (median).
pub fn measure_gemm_gflops(repeats: usize) -> f64 {
    use strata_engine::backend::cpu::{CpuTensor, CpuWeight};
    use strata_engine::backend::prelude::*;
    let (n, k, m) = (256, 2048, 8192);
    let x = CpuTensor::new((0..n * k).map(|i| ((i % 97) as f32 - 48.0) / 97.0).collect(), n, k);
    let w = CpuWeight::from_f32((0..m * k).map(|i| ((i % 89) as f32 - 44.0) / 890.0).collect(), m, k);
    let backend = CpuBackend::new();
    let mut rates = Vec::new();
    for _ in 0..repeats {
        let t = Instant::now();
        let _ = std::hint::black_box(backend.matmul(&x, &w));
        rates.push(2.0 * (n * k * m) as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    median(&rates)
}

use strata_common::stats::median;
