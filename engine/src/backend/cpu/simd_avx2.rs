//! AVX2 + FMA kernels for the decode matmul, for CPUs without AVX-512.
//!
//! The same shapes as the AVX-512 kernels in [`super::simd`], at 8 lanes and within 16
//! vector registers: a weight row is loaded 32 elements at a time, widened to f32 in
//! registers (bf16: a 16-bit shift; f16: `vcvtph2ps`; int8: sign extension), and
//! multiplied into up to 2 activation rows with four accumulators each. Decode runs
//! register tiles of 4 weight rows × up to 2 activation rows (8 accumulators): with several
//! activation rows the tile runs at FMA speed rather than at the speed of reloading
//! weights, and with one the four weight rows are four streams read side by side, which
//! the memory system serves faster than one (batch-1 decode of the 1B shape on an AVX2
//! host: 10.3 -> 11-14 tok/s). Callers check [`super::simd::level`] first.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use half::{bf16, f16};

use super::matmul::Widen;

/// Element types that widen 8 at a time into an AVX2 register.
pub trait Load8: Copy {
    /// # Safety
    /// `p` must point at 8 readable elements; the CPU must support AVX2 and F16C.
    unsafe fn load8(p: *const Self) -> __m256;
}

impl Load8 for f32 {
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> __m256 {
        _mm256_loadu_ps(p)
    }
}

impl Load8 for bf16 {
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> __m256 {
        let h = _mm_loadu_si128(p as *const __m128i);
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
    }
}

impl Load8 for f16 {
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    }
}

impl Load8 for i8 {
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> __m256 {
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p as *const __m128i)))
    }
}

/// The sum of a register's 8 lanes.
#[inline(always)]
unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps::<1>(s, s)))
}

/// `out[t] = dot(w, x[t*k..(t+1)*k])` for `t < out.len()` (at most [`DOT_ROWS`]).
///
/// # Safety
/// AVX2, FMA and F16C must be available; `w.len() == k`, `x.len() >= out.len() * k`.
pub unsafe fn dot_rows<T: Load8 + Widen>(w: &[T], x: &[f32], k: usize, out: &mut [f32]) {
    match out.len() {
        1 => dot_rows_n::<T, 1>(w, x, k, out),
        2 => dot_rows_n::<T, 2>(w, x, k, out),
        n => panic!("dot_rows takes at most {DOT_ROWS} rows, got {n}"),
    }
}

/// Activation rows per [`dot_rows`] call: with four accumulators each (so FMA latency
/// never limits the stream) and four weight vectors, two rows fill the 16 registers.
pub const DOT_ROWS: usize = 2;

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_rows_n<T: Load8 + Widen, const N: usize>(w: &[T], x: &[f32], k: usize, out: &mut [f32]) {
    let mut acc = [[_mm256_setzero_ps(); 4]; N];
    let (wp, xp) = (w.as_ptr(), x.as_ptr());
    let main = k / 32 * 32;
    let mut i = 0;
    while i < main {
        let wv: [__m256; 4] = std::array::from_fn(|c| T::load8(wp.add(i + 8 * c)));
        for (t, acc) in acc.iter_mut().enumerate() {
            for (c, a) in acc.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(wv[c], _mm256_loadu_ps(xp.add(t * k + i + 8 * c)), *a);
            }
        }
        i += 32;
    }
    for (t, a) in acc.iter().enumerate() {
        let mut s = hsum(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3])));
        for j in main..k {
            s += w[j].f32() * x[t * k + j];
        }
        out[t] = s;
    }
}

/// `out[t * ts + r * rs] = dot(x[t], w[r])` for `t < N` activation rows and `r < 4`
/// weight rows.
// Index loops are the point here: `t` and `r` address registers, rows and strides at once.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_n4<T: Load8 + Widen, const N: usize>(
    w: [&[T]; 4],
    x: &[f32],
    k: usize,
    out: &mut [f32],
    (ts, rs): (usize, usize),
) {
    let mut acc = [[_mm256_setzero_ps(); 4]; N];
    let main = k / 8 * 8;
    let xp = x.as_ptr();
    let mut i = 0;
    while i < main {
        let xv: [__m256; N] = std::array::from_fn(|t| _mm256_loadu_ps(xp.add(t * k + i)));
        for r in 0..4 {
            let wv = T::load8(w[r].as_ptr().add(i));
            for t in 0..N {
                acc[t][r] = _mm256_fmadd_ps(wv, xv[t], acc[t][r]);
            }
        }
        i += 8;
    }
    for t in 0..N {
        for r in 0..4 {
            let mut s = hsum(acc[t][r]);
            for j in main..k {
                s += w[r][j].f32() * x[t * k + j];
            }
            out[t * ts + r * rs] = s;
        }
    }
}

/// `out[t * ts + r * rs] = dot(x[t], w[r])` for every row `t` of `x` (`rows` of them) and
/// the 4 weight rows, in register tiles of 2 activation rows.
///
/// # Safety
/// AVX2, FMA and F16C must be available; each `w[r]` holds `k` elements; `x` holds `rows`
/// rows of `k`; `out` holds every index written.
pub unsafe fn rows_by_4<T: Load8 + Widen>(
    w: [&[T]; 4],
    x: &[f32],
    rows: usize,
    k: usize,
    out: &mut [f32],
    strides: (usize, usize),
) {
    let mut t = 0;
    while t < rows {
        let (xt, o) = (&x[t * k..], &mut out[t * strides.0..]);
        if rows - t >= 2 {
            tile_n4::<T, 2>(w, xt, k, o, strides);
            t += 2;
        } else {
            tile_n4::<T, 1>(w, xt, k, o, strides);
            t += 1;
        }
    }
}

/// Widens `src` into `dst` with AVX2 enabled (the loop vectorizes 8 wide).
///
/// # Safety
/// AVX2, FMA and F16C must be available.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn widen<T: Widen>(src: &[T], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = s.f32();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference<T: Widen>(w: &[T], x: &[f32]) -> f32 {
        w.iter().zip(x).map(|(a, b)| a.f32() as f64 * *b as f64).sum::<f64>() as f32
    }

    fn check<T: Load8 + Widen>(make: impl Fn(f32) -> T) {
        // k not a multiple of 32 (a scalar tail), 4 weight rows, 5 activation rows.
        let k = 77;
        let w: Vec<Vec<T>> = (0..4)
            .map(|r| (0..k).map(|i| make(((i * 7 + r * 3) % 11) as f32 / 4.0 - 1.0)).collect())
            .collect();
        let x: Vec<f32> = (0..5 * k).map(|i| ((i * 5) % 13) as f32 / 8.0 - 0.75).collect();
        let want = |t: usize, r: usize| reference(&w[r], &x[t * k..(t + 1) * k]);
        for n in 1..=DOT_ROWS {
            let mut out = vec![0f32; n];
            // SAFETY: the caller checked AVX2; shapes as documented.
            unsafe { dot_rows(&w[1], &x, k, &mut out) };
            for (t, o) in out.iter().enumerate() {
                assert!((o - want(t, 1)).abs() < 1e-4, "dot_rows n={n} row {t}: {o} vs {}", want(t, 1));
            }
        }
        let mut out = vec![0f32; 5 * 4];
        // SAFETY: as above; out is [t][r] with strides (4, 1).
        unsafe { rows_by_4([&w[0], &w[1], &w[2], &w[3]], &x, 5, k, &mut out, (4, 1)) };
        for t in 0..5 {
            for r in 0..4 {
                assert!((out[t * 4 + r] - want(t, r)).abs() < 1e-4, "tile ({t}, {r})");
            }
        }
    }

    #[test]
    fn avx2_kernels_match_the_reference_for_every_weight_type() {
        if !(is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c"))
        {
            return;
        }
        check(|v| v);
        check(bf16::from_f32);
        check(f16::from_f32);
        check(|v| (v * 4.0) as i8);
    }
}
