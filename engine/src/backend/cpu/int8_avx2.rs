//! int8 × int8 decode matmul with AVX2, for `--quantize int8` on CPUs without
//! AVX512-VNNI.
//!
//! As on AVX-512 ([`super::int8_vnni`]), each activation row is quantized to int8 (one
//! scale per row) and the dot products run in integers. AVX2's byte multiply
//! (`vpmaddubsw`) takes one unsigned and one signed operand and sums pairs into saturating
//! 16-bit lanes, so the weight's magnitude goes in as the unsigned operand and its sign
//! moves onto the activation (`vpsignb`): `|w| ≤ 128` and `|x| ≤ 127` keep every pair sum
//! within 16 bits, and `vpmaddwd` widens them to 32-bit sums. Exact integer arithmetic:
//! the result equals the AVX-512 kernel's.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use rayon::prelude::*;

use super::CpuTensor;

/// Output rows per rayon task.
const CHUNK: usize = 32;
/// Activation rows per pass over a weight row.
const ROWS: usize = 4;

/// `y = x · wᵀ` for `w ≈ q · scales` (per output row), `x` quantized per row.
///
/// # Panics
/// If the CPU lacks AVX2 (callers check [`super::simd::level`]).
pub fn matmul(x: &CpuTensor, q: &[i8], scales: &[f32], m: usize) -> CpuTensor {
    assert!(is_x86_feature_detected!("avx2"), "the AVX2 int8 kernel needs AVX2");
    let (n, k) = (x.rows, x.cols);
    let (xq, xs) = super::int8_vnni::quantize_rows(x, |q| q as i8);
    let mut out_t = vec![0f32; m * n];
    out_t.par_chunks_mut(CHUNK * n).enumerate().for_each(|(c, out)| {
        let mut acc = [0i32; ROWS];
        for (jj, out_row) in out.chunks_mut(n).enumerate() {
            let j = c * CHUNK + jj;
            let w = &q[j * k..(j + 1) * k];
            for (g, out_g) in out_row.chunks_mut(ROWS).enumerate() {
                let rows = out_g.len();
                // SAFETY: AVX2 is available (asserted); `w` holds k bytes and `xq` holds
                // `rows` rows of k from row g·ROWS.
                unsafe { dot_rows(w, &xq[g * ROWS * k..], k, &mut acc[..rows]) };
                for (t, o) in out_g.iter_mut().enumerate() {
                    *o = acc[t] as f32 * xs[g * ROWS + t] * scales[j];
                }
            }
        }
    });
    super::matmul::from_transposed(out_t, n, m)
}

/// `out[t] = Σ_i xq[t·k + i] · w[i]` for `t < out.len()` (at most [`ROWS`]).
#[target_feature(enable = "avx2")]
unsafe fn dot_rows(w: &[i8], xq: &[i8], k: usize, out: &mut [i32]) {
    let rows = out.len();
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_si256(); ROWS];
    let blocks = k / 32;
    for b in 0..blocks {
        let wv = _mm256_loadu_si256(w.as_ptr().add(b * 32) as *const _);
        let magnitude = _mm256_abs_epi8(wv); // -128 becomes 128 as an unsigned byte
        for (t, a) in acc.iter_mut().enumerate().take(rows) {
            let xv = _mm256_loadu_si256(xq.as_ptr().add(t * k + b * 32) as *const _);
            let signed = _mm256_sign_epi8(xv, wv); // x · sign(w), 0 where w is 0
            let pairs = _mm256_maddubs_epi16(magnitude, signed);
            *a = _mm256_add_epi32(*a, _mm256_madd_epi16(pairs, ones));
        }
    }
    for (t, o) in out.iter_mut().enumerate() {
        let mut lanes = [0i32; 8];
        _mm256_storeu_si256(lanes.as_mut_ptr() as *mut _, acc[t]);
        let mut sum: i32 = lanes.iter().sum();
        for i in blocks * 32..k {
            sum += xq[t * k + i] as i32 * w[i] as i32;
        }
        *o = sum;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integer_dots_are_exact_for_every_weight_byte() {
        if !is_x86_feature_detected!("avx2") {
            eprintln!("AVX2 not available on this CPU: the AVX2 int8 kernel is not used here");
            return;
        }
        // k not a multiple of 32 (a tail), m not of the chunk; weights cover -128..=127 and
        // activations reach ±127, the extremes of the 16-bit pair sums.
        let (n, k, m) = (6, 100, 70);
        let mut x: Vec<f32> = (0..n * k).map(|i| ((i * 37 % 101) as f32 - 50.0) / 37.0).collect();
        x[3] = -50.0;
        let q: Vec<i8> = (0..m * k).map(|i| ((i * 53 % 256) as i32 - 128) as i8).collect();
        assert!(q.contains(&-128) && q.contains(&127));
        let scales: Vec<f32> = (0..m).map(|j| 0.01 + j as f32 * 1e-3).collect();
        let y = matmul(&CpuTensor::new(x.clone(), n, k), &q, &scales, m);
        for t in 0..n {
            let row = &x[t * k..(t + 1) * k];
            let s = row.iter().fold(0f32, |a, v| a.max(v.abs())) / 127.0;
            let inv = 1.0 / s;
            for j in 0..m {
                let exact: i64 = (0..k)
                    .map(|i| (row[i] * inv).round().clamp(-127.0, 127.0) as i64 * q[j * k + i] as i64)
                    .sum();
                let want = exact as f64 * s as f64 * scales[j] as f64;
                let got = y.data[t * m + j] as f64;
                assert!((got - want).abs() < 1e-4 * (1.0 + want.abs()), "({t},{j}): {got} vs {want}");
            }
        }
    }
}
