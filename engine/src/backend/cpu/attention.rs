//! Paged causal attention on the CPU.
//!
//! Each new token attends to its own sequence's positions `lo..=pos` (`lo` > 0 only under
//! a sliding window), read from the paged cache through the sequence's block table; no
//! sequence is padded to another's length. Work is split across rayon tasks by
//! (token, KV head) pairs, so prefill and batched decode both keep every core busy, and
//! the query heads that share a KV head (GQA) read each K and V row once between them.
//! The inner loops (dot products over `head_dim`, the weighted sum of V rows) are written
//! with independent lane accumulators so the compiler vectorizes them; on x86-64 they are
//! compiled a second time for AVX-512 and picked at run time. A sequence with several new
//! tokens (prefill, a prompt chunk) runs in tiles of 16 tokens instead where the CPU has
//! AVX-512 ([`super::attention_tiles`]): the tokens become the vector lanes.
//!
//! Scores may be soft-capped (`c · tanh(s / c)`, Gemma 2) and a head may have a sink
//! (gpt-oss): a logit that joins the softmax's max and denominator and takes no value.

use rayon::prelude::*;

use super::{CpuKvLayer, CpuTensor, SendPtr};
use crate::backend::{AttentionShape, BatchLayout, SeqSlice};

/// Lanes of the dot product's accumulators (one AVX-512 register of f32).
const LANES: usize = 16;

pub fn paged_attention(
    q: &CpuTensor,
    cache: &CpuKvLayer,
    layout: &BatchLayout,
    shape: AttentionShape,
    sinks: Option<&[f32]>,
    bf16: bool,
) -> CpuTensor {
    let AttentionShape { num_heads, num_kv_heads, head_dim, .. } = shape;
    let group = num_heads / num_kv_heads;
    let width = group * head_dim;
    let group_sinks = |kv_head: usize| sinks.map(|s| &s[kv_head * group..(kv_head + 1) * group]);
    let mut out = CpuTensor::zeros(q.rows, num_heads * head_dim);
    let out_ptr = SendPtr(out.data.as_mut_ptr());
    plan(layout, shape).par_iter().for_each_init(Scratch::default, |scratch, work| match work {
        Work::Token { seq, row, kv_head } => {
            let job = Job {
                q: &q.row(*row)[kv_head * width..(kv_head + 1) * width],
                cache,
                seq,
                row: *row,
                kv_off: kv_head * head_dim,
                block_size: layout.block_size,
                shape,
                sinks: group_sinks(*kv_head),
            };
            // SAFETY: this task alone writes these columns of this row (one task per
            // (row, KV head)); they lie inside `out`.
            let o = unsafe {
                std::slice::from_raw_parts_mut(out_ptr.0.add((row * num_kv_heads + kv_head) * width), width)
            };
            #[cfg(target_arch = "x86_64")]
            match super::simd::level() {
                // SAFETY: the CPU has what each function is compiled for (checked at run
                // time).
                super::simd::Level::Avx512 | super::simd::Level::Amx => {
                    return unsafe { attend_avx512(&job, &mut scratch.scores, o) }
                }
                super::simd::Level::Avx2 => return unsafe { attend_avx2(&job, &mut scratch.scores, o) },
                super::simd::Level::Portable => {}
            }
            attend::<false>(&job, &mut scratch.scores, o);
        }
        #[cfg(target_arch = "x86_64")]
        Work::Tile(tile) => {
            // SAFETY: tiles are planned only where AVX-512 is available; each writes its
            // own rows' columns of its KV head.
            unsafe {
                let sinks = group_sinks(tile.kv_head);
                super::attention_tiles::attend(
                    q,
                    cache,
                    (layout.block_size, bf16),
                    shape,
                    sinks,
                    tile,
                    scratch,
                    &out_ptr,
                )
            }
        }
    });
    out
}

/// Per-thread buffers.
#[derive(Default)]
pub(super) struct Scratch {
    pub scores: Vec<f32>,
    pub qt: Vec<f32>,
    pub keys: Vec<usize>,
    pub inv: Vec<f32>,
}

/// Rows of one sequence's new tokens and one KV head's query heads, attended together.
pub(super) struct Tile<'a> {
    pub seq: &'a SeqSlice,
    /// The first row, counted from the sequence's first new token.
    pub first: usize,
    pub rows: usize,
    pub kv_head: usize,
}

enum Work<'a> {
    Token {
        seq: &'a SeqSlice,
        row: usize,
        kv_head: usize,
    },
    #[cfg(target_arch = "x86_64")]
    Tile(Tile<'a>),
}

/// Fewest new tokens of a sequence that run in tiles (fewer, as in decode, run per token).
const MIN_TILE_ROWS: usize = 4;

/// The step's attention as tasks: a prefill sequence in tiles where the CPU and shape
/// allow, every other token on its own.
fn plan(layout: &BatchLayout, shape: AttentionShape) -> Vec<Work<'_>> {
    let mut work = Vec::new();
    for seq in &layout.seqs {
        #[cfg(target_arch = "x86_64")]
        if seq.num_tokens >= MIN_TILE_ROWS
            && super::attention_tiles::fits(&shape, seq.context_before + seq.num_tokens)
        {
            use super::attention_tiles::TILE;
            for first in (0..seq.num_tokens).step_by(TILE) {
                let rows = TILE.min(seq.num_tokens - first);
                work.extend(
                    (0..shape.num_kv_heads).map(|kv_head| Work::Tile(Tile { seq, first, rows, kv_head })),
                );
            }
            continue;
        }
        for row in seq.token_start..seq.token_start + seq.num_tokens {
            work.extend((0..shape.num_kv_heads).map(|kv_head| Work::Token { seq, row, kv_head }));
        }
    }
    work
}

/// One token's query heads that share one KV head.
struct Job<'a> {
    /// `group` query heads of `head_dim`, one after another.
    q: &'a [f32],
    cache: &'a CpuKvLayer,
    seq: &'a SeqSlice,
    row: usize,
    kv_off: usize,
    block_size: usize,
    shape: AttentionShape,
    /// The group's heads' sinks, where the layer has them.
    sinks: Option<&'a [f32]>,
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,fma")]
unsafe fn attend_avx512(job: &Job, scores: &mut Vec<f32>, out: &mut [f32]) {
    attend::<true>(job, scores, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn attend_avx2(job: &Job, scores: &mut Vec<f32>, out: &mut [f32]) {
    attend::<true>(job, scores, out)
}

/// `FMA`: fuse multiply-adds (only where the CPU has FMA; elsewhere `mul_add` would be a
/// slow library call).
#[inline(always)]
fn attend<const FMA: bool>(job: &Job, scores: &mut Vec<f32>, out: &mut [f32]) {
    let AttentionShape { head_dim, scale, sliding_window, softcap, .. } = job.shape;
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
            let s = dot::<FMA>(q_h, k) * scale;
            scores[h * span + i] = match softcap {
                Some(c) => c * (s / c).tanh(),
                None => s,
            };
        }
    }
    for (h, s) in scores.chunks_exact_mut(span).enumerate() {
        let sink = job.sinks.map(|sinks| sinks[h]);
        let max = s.iter().fold(sink.unwrap_or(f32::NEG_INFINITY), |m, &v| m.max(v));
        let total = sink.map_or(0.0, |x| (x - max).exp()) + super::vmath::exp_sub_in_place(s, max);
        let inv = 1.0 / total;
        s.iter_mut().for_each(|v| *v *= inv);
    }
    out.fill(0.0);
    for (i, p) in (lo..=pos).enumerate() {
        let at = slot(p);
        let v = &job.cache.values()[at..at + head_dim];
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
    // Halving sums (a shuffle and a vector add each) instead of 15 dependent scalar adds.
    let mut width = LANES / 2;
    while width > 0 {
        for l in 0..width {
            acc[l] += acc[l + width];
        }
        width /= 2;
    }
    acc[0] + tail
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A prompt of this shape runs in tiles where the CPU has AVX-512 (so the dense
    /// comparison in `cpu/tests.rs` covers the tiled kernel here); a decoding token and a
    /// head dim that is not a multiple of 16 run per token.
    #[test]
    fn prompts_run_in_tiles_and_decode_tokens_alone() {
        let seq = |token_start, num_tokens| SeqSlice {
            token_start,
            num_tokens,
            context_before: 3,
            block_table: vec![0; 4],
        };
        let layout = BatchLayout { seqs: vec![seq(0, 20), seq(20, 1)], block_size: 16, ..Default::default() };
        let shape = |head_dim| AttentionShape {
            num_heads: 4,
            num_kv_heads: 2,
            head_dim,
            scale: 1.0,
            sliding_window: None,
            softcap: None,
        };
        let tiles = |work: &[Work]| work.iter().filter(|w| !matches!(w, Work::Token { .. })).count();
        #[cfg(target_arch = "x86_64")]
        if super::super::simd::available() {
            // 20 tokens: a tile of 16 and one of 4, per KV head; the decode token per KV head.
            let work = plan(&layout, shape(64));
            assert_eq!((tiles(&work), work.len()), (4, 6));
        }
        let work = plan(&layout, shape(72));
        assert_eq!((tiles(&work), work.len()), (0, 21 * 2));
    }
}
