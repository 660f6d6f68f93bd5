//! What the CPU can do at most, measured: the memory read bandwidth (decode's roofline),
//! the bandwidth the batch-1 matmul reaches, and the matmul's GFLOP/s on a prefill-shaped
//! problem. `strata model bench` and `strata gpu-check --device cpu` report them beside
//! what the engine achieves; they live with the kernels so that they are built as the
//! kernels are (optimized), whatever profile builds the command.

use std::time::Instant;

use rayon::prelude::*;
use strata_common::stats::median;

use super::{CpuBackend, CpuTensor, CpuWeight, HugeVec};
use crate::backend::prelude::*;

/// Bytes per second of a multi-threaded read of 256 MiB (far past any cache) on huge pages,
/// as the weights lie: the best of `repeats` reads in each of two patterns — one run per
/// thread at a time, and four 4 KiB runs side by side, as the decode kernels read four
/// weight rows at once (on an AVX2 host of this project's machine kind, four streams read
/// a third faster than one: 44 against 33 GB/s). A roofline is an upper bound and this
/// machine's readings are noisy, hence the best.
pub fn read_bandwidth(repeats: usize) -> f64 {
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
pub fn gemv_bandwidth(repeats: usize) -> f64 {
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
pub fn gemm_gflops(repeats: usize) -> f64 {
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

/// What a prefill matmul multiplies with on this CPU, at the kernels this process runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Compute {
    /// AMX tiles, bf16 pairs (`tdpbf16ps`).
    AmxBf16,
    /// AMX tiles, int8 quads (`tdpbssd`; integer operations).
    AmxInt8,
    /// AVX512-BF16 pairs (`vdpbf16ps`).
    Avx512Bf16,
    /// AVX-512 f32 FMA.
    Avx512F32,
    /// AVX2 f32 FMA.
    Avx2F32,
    /// Whatever the compiler makes of an f32 loop.
    Portable,
}

/// The weights a model's prefill matmuls read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefillWeights {
    /// bf16 computed in bf16 (packed for it where the CPU has AVX512-BF16).
    Bf16,
    /// `--quantize int8`.
    Int8,
    /// Anything widened to f32 in the matmul.
    Other,
}

impl Compute {
    /// The unit the prefill matmuls of a model with `weights` run on.
    pub fn for_prefill(weights: PrefillWeights) -> Compute {
        #[cfg(target_arch = "x86_64")]
        {
            use super::simd::{level, Level};
            let amx = level() == Level::Amx;
            if weights == PrefillWeights::Bf16 && CpuBackend::bf16_compute_available() {
                return if amx { Compute::AmxBf16 } else { Compute::Avx512Bf16 };
            }
            if weights == PrefillWeights::Int8 && super::amx::Amx::enabled_int8().is_some() {
                return Compute::AmxInt8;
            }
            // Unpacked weights run the gemm crate's kernels (not capped by the level).
            return match CpuBackend::prefill_gemm_kernels() {
                "avx512" => Compute::Avx512F32,
                "avx2" => Compute::Avx2F32,
                _ => Compute::Portable,
            };
        }
        #[allow(unreachable_code)]
        Compute::Portable
    }
}

/// The most GFLOP/s `compute` reaches on every thread of the pool at once: each thread
/// runs independent chains of the unit's multiply-adds on registers (no memory), the best
/// of `repeats` runs — prefill's compute roofline, as [`read_bandwidth`] is decode's.
pub fn peak_gflops(compute: Compute, repeats: usize) -> f64 {
    const ROUNDS: usize = 1 << 22;
    let mut best: f64 = 0.0;
    for _ in 0..repeats.max(1) {
        let t = Instant::now();
        let flops: f64 = rayon::broadcast(|_| peak_flops_on_thread(compute, ROUNDS)).iter().sum();
        best = best.max(flops / t.elapsed().as_secs_f64() / 1e9);
    }
    best
}

/// FLOPs of `rounds` rounds of `compute`'s multiply-add chains on this thread.
fn peak_flops_on_thread(compute: Compute, rounds: usize) -> f64 {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: each unit runs only where `Compute::for_prefill` found it (or the CPU has
    // it: the kernels check nothing else).
    unsafe {
        match compute {
            Compute::AmxBf16 => return super::amx::peak_flops(super::amx::Op::Bf16, rounds / 16),
            Compute::AmxInt8 => return super::amx::peak_flops(super::amx::Op::Int8, rounds / 16),
            Compute::Avx512Bf16 => return peak_avx512_bf16(rounds),
            Compute::Avx512F32 => return peak_avx512_f32(rounds),
            Compute::Avx2F32 => return peak_avx2_f32(rounds),
            Compute::Portable => {}
        }
    }
    let mut acc = [[0f32; 16]; 8];
    let (a, b) = (std::hint::black_box(1.000_001f32), std::hint::black_box(0.999_999f32));
    for _ in 0..rounds / 8 {
        for lane in acc.iter_mut() {
            lane.iter_mut().for_each(|v| *v = *v * a + b);
        }
    }
    std::hint::black_box(acc);
    (rounds / 8 * 8 * 16 * 2) as f64
}

/// Chains of multiply-adds on registers: `$n` independent accumulators, each round one
/// `$op` on each (so latency never limits throughput).
#[cfg(target_arch = "x86_64")]
macro_rules! peak_loop {
    ($name:ident, $features:literal, $n:literal, $flops:literal, $zero:expr, $one:expr, $op:expr) => {
        #[target_feature(enable = $features)]
        unsafe fn $name(rounds: usize) -> f64 {
            use std::arch::x86_64::*;
            let mut acc = [$zero; $n];
            let (a, b) = (std::hint::black_box($one), std::hint::black_box($one));
            for _ in 0..rounds {
                for v in acc.iter_mut() {
                    *v = $op(*v, a, b);
                }
            }
            std::hint::black_box(acc);
            (rounds * $n * $flops) as f64
        }
    };
}

#[cfg(target_arch = "x86_64")]
peak_loop!(peak_avx512_f32, "avx512f,fma", 12, 32, _mm512_setzero_ps(), _mm512_set1_ps(1e-7), |c, a, b| {
    _mm512_fmadd_ps(a, b, c)
});
#[cfg(target_arch = "x86_64")]
peak_loop!(peak_avx2_f32, "avx2,fma", 10, 16, _mm256_setzero_ps(), _mm256_set1_ps(1e-7), |c, a, b| {
    _mm256_fmadd_ps(a, b, c)
});
#[cfg(target_arch = "x86_64")]
peak_loop!(
    peak_avx512_bf16,
    "avx512f,avx512bf16",
    12,
    64,
    _mm512_setzero_ps(),
    std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(0x3380_3380)),
    |c, a, b| _mm512_dpbf16_ps(c, a, b)
);
