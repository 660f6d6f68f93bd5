//! Paged causal attention on the CPU.
//!
//! Each new token attends to its own sequence's positions `lo..=pos` (`lo` > 0 only under
//! a sliding window), read from the paged cache through the sequence's block table; no
//! sequence is padded to another's length. Work is split across rayon tasks by
//! (token, head) pairs, so prefill and batched decode both keep every core busy.

use rayon::prelude::*;

use super::{CpuKvLayer, CpuTensor};
use crate::backend::{AttentionShape, BatchLayout};

pub fn paged_attention(
    q: &CpuTensor,
    cache: &CpuKvLayer,
    layout: &BatchLayout,
    shape: AttentionShape,
) -> CpuTensor {
    let AttentionShape { num_heads, num_kv_heads, head_dim, scale, sliding_window } = shape;
    let group = num_heads / num_kv_heads;
    let n = q.rows;
    // Which sequence each row belongs to.
    let mut seq_of_row = vec![0usize; n];
    for (s, seq) in layout.seqs.iter().enumerate() {
        seq_of_row[seq.token_start..seq.token_start + seq.num_tokens].fill(s);
    }
    let bs = layout.block_size;
    let kv_dim = cache.kv_dim;
    let mut out = CpuTensor::zeros(n, num_heads * head_dim);
    out.data.par_chunks_mut(head_dim).enumerate().for_each_init(Vec::new, |scores, (idx, o)| {
        let (row, head) = (idx / num_heads, idx % num_heads);
        let seq = &layout.seqs[seq_of_row[row]];
        let pos = seq.context_before + (row - seq.token_start);
        let lo = match sliding_window {
            Some(w) => (pos + 1).saturating_sub(w),
            None => 0,
        };
        let q_h = &q.row(row)[head * head_dim..(head + 1) * head_dim];
        let kv_off = (head / group) * head_dim;
        let slot = |p: usize| (seq.block_table[p / bs] as usize * bs + p % bs) * kv_dim + kv_off;

        scores.clear();
        let mut max = f32::NEG_INFINITY;
        for p in lo..=pos {
            let at = slot(p);
            let k = &cache.k[at..at + head_dim];
            let s = q_h.iter().zip(k).map(|(a, b)| a * b).sum::<f32>() * scale;
            max = max.max(s);
            scores.push(s);
        }
        let mut total = 0f32;
        for s in scores.iter_mut() {
            *s = (*s - max).exp();
            total += *s;
        }
        let inv = 1.0 / total;
        o.fill(0.0);
        for (p, &s) in (lo..=pos).zip(scores.iter()) {
            let at = slot(p);
            let v = &cache.v[at..at + head_dim];
            let wgt = s * inv;
            for (acc, x) in o.iter_mut().zip(v) {
                *acc += wgt * x;
            }
        }
    });
    out
}
