//! `y = x · wᵀ` on the CPU, with weights in f32, bf16 or f16.
//!
//! Two regimes, because decode and prefill are bound by different things:
//! - **Few rows (decode, up to 48)**: every weight row is streamed once, widened to f32 in
//!   registers and dotted with the activation rows — one row with two accumulators
//!   (memory-bound), several in register tiles of 4 weight rows × 6 activation rows (so
//!   batched decode runs at FMA speed); rayon splits the output rows across cores. The
//!   kernels are picked at run time — AVX-512 ([`super::simd`]), AVX2 + FMA
//!   ([`super::simd_avx2`]), else a portable loop — so one binary runs everywhere and uses
//!   what the CPU has; int8 weights run integer dot products on either (`int8_vnni`,
//!   `int8_avx2`).
//! - **Many rows (prefill)**: compute-bound. Output columns are cut into tiles; each tile of
//!   weight rows is widened into a per-thread f32 buffer (cost amortised over all rows of
//!   `x`) and multiplied by the `gemm` crate's packed AVX-512 kernels.

use half::{bf16, f16};
use rayon::prelude::*;
use strata_common::{Error, Result};

use super::huge::HugeVec;
use super::{CpuTensor, SendPtr};
use crate::tensor::{DType, HostTensor};

/// Up to this many activation rows take the streaming (decode) path.
const STREAM_MAX_ROWS: usize = 48;
/// Output rows per rayon task in the streaming path.
const STREAM_CHUNK: usize = 32;
/// Weight rows widened per tile in the tiled (prefill) path.
const TILE_ROWS: usize = 128;

/// Weights from this size on are copied onto huge pages at load (they share huge pages
/// in slabs, see `super::huge`: a mixture of experts' small matrices stream from them as
/// fast as large ones; below this a weight is a few pages of the checkpoint's mapping).
const HUGE_MIN_BYTES: usize = 256 << 10;

/// A weight's elements in the dtype the kernels read.
pub enum WeightData {
    F32(Elems<f32>),
    Bf16(Elems<bf16>),
    F16(Elems<f16>),
    /// int8 with one f32 scale per output row (`--quantize int8`): `w[j][i] ≈ q[j][i] ·
    /// scales[j]`. The kernels widen `q` like any other dtype and scale each output.
    Int8 {
        q: HugeVec<i8>,
        scales: Vec<f32>,
        sums: Vec<i32>,
    },
    /// bf16 packed at load for the bf16 × bf16 kernel (bf16 compute on AVX512-BF16).
    #[cfg(target_arch = "x86_64")]
    Bf16Packed(super::bf16_gemm::PackedBf16),
}

/// Weight elements: borrowed from the checkpoint mapping, owned, or copied onto huge pages.
pub enum Elems<T> {
    Mapped(HostTensor),
    Owned(Vec<T>),
    Huge(HugeVec<T>),
}

impl<T: bytemuck::Pod> Elems<T> {
    fn from_host(host: &HostTensor) -> Self {
        // Zero copy when the mapping is aligned for T (safetensors normally is).
        if bytemuck::try_cast_slice::<u8, T>(host.bytes()).is_ok() {
            Elems::Mapped(host.clone())
        } else {
            Elems::Owned(bytemuck::pod_collect_to_vec(host.bytes()))
        }
    }

    /// A copy on huge pages, from [`HUGE_MIN_BYTES`] on (see `super::huge`).
    fn on_huge_pages(self) -> Self {
        match self {
            Elems::Mapped(_) | Elems::Owned(_)
                if std::mem::size_of_val(self.as_slice()) >= HUGE_MIN_BYTES =>
            {
                Elems::Huge(HugeVec::from_slice(self.as_slice()))
            }
            e => e,
        }
    }

    fn as_slice(&self) -> &[T] {
        match self {
            Elems::Mapped(h) => bytemuck::cast_slice(h.bytes()),
            Elems::Owned(v) => v,
            Elems::Huge(v) => v,
        }
    }
}

/// A `[rows, cols]` weight matrix (`rows` = output features).
pub struct CpuWeight {
    pub rows: usize,
    pub cols: usize,
    pub data: WeightData,
}

impl CpuWeight {
    pub fn from_host(host: &HostTensor) -> Result<Self> {
        let [rows, cols] = host.shape[..] else {
            return Err(Error::model_file(
                host.file.as_path(),
                format!("tensor {:?} should be 2-D, has shape {:?}", host.name, host.shape),
            ));
        };
        let data = match host.dtype {
            DType::F32 => WeightData::F32(Elems::from_host(host)),
            DType::BF16 => WeightData::Bf16(Elems::from_host(host)),
            DType::F16 => WeightData::F16(Elems::from_host(host)),
            DType::I8 => {
                return Err(Error::model_file(
                    host.file.as_path(),
                    format!(
                        "int8 tensor {:?} has no {:?} beside it",
                        host.name,
                        format!("{}_scale", host.name)
                    ),
                ))
            }
        };
        Ok(CpuWeight { rows, cols, data })
    }

    /// An int8 matrix with one scale per output row, as `strata model quantize` stores it.
    pub fn from_int8(q: &HostTensor, scales: &HostTensor) -> Result<Self> {
        let (DType::I8, &[rows, cols], DType::F32) = (q.dtype, &q.shape[..], scales.dtype) else {
            return Err(Error::model_file(
                q.file.as_path(),
                format!("{:?}: an int8 matrix needs 2-D I8 values and F32 scales", q.name),
            ));
        };
        if scales.shape[..] != [rows] {
            return Err(Error::model_file(
                q.file.as_path(),
                format!("{:?}: {rows} rows but scales of shape {:?}", q.name, scales.shape),
            ));
        }
        Ok(Self::int8(rows, cols, HugeVec::from_slice(bytemuck::cast_slice(q.bytes())), scales.to_f32_vec()))
    }

    /// The int8 values and per-row scales of a quantized weight.
    pub fn int8_parts(&self) -> Option<(&[i8], &[f32])> {
        match &self.data {
            WeightData::Int8 { q, scales, .. } => Some((q, scales)),
            _ => None,
        }
    }

    /// An owned f32 matrix (tests and sharded copies).
    pub fn from_f32(data: Vec<f32>, rows: usize, cols: usize) -> Self {
        assert_eq!(data.len(), rows * cols);
        CpuWeight { rows, cols, data: WeightData::F32(Elems::Owned(data)) }
    }

    /// An owned bf16 matrix (benchmarks).
    pub fn from_bf16(data: Vec<bf16>, rows: usize, cols: usize) -> Self {
        assert_eq!(data.len(), rows * cols);
        CpuWeight { rows, cols, data: WeightData::Bf16(Elems::Owned(data)) }
    }

    /// Quantizes to int8 with a symmetric scale per output row (`max |w| / 127`), from
    /// whatever dtype the weight is in; the int8 copy replaces it.
    pub fn quantized_int8(self) -> Self {
        let (rows, cols) = (self.rows, self.cols);
        let mut q = HugeVec::<i8>::zeroed(rows * cols);
        let mut scales = vec![0f32; rows];
        q.par_chunks_mut(cols.max(1)).zip(scales.par_iter_mut()).enumerate().for_each_init(
            || vec![0f32; cols],
            |row, (r, (qr, scale))| {
                self.row_to_f32(r, row);
                let max = row.iter().fold(0f32, |m, v| m.max(v.abs()));
                *scale = if max > 0.0 { max / 127.0 } else { 1.0 };
                for (qv, v) in qr.iter_mut().zip(row.iter()) {
                    *qv = (v / *scale).round().clamp(-127.0, 127.0) as i8;
                }
            },
        );
        Self::int8(rows, cols, q, scales)
    }

    fn int8(rows: usize, cols: usize, q: HugeVec<i8>, scales: Vec<f32>) -> Self {
        #[cfg(target_arch = "x86_64")]
        let sums = super::int8_vnni::row_sums(&q, cols);
        #[cfg(not(target_arch = "x86_64"))]
        let sums = Vec::new();
        CpuWeight { rows, cols, data: WeightData::Int8 { q, scales, sums } }
    }

    /// The weight with its elements on huge pages when it is big enough to matter (a
    /// decode step streams every weight; see `super::huge`); packed and int8 weights are
    /// there already.
    pub fn on_huge_pages(self) -> Self {
        let data = match self.data {
            WeightData::F32(e) => WeightData::F32(e.on_huge_pages()),
            WeightData::Bf16(e) => WeightData::Bf16(e.on_huge_pages()),
            WeightData::F16(e) => WeightData::F16(e.on_huge_pages()),
            d => d,
        };
        CpuWeight { data, ..self }
    }

    /// Packs a bf16 weight for the bf16 × bf16 kernel; the packed copy replaces the
    /// row-major one (other weights are returned as they are).
    #[cfg(target_arch = "x86_64")]
    pub fn packed_bf16(self) -> Self {
        match &self.data {
            WeightData::Bf16(e) => {
                let packed = super::bf16_gemm::PackedBf16::pack(e.as_slice(), self.rows, self.cols);
                CpuWeight { rows: self.rows, cols: self.cols, data: WeightData::Bf16Packed(packed) }
            }
            _ => self,
        }
    }

    pub fn bytes(&self) -> usize {
        let elem = match &self.data {
            WeightData::F32(_) => 4,
            WeightData::Bf16(_) | WeightData::F16(_) => 2,
            WeightData::Int8 { scales, .. } => return self.rows * self.cols + scales.len() * 4,
            #[cfg(target_arch = "x86_64")]
            WeightData::Bf16Packed(p) => return p.bytes(),
        };
        self.rows * self.cols * elem
    }

    /// Widens row `r` into `out`.
    pub fn row_to_f32(&self, r: usize, out: &mut [f32]) {
        let span = r * self.cols..(r + 1) * self.cols;
        match &self.data {
            WeightData::F32(e) => out.copy_from_slice(&e.as_slice()[span]),
            WeightData::Bf16(e) => widen(&e.as_slice()[span], out),
            WeightData::F16(e) => widen(&e.as_slice()[span], out),
            WeightData::Int8 { q, scales, .. } => {
                widen(&q[span], out);
                out.iter_mut().for_each(|v| *v *= scales[r]);
            }
            #[cfg(target_arch = "x86_64")]
            WeightData::Bf16Packed(p) => p.row_to_f32(r, out),
        }
    }
}

/// Element types the kernels widen to f32.
pub trait Widen: Copy + Send + Sync {
    fn f32(self) -> f32;
}

impl Widen for f32 {
    #[inline(always)]
    fn f32(self) -> f32 {
        self
    }
}

impl Widen for bf16 {
    #[inline(always)]
    fn f32(self) -> f32 {
        f32::from_bits((self.to_bits() as u32) << 16)
    }
}

impl Widen for i8 {
    #[inline(always)]
    fn f32(self) -> f32 {
        self as f32
    }
}

impl Widen for f16 {
    #[inline(always)]
    fn f32(self) -> f32 {
        self.to_f32()
    }
}

fn widen<T: Widen>(src: &[T], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = s.f32();
    }
}

/// `x · wᵀ` in the weight's own precision: f32 with widened weights, except bf16 weights
/// packed at load (bf16 compute) and int8 decode rows (integer dot products).
pub fn matmul(x: &CpuTensor, w: &CpuWeight) -> CpuTensor {
    assert_eq!(x.cols, w.cols, "matmul: x has {} columns, weight has {}", x.cols, w.cols);
    match &w.data {
        WeightData::F32(e) => matmul_typed(x, e.as_slice(), w.rows),
        WeightData::Bf16(e) => matmul_typed(x, e.as_slice(), w.rows),
        WeightData::F16(e) => matmul_typed(x, e.as_slice(), w.rows),
        WeightData::Int8 { q, scales, sums } => matmul_int8(x, q, scales, sums, w.rows),
        #[cfg(target_arch = "x86_64")]
        WeightData::Bf16Packed(_) if x.rows == 0 => CpuTensor::zeros(0, w.rows),
        #[cfg(target_arch = "x86_64")]
        WeightData::Bf16Packed(p) => super::bf16_gemm::matmul_packed(x, p),
    }
}

/// `x · wᵀ` for int8 weights: on AMX-INT8 tiles from 16 rows where the CPU has them, in
/// integer dot products for decode rows (VNNI or AVX2; activations quantized per row as on
/// the tiles), else in f32 with the weights widened.
fn matmul_int8(x: &CpuTensor, q: &[i8], scales: &[f32], sums: &[i32], m: usize) -> CpuTensor {
    #[cfg(target_arch = "x86_64")]
    {
        let decode = x.rows > 0 && x.rows <= STREAM_MAX_ROWS;
        if x.rows >= super::bf16_gemm::AMX_MIN_ROWS && x.cols > 0 {
            if let Some(tiles) = super::amx::matrix_engine_int8() {
                return super::int8_vnni::matmul_tiles(tiles, x, q, scales, m);
            }
        }
        if decode && super::int8_vnni::available() {
            return super::int8_vnni::matmul(x, q, scales, sums, m);
        }
        if decode && super::simd::level() >= super::simd::Level::Avx2 {
            return super::int8_avx2::matmul(x, q, scales, m);
        }
    }
    let _ = sums;
    let mut y = matmul_typed(x, q, m);
    y.data.par_chunks_mut(m.max(1)).for_each(|row| {
        row.iter_mut().zip(scales).for_each(|(v, s)| *v *= s);
    });
    y
}

fn matmul_typed<T: Kernel>(x: &CpuTensor, w: &[T], out_features: usize) -> CpuTensor {
    if x.rows == 0 {
        return CpuTensor::zeros(0, out_features);
    }
    if x.rows <= STREAM_MAX_ROWS {
        streaming(x, w, out_features)
    } else {
        tiled(x, w, out_features)
    }
}

/// Decode path: `out_t[j, t] = dot(w[j], x[t])`, output rows split across threads.
fn streaming<T: Kernel>(x: &CpuTensor, w: &[T], m: usize) -> CpuTensor {
    let (n, k) = (x.rows, x.cols);
    let mut out_t = vec![0f32; m * n];
    out_t.par_chunks_mut(STREAM_CHUNK * n).enumerate().for_each(|(c, out)| {
        let j0 = c * STREAM_CHUNK;
        let rows = out.len() / n;
        let row = |j: usize| &w[(j0 + j) * k..(j0 + j + 1) * k];
        let mut jj = 0;
        #[cfg(target_arch = "x86_64")]
        if n > 1 && super::simd::available() {
            // Several activation rows: register tiles of 4 weight rows × up to 6 rows.
            while jj + 4 <= rows {
                let w4 = [row(jj), row(jj + 1), row(jj + 2), row(jj + 3)];
                // SAFETY: AVX-512 is available; each weight row has k elements, x has n
                // rows of k, and indices t + r·n (t < n, r < 4) lie inside out[jj·n..].
                unsafe { super::simd::rows_by_4(w4, &x.data, n, k, &mut out[jj * n..], (1, n)) };
                jj += 4;
            }
        } else if super::simd::level() == super::simd::Level::Avx2 {
            // Register tiles of 4 weight rows × up to 2 activation rows — for a single
            // activation row too: four weight rows streamed side by side read faster than
            // one row at a time (batch-1 decode of the 1B shape on an AVX2 host: 10.3 ->
            // 11.0-14.2 tok/s; docs/PERFORMANCE.md).
            while jj + 4 <= rows {
                let w4 = [row(jj), row(jj + 1), row(jj + 2), row(jj + 3)];
                // SAFETY: AVX2, FMA and F16C are available; shapes as above.
                unsafe { super::simd_avx2::rows_by_4(w4, &x.data, n, k, &mut out[jj * n..], (1, n)) };
                jj += 4;
            }
        }
        for (j, out_row) in out.chunks_mut(n).enumerate().skip(jj) {
            dot_rows(row(j), &x.data, k, out_row);
        }
    });
    from_transposed(out_t, n, m)
}

/// The `[n, m]` output of a decode kernel that wrote it transposed (`out_t[j·n + t]`).
pub(super) fn from_transposed(out_t: Vec<f32>, n: usize, m: usize) -> CpuTensor {
    if n == 1 {
        return CpuTensor::new(out_t, 1, m);
    }
    let mut y = vec![0f32; n * m];
    for j in 0..m {
        for t in 0..n {
            y[t * m + j] = out_t[j * n + t];
        }
    }
    CpuTensor::new(y, n, m)
}

/// Element types with a portable kernel and, on x86-64, AVX-512 and AVX2 ones.
#[cfg(target_arch = "x86_64")]
pub trait Kernel: Widen + super::simd::Load16 + super::simd_avx2::Load8 {}
#[cfg(target_arch = "x86_64")]
impl<T: Widen + super::simd::Load16 + super::simd_avx2::Load8> Kernel for T {}
#[cfg(not(target_arch = "x86_64"))]
pub trait Kernel: Widen {}
#[cfg(not(target_arch = "x86_64"))]
impl<T: Widen> Kernel for T {}

fn dot_rows<T: Kernel>(w: &[T], x: &[f32], k: usize, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if super::simd::available() {
        // Up to 8 activation rows per pass over the weight row (it stays in L1 between
        // passes).
        for (g, out) in out.chunks_mut(8).enumerate() {
            let x = &x[g * 8 * k..];
            // SAFETY: the CPU has AVX-512; `w` is one row of k elements and `x` holds
            // `out.len()` rows of k.
            unsafe { super::simd::dot_rows(w, x, k, out) };
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if super::simd::level() == super::simd::Level::Avx2 {
        use super::simd_avx2::DOT_ROWS;
        for (g, out) in out.chunks_mut(DOT_ROWS).enumerate() {
            // SAFETY: the CPU has AVX2, FMA and F16C; `x` holds `out.len()` rows of k.
            unsafe { super::simd_avx2::dot_rows(w, &x[g * DOT_ROWS * k..], k, out) };
        }
        return;
    }
    for (t, o) in out.iter_mut().enumerate() {
        *o = dot_portable(w, &x[t * k..(t + 1) * k]);
    }
}

fn dot_portable<T: Widen>(w: &[T], x: &[f32]) -> f32 {
    const LANES: usize = 16;
    let mut acc = [0f32; LANES];
    let split = w.len() / LANES * LANES;
    for (wc, xc) in w[..split].chunks_exact(LANES).zip(x[..split].chunks_exact(LANES)) {
        for l in 0..LANES {
            acc[l] += wc[l].f32() * xc[l];
        }
    }
    let tail: f32 = w[split..].iter().zip(&x[split..]).map(|(a, b)| a.f32() * b).sum();
    acc.iter().sum::<f32>() + tail
}

/// Prefill path: widen a tile of weight rows, then one packed GEMM per tile.
fn tiled<T: Widen>(x: &CpuTensor, w: &[T], m: usize) -> CpuTensor {
    let (n, k) = (x.rows, x.cols);
    let mut y = vec![0f32; n * m];
    let y_ptr = SendPtr(y.as_mut_ptr());
    let tiles = m.div_ceil(TILE_ROWS);
    (0..tiles).into_par_iter().for_each_init(Vec::<f32>::new, |buf, tile| {
        let j0 = tile * TILE_ROWS;
        let rows = TILE_ROWS.min(m - j0);
        let src = &w[j0 * k..(j0 + rows) * k];
        buf.resize(rows * k, 0.0);
        widen_fast(src, buf);
        let y_ptr = &y_ptr;
        // SAFETY: this task writes columns j0..j0+rows of y only; tiles are disjoint, and
        // all strides describe buffers of the stated sizes.
        unsafe {
            gemm::gemm(
                n,
                rows,
                k,
                y_ptr.0.add(j0),
                1,
                m as isize,
                false,
                x.data.as_ptr(),
                1,
                k as isize,
                buf.as_ptr(),
                k as isize,
                1,
                0.0,
                1.0,
                false,
                false,
                false,
                gemm::Parallelism::None,
            );
        }
    });
    CpuTensor::new(y, n, m)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn widen_avx512<T: Widen>(src: &[T], dst: &mut [f32]) {
    widen(src, dst)
}

fn widen_fast<T: Widen>(src: &[T], dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if super::simd::available() {
        // SAFETY: the CPU supports every feature the function is compiled for.
        return unsafe { widen_avx512(src, dst) };
    }
    #[cfg(target_arch = "x86_64")]
    if super::simd::level() == super::simd::Level::Avx2 {
        // SAFETY: the CPU has AVX2, FMA and F16C.
        return unsafe { super::simd_avx2::widen(src, dst) };
    }
    widen(src, dst)
}
