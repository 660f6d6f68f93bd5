//! Opt-in bf16 × bf16 prefill GEMM with AVX512-BF16 (`vdpbf16ps`).
//!
//! `vdpbf16ps` multiplies pairs of bf16 values and accumulates in f32, twice the work per
//! instruction of an f32 FMA. It needs both operands in bf16, so activations are rounded
//! to bf16 (round-to-nearest-even) — what HF transformers does when it runs a bf16 model —
//! which costs Strata's f32-exact logits; that is why this path is off by default
//! (`EngineConfig::bf16_prefill`, `--bf16-prefill`) and used only for bf16 weights and
//! matmuls with many rows (prefill).
//!
//! Layout: activations are converted once per matmul into bf16 rows padded to a multiple
//! of 32; each rayon task packs 32 weight rows into pair-interleaved order (`[k/2][32]`
//! u32 pairs, so one 512-bit load holds one k-pair of 16 output columns) and runs an
//! 8 × 32 register tile: per k-pair, 2 weight loads, 8 broadcasts and 16 `vdpbf16ps`.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use half::bf16;
use rayon::prelude::*;

use super::CpuTensor;

const NR: usize = 32;

pub fn available() -> bool {
    use std::sync::OnceLock;
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| super::simd::available() && is_x86_feature_detected!("avx512bf16"))
}

/// `x · wᵀ` with `w` in bf16 (`[m, k]`), activations rounded to bf16.
pub fn matmul(x: &CpuTensor, w: &[bf16], m: usize) -> CpuTensor {
    assert!(available(), "bf16 GEMM needs AVX512-BF16");
    let (n, k) = (x.rows, x.cols);
    let kp = k.div_ceil(32) * 32;
    // Activations as bf16 bit patterns, rows padded with zeros to kp.
    let mut xb = vec![0u16; n * kp];
    xb.par_chunks_mut(kp).zip(x.data.par_chunks(k)).for_each(|(dst, src)| {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = bf16::from_f32(*s).to_bits();
        }
    });
    let mut y = vec![0f32; n * m];
    let y_ptr = SendPtr(y.as_mut_ptr());
    let tiles = m.div_ceil(NR);
    (0..tiles).into_par_iter().for_each_init(Vec::<u32>::new, |packed, tile_index| {
        let j0 = tile_index * NR;
        let cols = NR.min(m - j0);
        pack_weights(w, k, kp, j0, cols, packed);
        let y_ptr = &y_ptr;
        let mut t = 0;
        while t < n {
            let rows = (n - t).min(8);
            // SAFETY: AVX512-BF16 is available (asserted above); this task writes only
            // columns j0..j0+cols of rows t..t+rows of y; buffers have the sizes used.
            unsafe {
                let out = y_ptr.0.add(t * m + j0);
                match rows {
                    8 => tile::<8>(&xb[t * kp..], kp, packed, out, m, cols),
                    7 => tile::<7>(&xb[t * kp..], kp, packed, out, m, cols),
                    6 => tile::<6>(&xb[t * kp..], kp, packed, out, m, cols),
                    5 => tile::<5>(&xb[t * kp..], kp, packed, out, m, cols),
                    4 => tile::<4>(&xb[t * kp..], kp, packed, out, m, cols),
                    3 => tile::<3>(&xb[t * kp..], kp, packed, out, m, cols),
                    2 => tile::<2>(&xb[t * kp..], kp, packed, out, m, cols),
                    _ => tile::<1>(&xb[t * kp..], kp, packed, out, m, cols),
                }
            }
            t += rows;
        }
    });
    CpuTensor::new(y, n, m)
}

/// Packs weight rows `j0..j0+cols` into `[kp/2][NR]` u32 pairs (missing rows and the k
/// padding are zeros).
fn pack_weights(w: &[bf16], k: usize, kp: usize, j0: usize, cols: usize, out: &mut Vec<u32>) {
    out.clear();
    out.resize(kp / 2 * NR, 0);
    for j in 0..cols {
        let row = &w[(j0 + j) * k..(j0 + j + 1) * k];
        for (i, pair) in row.chunks(2).enumerate() {
            let lo = pair[0].to_bits() as u32;
            let hi = pair.get(1).map_or(0, |v| v.to_bits() as u32);
            out[i * NR + j] = lo | (hi << 16);
        }
    }
}

/// One `R × NR` tile: `out[r * ld + c] = Σ_k x[r][k] · w[c][k]` for `c < cols`.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn tile<const R: usize>(xb: &[u16], kp: usize, packed: &[u32], out: *mut f32, ld: usize, cols: usize) {
    let mut acc = [[_mm512_setzero_ps(); 2]; R];
    let pairs = kp / 2;
    let xp = xb.as_ptr() as *const u32; // pairs of bf16 along k
    let wp = packed.as_ptr();
    for i in 0..pairs {
        let w0: __m512bh = std::mem::transmute(_mm512_loadu_si512(wp.add(i * NR) as *const _));
        let w1: __m512bh = std::mem::transmute(_mm512_loadu_si512(wp.add(i * NR + 16) as *const _));
        for (r, a) in acc.iter_mut().enumerate() {
            let xv = std::ptr::read_unaligned(xp.add(r * pairs + i));
            let xb: __m512bh = std::mem::transmute(_mm512_set1_epi32(xv as i32));
            a[0] = _mm512_dpbf16_ps(a[0], xb, w0);
            a[1] = _mm512_dpbf16_ps(a[1], xb, w1);
        }
    }
    for (r, a) in acc.iter().enumerate() {
        let row = out.add(r * ld);
        if cols == NR {
            _mm512_storeu_ps(row, a[0]);
            _mm512_storeu_ps(row.add(16), a[1]);
        } else {
            let mut tmp = [0f32; NR];
            _mm512_storeu_ps(tmp.as_mut_ptr(), a[0]);
            _mm512_storeu_ps(tmp.as_mut_ptr().add(16), a[1]);
            std::ptr::copy_nonoverlapping(tmp.as_ptr(), row, cols);
        }
    }
}

struct SendPtr(*mut f32);
// SAFETY: used only to hand disjoint column ranges of one buffer to rayon tasks.
unsafe impl Sync for SendPtr {}
unsafe impl Send for SendPtr {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_a_bf16_rounded_reference() {
        if !available() {
            eprintln!("AVX512-BF16 not available on this CPU: the bf16 GEMM is not used here");
            return;
        }
        let (n, k, m) = (19, 75, 70); // odd k (padding), m not a multiple of 32, n of 8
        let x: Vec<f32> = (0..n * k).map(|i| ((i * 37 % 101) as f32 - 50.0) / 37.0).collect();
        let w: Vec<bf16> = (0..m * k).map(|i| bf16::from_f32(((i * 53 % 89) as f32 - 44.0) / 61.0)).collect();
        let y = matmul(&CpuTensor::new(x.clone(), n, k), &w, m);
        for t in 0..n {
            for j in 0..m {
                let want: f64 = (0..k)
                    .map(|i| bf16::from_f32(x[t * k + i]).to_f32() as f64 * w[j * k + i].to_f32() as f64)
                    .sum();
                let got = y.data[t * m + j] as f64;
                assert!((got - want).abs() < 1e-3 * (1.0 + want.abs()), "({t},{j}): {got} vs {want}");
            }
        }
    }
}
