//! bf16 × bf16 GEMM with AVX512-BF16 (`vdpbf16ps`): the compute of a bf16 model.
//!
//! `vdpbf16ps` multiplies pairs of bf16 values and accumulates in f32, twice the work per
//! instruction of an f32 FMA. It needs both operands in bf16, so activations are rounded
//! to bf16 (round-to-nearest-even), as HF transformers and vLLM do when they run a bf16
//! model. It runs every matmul of bf16 weights unless `--dtype f32` asks for the exact
//! f32 path; a CPU without AVX512-BF16 runs the f32 path instead (more precise, slower).
//!
//! Layout: activations are converted once per matmul into bf16 pairs in blocks of 8 rows
//! (k padded to a multiple of 32; 32 at a time on AVX-512). Weights are packed **once, at
//! load** ([`PackedBf16`]) into panels of 32 output rows on huge pages ([`super::huge`]) in pair-interleaved order
//! (`[k/2][32]` u32 pairs, so one 512-bit load holds one k-pair of 16 output columns) —
//! the packed copy replaces the row-major one, so memory stays one checkpoint. A matmul
//! runs 8 × 32 register tiles straight from the panels: per k-pair, 2 weight loads, 8
//! broadcasts and 16 `vdpbf16ps`. Decode rows (1–8) use the same tiles and read each
//! panel once, in order: bandwidth-bound as it should be.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use half::bf16;
use rayon::prelude::*;

use super::amx::{self, Activations, Op, PanelSource, Panels, Tiles};
use super::huge::HugeVec;
use super::{CpuTensor, SendPtr};

const NR: usize = 32;

pub fn available() -> bool {
    use std::sync::OnceLock;
    static HAS: OnceLock<bool> = OnceLock::new();
    super::simd::available() && *HAS.get_or_init(|| is_x86_feature_detected!("avx512bf16"))
}

/// A `[m, k]` bf16 weight packed into panels of [`NR`] rows for the tile kernel.
pub struct PackedBf16 {
    /// `m.div_ceil(NR)` panels of `kp / 2 × NR` u32 pairs.
    panels: HugeVec<u32>,
    m: usize,
    k: usize,
    kp: usize,
}

impl PackedBf16 {
    /// Packs row-major `w` (`[m, k]`), in parallel over panels.
    pub fn pack(w: &[bf16], m: usize, k: usize) -> Self {
        let kp = k.div_ceil(32) * 32;
        let panel = kp / 2 * NR;
        let mut panels = HugeVec::<u32>::zeroed(m.div_ceil(NR) * panel);
        panels.par_chunks_mut(panel).enumerate().for_each(|(p, out)| {
            let j0 = p * NR;
            for j in 0..NR.min(m - j0) {
                let row = &w[(j0 + j) * k..(j0 + j + 1) * k];
                for (i, pair) in row.chunks(2).enumerate() {
                    let lo = pair[0].to_bits() as u32;
                    let hi = pair.get(1).map_or(0, |v| v.to_bits() as u32);
                    out[i * NR + j] = lo | (hi << 16);
                }
            }
        });
        PackedBf16 { panels, m, k, kp }
    }

    pub fn bytes(&self) -> usize {
        self.panels.len() * 4
    }

    /// Row `r` widened to f32 (embedding lookups of a packed table).
    pub fn row_to_f32(&self, r: usize, out: &mut [f32]) {
        let panel = &self.panels[(r / NR) * (self.kp / 2 * NR)..];
        let j = r % NR;
        for (i, o) in out[..self.k].iter_mut().enumerate() {
            let pair = panel[(i / 2) * NR + j];
            let bits = if i % 2 == 0 { pair & 0xffff } else { pair >> 16 };
            *o = f32::from_bits(bits << 16);
        }
    }
}

/// Activation rows from which a matmul runs on the AMX tiles where the CPU has them: below,
/// the AVX512-BF16 tiles read each panel once per 8 rows from L1/L2 and keep up.
pub const AMX_MIN_ROWS: usize = 16;

/// `x · wᵀ` with `w` packed at load, activations rounded to bf16.
pub fn matmul_packed(x: &CpuTensor, w: &PackedBf16) -> CpuTensor {
    assert!(available(), "bf16 GEMM needs AVX512-BF16");
    assert_eq!(x.cols, w.k, "matmul: x has {} columns, weight has {}", x.cols, w.k);
    if x.rows >= AMX_MIN_ROWS {
        if let Some(tiles) = amx::matrix_engine() {
            return matmul_tiles(tiles, x, w);
        }
    }
    matmul_vector(x, w)
}

/// `x · wᵀ` on the AVX512-BF16 register tiles, whatever the row count.
fn matmul_vector(x: &CpuTensor, w: &PackedBf16) -> CpuTensor {
    let (n, k, kp, m) = (x.rows, w.k, w.kp, w.m);
    let xb = activations(x, k, kp);
    let mut y = vec![0f32; n * m];
    let y_ptr = SendPtr(y.as_mut_ptr());
    let panel = kp / 2 * NR;
    (0..m.div_ceil(NR)).into_par_iter().for_each(|p| {
        let j0 = p * NR;
        let cols = NR.min(m - j0);
        let packed = &w.panels[p * panel..(p + 1) * panel];
        run_tiles(&xb, n, kp, packed, &y_ptr, m, j0, cols);
    });
    CpuTensor::new(y, n, m)
}

/// `x · wᵀ` on matrix tiles (the CPU's, or their model in tests): the same panels, the
/// same bf16 rounding of the activations, f32 accumulation.
pub(super) fn matmul_tiles<T: Tiles + ?Sized>(tiles: &T, x: &CpuTensor, w: &PackedBf16) -> CpuTensor {
    assert_eq!(x.cols, w.k, "matmul: x has {} columns, weight has {}", x.cols, w.k);
    let (n, k, kp, m) = (x.rows, w.k, w.kp, w.m);
    let acts = Activations::new(n, kp / 2, |r, out| to_pairs(&x.data[r * k..(r + 1) * k], out));
    let panels = Panels { source: PanelSource::Packed(&w.panels), count: m.div_ceil(NR), steps: kp / 32 };
    let y = amx::gemm_rows(tiles, Op::Bf16, &acts, &panels, m, |_, _, bits| f32::from_bits(bits));
    CpuTensor::new(y, n, m)
}

/// Rows of activations per block: the tile kernel's rows.
const MR: usize = 8;

/// Activations as bf16 pairs in blocks of [`MR`] rows, interleaved by k-pair
/// (`[n / MR][kp / 2][MR]` u32; a last, shorter block of `R` rows is `[kp / 2][R]`), so the
/// tile kernel's broadcasts read one contiguous run instead of `MR` rows a whole row apart
/// (rows `kp · 2` bytes apart alias in L1 when `k` is a multiple of 2048), and a decode
/// row's pairs lie 4 bytes apart (its whole input fits L1 beside the weight stream). The
/// k padding is zeros.
fn activations(x: &CpuTensor, k: usize, kp: usize) -> Vec<u32> {
    let pairs = kp / 2;
    let mut xb = vec![0u32; x.rows * pairs];
    xb.par_chunks_mut(pairs * MR).zip(x.data.par_chunks(k * MR)).for_each_init(
        Vec::new,
        |tmp, (dst, src)| {
            let rows = src.len() / k;
            if rows == 1 {
                to_pairs(src, dst);
                return;
            }
            tmp.resize(pairs, 0);
            for (r, row) in src.chunks(k).enumerate() {
                to_pairs(row, tmp);
                for (i, &pair) in tmp.iter().enumerate() {
                    dst[i * rows + r] = pair;
                }
            }
        },
    );
    xb
}

/// `row` rounded to bf16 (as `bf16::from_f32`: to nearest even, NaN kept quiet) in pairs,
/// `out[i] = row[2i] | row[2i + 1] << 16`; `out` past the row's pairs is left alone.
fn to_pairs(row: &[f32], out: &mut [u32]) {
    let main = if super::simd::available() { row.len() / 32 * 32 } else { 0 };
    // SAFETY: AVX-512 F/BW are there; `out` has a pair for every two elements of `row`
    // (at least `main / 2` of them).
    unsafe { to_pairs_avx512(&row[..main], &mut out[..main / 2]) };
    for (i, pair) in row[main..].chunks(2).enumerate() {
        let lo = bf16::from_f32(pair[0]).to_bits() as u32;
        let hi = pair.get(1).map_or(0, |v| bf16::from_f32(*v).to_bits() as u32);
        out[main / 2 + i] = lo | (hi << 16);
    }
}

/// [`to_pairs`] over a multiple of 32 elements: integer rounding of the f32 bits, so
/// denormals round as they do on the host (`vcvtne2ps2bf16` would flush them).
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn to_pairs_avx512(row: &[f32], out: &mut [u32]) {
    debug_assert!(row.len().is_multiple_of(32) && out.len() == row.len() / 2);
    let round = |v: __m512| -> __m256i {
        let bits = _mm512_castps_si512(v);
        let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(bits), _mm512_set1_epi32(1));
        let biased = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
        let quiet = _mm512_or_si512(bits, _mm512_set1_epi32(0x0040_0000));
        let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
        _mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(_mm512_mask_blend_epi32(nan, biased, quiet)))
    };
    for (src, dst) in row.chunks_exact(32).zip(out.chunks_exact_mut(16)) {
        let lo = round(_mm512_loadu_ps(src.as_ptr()));
        let hi = round(_mm512_loadu_ps(src.as_ptr().add(16)));
        let both = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
        _mm512_storeu_si512(dst.as_mut_ptr() as *mut _, both);
    }
}

/// Every row of `x` against one panel: output columns `j0..j0 + cols`.
#[allow(clippy::too_many_arguments)]
fn run_tiles(
    xb: &[u32],
    n: usize,
    kp: usize,
    packed: &[u32],
    y_ptr: &SendPtr,
    m: usize,
    j0: usize,
    cols: usize,
) {
    let mut t = 0;
    while t < n {
        let rows = (n - t).min(MR);
        let x = &xb[t * kp / 2..(t + rows) * kp / 2];
        // SAFETY: AVX512-BF16 is available (the callers assert it); this call writes only
        // columns j0..j0+cols of rows t..t+rows of y; buffers have the sizes used.
        unsafe {
            let out = y_ptr.0.add(t * m + j0);
            match rows {
                8 => tile::<8>(x, kp, packed, out, m, cols),
                7 => tile::<7>(x, kp, packed, out, m, cols),
                6 => tile::<6>(x, kp, packed, out, m, cols),
                5 => tile::<5>(x, kp, packed, out, m, cols),
                4 => tile::<4>(x, kp, packed, out, m, cols),
                3 => tile::<3>(x, kp, packed, out, m, cols),
                2 => tile::<2>(x, kp, packed, out, m, cols),
                _ => tile::<1>(x, kp, packed, out, m, cols),
            }
        }
        t += rows;
    }
}

/// One `R × NR` tile: `out[r * ld + c] = Σ_k x[r][k] · w[c][k]` for `c < cols`.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn tile<const R: usize>(xb: &[u32], kp: usize, packed: &[u32], out: *mut f32, ld: usize, cols: usize) {
    let mut acc = [[_mm512_setzero_ps(); 2]; R];
    let pairs = kp / 2;
    debug_assert_eq!(xb.len(), pairs * R, "a block of R rows");
    let xp = xb.as_ptr(); // one block: pairs of bf16 along k, R rows per pair
    let wp = packed.as_ptr();
    for i in 0..pairs {
        let w0: __m512bh = std::mem::transmute(_mm512_loadu_si512(wp.add(i * NR) as *const _));
        let w1: __m512bh = std::mem::transmute(_mm512_loadu_si512(wp.add(i * NR + 16) as *const _));
        for (r, a) in acc.iter_mut().enumerate() {
            let xv = *xp.add(i * R + r);
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
        let packed = PackedBf16::pack(&w, m, k);
        // The vector kernel itself: 19 rows would go to a matrix engine where one runs (its
        // own test checks it), and its sums are ordered otherwise than one row's.
        let y = matmul_vector(&CpuTensor::new(x.clone(), n, k), &packed);
        for t in 0..n {
            for j in 0..m {
                let want: f64 = (0..k)
                    .map(|i| bf16::from_f32(x[t * k + i]).to_f32() as f64 * w[j * k + i].to_f32() as f64)
                    .sum();
                let got = y.data[t * m + j] as f64;
                assert!((got - want).abs() < 1e-3 * (1.0 + want.abs()), "({t},{j}): {got} vs {want}");
            }
        }
        // A decode-sized input gets the same products; rows come back out of the panels
        // exactly.
        let one = CpuTensor::new(x[..k].to_vec(), 1, k);
        assert_eq!(matmul_packed(&one, &packed).data, y.data[..m].to_vec());
        let mut row = vec![0f32; k];
        packed.row_to_f32(37, &mut row);
        assert!(row.iter().zip(&w[37 * k..38 * k]).all(|(a, b)| *a == b.to_f32()));
    }

    /// Odd shapes for the tiles: two blocks of rows with a partial one, k not a multiple
    /// of a step (padding), a partial last panel.
    fn odd_problem() -> (CpuTensor, Vec<bf16>, PackedBf16) {
        let (n, k, m) = (37, 75, 70);
        let x: Vec<f32> = (0..n * k).map(|i| ((i * 37 % 101) as f32 - 50.0) / 37.0).collect();
        let w: Vec<bf16> = (0..m * k).map(|i| bf16::from_f32(((i * 53 % 89) as f32 - 44.0) / 61.0)).collect();
        let packed = PackedBf16::pack(&w, m, k);
        (CpuTensor::new(x, n, k), w, packed)
    }

    #[test]
    fn tiles_match_a_bf16_rounded_reference() {
        let (x, w, packed) = odd_problem();
        let (n, k, m) = (x.rows, x.cols, packed.m);
        let y = matmul_tiles(&amx::Sim, &x, &packed);
        for t in 0..n {
            for j in 0..m {
                let want: f64 = (0..k)
                    .map(|i| bf16::from_f32(x.data[t * k + i]).to_f32() as f64 * w[j * k + i].to_f32() as f64)
                    .sum();
                let got = y.data[t * m + j] as f64;
                assert!((got - want).abs() < 1e-3 * (1.0 + want.abs()), "({t},{j}): {got} vs {want}");
            }
        }
        // The AVX512-BF16 kernels and the CPU's tiles, where this host has them, agree.
        let close = |other: &CpuTensor, what: &str| {
            for (a, b) in other.data.iter().zip(&y.data) {
                assert!((a - b).abs() < 1e-4 * (1.0 + b.abs()), "{what} {a} vs the tiles' model {b}");
            }
        };
        if available() {
            close(&matmul_vector(&x, &packed), "AVX512-BF16");
        }
        match amx::Amx::enabled() {
            Some(tiles) => close(&matmul_tiles(&tiles, &x, &packed), "the CPU's tiles"),
            None => eprintln!("no AMX tiles on this CPU (or capped): their model ran"),
        }
    }

    #[test]
    fn rounds_activations_as_the_host_does() {
        if !available() {
            eprintln!("AVX512-BF16 not available on this CPU: the bf16 GEMM is not used here");
            return;
        }
        // Ties to even both ways, carries into the exponent, overflow to infinity,
        // denormals, signed zeros, infinities and NaNs, and a tail past the vector part.
        let mut row: Vec<f32> = [
            0x3f80_8000u32,
            0x3f81_8000,
            0x3f80_8001,
            0x3fff_ffff,
            0x7f7f_ffff,
            0x0000_8001,
            0x8000_0000,
            0x7f80_0000,
            0xff80_0000,
            0x7fc0_0001,
            0xff80_0001,
            0x0001_8000,
            0x807f_ffff,
        ]
        .iter()
        .map(|&b| f32::from_bits(b))
        .collect();
        row.extend((0..60).map(|i| (i as f32 - 29.5) * 1.0e-3f32.powi(i % 4)));
        let mut got = vec![0u32; row.len().div_ceil(2)];
        to_pairs(&row, &mut got);
        for (i, &pair) in got.iter().enumerate() {
            for (half, v) in
                [(pair & 0xffff, row[2 * i]), (pair >> 16, row.get(2 * i + 1).copied().unwrap_or(0.0))]
            {
                assert_eq!(
                    half as u16,
                    bf16::from_f32(v).to_bits(),
                    "element of pair {i}: {v:e} ({:#x})",
                    v.to_bits()
                );
            }
        }
    }
}
