//! Elementwise math in vectors: `exp`, SiLU and the softmax normaliser of a logits row.
//!
//! Each entry point runs its vector loop on AVX-512 or AVX2 + FMA, whichever the CPU has
//! ([`super::simd::level`]), and the same arithmetic with the library's `exp` elsewhere;
//! results differ between them by f32 rounding only (`exp` within 2 ulp).

#![cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// `out[i] = silu(gate[i]) · up[i]`, `silu(g) = g / (1 + e^-g)`.
pub fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert!(gate.len() == up.len() && up.len() == out.len(), "silu_mul: lengths differ");
    let mut main = 0;
    #[cfg(target_arch = "x86_64")]
    if super::simd::available() {
        main = gate.len() / 16 * 16;
        // SAFETY: AVX-512 is available; the three slices hold `main` elements.
        unsafe { silu_mul_avx512(&gate[..main], &up[..main], &mut out[..main]) };
    } else if super::simd::level() == super::simd::Level::Avx2 {
        main = gate.len() / 8 * 8;
        // SAFETY: AVX2 and FMA are available; the three slices hold `main` elements.
        unsafe { silu_mul_avx2(&gate[..main], &up[..main], &mut out[..main]) };
    }
    for ((o, &g), &u) in out[main..].iter_mut().zip(&gate[main..]).zip(&up[main..]) {
        *o = g / (1.0 + (-g).exp()) * u;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
unsafe fn silu_mul_avx512(gate: &[f32], up: &[f32], out: &mut [f32]) {
    let one = _mm512_set1_ps(1.0);
    for ((g, u), o) in gate.chunks_exact(16).zip(up.chunks_exact(16)).zip(out.chunks_exact_mut(16)) {
        let g = _mm512_loadu_ps(g.as_ptr());
        let e = exp(_mm512_sub_ps(_mm512_setzero_ps(), g));
        let s = _mm512_div_ps(g, _mm512_add_ps(one, e));
        _mm512_storeu_ps(o.as_mut_ptr(), _mm512_mul_ps(s, _mm512_loadu_ps(u.as_ptr())));
    }
}

/// `out[i] = gelu(gate[i]) · up[i]`, GELU in its tanh form (`gelu_pytorch_tanh`) in the
/// order PyTorch computes it.
pub fn gelu_tanh_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert!(gate.len() == up.len() && up.len() == out.len(), "gelu_tanh_mul: lengths differ");
    const BETA: f32 = 0.797_884_6; // √(2/π)
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        let inner = BETA * (g + 0.044715 * (g * g * g));
        *o = 0.5 * g * (1.0 + inner.tanh()) * u;
    }
}

/// gpt-oss's clamped SwiGLU: with `g = min(gate, limit)` and `u = clamp(up, ±limit)`,
/// `out = (u + 1) · g · sigmoid(alpha · g)`, in the order transformers computes it.
pub fn clamped_swiglu_mul(gate: &[f32], up: &[f32], out: &mut [f32], alpha: f32, limit: f32) {
    assert!(gate.len() == up.len() && up.len() == out.len(), "clamped_swiglu_mul: lengths differ");
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        let g = g.min(limit);
        let u = u.clamp(-limit, limit);
        let glu = g * (1.0 / (1.0 + (-(g * alpha)).exp()));
        *o = (u + 1.0) * glu;
    }
}

/// `Σ e^(x[i] - max)`, summed in f64 (a vocabulary-sized row loses nothing to the sum).
pub fn sum_exp(x: &[f32], max: f32) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if super::simd::available() {
        // SAFETY: AVX-512 is available.
        return unsafe { sum_exp_avx512(x, max) };
    }
    #[cfg(target_arch = "x86_64")]
    if super::simd::level() == super::simd::Level::Avx2 {
        // SAFETY: AVX2 and FMA are available.
        return unsafe { sum_exp_avx2(x, max) };
    }
    x.iter().map(|&l| ((l - max) as f64).exp()).sum()
}

/// `x[i] = e^(x[i] - max)` in place; returns their sum, in f32 lanes (a softmax row of
/// attention scores, every term ≤ 1 when `max` is the row's maximum).
pub fn exp_sub_in_place(x: &mut [f32], max: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if super::simd::available() {
        // SAFETY: AVX-512 is available.
        return unsafe { exp_sub_avx512(x, max) };
    }
    #[cfg(target_arch = "x86_64")]
    if super::simd::level() == super::simd::Level::Avx2 {
        // SAFETY: AVX2 and FMA are available.
        return unsafe { exp_sub_avx2(x, max) };
    }
    exp_sub_scalar(x, max)
}

fn exp_sub_scalar(x: &mut [f32], max: f32) -> f32 {
    let mut total = 0.0;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        total += *v;
    }
    total
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
unsafe fn exp_sub_avx512(x: &mut [f32], max: f32) -> f32 {
    let m = _mm512_set1_ps(max);
    let mut acc = _mm512_setzero_ps();
    let mut chunks = x.chunks_exact_mut(16);
    for v in &mut chunks {
        let e = exp(_mm512_sub_ps(_mm512_loadu_ps(v.as_ptr()), m));
        _mm512_storeu_ps(v.as_mut_ptr(), e);
        acc = _mm512_add_ps(acc, e);
    }
    _mm512_reduce_add_ps(acc) + exp_sub_scalar(chunks.into_remainder(), max)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp_sub_avx2(x: &mut [f32], max: f32) -> f32 {
    let m = _mm256_set1_ps(max);
    let mut acc = _mm256_setzero_ps();
    let mut chunks = x.chunks_exact_mut(8);
    for v in &mut chunks {
        let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(v.as_ptr()), m));
        _mm256_storeu_ps(v.as_mut_ptr(), e);
        acc = _mm256_add_ps(acc, e);
    }
    let mut lanes = [0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), acc);
    lanes.iter().sum::<f32>() + exp_sub_scalar(chunks.into_remainder(), max)
}

/// Blocks of 256 values are summed in f32 lanes (16 terms each, all ≤ 1 when `max` is
/// the row's maximum), the blocks in f64.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
unsafe fn sum_exp_avx512(x: &[f32], max: f32) -> f64 {
    let m = _mm512_set1_ps(max);
    let mut total = 0f64;
    let mut blocks = x.chunks_exact(256);
    for block in &mut blocks {
        let mut acc = _mm512_setzero_ps();
        for v in block.chunks_exact(16) {
            acc = _mm512_add_ps(acc, exp(_mm512_sub_ps(_mm512_loadu_ps(v.as_ptr()), m)));
        }
        total += _mm512_reduce_add_ps(acc) as f64;
    }
    total + blocks.remainder().iter().map(|&l| ((l - max) as f64).exp()).sum::<f64>()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn silu_mul_avx2(gate: &[f32], up: &[f32], out: &mut [f32]) {
    let one = _mm256_set1_ps(1.0);
    for ((g, u), o) in gate.chunks_exact(8).zip(up.chunks_exact(8)).zip(out.chunks_exact_mut(8)) {
        let g = _mm256_loadu_ps(g.as_ptr());
        let e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
        let s = _mm256_div_ps(g, _mm256_add_ps(one, e));
        _mm256_storeu_ps(o.as_mut_ptr(), _mm256_mul_ps(s, _mm256_loadu_ps(u.as_ptr())));
    }
}

/// As [`sum_exp_avx512`], 8 lanes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn sum_exp_avx2(x: &[f32], max: f32) -> f64 {
    let m = _mm256_set1_ps(max);
    let mut total = 0f64;
    let mut blocks = x.chunks_exact(128);
    for block in &mut blocks {
        let mut acc = _mm256_setzero_ps();
        for v in block.chunks_exact(8) {
            acc = _mm256_add_ps(acc, exp8(_mm256_sub_ps(_mm256_loadu_ps(v.as_ptr()), m)));
        }
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), acc);
        total += lanes.iter().map(|&l| l as f64).sum::<f64>();
    }
    total + blocks.remainder().iter().map(|&l| ((l - max) as f64).exp()).sum::<f64>()
}

/// [`exp`] on 8 lanes (AVX2 has no `scalef`: `2^n` is built in the exponent bits, so `x`
/// is kept to where `2^n` is a normal float): below -87.3 gives 0, above 88.3 gives
/// infinity (the library's result there is a denormal, or finite up to 88.72 — nothing
/// SiLU or a softmax can tell apart); NaN stays NaN.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma")]
pub unsafe fn exp8(x: __m256) -> __m256 {
    let (lo, hi) = (_mm256_set1_ps(-87.3), _mm256_set1_ps(88.3));
    let c = _mm256_min_ps(hi, _mm256_max_ps(lo, x));
    let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        c,
        _mm256_set1_ps(std::f32::consts::LOG2_E),
    ));
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), c);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
    let mut p = _mm256_set1_ps(1.0 / 5040.0);
    for k in [1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(k));
    }
    let pow2n = _mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)));
    let y = _mm256_mul_ps(p, _mm256_castsi256_ps(pow2n));
    let y = _mm256_blendv_ps(y, _mm256_setzero_ps(), _mm256_cmp_ps::<_CMP_LT_OQ>(x, lo));
    let y = _mm256_blendv_ps(y, _mm256_set1_ps(f32::INFINITY), _mm256_cmp_ps::<_CMP_GT_OQ>(x, hi));
    // NaN lanes: the clamps above made them finite.
    _mm256_blendv_ps(y, x, _mm256_cmp_ps::<_CMP_UNORD_Q>(x, x))
}

/// `e^x` per lane: `2^n · e^r` with `n = round(x / ln 2)`, `|r| ≤ ln 2 / 2`, `e^r` by its
/// Taylor polynomial to degree 7 (relative error under 1e-8 before rounding). `-inf` and
/// anything below -104 give 0; NaN stays NaN.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f,fma")]
pub unsafe fn exp(x: __m512) -> __m512 {
    let x = _mm512_max_ps(_mm512_set1_ps(-104.0), x);
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(
        x,
        _mm512_set1_ps(std::f32::consts::LOG2_E),
    ));
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693_359_4), x);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.121_944_4e-4), r);
    let mut p = _mm512_set1_ps(1.0 / 5040.0);
    for c in [1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    }
    _mm512_scalef_ps(p, n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_softmax_row_exponentiates_in_place_and_sums() {
        // 37 values: whole vectors and a remainder on every kernel level.
        let row: Vec<f32> = (0..37).map(|i| (i as f32 * 0.37).sin() * 9.0).collect();
        let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        let mut got = row.clone();
        let total = exp_sub_in_place(&mut got, max);
        let want: Vec<f32> = row.iter().map(|v| (v - max).exp()).collect();
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() <= 1e-6 * w.max(1e-30), "{g} against {w}");
        }
        assert!((total - want.iter().sum::<f32>()).abs() < 1e-5, "sum {total}");
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn exp_matches_the_library_within_two_ulp() {
        if !super::super::simd::available() {
            return;
        }
        let mut xs: Vec<f32> = (-2000..=1000).map(|i| i as f32 * 0.0517).collect();
        xs.extend([0.0, -0.0, 1e-8, -1e-8, -87.0, -103.0, 88.0]);
        for chunk in xs.chunks(16) {
            let mut lanes = [0f32; 16];
            lanes[..chunk.len()].copy_from_slice(chunk);
            let mut got = [0f32; 16];
            // SAFETY: AVX-512 is available (checked above).
            unsafe { _mm512_storeu_ps(got.as_mut_ptr(), exp(_mm512_loadu_ps(lanes.as_ptr()))) };
            for (&x, &y) in lanes.iter().zip(&got) {
                let want = x.exp();
                let ulp = (want.to_bits() as i64 - y.to_bits() as i64).abs();
                assert!(ulp <= 2 || (want - y).abs() < 1e-37, "exp({x}) = {y}, library {want}");
            }
        }
        let mut lanes = [f32::NEG_INFINITY; 16];
        lanes[1] = f32::NAN;
        lanes[2] = -1000.0;
        let mut got = [0f32; 16];
        // SAFETY: as above.
        unsafe { _mm512_storeu_ps(got.as_mut_ptr(), exp(_mm512_loadu_ps(lanes.as_ptr()))) };
        assert_eq!((got[0], got[2]), (0.0, 0.0));
        assert!(got[1].is_nan());
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn exp8_matches_the_library_within_two_ulp() {
        if super::super::simd::level() < super::super::simd::Level::Avx2 {
            return;
        }
        let mut xs: Vec<f32> = (-1700..=1700).map(|i| i as f32 * 0.0517).collect();
        xs.extend([
            0.0,
            -0.0,
            1e-8,
            -1e-8,
            -87.0,
            88.0,
            -1000.0,
            1000.0,
            f32::NEG_INFINITY,
            f32::INFINITY,
            f32::NAN,
        ]);
        for chunk in xs.chunks(8) {
            let mut lanes = [0f32; 8];
            lanes[..chunk.len()].copy_from_slice(chunk);
            let mut got = [0f32; 8];
            // SAFETY: AVX2 and FMA are available (checked above).
            unsafe { _mm256_storeu_ps(got.as_mut_ptr(), exp8(_mm256_loadu_ps(lanes.as_ptr()))) };
            for (&x, &y) in lanes.iter().zip(&got) {
                let want = x.exp();
                let ulp = (want.to_bits() as i64 - y.to_bits() as i64).abs();
                let same = ulp <= 2 || (want - y).abs() < 1e-37 || (want.is_nan() && y.is_nan());
                assert!(same, "exp8({x}) = {y}, library {want}");
            }
        }
    }

    #[test]
    fn silu_and_softmax_sums_match_the_library() {
        let g: Vec<f32> = (0..1000).map(|i| (i as f32 - 500.0) * 0.037).collect();
        let u: Vec<f32> = (0..1000).map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.5).collect();
        let mut out = vec![0f32; g.len()];
        silu_mul(&g, &u, &mut out);
        for ((&g, &u), &o) in g.iter().zip(&u).zip(&out) {
            let want = g / (1.0 + (-g).exp()) * u;
            assert!(
                (o - want).abs() <= 4.0 * f32::EPSILON * want.abs().max(1e-30),
                "silu({g})·{u} = {o}, want {want}"
            );
        }
        let row: Vec<f32> = (0..128_256).map(|i| ((i * 7919 % 10007) as f32) * 1e-3 - 5.0).collect();
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let want: f64 = row.iter().map(|&l| ((l - max) as f64).exp()).sum();
        let got = sum_exp(&row, max);
        assert!((got - want).abs() < 1e-6 * want, "{got} vs {want}");
        assert_eq!(sum_exp(&[], 0.0), 0.0);
    }
}
