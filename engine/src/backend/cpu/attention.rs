//! Paged causal attention on the CPU.
//!
//! Each new token attends to its own sequence's positions `lo..=pos` (`lo` > 0 only under
//! a sliding window), read from the paged cache through the sequence's block table; no
//! sequence is padded to another's length. Work is split across rayon tasks by
//! (token, KV head) pairs, so prefill and batched decode both keep every core busy, and
//! the query heads that share a KV head (GQA) read each K and V row once between them.
//! The inner loops (dot products over `head_dim`, the weighted sum of V rows) are written
//! with independent lane accumulators so the compiler vectorizes them; on x86-64 they are
//! compiled a second time for AVX-512 and picked at run time.

use rayon::prelude::*;

use super::{CpuKvLayer, CpuTensor};
use crate::backend::{AttentionShape, BatchLayout};

/// Lanes of the dot product's accumulators (one AVX-512 register of f32).
const LANES: usize = 16;

pub fn paged_attention(
    q: &CpuTensor,
    cache: &CpuKvLayer,
    layout: &BatchLayout,
    shape: AttentionShape,
) -> CpuTensor {
    let AttentionShape { num_heads, num_kv_heads, head_dim, .. } = shape;
    let group = num_heads / num_kv_heads;
    let n = q.rows;
    // Which sequence each row belongs to.
    let mut seq_of_row = vec![0usize; n];
    for (s, seq) in layout.seqs.iter().enumerate() {
        seq_of_row[seq.token_start..seq.token_start + seq.num_tokens].fill(s);
    }
    let mut out = CpuTensor::zeros(n, num_heads * head_dim);
    let width = group * head_dim;
    out.data.par_chunks_mut(width).enumerate().for_each_init(Vec::new, |scores, (idx, o)| {
        let (row, kv_head) = (idx / num_kv_heads, idx % num_kv_heads);
        let job = Job {
            q: &q.row(row)[kv_head * width..(kv_head + 1) * width],
            cache,
            seq: &layout.seqs[seq_of_row[row]],
            row,
            kv_off: kv_head * head_dim,
            block_size: layout.block_size,
            shape,
        };
        #[cfg(target_arch = "x86_64")]
        if super::simd::available() {
            // SAFETY: AVX-512 is available (checked at run time).
            unsafe { attend_avx512(&job, scores, o) };
            return;
        }
        attend::<false>(&job, scores, o);
    });
    out
}

/// One token's query heads that share one KV head.
struct Job<'a> {
    /// `group` query heads of `head_dim`, one after another.
    q: &'a [f32],
    cache: &'a CpuKvLayer,
    seq: &'a crate::backend::SeqSlice,
    row: usize,
    kv_off: usize,
    block_size: usize,
    shape: AttentionShape,
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,fma")]
unsafe fn attend_avx512(job: &Job, scores: &mut Vec<f32>, out: &mut [f32]) {
    attend::<true>(job, scores, out)
}

/// `FMA`: fuse multiply-adds (only where the CPU has FMA; elsewhere `mul_add` would be a
/// slow library call).
#[inline(always)]
fn attend<const FMA: bool>(job: &Job, scores: &mut Vec<f32>, out: &mut [f32]) {
    let AttentionShape { head_dim, scale, sliding_window, .. } = job.shape;
    let seq = job.seq;
    let pos = seq.context_before + (job.row - seq.token_start);
    let lo = match sliding_window {
        Some(w) => (pos + 1).saturating_sub(w),
        None => 0,
    };
    let (bs, kv_dim) = (job.block_size, job.cache.kv_dim);
    let slot = |p: usize| (seq.block_table[p / bs] as usize * bs + p % bs) * kv_dim + job.kv_off;
    let span = pos + 1 - lo;
    let heads = job.q.len() / head_dim;
    scores.clear();
    scores.resize(heads * span, 0.0);
    for (i, p) in (lo..=pos).enumerate() {
        let at = slot(p);
        let k = &job.cache.k[at..at + head_dim];
        for (h, q_h) in job.q.chunks_exact(head_dim).enumerate() {
            scores[h * span + i] = dot::<FMA>(q_h, k) * scale;
        }
    }
    for s in scores.chunks_exact_mut(span) {
        let max = s.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        let mut total = 0f32;
        for v in s.iter_mut() {
            *v = (*v - max).exp();
            total += *v;
        }
        let inv = 1.0 / total;
        s.iter_mut().for_each(|v| *v *= inv);
    }
    out.fill(0.0);
    for (i, p) in (lo..=pos).enumerate() {
        let at = slot(p);
        let v = &job.cache.v[at..at + head_dim];
        for (h, o) in out.chunks_exact_mut(head_dim).enumerate() {
            let w = scores[h * span + i];
            for (acc, x) in o.iter_mut().zip(v) {
                *acc = madd::<FMA>(w, *x, *acc);
            }
        }
    }
}

/// `Σ a[i]·b[i]` with [`LANES`] independent partial sums (vectorizable; the order of
/// additions differs from a left-to-right sum only by f32 rounding).
#[inline(always)]
fn dot<const FMA: bool>(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let split = a.len() / LANES * LANES;
    for (x, y) in a[..split].chunks_exact(LANES).zip(b[..split].chunks_exact(LANES)) {
        for l in 0..LANES {
            acc[l] = madd::<FMA>(x[l], y[l], acc[l]);
        }
    }
    let tail: f32 = a[split..].iter().zip(&b[split..]).map(|(x, y)| x * y).sum();
    acc.iter().sum::<f32>() + tail
}

/// `a·b + c`, fused when `FMA`.
#[inline(always)]
fn madd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}
