//! Prefill attention in tiles, on AVX-512: up to [`TILE`] consecutive new tokens of one
//! sequence with the query heads of one KV head, at once.
//!
//! The per-token kernel computes each score as a `head_dim`-wide dot product reduced
//! across lanes, then one scalar `exp`: a 512-token prompt of the 1B shape spent about a
//! fifth of its prefill there, for under 2% of its FLOPs. Here the tile's tokens are the
//! vector lanes. A key's scores for all of them are `head_dim` FMAs of the transposed,
//! pre-scaled queries against the key's broadcast elements (no reduction across lanes),
//! eight keys at a time so FMA latency never stalls; masking (causal, sliding window),
//! the softmax and its `exp` run over the same lanes; the weighted sum of V rows keeps
//! four tokens × 64 output columns in registers. Results differ from the per-token
//! kernel's only by f32 rounding (summation order; `exp` within 2 ulp).

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use super::attention::{Scratch, Tile};
use super::vmath::exp;
use super::{CpuKvLayer, CpuTensor, SendPtr};
use crate::backend::AttentionShape;

/// Tokens per tile: the lanes of one AVX-512 register of f32.
pub const TILE: usize = 16;
/// Keys whose scores are computed together.
const KEYS: usize = 8;
/// Tokens whose outputs accumulate together in the V pass.
const TOKENS: usize = 4;
/// Fewest keys whose products run on AMX tiles where the CPU has them (packing the keys
/// and values for the tiles is a pass over them per tile; shorter spans stay on vectors).
const AMX_MIN_KEYS: usize = 128;
/// Most bytes of scores one tile may hold; a longer context takes the per-token kernel.
const MAX_SCORE_BYTES: usize = 16 << 20;

/// Whether tiles can run attention of this shape over `keys` positions at most.
pub fn fits(shape: &AttentionShape, keys: usize) -> bool {
    let group = shape.num_heads / shape.num_kv_heads;
    let keys = shape.sliding_window.map_or(keys, |w| keys.min(w + TILE));
    super::simd::available()
        && shape.head_dim.is_multiple_of(16)
        && group * keys * TILE * 4 <= MAX_SCORE_BYTES
}

/// The tile's outputs: `tile.rows` rows of `group · head_dim` values, written at column
/// `kv_head · group · head_dim` of rows `token_start + first ..` of `out` (`[n, num_heads ·
/// head_dim]`, row stride `ld`). `bf16`: the model computes in bf16, so long spans may run
/// on AMX tiles.
///
/// # Safety
/// AVX-512F/BW and FMA must be available ([`fits`]); no other task writes that part of
/// `out`.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,fma")]
pub unsafe fn attend(
    q: &CpuTensor,
    cache: &CpuKvLayer,
    (block_size, bf16): (usize, bool),
    shape: AttentionShape,
    sinks: Option<&[f32]>,
    tile: &Tile,
    scratch: &mut Scratch,
    out: &SendPtr,
) {
    let AttentionShape { num_heads, num_kv_heads, head_dim: hd, scale, sliding_window, softcap } = shape;
    let group = num_heads / num_kv_heads;
    let seq = tile.seq;
    let pos0 = seq.context_before + tile.first;
    let last = tile.rows - 1;
    // Lanes past the tile's rows repeat its last token: valid key ranges, never written.
    let pos: [i32; TILE] = std::array::from_fn(|t| (pos0 + t.min(last)) as i32);
    let lo: [i32; TILE] =
        std::array::from_fn(|t| sliding_window.map_or(0, |w| (pos[t] as usize + 1).saturating_sub(w)) as i32);
    let first_key = lo[0] as usize;
    let span = pos0 + last + 1 - first_key;

    // Each key's offset in the cache, checked once here so the kernels read in bounds.
    let kv_off = tile.kv_head * hd;
    scratch.keys.clear();
    for p in first_key..first_key + span {
        let at =
            (seq.block_table[p / block_size] as usize * block_size + p % block_size) * cache.kv_dim + kv_off;
        assert!(
            at + hd <= cache.k.len() && at + hd <= cache.values().len(),
            "KV slot {at} outside the cache"
        );
        scratch.keys.push(at);
    }
    // Queries transposed, `qt[(h · hd + d) · TILE + t]`, scaled once.
    let col0 = tile.kv_head * group * hd;
    scratch.qt.clear();
    scratch.qt.resize(group * hd * TILE, 0.0);
    for t in 0..tile.rows {
        let row = &q.row(seq.token_start + tile.first + t)[col0..col0 + group * hd];
        for (i, &v) in row.iter().enumerate() {
            scratch.qt[i * TILE + t] = v * scale;
        }
    }
    scratch.scores.clear();
    scratch.scores.resize(group * span * TILE, 0.0);
    // A bf16 model's long spans on AMX tiles (both products in bf16), else on vectors in f32.
    let amx = bf16 && span >= AMX_MIN_KEYS && super::attention_amx::fits(hd);
    let tiles = super::amx::matrix_engine().filter(|_| amx);
    match tiles {
        Some(t) => super::attention_amx::scores(
            t,
            &scratch.qt,
            &cache.k,
            &scratch.keys,
            group,
            hd,
            &mut scratch.scores,
        ),
        None => scores(&scratch.qt, &cache.k, &scratch.keys, group, hd, &mut scratch.scores),
    }
    if let Some(c) = softcap {
        scratch.scores.iter_mut().for_each(|s| *s = c * (*s / c).tanh());
    }
    scratch.inv.clear();
    scratch.inv.resize(group * TILE, 0.0);
    softmax(&mut scratch.scores, &mut scratch.inv, span, first_key, &pos, &lo, sinks);

    if let Some(t) = tiles {
        let at =
            super::attention_amx::Out { ptr: out.0, ld: q.cols, row0: seq.token_start + tile.first, col0 };
        let (e, v, keys, inv) = (&scratch.scores, cache.values(), &scratch.keys, &scratch.inv);
        // SAFETY: the tile's rows and its KV head's columns of `out` are this task's alone.
        return super::attention_amx::values(t, e, v, keys, inv, (group, hd, tile.rows), &at);
    }
    let at = Out { ptr: out, ld: q.cols, row0: seq.token_start + tile.first, col0 };
    for dc in (0..hd).step_by(64) {
        let values = match (hd - dc).min(64) / 16 {
            4 => values::<4>,
            3 => values::<3>,
            2 => values::<2>,
            _ => values::<1>,
        };
        values(&scratch.scores, cache.values(), &scratch.keys, &scratch.inv, group, hd, dc, tile.rows, &at);
    }
}

/// `s[(h · span + i) · TILE + t]`: query head `h` of token `t` against key `i`.
#[target_feature(enable = "avx512f,avx512bw,fma")]
unsafe fn scores(qt: &[f32], k: &[f32], keys: &[usize], group: usize, hd: usize, s: &mut [f32]) {
    let span = keys.len();
    let mut i = 0;
    while i < span {
        let n = KEYS.min(span - i);
        // A short last block repeats its last key; those scores are not stored.
        let kp: [*const f32; KEYS] = std::array::from_fn(|j| k.as_ptr().add(keys[i + j.min(n - 1)]));
        for h in 0..group {
            let qh = qt.as_ptr().add(h * hd * TILE);
            let mut acc = [_mm512_setzero_ps(); KEYS];
            for d in 0..hd {
                let qv = _mm512_loadu_ps(qh.add(d * TILE));
                for (a, p) in acc.iter_mut().zip(&kp) {
                    *a = _mm512_fmadd_ps(qv, _mm512_set1_ps(*p.add(d)), *a);
                }
            }
            for (j, a) in acc.iter().enumerate().take(n) {
                _mm512_storeu_ps(s.as_mut_ptr().add((h * span + i + j) * TILE), *a);
            }
        }
        i += n;
    }
}

/// Masks each lane's keys outside `lo[t]..=pos[t]` and turns scores into `exp(s - max)`;
/// writes each (head, token)'s `1 / Σ exp` to `inv[h · TILE + t]` (one head per `TILE`),
/// the head's sink counted in the max and the sum where there is one.
#[target_feature(enable = "avx512f,avx512bw,fma")]
unsafe fn softmax(
    s: &mut [f32],
    inv: &mut [f32],
    span: usize,
    first_key: usize,
    pos: &[i32; TILE],
    lo: &[i32; TILE],
    sinks: Option<&[f32]>,
) {
    let group = inv.len() / TILE;
    let posv = _mm512_loadu_si512(pos.as_ptr() as *const _);
    let lov = _mm512_loadu_si512(lo.as_ptr() as *const _);
    let neg_inf = _mm512_set1_ps(f32::NEG_INFINITY);
    for h in 0..group {
        let row = s.as_mut_ptr().add(h * span * TILE);
        let mut max = neg_inf;
        for i in 0..span {
            let p = _mm512_set1_epi32((first_key + i) as i32);
            let keep = _mm512_cmple_epi32_mask(p, posv) & _mm512_cmpge_epi32_mask(p, lov);
            let v = _mm512_mask_blend_ps(keep, neg_inf, _mm512_loadu_ps(row.add(i * TILE)));
            _mm512_storeu_ps(row.add(i * TILE), v);
            max = _mm512_max_ps(max, v);
        }
        // A sink joins the max and the denominator (it takes no value).
        if let Some(sinks) = sinks {
            max = _mm512_max_ps(max, _mm512_set1_ps(sinks[h]));
        }
        let mut sum = match sinks {
            Some(sinks) => exp(_mm512_sub_ps(_mm512_set1_ps(sinks[h]), max)),
            None => _mm512_setzero_ps(),
        };
        for i in 0..span {
            let e = exp(_mm512_sub_ps(_mm512_loadu_ps(row.add(i * TILE)), max));
            _mm512_storeu_ps(row.add(i * TILE), e);
            sum = _mm512_add_ps(sum, e);
        }
        _mm512_storeu_ps(inv.as_mut_ptr().add(h * TILE), _mm512_div_ps(_mm512_set1_ps(1.0), sum));
    }
}

/// Where a tile's outputs go.
struct Out<'a> {
    ptr: &'a SendPtr,
    ld: usize,
    row0: usize,
    col0: usize,
}

/// Output columns `dc..dc + 16 · NV` of every head of the tile: `Σ_i e · V[i]`, scaled by
/// `inv`.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,fma")]
unsafe fn values<const NV: usize>(
    e: &[f32],
    v: &[f32],
    keys: &[usize],
    inv: &[f32],
    group: usize,
    hd: usize,
    dc: usize,
    rows: usize,
    out: &Out,
) {
    let span = keys.len();
    for h in 0..group {
        for t0 in (0..rows).step_by(TOKENS) {
            let mut acc = [[_mm512_setzero_ps(); NV]; TOKENS];
            for (i, &at) in keys.iter().enumerate() {
                let vp = v.as_ptr().add(at + dc);
                let vv: [__m512; NV] = std::array::from_fn(|c| _mm512_loadu_ps(vp.add(16 * c)));
                let w = e.as_ptr().add((h * span + i) * TILE + t0);
                for (j, a) in acc.iter_mut().enumerate() {
                    let wj = _mm512_set1_ps(*w.add(j));
                    for (a, x) in a.iter_mut().zip(&vv) {
                        *a = _mm512_fmadd_ps(wj, *x, *a);
                    }
                }
            }
            for (j, a) in acc.iter().enumerate().take(rows - t0) {
                let t = t0 + j;
                let scale = _mm512_set1_ps(inv[h * TILE + t]);
                let o = out.ptr.0.add((out.row0 + t) * out.ld + out.col0 + h * hd + dc);
                for (c, a) in a.iter().enumerate() {
                    _mm512_storeu_ps(o.add(16 * c), _mm512_mul_ps(*a, scale));
                }
            }
        }
    }
}
