//! Prefill attention's two products on matrix tiles (AMX), for a tile of
//! [`super::attention_tiles`]: the scores `Q · Kᵀ` and the weighted sum `E · V`, in bf16
//! with f32 accumulation, as HF transformers computes a bf16 model's attention. The
//! softmax between them stays the vector code's, on the same score layout.
//!
//! Rows of both products are the tile's (query head, token) pairs, `h · TILE + t`; the
//! keys are cut into panels of 32: for the scores each panel holds 32 keys' `head_dim`
//! values as bf16 pairs (`[hd / 2][32]`), for the sum 32 output columns of every key
//! (`[keys / 2][32]`), both the layout [`amx::gemm`] reads. Packing them costs one pass
//! over the keys per tile, against `group · TILE` rows of products it feeds.

#![cfg(target_arch = "x86_64")]

use half::bf16;

use super::amx::{self, Activations, Block, Op, PanelSource, Panels, Tiles, BLOCK};
use super::attention_tiles::TILE;

/// Whether the tiles take attention with this head size (k of the score product is
/// `head_dim`, in steps of 32).
pub fn fits(head_dim: usize) -> bool {
    head_dim.is_multiple_of(32)
}

fn pair(lo: f32, hi: f32) -> u32 {
    bf16::from_f32(lo).to_bits() as u32 | (bf16::from_f32(hi).to_bits() as u32) << 16
}

/// A raw pointer the tiles' emit callbacks write through (each element from one task).
struct Shared(*mut f32);
// SAFETY: the callbacks write disjoint elements (each block is emitted once).
unsafe impl Sync for Shared {}

/// `s[(h · span + i) · TILE + t] = Σ_d qt[(h · hd + d) · TILE + t] · K[keys[i]][d]`, the
/// layout the vector softmax reads: `qt` holds the tile's scaled queries transposed, `k`
/// the cache's keys at the offsets `keys`.
pub fn scores<T: Tiles + ?Sized>(
    tiles: &T,
    qt: &[f32],
    k: &[f32],
    keys: &[usize],
    group: usize,
    hd: usize,
    s: &mut [f32],
) {
    let span = keys.len();
    assert!(fits(hd) && qt.len() >= group * hd * TILE && s.len() >= group * span * TILE);
    let q = Activations::new(group * TILE, hd / 2, |r, out| {
        let (h, t) = (r / TILE, r % TILE);
        for (d2, o) in out.iter_mut().enumerate() {
            let at = |d: usize| qt[(h * hd + d) * TILE + t];
            *o = pair(at(2 * d2), at(2 * d2 + 1));
        }
    });
    let count = span.div_ceil(BLOCK);
    let panel_len = hd / 2 * BLOCK;
    let mut panels = vec![0u32; count * panel_len];
    for (p, panel) in panels.chunks_mut(panel_len).enumerate() {
        for (c, &at) in keys[p * BLOCK..span.min((p + 1) * BLOCK)].iter().enumerate() {
            let key = &k[at..at + hd];
            for d2 in 0..hd / 2 {
                panel[d2 * BLOCK + c] = pair(key[2 * d2], key[2 * d2 + 1]);
            }
        }
    }
    let w = Panels { source: PanelSource::Packed(&panels), count, steps: hd / 32 };
    let out = Shared(s.as_mut_ptr());
    amx::gemm(tiles, Op::Bf16, &q, &w, |r0, p, c: &Block| {
        let out = &out;
        for (r, row) in c.iter().enumerate().take((group * TILE).saturating_sub(r0)) {
            let (h, t) = ((r0 + r) / TILE, (r0 + r) % TILE);
            for (j, &bits) in row.iter().enumerate().take(span.saturating_sub(p * BLOCK)) {
                // SAFETY: inside `s` (h < group, key < span, t < TILE); written once.
                unsafe { *out.0.add((h * span + p * BLOCK + j) * TILE + t) = f32::from_bits(bits) };
            }
        }
    });
}

/// Where [`values`] writes: row `row0 + t` of an output with rows `ld` apart, columns
/// from `col0 + h · hd`.
pub struct Out {
    pub ptr: *mut f32,
    pub ld: usize,
    pub row0: usize,
    pub col0: usize,
}

/// For the tile's first `rows` tokens: `out[t][h · hd + c] = inv[h · TILE + t] · Σ_i
/// e[(h · span + i) · TILE + t] · V[keys[i]][c]`.
///
/// # Safety
/// `out` must be valid for those rows and columns, written by this call alone.
#[allow(clippy::too_many_arguments)]
pub unsafe fn values<T: Tiles + ?Sized>(
    tiles: &T,
    e: &[f32],
    v: &[f32],
    keys: &[usize],
    inv: &[f32],
    (group, hd, rows): (usize, usize, usize),
    out: &Out,
) {
    let span = keys.len();
    let padded = span.div_ceil(BLOCK) * BLOCK;
    assert!(fits(hd) && e.len() >= group * span * TILE && inv.len() >= group * TILE && rows <= TILE);
    let p = Activations::new(group * TILE, padded / 2, |r, out| {
        let (h, t) = (r / TILE, r % TILE);
        let at = |i: usize| if i < span { e[(h * span + i) * TILE + t] } else { 0.0 };
        for (i2, o) in out.iter_mut().enumerate() {
            *o = pair(at(2 * i2), at(2 * i2 + 1));
        }
    });
    let count = hd / BLOCK;
    let panel_len = padded / 2 * BLOCK;
    let mut panels = vec![0u32; count * panel_len];
    let row = |i: usize| if i < span { &v[keys[i]..keys[i] + hd] } else { &v[..0] };
    for i2 in 0..padded / 2 {
        let (a, b) = (row(2 * i2), row(2 * i2 + 1));
        for (cb, panel) in panels.chunks_mut(panel_len).enumerate() {
            for c in 0..BLOCK {
                let d = cb * BLOCK + c;
                panel[i2 * BLOCK + c] =
                    pair(a.get(d).copied().unwrap_or(0.0), b.get(d).copied().unwrap_or(0.0));
            }
        }
    }
    let w = Panels { source: PanelSource::Packed(&panels), count, steps: padded / 32 };
    let dst = Shared(out.ptr);
    let (ld, row0, col0) = (out.ld, out.row0, out.col0);
    amx::gemm(tiles, Op::Bf16, &p, &w, |r0, cb, c: &Block| {
        let dst = &dst;
        for (r, block_row) in c.iter().enumerate().take((group * TILE).saturating_sub(r0)) {
            let (h, t) = ((r0 + r) / TILE, (r0 + r) % TILE);
            if t >= rows {
                continue;
            }
            let scale = inv[h * TILE + t];
            let o = (row0 + t) * ld + col0 + h * hd + cb * BLOCK;
            for (j, &bits) in block_row.iter().enumerate() {
                // SAFETY: the caller's contract; each (row, column) is emitted once.
                unsafe { *dst.0.add(o + j) = f32::from_bits(bits) * scale };
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round(v: f32) -> f64 {
        bf16::from_f32(v).to_f32() as f64
    }

    /// Two query heads of a tile against 45 keys (a partial last panel) spread through
    /// a cache, then the weighted sum of their values: both against f64 sums of the
    /// bf16-rounded operands.
    #[test]
    fn tile_products_match_bf16_rounded_references() {
        let (group, hd, span, rows) = (2, 64, 45, 11);
        let kv_dim = 3 * hd;
        let cache: Vec<f32> = (0..100 * kv_dim).map(|i| ((i * 29 % 83) as f32 - 41.0) / 53.0).collect();
        let keys: Vec<usize> = (0..span).map(|i| (i * 2 + 1) * kv_dim + hd).collect();
        let qt: Vec<f32> = (0..group * hd * TILE).map(|i| ((i * 31 % 97) as f32 - 48.0) / 61.0).collect();
        let mut s = vec![f32::NAN; group * span * TILE];
        scores(&amx::Sim, &qt, &cache, &keys, group, hd, &mut s);
        for h in 0..group {
            for (i, &at) in keys.iter().enumerate() {
                for t in 0..TILE {
                    let want: f64 =
                        (0..hd).map(|d| round(qt[(h * hd + d) * TILE + t]) * round(cache[at + d])).sum();
                    let got = s[(h * span + i) * TILE + t] as f64;
                    assert!(
                        (got - want).abs() < 1e-4 * (1.0 + want.abs()),
                        "score ({h},{i},{t}): {got} vs {want}"
                    );
                }
            }
        }
        let e: Vec<f32> = (0..group * span * TILE).map(|i| (i * 13 % 37) as f32 / 37.0).collect();
        let inv: Vec<f32> = (0..group * TILE).map(|i| 1.0 / (1.0 + i as f32)).collect();
        let (ld, col0, row0) = (group * hd + 8, 4, 2);
        let mut out = vec![-7.0f32; (row0 + TILE) * ld];
        let at = Out { ptr: out.as_mut_ptr(), ld, row0, col0 };
        // SAFETY: `out` holds rows row0.. row0 + TILE of `ld` columns.
        unsafe { values(&amx::Sim, &e, &cache, &keys, &inv, (group, hd, rows), &at) };
        for t in 0..TILE {
            for h in 0..group {
                for c in 0..hd {
                    let got = out[(row0 + t) * ld + col0 + h * hd + c];
                    if t >= rows {
                        assert_eq!(got, -7.0, "row {t} past the tile's rows was written");
                        continue;
                    }
                    let sum: f64 = (0..span)
                        .map(|i| round(e[(h * span + i) * TILE + t]) * round(cache[keys[i] + c]))
                        .sum();
                    let want = sum * inv[h * TILE + t] as f64;
                    assert!(
                        (got as f64 - want).abs() < 1e-4 * (1.0 + want.abs()),
                        "value ({t},{h},{c}): {got} vs {want}"
                    );
                }
            }
        }
        assert!(out[..row0 * ld].iter().all(|&v| v == -7.0), "rows before the tile written");
    }
}
