//! int8 × int8 decode matmul with AVX512-VNNI (`vpdpbusd`), for `--quantize int8`.
//!
//! Widening int8 weights to f32 costs more instructions than the bytes it saves, so at
//! batch 1 it is compute-bound. Instead, as llama.cpp does for q8_0, each activation row is
//! quantized to int8 too (one scale per row) and the dot products run in integers:
//! `vpdpbusd` multiplies 64 unsigned × signed byte pairs per instruction. It needs the
//! activations unsigned, so they are stored as `x + 128`, and `128 · Σw` (per weight row,
//! computed at load) is subtracted from each sum.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use rayon::prelude::*;

use super::amx::{self, Activations, Op, PanelSource, Panels, Tiles, BLOCK, STEP_BYTES};
use super::CpuTensor;

/// Output rows per rayon task.
const CHUNK: usize = 32;

pub fn available() -> bool {
    use std::sync::OnceLock;
    static HAS: OnceLock<bool> = OnceLock::new();
    super::simd::available()
        && *HAS.get_or_init(|| is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512bw"))
}

/// Σ of each weight row's int8 values (for the unsigned-activation correction).
pub fn row_sums(q: &[i8], k: usize) -> Vec<i32> {
    q.chunks(k.max(1)).map(|r| r.iter().map(|&v| v as i32).sum()).collect()
}

/// Activation rows quantized symmetrically per row, `q = round(x / s)` in -127..=127 with
/// `s = max |x| / 127`, each stored as `store(q)`: the int8 decode kernels' inputs (as
/// bytes `q + 128` here, as `i8` in [`super::int8_avx2`]).
pub(super) fn quantize_rows<T: Copy + Default + Send>(
    x: &CpuTensor,
    store: impl Fn(i32) -> T + Sync,
) -> (Vec<T>, Vec<f32>) {
    let k = x.cols.max(1);
    let mut xq = vec![T::default(); x.rows * x.cols];
    let mut scales = vec![0f32; x.rows];
    xq.par_chunks_mut(k).zip(scales.par_iter_mut()).zip(x.data.par_chunks(k)).for_each(|((dst, s), src)| {
        let max = src.iter().fold(0f32, |m, v| m.max(v.abs()));
        *s = if max > 0.0 { max / 127.0 } else { 1.0 };
        let inv = 1.0 / *s;
        for (d, v) in dst.iter_mut().zip(src) {
            *d = store((v * inv).round().clamp(-127.0, 127.0) as i32);
        }
    });
    (xq, scales)
}

/// `y = x · wᵀ` for `w ≈ q · scales` (per output row), `x` quantized per row.
pub fn matmul(x: &CpuTensor, q: &[i8], scales: &[f32], sums: &[i32], m: usize) -> CpuTensor {
    assert!(available(), "the int8 decode kernel needs AVX512-VNNI");
    let (n, k) = (x.rows, x.cols);
    let (xu, xs) = quantize_rows(x, |q| (q + 128) as u8);
    let mut out_t = vec![0f32; m * n];
    out_t.par_chunks_mut(CHUNK * n).enumerate().for_each(|(c, out)| {
        let mut acc = [0i32; 8];
        for (jj, out_row) in out.chunks_mut(n).enumerate() {
            let j = c * CHUNK + jj;
            let w = &q[j * k..(j + 1) * k];
            for (g, out_g) in out_row.chunks_mut(8).enumerate() {
                let rows = out_g.len();
                // SAFETY: AVX512-VNNI and BW are available (asserted); `w` holds k bytes and
                // `xu` holds `rows` rows of k from row g·8.
                unsafe { dot_rows(w, &xu[g * 8 * k..], k, &mut acc[..rows]) };
                for (t, o) in out_g.iter_mut().enumerate() {
                    let exact = acc[t] - 128 * sums[j];
                    *o = exact as f32 * xs[g * 8 + t] * scales[j];
                }
            }
        }
    });
    super::matmul::from_transposed(out_t, n, m)
}

/// `y = x · wᵀ` for `w ≈ q · scales` on matrix tiles (AMX-INT8, or their model in tests):
/// activations quantized per row as for the decode kernels (kept signed: `tdpbssd` takes
/// both operands signed), integer sums, the same scaling. `q` stays in rows; the tiles'
/// driver packs quad panels from them task by task.
pub fn matmul_tiles<T: Tiles + ?Sized>(
    tiles: &T,
    x: &CpuTensor,
    q: &[i8],
    scales: &[f32],
    m: usize,
) -> CpuTensor {
    let (n, k) = (x.rows, x.cols);
    let kp = k.div_ceil(STEP_BYTES) * STEP_BYTES;
    let (xq, xs) = quantize_rows(x, |q| q as i8);
    let acts = Activations::new(n, kp / 4, |r, out| {
        for (o, values) in out.iter_mut().zip(xq[r * k..(r + 1) * k].chunks(4)) {
            *o = amx::quad(values);
        }
    });
    let panels = Panels {
        source: PanelSource::Int8Rows { q, m, k },
        count: m.div_ceil(BLOCK),
        steps: kp / STEP_BYTES,
    };
    let y =
        amx::gemm_rows(tiles, Op::Int8, &acts, &panels, m, |t, j, acc| acc as i32 as f32 * xs[t] * scales[j]);
    CpuTensor::new(y, n, m)
}

/// `out[t] = Σ_i xu[t·k + i] · w[i]` for `t < out.len()` (at most 8).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn dot_rows(w: &[i8], xu: &[u8], k: usize, out: &mut [i32]) {
    let rows = out.len();
    let mut acc = [_mm512_setzero_si512(); 8];
    let blocks = k / 64;
    for b in 0..blocks {
        let wv = _mm512_loadu_si512(w.as_ptr().add(b * 64) as *const _);
        for (t, a) in acc.iter_mut().enumerate().take(rows) {
            let xv = _mm512_loadu_si512(xu.as_ptr().add(t * k + b * 64) as *const _);
            *a = _mm512_dpbusd_epi32(*a, xv, wv);
        }
    }
    for (t, o) in out.iter_mut().enumerate() {
        let mut sum = _mm512_reduce_add_epi32(acc[t]);
        for i in blocks * 64..k {
            sum += xu[t * k + i] as i32 * w[i] as i32;
        }
        *o = sum;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiles_sum_the_same_quantized_products_as_the_decode_kernels() {
        // Two blocks of rows with a partial one, k with a tail past whole steps, a partial
        // last panel.
        let (n, k, m) = (37, 200, 70);
        let x: Vec<f32> = (0..n * k).map(|i| ((i * 37 % 101) as f32 - 50.0) / 37.0).collect();
        let q: Vec<i8> = (0..m * k).map(|i| ((i * 53 % 255) as i32 - 127) as i8).collect();
        let scales: Vec<f32> = (0..m).map(|j| 0.01 + j as f32 * 1e-3).collect();
        let x = CpuTensor::new(x, n, k);
        let y = matmul_tiles(&amx::Sim, &x, &q, &scales, m);
        for t in 0..n {
            let row = &x.data[t * k..(t + 1) * k];
            let s = row.iter().fold(0f32, |a, v| a.max(v.abs())) / 127.0;
            for j in 0..m {
                let exact: i32 =
                    (0..k).map(|i| (row[i] * (1.0 / s)).round() as i32 * q[j * k + i] as i32).sum();
                assert_eq!(y.data[t * m + j], exact as f32 * s * scales[j], "({t},{j})");
            }
        }
        // The decode kernels this host has give the very same numbers on these rows.
        let first = CpuTensor::new(x.data[..8 * k].to_vec(), 8, k);
        let decode = if available() {
            Some(matmul(&first, &q, &scales, &row_sums(&q, k), m))
        } else if is_x86_feature_detected!("avx2") {
            Some(super::super::int8_avx2::matmul(&first, &q, &scales, m))
        } else {
            None
        };
        if let Some(d) = decode {
            assert_eq!(d.data, y.data[..8 * m].to_vec());
        }
        if let Some(tiles) = amx::Amx::enabled_int8() {
            assert_eq!(
                matmul_tiles(&tiles, &x, &q, &scales, m).data,
                y.data,
                "the CPU's tiles vs their model"
            );
        }
    }

    #[test]
    fn integer_dots_match_the_dequantized_product() {
        if !available() {
            eprintln!("AVX512-VNNI not available on this CPU: the int8 decode kernel is not used here");
            return;
        }
        let (n, k, m) = (5, 200, 70); // k not a multiple of 64 (tail), m not of the chunk
        let x: Vec<f32> = (0..n * k).map(|i| ((i * 37 % 101) as f32 - 50.0) / 37.0).collect();
        let q: Vec<i8> = (0..m * k).map(|i| ((i * 53 % 255) as i32 - 127) as i8).collect();
        let scales: Vec<f32> = (0..m).map(|j| 0.01 + j as f32 * 1e-3).collect();
        let y = matmul(&CpuTensor::new(x.clone(), n, k), &q, &scales, &row_sums(&q, k), m);
        for t in 0..n {
            let row = &x[t * k..(t + 1) * k];
            let s = row.iter().fold(0f32, |a, v| a.max(v.abs())) / 127.0;
            let inv = 1.0 / s;
            for j in 0..m {
                // The same quantized activations, dequantized: the integer path must be exact.
                let want: f64 = (0..k)
                    .map(|i| {
                        (row[i] * inv).round() as f64 * s as f64 * q[j * k + i] as f64 * scales[j] as f64
                    })
                    .sum();
                let got = y.data[t * m + j] as f64;
                assert!((got - want).abs() < 1e-3 * (1.0 + want.abs()), "({t},{j}): {got} vs {want}");
            }
        }
    }
}
