//! The CPU backend: f32 activations, weights kept in their checkpoint dtype.
//!
//! Weight matrices of 2 MiB and more are copied out of the memory mapping onto huge
//! pages at load ([`huge`]: a decode step streams every one); smaller ones stay in the
//! mapping (zero copy where aligned). f16 weights, and bf16 weights under `--dtype f32`,
//! are widened to f32 inside the matmul's tiles, never by materialising an f32 copy of
//! the model. bf16 weights
//! otherwise compute in bf16: packed once at load into the layout of the bf16
//! dot-product kernel (the packed copy, on huge pages too, replaces the mapping; so do
//! int8 weights), activations rounded to bf16 at each matmul's input, f32
//! accumulation. Matmuls run on rayon's pool (see [`matmul`]); attention reads the paged
//! cache through block tables (see [`attention`]); `exp`, SiLU and the logits normaliser
//! run in vectors ([`vmath`]).

mod amx;
mod attention;
mod attention_amx;
mod attention_tiles;
mod bf16_gemm;
mod huge;
mod int8_avx2;
mod int8_vnni;
mod matmul;
pub mod roofline;
mod simd;
mod simd_avx2;
pub(crate) mod vmath;

use rayon::prelude::*;
use strata_common::{Error, Result};

use super::{
    check_scatter, Activation, AttentionOps, AttentionShape, BatchLayout, ExpertOps, LogitsOps, Pointwise,
    RopeTable, StepGraphs, TensorOps, Tensors,
};
use crate::tensor::{DType, HostTensor};

pub use huge::HugeVec;
pub use matmul::{CpuWeight, WeightData};

/// Row-major 2-D f32 tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct CpuTensor {
    pub data: Vec<f32>,
    pub rows: usize,
    pub cols: usize,
}

impl CpuTensor {
    pub fn new(data: Vec<f32>, rows: usize, cols: usize) -> Self {
        assert_eq!(data.len(), rows * cols, "tensor data does not match its shape");
        CpuTensor { data, rows, cols }
    }

    pub fn zeros(rows: usize, cols: usize) -> Self {
        CpuTensor { data: vec![0.0; rows * cols], rows, cols }
    }

    pub fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }
}

/// A pointer into one output buffer that rayon tasks share, each writing its own
/// disjoint part of it (what `par_chunks_mut` cannot express: column ranges, tiles).
pub(super) struct SendPtr(pub *mut f32);
// SAFETY: only ever used to hand disjoint parts of one buffer to rayon tasks.
unsafe impl Sync for SendPtr {}
unsafe impl Send for SendPtr {}

/// One layer's paged K and V: `[num_blocks * block_size, kv_dim]` each.
pub struct CpuKvLayer {
    pub k: Vec<f32>,
    /// Empty where the values are the keys ([`AttentionOps::alloc_kv_shared`]).
    pub v: Vec<f32>,
    pub kv_dim: usize,
}

impl CpuKvLayer {
    /// What attention weighs: the values, or the keys where they are one.
    pub fn values(&self) -> &[f32] {
        if self.v.is_empty() {
            &self.k
        } else {
            &self.v
        }
    }
}

/// Below this many rows, elementwise ops run on the calling thread.
const PAR_ROWS: usize = 16;

#[derive(Debug, Default, Clone)]
pub struct CpuBackend {
    /// Run bf16 weights as bf16 × bf16 (packed at load), not widened to f32.
    bf16_compute: bool,
    /// Store weight matrices in this dtype instead of the checkpoint's.
    weight_dtype: Option<DType>,
    /// Quantize weight matrices at load.
    quantize: Option<super::Quantization>,
    /// Set when a weight was packed for bf16 compute: the model computes in bf16, so
    /// prefill attention may too (on AMX tiles), as HF transformers does for bf16 models;
    /// an f32 model's attention stays f32.
    computes_bf16: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl CpuBackend {
    pub fn new() -> Self {
        CpuBackend::default()
    }

    /// bf16 compute for bf16 weights (what a bf16 model runs with; off for `--dtype f32`
    /// and in `new()`, which is exact): they are packed once at load for the CPU's bf16
    /// dot-product instructions, and every matmul with them (prefill and decode) rounds
    /// its activations to bf16 — about twice the f32 speed when compute-bound. On a CPU
    /// without AVX512-BF16 the f32 path runs instead (more precise, slower), and the
    /// first bf16 weight loaded says so once.
    pub fn with_bf16_compute(mut self, on: bool) -> Self {
        self.bf16_compute = on;
        self
    }

    /// Keeps weight matrices in `dtype` (converted once at load) instead of the
    /// checkpoint's dtype; None keeps the checkpoint's (zero copy).
    pub fn with_weight_dtype(mut self, dtype: Option<DType>) -> Self {
        self.weight_dtype = dtype;
        self
    }

    /// Quantizes every weight matrix at load (int8: one scale per output row).
    pub fn with_quantize(mut self, q: Option<super::Quantization>) -> Self {
        self.quantize = q;
        self
    }

    /// The kernels this process runs: `avx512`, `avx2` or `portable` (what the CPU has,
    /// capped by the `STRATA_CPU_KERNELS` environment variable).
    pub fn kernels() -> &'static str {
        #[cfg(target_arch = "x86_64")]
        return simd::level().name();
        #[cfg(not(target_arch = "x86_64"))]
        "portable"
    }

    /// Runs the kernels of level `name` (as `STRATA_CPU_KERNELS` names them) from now on,
    /// at most what the CPU has: for benchmarks that alternate levels in one process.
    /// Weights keep the layout they were loaded in, so both levels must read it (bf16
    /// weights packed for AVX512-BF16 need `avx512` or `amx`); the caller checks.
    pub fn set_kernels(name: &str) -> Result<()> {
        #[cfg(target_arch = "x86_64")]
        {
            let invalid = |reason: String| Error::InvalidArgument { field: "CPU kernels".into(), reason };
            let level = match name {
                "native" => simd::detected(),
                _ => simd::Level::parse(name).ok_or_else(|| {
                    invalid(format!("{name:?} is not amx, avx512, avx2, portable or native"))
                })?,
            };
            if level > simd::detected() {
                return Err(invalid(format!(
                    "this CPU runs kernels up to {}, not {name}",
                    simd::detected().name()
                )));
            }
            simd::set_cap(level);
            Ok(())
        }
        #[cfg(not(target_arch = "x86_64"))]
        match name {
            "portable" | "native" => Ok(()),
            _ => Err(Error::InvalidArgument {
                field: "CPU kernels".into(),
                reason: format!("this CPU runs portable kernels only, not {name}"),
            }),
        }
    }

    /// The kernels the prefill GEMM of weights kept unpacked (the `gemm` crate) picks on
    /// this CPU: `avx512` only in a build with the `gemm-avx512` feature, whatever
    /// `STRATA_CPU_KERNELS` says; else `avx2` (with FMA) or `portable`.
    pub fn prefill_gemm_kernels() -> &'static str {
        #[cfg(target_arch = "x86_64")]
        {
            if cfg!(feature = "gemm-avx512") && std::arch::is_x86_feature_detected!("avx512f") {
                return "avx512";
            }
            if std::arch::is_x86_feature_detected!("fma") {
                return "avx2";
            }
        }
        "portable"
    }

    /// Whether this CPU has the bf16 dot products bf16 compute runs on (AVX512-BF16).
    pub fn bf16_compute_available() -> bool {
        #[cfg(target_arch = "x86_64")]
        return bf16_gemm::available();
        #[cfg(not(target_arch = "x86_64"))]
        false
    }
}

impl Tensors for CpuBackend {
    type Tensor = CpuTensor;
    type Weight = CpuWeight;
    fn name(&self) -> &'static str {
        "cpu"
    }
    fn uses_thread_pool(&self) -> bool {
        true
    }
    fn load_weight(&self, host: &HostTensor) -> Result<CpuWeight> {
        let w = match self.weight_dtype {
            Some(d) if d != host.dtype && host.dtype != DType::I8 => CpuWeight::from_host(&host.cast(d))?,
            _ => CpuWeight::from_host(host)?,
        };
        if self.quantize == Some(super::Quantization::Int8) {
            return Ok(w.quantized_int8());
        }
        if self.bf16_compute && matches!(w.data, matmul::WeightData::Bf16(_)) {
            #[cfg(target_arch = "x86_64")]
            if bf16_gemm::available() {
                self.computes_bf16.store(true, std::sync::atomic::Ordering::Relaxed);
                return Ok(w.packed_bf16());
            }
            static WARNED: std::sync::Once = std::sync::Once::new();
            WARNED.call_once(|| {
                tracing::warn!(kernels = Self::kernels(), "no AVX512-BF16 kernels on this CPU (or STRATA_CPU_KERNELS caps them): bf16 weights are computed in f32 (exact, slower)")
            });
        }
        Ok(w.on_huge_pages())
    }
    fn load_weight_int8(&self, q: &HostTensor, scales: &HostTensor) -> Result<CpuWeight> {
        CpuWeight::from_int8(q, scales)
    }
    fn load_vector(&self, host: &HostTensor) -> Result<CpuTensor> {
        if host.shape.len() != 1 {
            return Err(Error::model_file(
                host.file.as_path(),
                format!("tensor {:?} should be 1-D, has shape {:?}", host.name, host.shape),
            ));
        }
        let data = host.to_f32_vec();
        let n = data.len();
        Ok(CpuTensor::new(data, 1, n))
    }
    fn weight_bytes(&self, w: &CpuWeight) -> usize {
        w.bytes()
    }
    fn to_host(&self, x: &CpuTensor) -> Result<Vec<f32>> {
        Ok(x.data.clone())
    }
    fn upload(&self, data: Vec<f32>, rows: usize, cols: usize) -> Result<CpuTensor> {
        if data.len() != rows * cols {
            return Err(Error::Internal(format!("{} values for a [{rows}, {cols}] tensor", data.len())));
        }
        Ok(CpuTensor::new(data, rows, cols))
    }
    fn with_host_mut(&self, x: &mut CpuTensor, f: &mut dyn FnMut(&mut [f32]) -> Result<()>) -> Result<()> {
        f(&mut x.data)
    }

    fn shape(&self, x: &CpuTensor) -> (usize, usize) {
        (x.rows, x.cols)
    }
    fn reshape(&self, x: CpuTensor, rows: usize, cols: usize) -> Result<CpuTensor> {
        if rows * cols != x.rows * x.cols {
            return Err(Error::Internal(format!("[{}, {}] reshaped as [{rows}, {cols}]", x.rows, x.cols)));
        }
        Ok(CpuTensor { rows, cols, ..x })
    }
}

impl TensorOps for CpuBackend {
    fn embed(&self, table: &CpuWeight, ids: &[u32], first_id: u32) -> Result<CpuTensor> {
        let cols = table.cols;
        let mut out = CpuTensor::zeros(ids.len(), cols);
        for (row, &id) in out.data.chunks_mut(cols).zip(ids) {
            if let Some(local) = id.checked_sub(first_id).filter(|&l| (l as usize) < table.rows) {
                table.row_to_f32(local as usize, row);
            }
        }
        Ok(out)
    }
    fn matmul(&self, x: &CpuTensor, w: &CpuWeight) -> Result<CpuTensor> {
        Ok(matmul::matmul(x, w))
    }
    /// The matmuls side by side in one parallel region (each splits its rows as alone): a
    /// thread that finishes its share of one goes on to another's instead of waiting at
    /// a join, so q, k and v (and gate and up) cost one join per layer, not three.
    fn matmul_many(&self, x: &CpuTensor, ws: &[&CpuWeight]) -> Result<Vec<CpuTensor>> {
        Ok(ws.par_iter().map(|w| matmul::matmul(x, w)).collect())
    }
    fn add_bias(&self, x: &mut CpuTensor, bias: &CpuTensor) -> Result<()> {
        for row in x.data.chunks_mut(x.cols) {
            for (a, b) in row.iter_mut().zip(&bias.data) {
                *a += b;
            }
        }
        Ok(())
    }
    fn add_assign(&self, x: &mut CpuTensor, y: &CpuTensor) -> Result<()> {
        debug_assert_eq!(x.data.len(), y.data.len());
        for (a, b) in x.data.iter_mut().zip(&y.data) {
            *a += b;
        }
        Ok(())
    }
    fn rms_norm(&self, x: &CpuTensor, weight: &CpuTensor, eps: f32) -> Result<CpuTensor> {
        let mut out = CpuTensor::zeros(x.rows, x.cols);
        let norm_row = |(src, dst): (&[f32], &mut [f32])| {
            let mean_sq = src.iter().map(|v| v * v).sum::<f32>() / src.len() as f32;
            let inv = 1.0 / (mean_sq + eps).sqrt();
            for ((d, s), w) in dst.iter_mut().zip(src).zip(&weight.data) {
                *d = w * (s * inv);
            }
        };
        if x.rows >= PAR_ROWS {
            x.data.par_chunks(x.cols).zip(out.data.par_chunks_mut(x.cols)).for_each(norm_row);
        } else {
            x.data.chunks(x.cols).zip(out.data.chunks_mut(x.cols)).for_each(norm_row);
        }
        Ok(out)
    }
    fn gated(&self, act: Activation, gate: &CpuTensor, up: &CpuTensor) -> Result<CpuTensor> {
        if (gate.rows, gate.cols) != (up.rows, up.cols) {
            return Err(Error::Internal("a gated product of tensors of different shapes".into()));
        }
        let mut out = CpuTensor::zeros(gate.rows, gate.cols);
        let row = |((g, u), o): ((&[f32], &[f32]), &mut [f32])| match act {
            Activation::Silu => vmath::silu_mul(g, u, o),
            Activation::GeluTanh => vmath::gelu_tanh_mul(g, u, o),
            Activation::ClampedSwiglu { alpha, limit } => vmath::clamped_swiglu_mul(g, u, o, alpha, limit),
        };
        let cols = gate.cols.max(1);
        if gate.rows >= PAR_ROWS {
            let rows = gate.data.par_chunks(cols).zip(up.data.par_chunks(cols));
            rows.zip(out.data.par_chunks_mut(cols)).for_each(row);
        } else {
            gate.data.chunks(cols).zip(up.data.chunks(cols)).zip(out.data.chunks_mut(cols)).for_each(row);
        }
        Ok(out)
    }
    fn pointwise(&self, x: &mut CpuTensor, op: Pointwise) -> Result<()> {
        x.data.iter_mut().for_each(|v| *v = op.apply(*v));
        Ok(())
    }
    fn gather_rows(&self, x: &CpuTensor, rows: &[usize]) -> Result<CpuTensor> {
        let mut data = Vec::with_capacity(rows.len() * x.cols);
        for &r in rows {
            data.extend_from_slice(x.row(r));
        }
        Ok(CpuTensor::new(data, rows.len(), x.cols))
    }

    fn interleave_blocks(&self, x: &CpuTensor, blocks: usize) -> Result<CpuTensor> {
        if blocks == 0 || !x.rows.is_multiple_of(blocks) {
            return Err(Error::Internal(format!("{} rows are not {blocks} blocks", x.rows)));
        }
        let (n, w) = (x.rows / blocks, x.cols);
        let mut out = CpuTensor::zeros(n, blocks * w);
        for b in 0..blocks {
            for r in 0..n {
                out.data[r * blocks * w + b * w..][..w].copy_from_slice(x.row(b * n + r));
            }
        }
        Ok(out)
    }
    fn columns(&self, x: &CpuTensor, cols: std::ops::Range<usize>) -> Result<CpuTensor> {
        if cols.end > x.cols || cols.start > cols.end {
            return Err(Error::Internal(format!("columns {cols:?} of {}", x.cols)));
        }
        let data = (0..x.rows).flat_map(|r| x.row(r)[cols.clone()].iter().copied()).collect();
        Ok(CpuTensor::new(data, x.rows, cols.len()))
    }
    fn concat_columns(&self, parts: &[&CpuTensor]) -> Result<CpuTensor> {
        let rows = parts.first().map_or(0, |p| p.rows);
        if parts.iter().any(|p| p.rows != rows) {
            return Err(Error::Internal("concatenating tensors of different row counts".into()));
        }
        let width = parts.iter().map(|p| p.cols).sum();
        let mut data = Vec::with_capacity(rows * width);
        for r in 0..rows {
            for p in parts {
                data.extend_from_slice(p.row(r));
            }
        }
        Ok(CpuTensor::new(data, rows, width))
    }
}

impl AttentionOps for CpuBackend {
    type KvLayer = CpuKvLayer;
    fn alloc_kv(&self, num_blocks: usize, block_size: usize, kv_dim: usize) -> Result<CpuKvLayer> {
        let n = num_blocks
            .checked_mul(block_size)
            .and_then(|n| n.checked_mul(kv_dim))
            .ok_or_else(|| Error::invalid("kv_cache", "size overflows"))?;
        Ok(CpuKvLayer { k: vec![0.0; n], v: vec![0.0; n], kv_dim })
    }
    fn alloc_kv_shared(&self, num_blocks: usize, block_size: usize, kv_dim: usize) -> Result<CpuKvLayer> {
        let mut layer = self.alloc_kv(num_blocks, block_size, kv_dim)?;
        layer.v = Vec::new();
        Ok(layer)
    }
    fn rope(&self, x: &mut CpuTensor, head_dim: usize, positions: &[u32], rope: &RopeTable) -> Result<()> {
        // Pairs (i, i + half) of the first 2 · half dims of each head; the rest pass.
        let half = rope.inv_freq.len();
        if head_dim == 0
            || 2 * half > head_dim
            || !x.cols.is_multiple_of(head_dim)
            || positions.len() != x.rows
        {
            return Err(Error::Internal(format!(
                "rope of {half} pairs over heads of {head_dim} in rows of {} ({} positions, {} rows)",
                x.cols,
                positions.len(),
                x.rows
            )));
        }
        let cols = x.cols;
        let rotate_row = |(row, &pos): (&mut [f32], &u32)| {
            let mut cos = vec![0f32; half];
            let mut sin = vec![0f32; half];
            for i in 0..half {
                let angle = pos as f32 * rope.inv_freq[i];
                cos[i] = angle.cos() * rope.scale;
                sin[i] = angle.sin() * rope.scale;
            }
            for head in row.chunks_mut(head_dim) {
                let (a, b) = head.split_at_mut(half);
                for i in 0..half {
                    let (x1, x2) = (a[i], b[i]);
                    a[i] = x1 * cos[i] - x2 * sin[i];
                    b[i] = x2 * cos[i] + x1 * sin[i];
                }
            }
        };
        if x.rows >= PAR_ROWS {
            x.data.par_chunks_mut(cols).zip(positions.par_iter()).for_each(rotate_row);
        } else {
            x.data.chunks_mut(cols).zip(positions.iter()).for_each(rotate_row);
        }
        Ok(())
    }
    fn write_kv(
        &self,
        cache: &mut CpuKvLayer,
        k: &CpuTensor,
        v: &CpuTensor,
        layout: &BatchLayout,
    ) -> Result<()> {
        let d = cache.kv_dim;
        for (t, &slot) in layout.slots.iter().enumerate() {
            let at = slot as usize * d;
            cache.k[at..at + d].copy_from_slice(k.row(t));
            if !cache.v.is_empty() {
                cache.v[at..at + d].copy_from_slice(v.row(t));
            }
        }
        Ok(())
    }
    fn attention(
        &self,
        q: &CpuTensor,
        cache: &CpuKvLayer,
        layout: &BatchLayout,
        shape: AttentionShape,
        sinks: Option<&CpuTensor>,
    ) -> Result<CpuTensor> {
        let sinks = sinks.map(|s| &s.data[..]);
        if sinks.is_some_and(|s| s.len() != shape.num_heads) {
            return Err(Error::Internal(format!("attention sinks for {} heads", shape.num_heads)));
        }
        let bf16 = self.computes_bf16.load(std::sync::atomic::Ordering::Relaxed);
        Ok(attention::paged_attention(q, cache, layout, shape, sinks, bf16))
    }
}

impl LogitsOps for CpuBackend {
    fn greedy_picks(&self, logits: &CpuTensor, first_id: u32) -> Result<Vec<crate::logits::Pick>> {
        Ok(super::host_logits::host_picks(&logits.data, logits.rows, logits.cols, first_id))
    }
}

impl ExpertOps for CpuBackend {
    /// The CPU routes on the host (its experts run as matmuls already).
    type DeviceExperts = std::convert::Infallible;

    fn run_experts(&self, _x: &CpuTensor, experts: &Self::DeviceExperts) -> Result<CpuTensor> {
        match *experts {}
    }

    fn routed_counts(&self, experts: &Self::DeviceExperts) -> Result<Option<Vec<u64>>> {
        match *experts {}
    }

    fn scatter_add_rows(
        &self,
        out: &mut CpuTensor,
        y: &CpuTensor,
        rows: &[usize],
        weights: &[f32],
    ) -> Result<()> {
        check_scatter((out.rows, out.cols), (y.rows, y.cols), rows, weights)?;
        for ((i, &r), &w) in rows.iter().enumerate().zip(weights) {
            let src = &y.data[i * y.cols..(i + 1) * y.cols];
            for (o, &v) in out.data[r * out.cols..(r + 1) * out.cols].iter_mut().zip(src) {
                *o += v * w;
            }
        }
        Ok(())
    }
}

/// The CPU replays nothing: its decode steps cost no launches.
impl StepGraphs for CpuBackend {}

#[cfg(test)]
mod tests;
