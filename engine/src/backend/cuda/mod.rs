//! The CUDA backend: bf16 weights and a paged bf16 KV cache in device memory, f32
//! activations, GEMMs through cuBLAS (bf16 × bf16, f32 accumulation and output), every
//! other op a kernel of `kernels.cu` compiled by NVRTC at start-up; a mixture of experts'
//! routed experts run whole on the device (`moe.cu`, [`experts`]).
//!
//! [`CudaBackend`] is the host side — buffer shapes, launch shapes, argument order — and is
//! written once against the [`Gpu`] seam: [`driver::CudaGpu`] runs it on an NVIDIA GPU
//! (feature `cuda`; libraries loaded at run time), the [`emulator`] on CPU threads (feature
//! `cuda-emulator`, tests only), so everything but the vendor libraries is exercised on
//! machines without a GPU.
//!
//! Numerics: matmul inputs are rounded to bf16 (HF transformers runs bf16 models in bf16),
//! so logits differ from the f32-exact CPU backend by bf16 rounding; everything else (norm,
//! RoPE, softmax, residuals) is f32 as on the CPU.
//!
//! Per step, the batch layout (positions, slots, block tables) is uploaded once and reused
//! by every layer; small per-call uploads (token ids, row indices) are the only host →
//! device traffic besides the step's hidden states at pipeline boundaries.

mod blocks;
pub mod device;
#[cfg(feature = "cuda")]
pub mod driver;
/// Without the `cuda` feature: the same names, every call an error that says so.
#[cfg(not(feature = "cuda"))]
#[path = "driver_stub.rs"]
pub mod driver;
#[cfg(feature = "cuda-emulator")]
pub mod emulator;
mod experts;
mod graphs;
pub mod kernels;
mod layout;
mod logits;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use strata_common::{Error, Result};

use self::device::{Arg, Gpu, Launch};
use self::kernels::Kernel;
use self::layout::{DeviceLayout, LayoutArrays};
use super::{
    check_scatter, Activation, AttentionOps, AttentionShape, BatchLayout, ExpertLayer, ExpertOps,
    GraphOutput, Pointwise, RopeTable, StepBody, StepGraphs, TensorOps, Tensors,
};
use crate::step::Step;
use crate::tensor::{DType, HostTensor};

/// Rope tables kept on the device at once (models use one or two).
const MAX_ROPE_TABLES: usize = 4;

/// Threads per block of the attention kernels (a power of two).
const ATTN_THREADS: u32 = 128;
/// Queries per tile of the tiled prefill attention (`TILE_Q` in kernels.cu).
const TILE_Q: usize = 16;
/// Largest head the tiled kernel takes: TILE_Q × head_dim ≤ TILE_MAX_ACC (32) × ATTN_THREADS.
const TILED_MAX_HEAD_DIM: usize = 32 * ATTN_THREADS as usize / TILE_Q;
/// Most head dimensions the attention kernel handles (ATTN_MAX_DIMS × ATTN_THREADS).
const MAX_HEAD_DIM: usize = 5 * ATTN_THREADS as usize;
const ELEMENTWISE_THREADS: u32 = 256;
/// The KV cache holds bf16.
const KV_ELEMENT_BYTES: usize = 2;
const ROW_THREADS: u32 = 256;

/// Row-major f32 activations on the device.
pub struct GpuTensor<B> {
    buf: B,
    pub rows: usize,
    pub cols: usize,
}

impl<B> GpuTensor<B> {
    /// Its device buffer (at least `rows × cols` f32s), for a communicator of device
    /// buffers.
    pub fn buf(&self) -> &B {
        &self.buf
    }

    pub fn buf_mut(&mut self) -> &mut B {
        &mut self.buf
    }
}

/// A `[rows, cols]` bf16 weight matrix on the device.
pub struct GpuWeight<B> {
    buf: B,
    pub rows: usize,
    pub cols: usize,
}

/// One layer's paged K and V, bf16, `[slots, kv_dim]` each.
pub struct GpuKv<B> {
    k: B,
    /// None where the values are the keys ([`AttentionOps::alloc_kv_shared`]).
    v: Option<B>,
    kv_dim: usize,
}

impl<B> GpuKv<B> {
    /// What attention weighs: the values, or the keys where they are one. A shared
    /// layer's writes of V rows (its K rows) land on the keys again, unchanged.
    fn values(&self) -> &B {
        self.v.as_ref().unwrap_or(&self.k)
    }
}

/// The rotary frequencies last uploaded, and their device copy.
/// The rope tables uploaded so far, by their frequencies (a model has one, or two: local
/// and global layers). Uploaded once, so a captured step finds them on the device.
type RopeCache<B> = Mutex<Vec<(Vec<f32>, Arc<B>)>>;

/// Layouts kept on the device: a step uploads one for each KV group of the model's
/// layers (Gemma 3's shapes have up to 7).
const LAYOUTS_KEPT: usize = 16;

pub struct CudaBackend<G: Gpu> {
    gpu: Arc<G>,
    /// The step's layouts on the device, the latest first: one for each KV group of the
    /// model's layers (at most [`LAYOUTS_KEPT`]).
    layout: Mutex<Vec<Arc<DeviceLayout<G::Buf>>>>,
    rope: RopeCache<G::Buf>,
    graphs: Mutex<graphs::Graphs<G>>,
    /// A captured step's token ids and logit rows, while it is captured.
    pinned: Mutex<Option<graphs::Pinned<G::Buf>>>,
    /// Blocks the engine's KV cache has; one more, past them, is the scratch block that
    /// the padding rows of a graph's step write and read. usize::MAX before `alloc_kv`.
    kv_blocks: AtomicUsize,
}

fn i32_bytes(v: &[i32]) -> &[u8] {
    bytemuck::cast_slice(v)
}

fn to_i32(v: impl IntoIterator<Item = usize>) -> Result<Vec<i32>> {
    v.into_iter()
        .map(|x| i32::try_from(x).map_err(|_| Error::Internal(format!("{x} does not fit a kernel's i32"))))
        .collect()
}

fn dim(x: usize) -> Result<i32> {
    i32::try_from(x).map_err(|_| Error::Internal(format!("{x} does not fit a kernel's i32")))
}

impl<G: Gpu> CudaBackend<G> {
    /// A backend on `gpu` that replays decode steps from CUDA graphs.
    pub fn new(gpu: Arc<G>) -> Self {
        Self::with_graphs(gpu, true)
    }

    /// A backend that captures decode steps as graphs, or (`graphs` false) runs every
    /// step op by op (`--enforce-eager`).
    pub fn with_graphs(gpu: Arc<G>, graphs: bool) -> Self {
        CudaBackend {
            gpu,
            layout: Mutex::new(Vec::new()),
            rope: Mutex::new(Vec::new()),
            graphs: Mutex::new(graphs::Graphs::new(graphs)),
            pinned: Mutex::new(None),
            kv_blocks: AtomicUsize::new(usize::MAX),
        }
    }

    /// `values` as the kernels' i32 on the device: while a step is captured, its pinned
    /// buffer (`which`: token ids or logit rows) when that holds them; else an upload.
    fn indices(
        &self,
        values: impl IntoIterator<Item = usize>,
        which: fn(&graphs::Pinned<G::Buf>) -> &graphs::Indices<G::Buf>,
    ) -> Result<Arc<G::Buf>> {
        let v = to_i32(values)?;
        if let Some(p) = self.pinned.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            let pinned = which(p);
            if pinned.values == v {
                return Ok(pinned.buf.clone());
            }
        }
        Ok(Arc::new(self.gpu.upload(i32_bytes(if v.is_empty() { &[0] } else { &v }))?))
    }

    /// The KV block past the engine's, which padding rows use (None before `alloc_kv`).
    fn scratch_block(&self) -> Option<u32> {
        u32::try_from(self.kv_blocks.load(Ordering::Relaxed)).ok()
    }

    pub fn gpu(&self) -> &Arc<G> {
        &self.gpu
    }

    /// An output tensor (contents undefined until an op writes every element).
    pub fn output(&self, rows: usize, cols: usize) -> Result<GpuTensor<G::Buf>> {
        Ok(GpuTensor { buf: self.gpu.alloc_output((rows * cols).max(1) * 4)?, rows, cols })
    }

    /// `x` rounded to bf16, the GEMMs' input.
    fn cast_bf16(&self, x: &GpuTensor<G::Buf>) -> Result<G::Buf> {
        let n = x.rows * x.cols;
        let xb = self.gpu.alloc_output(n.max(1) * 2)?;
        self.launch(
            Kernel::CastBf16,
            Launch::elements(n, ELEMENTWISE_THREADS),
            &[Arg::Buf(&x.buf), Arg::Buf(&xb), Arg::I32(dim(n)?)],
        )?;
        Ok(xb)
    }

    fn gemm(&self, x: &GpuTensor<G::Buf>, xb: &G::Buf, w: &GpuWeight<G::Buf>) -> Result<GpuTensor<G::Buf>> {
        if x.cols != w.cols {
            return Err(Error::Internal(format!(
                "matmul of [{}, {}] by [{}, {}]ᵀ",
                x.rows, x.cols, w.rows, w.cols
            )));
        }
        let mut y = self.output(x.rows, w.rows)?;
        if x.rows > 0 {
            self.gpu.gemm_bf16(w.rows, x.rows, w.cols, &w.buf, xb, &mut y.buf)?;
        }
        Ok(y)
    }

    fn launch(&self, k: Kernel, l: Launch, args: &[Arg<'_, G::Buf>]) -> Result<()> {
        if l.grid.0 == 0 || l.grid.1 == 0 || l.grid.2 == 0 {
            return Ok(()); // nothing to do (an empty batch)
        }
        self.gpu.launch(k, l, args)
    }

    /// The device copy of `layout`, uploaded on the step's first use.
    fn device_layout(&self, layout: &BatchLayout) -> Result<Arc<DeviceLayout<G::Buf>>> {
        let key = LayoutArrays::of(layout, None)?;
        let mut cached = self.layout.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(l) = cached.iter().find(|l| l.key == key) {
            return Ok(l.clone());
        }
        let l = Arc::new(DeviceLayout::upload(&*self.gpu, layout, None)?);
        cached.insert(0, l.clone());
        cached.truncate(LAYOUTS_KEPT);
        Ok(l)
    }

    fn rope_table(&self, rope: &RopeTable) -> Result<Arc<G::Buf>> {
        let mut cached = self.rope.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, buf)) = cached.iter().find(|(freqs, _)| *freqs == rope.inv_freq) {
            return Ok(buf.clone());
        }
        let buf = Arc::new(self.gpu.upload(bytemuck::cast_slice(&rope.inv_freq))?);
        if cached.len() == MAX_ROPE_TABLES {
            cached.remove(0);
        }
        cached.push((rope.inv_freq.clone(), buf.clone()));
        Ok(buf)
    }
}

impl<G: Gpu> CudaBackend<G> {
    /// Bytes of one layer's K (or V) storage: one block more than asked, the scratch
    /// block of graphs' padding rows.
    fn kv_bytes(&self, num_blocks: usize, block_size: usize, kv_dim: usize) -> Result<usize> {
        let bytes = (num_blocks + 1)
            .checked_mul(block_size)
            .and_then(|n| n.checked_mul(kv_dim))
            .and_then(|n| n.checked_mul(KV_ELEMENT_BYTES))
            .ok_or_else(|| Error::invalid("kv_cache", "size overflows"))?;
        Ok(bytes.max(4))
    }

    /// tiled_attention over the step's prefill tiles, into `out`.
    #[allow(clippy::too_many_arguments)]
    fn launch_tiled(
        &self,
        q: &GpuTensor<G::Buf>,
        cache: &GpuKv<G::Buf>,
        out: &GpuTensor<G::Buf>,
        l: &DeviceLayout<G::Buf>,
        block_size: usize,
        shape: AttentionShape,
        sinks: Option<&GpuTensor<G::Buf>>,
    ) -> Result<()> {
        let AttentionShape { num_heads, num_kv_heads, head_dim, scale, sliding_window, softcap } = shape;
        // Key chunk: 16 positions, fewer for wide heads (dynamic shared memory ≤ 48 KiB).
        let tile_k = if head_dim <= 128 { 16 } else { 8 };
        let floats = TILE_Q * head_dim + 2 * tile_k * head_dim + TILE_Q * tile_k + 3 * TILE_Q;
        let launch = Launch {
            grid: (l.num_tiles as u32, num_heads as u32, 1),
            block: ATTN_THREADS,
            shared_bytes: (floats * 4) as u32,
        };
        self.launch(
            Kernel::TiledAttention,
            launch,
            &[
                Arg::Buf(&q.buf),
                Arg::Buf(&cache.k),
                Arg::Buf(cache.values()),
                Arg::Buf(&out.buf),
                Arg::Buf(&l.tiles),
                Arg::Buf(&l.tile_len),
                Arg::Buf(&l.tok_seq),
                Arg::Buf(&l.seq_start),
                Arg::Buf(&l.seq_ctx),
                Arg::Buf(&l.bt_offset),
                Arg::Buf(&l.block_tables),
                Arg::I32(dim(num_heads)?),
                Arg::I32(dim(num_kv_heads)?),
                Arg::I32(dim(head_dim)?),
                Arg::I32(dim(cache.kv_dim)?),
                Arg::I32(dim(block_size)?),
                Arg::F32(scale),
                Arg::I32(dim(sliding_window.unwrap_or(0))?),
                Arg::I32(dim(tile_k)?),
                Arg::F32(softcap.unwrap_or(0.0)),
                // Without sinks the pointer is never read.
                Arg::Buf(&sinks.unwrap_or(q).buf),
                Arg::I32(i32::from(sinks.is_some())),
            ],
        )
    }
}

impl<G: Gpu> Tensors for CudaBackend<G> {
    type Tensor = GpuTensor<G::Buf>;
    type Weight = GpuWeight<G::Buf>;
    fn name(&self) -> &'static str {
        "cuda"
    }
    fn load_weight(&self, host: &HostTensor) -> Result<Self::Weight> {
        let [rows, cols] = host.shape[..] else {
            return Err(Error::model_file(
                host.file.as_path(),
                format!("tensor {:?} should be 2-D, has shape {:?}", host.name, host.shape),
            ));
        };
        let bf16 = host.cast(DType::BF16);
        Ok(GpuWeight { buf: self.gpu.upload(bf16.bytes())?, rows, cols })
    }
    fn load_vector(&self, host: &HostTensor) -> Result<Self::Tensor> {
        if host.shape.len() != 1 {
            return Err(Error::model_file(
                host.file.as_path(),
                format!("tensor {:?} should be 1-D, has shape {:?}", host.name, host.shape),
            ));
        }
        let data = host.to_f32_vec();
        self.upload(data.clone(), 1, data.len())
    }
    fn weight_bytes(&self, w: &Self::Weight) -> usize {
        w.rows * w.cols * 2
    }
    fn to_host(&self, x: &Self::Tensor) -> Result<Vec<f32>> {
        let mut out = vec![0f32; x.rows * x.cols];
        self.gpu.download(&x.buf, bytemuck::cast_slice_mut(&mut out))?;
        Ok(out)
    }
    fn upload(&self, data: Vec<f32>, rows: usize, cols: usize) -> Result<Self::Tensor> {
        if data.len() != rows * cols {
            return Err(Error::Internal(format!("{} values for a [{rows}, {cols}] tensor", data.len())));
        }
        let bytes: &[u8] = if data.is_empty() { &[0; 4] } else { bytemuck::cast_slice(&data) };
        Ok(GpuTensor { buf: self.gpu.upload(bytes)?, rows, cols })
    }
    fn with_host_mut(&self, x: &mut Self::Tensor, f: &mut dyn FnMut(&mut [f32]) -> Result<()>) -> Result<()> {
        let mut host = self.to_host(x)?;
        f(&mut host)?;
        if !host.is_empty() {
            self.gpu.write(&mut x.buf, bytemuck::cast_slice(&host))?;
        }
        Ok(())
    }

    fn shape(&self, x: &Self::Tensor) -> (usize, usize) {
        (x.rows, x.cols)
    }
    fn reshape(&self, x: Self::Tensor, rows: usize, cols: usize) -> Result<Self::Tensor> {
        if rows * cols != x.rows * x.cols {
            return Err(Error::Internal(format!("[{}, {}] reshaped as [{rows}, {cols}]", x.rows, x.cols)));
        }
        Ok(GpuTensor { rows, cols, ..x })
    }
}

impl<G: Gpu> TensorOps for CudaBackend<G> {
    fn embed(&self, table: &Self::Weight, ids: &[u32], first_id: u32) -> Result<Self::Tensor> {
        let out = self.output(ids.len(), table.cols)?;
        let ids_buf = self.indices(ids.iter().map(|&i| i as usize), |p| &p.ids)?;
        self.launch(
            Kernel::Embed,
            Launch::rows(ids.len(), ROW_THREADS),
            &[
                Arg::Buf(&table.buf),
                Arg::Buf(&ids_buf),
                Arg::Buf(&out.buf),
                Arg::I32(dim(table.cols)?),
                Arg::I32(dim(first_id as usize)?),
                Arg::I32(dim(table.rows)?),
            ],
        )?;
        Ok(out)
    }
    fn matmul(&self, x: &Self::Tensor, w: &Self::Weight) -> Result<Self::Tensor> {
        let xb = self.cast_bf16(x)?;
        self.gemm(x, &xb, w)
    }
    fn matmul_many(&self, x: &Self::Tensor, ws: &[&Self::Weight]) -> Result<Vec<Self::Tensor>> {
        // One bf16 copy of the input for every projection that reads it (q/k/v, gate/up).
        let xb = self.cast_bf16(x)?;
        ws.iter().map(|w| self.gemm(x, &xb, w)).collect()
    }
    fn add_bias(&self, x: &mut Self::Tensor, bias: &Self::Tensor) -> Result<()> {
        let n = x.rows * x.cols;
        self.launch(
            Kernel::AddBias,
            Launch::elements(n, ELEMENTWISE_THREADS),
            &[Arg::Buf(&x.buf), Arg::Buf(&bias.buf), Arg::I32(dim(x.rows)?), Arg::I32(dim(x.cols)?)],
        )
    }
    fn add_assign(&self, x: &mut Self::Tensor, y: &Self::Tensor) -> Result<()> {
        let n = x.rows * x.cols;
        if n != y.rows * y.cols {
            return Err(Error::Internal("add of tensors of different sizes".into()));
        }
        self.launch(
            Kernel::Add,
            Launch::elements(n, ELEMENTWISE_THREADS),
            &[Arg::Buf(&x.buf), Arg::Buf(&y.buf), Arg::I32(dim(n)?)],
        )
    }
    fn rms_norm(&self, x: &Self::Tensor, weight: &Self::Tensor, eps: f32) -> Result<Self::Tensor> {
        let y = self.output(x.rows, x.cols)?;
        self.launch(
            Kernel::RmsNorm,
            Launch::rows(x.rows, ROW_THREADS),
            &[
                Arg::Buf(&x.buf),
                Arg::Buf(&weight.buf),
                Arg::Buf(&y.buf),
                Arg::I32(dim(x.cols)?),
                Arg::F32(eps),
            ],
        )?;
        Ok(y)
    }
    fn add_rms_norm(
        &self,
        x: &mut Self::Tensor,
        delta: &Self::Tensor,
        weight: &Self::Tensor,
        eps: f32,
    ) -> Result<Self::Tensor> {
        if (x.rows, x.cols) != (delta.rows, delta.cols) || weight.rows * weight.cols != x.cols {
            return Err(Error::Internal("add_rms_norm of tensors of different shapes".into()));
        }
        let y = self.output(x.rows, x.cols)?;
        self.launch(
            Kernel::AddRmsNorm,
            Launch::rows(x.rows, ROW_THREADS),
            &[
                Arg::Buf(&x.buf),
                Arg::Buf(&delta.buf),
                Arg::Buf(&weight.buf),
                Arg::Buf(&y.buf),
                Arg::I32(dim(x.cols)?),
                Arg::F32(eps),
            ],
        )?;
        Ok(y)
    }
    fn gated(&self, act: Activation, gate: &Self::Tensor, up: &Self::Tensor) -> Result<Self::Tensor> {
        if (gate.rows, gate.cols) != (up.rows, up.cols) {
            return Err(Error::Internal("a gated product of tensors of different shapes".into()));
        }
        let y = self.output(gate.rows, gate.cols)?;
        let n = gate.rows * gate.cols;
        let mut args = vec![Arg::Buf(&gate.buf), Arg::Buf(&up.buf), Arg::Buf(&y.buf), Arg::I32(dim(n)?)];
        let kernel = match act {
            Activation::Silu => Kernel::SiluMul,
            Activation::GeluTanh => Kernel::GeluTanhMul,
            Activation::ClampedSwiglu { alpha, limit } => {
                args.extend([Arg::F32(alpha), Arg::F32(limit)]);
                Kernel::ClampedSwigluMul
            }
        };
        self.launch(kernel, Launch::elements(n, ELEMENTWISE_THREADS), &args)?;
        Ok(y)
    }
    fn pointwise(&self, x: &mut Self::Tensor, op: Pointwise) -> Result<()> {
        let n = x.rows * x.cols;
        let (mode, a) = match op {
            Pointwise::Scale(s) => (0, s),
            Pointwise::SoftCap(c) => (1, c),
        };
        let args = [Arg::Buf(&x.buf), Arg::I32(dim(n)?), Arg::I32(mode), Arg::F32(a)];
        self.launch(Kernel::Pointwise, Launch::elements(n, ELEMENTWISE_THREADS), &args)
    }
    fn gather_rows(&self, x: &Self::Tensor, rows: &[usize]) -> Result<Self::Tensor> {
        if let Some(bad) = rows.iter().find(|&&r| r >= x.rows) {
            return Err(Error::Internal(format!("gather of row {bad} of {}", x.rows)));
        }
        let y = self.output(rows.len(), x.cols)?;
        let idx_buf = self.indices(rows.iter().copied(), |p| &p.rows)?;
        self.launch(
            Kernel::GatherRows,
            Launch::rows(rows.len(), ROW_THREADS),
            &[Arg::Buf(&x.buf), Arg::Buf(&idx_buf), Arg::Buf(&y.buf), Arg::I32(dim(x.cols)?)],
        )?;
        Ok(y)
    }

    fn columns(&self, x: &Self::Tensor, cols: std::ops::Range<usize>) -> Result<Self::Tensor> {
        if cols.end > x.cols || cols.start > cols.end {
            return Err(Error::Internal(format!("columns {cols:?} of {}", x.cols)));
        }
        let y = self.output(x.rows, cols.len())?;
        self.copy_block(x, &y, (cols.start, 0, 0), cols.len())?;
        Ok(y)
    }
    fn concat_columns(&self, parts: &[&Self::Tensor]) -> Result<Self::Tensor> {
        let rows = parts.first().map_or(0, |p| p.rows);
        if parts.iter().any(|p| p.rows != rows) {
            return Err(Error::Internal("concatenating tensors of different row counts".into()));
        }
        let y = self.output(rows, parts.iter().map(|p| p.cols).sum())?;
        let mut at = 0;
        for p in parts {
            self.copy_block(p, &y, (0, at, 0), p.cols)?;
            at += p.cols;
        }
        Ok(y)
    }
    fn concat_rows(&self, parts: &[&Self::Tensor]) -> Result<Self::Tensor> {
        let cols = parts.first().map_or(0, |p| p.cols);
        if parts.iter().any(|p| p.cols != cols) {
            return Err(Error::Internal("stacking tensors of different widths".into()));
        }
        let y = self.output(parts.iter().map(|p| p.rows).sum(), cols)?;
        let mut at = 0;
        for p in parts {
            self.copy_block(p, &y, (0, 0, at), cols)?;
            at += p.rows;
        }
        Ok(y)
    }
    fn interleave_blocks(&self, x: &Self::Tensor, blocks: usize) -> Result<Self::Tensor> {
        if blocks == 0 || !x.rows.is_multiple_of(blocks) {
            return Err(Error::Internal(format!("{} rows are not {blocks} blocks", x.rows)));
        }
        let (rows, w) = (x.rows / blocks, x.cols);
        let y = self.output(rows, w * blocks)?;
        if rows == 0 {
            return Ok(y); // no launch of an empty grid
        }
        let args = [
            Arg::Buf(&x.buf),
            Arg::Buf(&y.buf),
            Arg::I32(dim(rows)?),
            Arg::I32(dim(w)?),
            Arg::I32(dim(blocks)?),
        ];
        self.launch(Kernel::UnshardRows, Launch::rows(rows, ROW_THREADS), &args)?;
        Ok(y)
    }
}

impl<G: Gpu> AttentionOps for CudaBackend<G> {
    type KvLayer = GpuKv<G::Buf>;
    fn alloc_kv(&self, num_blocks: usize, block_size: usize, kv_dim: usize) -> Result<Self::KvLayer> {
        let mut layer = self.alloc_kv_shared(num_blocks, block_size, kv_dim)?;
        layer.v = Some(self.gpu.alloc(self.kv_bytes(num_blocks, block_size, kv_dim)?)?);
        Ok(layer)
    }
    fn alloc_kv_shared(&self, num_blocks: usize, block_size: usize, kv_dim: usize) -> Result<Self::KvLayer> {
        self.kv_blocks.store(num_blocks, Ordering::Relaxed);
        Ok(GpuKv { k: self.gpu.alloc(self.kv_bytes(num_blocks, block_size, kv_dim)?)?, v: None, kv_dim })
    }
    fn kv_element_bytes(&self) -> usize {
        KV_ELEMENT_BYTES
    }
    fn rope(&self, x: &mut Self::Tensor, head_dim: usize, positions: &[u32], rope: &RopeTable) -> Result<()> {
        if positions.len() != x.rows
            || head_dim == 0
            || !x.cols.is_multiple_of(head_dim)
            || !head_dim.is_multiple_of(2)
            || 2 * rope.inv_freq.len() > head_dim
        {
            return Err(Error::Internal(format!(
                "rope of [{}, {}] with head_dim {head_dim} and {} positions",
                x.rows,
                x.cols,
                positions.len()
            )));
        }
        // The step's layout (uploaded by the previous layer, or by write_kv) usually holds
        // these positions already.
        let cached = self.layout.lock().unwrap_or_else(|p| p.into_inner()).first().cloned();
        let pos = to_i32(positions.iter().map(|&p| p as usize))?;
        let fresh;
        let pos_buf = match cached.as_ref().filter(|l| l.key.positions == pos) {
            Some(l) => &l.positions,
            None => {
                fresh = self.gpu.upload(i32_bytes(if pos.is_empty() { &[0] } else { &pos }))?;
                &fresh
            }
        };
        let freqs = self.rope_table(rope)?;
        self.launch(
            Kernel::Rope,
            Launch::rows(x.rows, ROW_THREADS),
            &[
                Arg::Buf(&x.buf),
                Arg::Buf(pos_buf),
                Arg::Buf(&freqs),
                Arg::I32(dim(x.cols)?),
                Arg::I32(dim(head_dim)?),
                Arg::I32(dim(rope.inv_freq.len())?),
                Arg::F32(rope.scale),
            ],
        )
    }
    fn rope_write_kv(
        &self,
        q: &mut Self::Tensor,
        k: &mut Self::Tensor,
        v: &Self::Tensor,
        cache: &mut Self::KvLayer,
        layout: &BatchLayout,
        head_dim: usize,
        rope: &RopeTable,
    ) -> Result<()> {
        let rows = layout.positions.len();
        let shapes_ok = q.rows == rows && k.rows == rows && v.rows == rows && layout.slots.len() == rows;
        let heads_ok = head_dim > 0
            && head_dim.is_multiple_of(2)
            && 2 * rope.inv_freq.len() <= head_dim
            && q.cols.is_multiple_of(head_dim)
            && k.cols == cache.kv_dim
            && v.cols == cache.kv_dim
            && cache.kv_dim.is_multiple_of(head_dim);
        if !shapes_ok || !heads_ok {
            return Err(Error::Internal(format!(
                "rope_write_kv of q [{}, {}], k [{}, {}] for {rows} positions, head_dim {head_dim}, kv_dim {}",
                q.rows, q.cols, k.rows, k.cols, cache.kv_dim
            )));
        }
        let l = self.device_layout(layout)?;
        let freqs = self.rope_table(rope)?;
        self.launch(
            Kernel::RopeWriteKv,
            Launch::rows(rows, ROW_THREADS),
            &[
                Arg::Buf(&q.buf),
                Arg::Buf(&k.buf),
                Arg::Buf(&v.buf),
                Arg::Buf(&cache.k),
                Arg::Buf(cache.values()),
                Arg::Buf(&l.positions),
                Arg::Buf(&l.slots),
                Arg::Buf(&freqs),
                Arg::I32(dim(q.cols)?),
                Arg::I32(dim(cache.kv_dim)?),
                Arg::I32(dim(head_dim)?),
                Arg::I32(dim(rope.inv_freq.len())?),
                Arg::F32(rope.scale),
            ],
        )
    }
    fn write_kv(
        &self,
        cache: &mut Self::KvLayer,
        k: &Self::Tensor,
        v: &Self::Tensor,
        layout: &BatchLayout,
    ) -> Result<()> {
        if k.cols != cache.kv_dim || v.cols != cache.kv_dim || layout.slots.len() != k.rows {
            return Err(Error::Internal("write_kv: K/V rows do not match the cache or the layout".into()));
        }
        let l = self.device_layout(layout)?;
        self.launch(
            Kernel::WriteKv,
            Launch::rows(k.rows, ROW_THREADS),
            &[
                Arg::Buf(&cache.k),
                Arg::Buf(cache.values()),
                Arg::Buf(&k.buf),
                Arg::Buf(&v.buf),
                Arg::Buf(&l.slots),
                Arg::I32(dim(cache.kv_dim)?),
            ],
        )
    }
    fn attention(
        &self,
        q: &Self::Tensor,
        cache: &Self::KvLayer,
        layout: &BatchLayout,
        shape: AttentionShape,
        sinks: Option<&Self::Tensor>,
    ) -> Result<Self::Tensor> {
        let AttentionShape { num_heads, num_kv_heads, head_dim, scale, sliding_window, softcap } = shape;
        if sinks.is_some_and(|s| s.rows * s.cols != num_heads) {
            return Err(Error::Internal(format!("attention sinks for {num_heads} heads")));
        }
        if head_dim > MAX_HEAD_DIM || num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
            return Err(Error::Unsupported(format!(
                "CUDA attention needs head_dim ≤ {MAX_HEAD_DIM} and heads divisible by KV heads (head_dim {head_dim}, {num_heads} heads, {num_kv_heads} KV heads)"
            )));
        }
        let out = self.output(q.rows, num_heads * head_dim)?;
        let l = self.device_layout(layout)?;
        // Prefill chunks in tiles (K/V read once per tile, not per query); decoding tokens
        // one block each (their positions spread over the block's threads).
        let tiled = l.num_tiles > 0 && head_dim <= TILED_MAX_HEAD_DIM;
        if tiled {
            self.launch_tiled(q, cache, &out, &l, layout.block_size, shape, sinks)?;
        }
        let (rows, use_rows) = if tiled { (l.num_decode_rows, 1) } else { (q.rows, 0) };
        let shared = ((head_dim + 3 * ATTN_THREADS as usize) * 4) as u32;
        let launch =
            Launch { grid: (rows as u32, num_heads as u32, 1), block: ATTN_THREADS, shared_bytes: shared };
        self.launch(
            Kernel::PagedAttention,
            launch,
            &[
                Arg::Buf(&q.buf),
                Arg::Buf(&cache.k),
                Arg::Buf(cache.values()),
                Arg::Buf(&out.buf),
                Arg::Buf(&l.tok_seq),
                Arg::Buf(&l.seq_start),
                Arg::Buf(&l.seq_ctx),
                Arg::Buf(&l.bt_offset),
                Arg::Buf(&l.block_tables),
                Arg::I32(dim(num_heads)?),
                Arg::I32(dim(num_kv_heads)?),
                Arg::I32(dim(head_dim)?),
                Arg::I32(dim(cache.kv_dim)?),
                Arg::I32(dim(layout.block_size)?),
                Arg::F32(scale),
                Arg::I32(dim(sliding_window.unwrap_or(0))?),
                Arg::Buf(&l.decode_rows),
                Arg::I32(use_rows),
                Arg::F32(softcap.unwrap_or(0.0)),
                Arg::Buf(&sinks.unwrap_or(q).buf),
                Arg::I32(i32::from(sinks.is_some())),
            ],
        )?;
        Ok(out)
    }
}

impl<G: Gpu> ExpertOps for CudaBackend<G> {
    type DeviceExperts = experts::DeviceExperts<G::Buf>;

    fn device_experts(&self, layer: ExpertLayer<'_, Self>) -> Result<Option<Self::DeviceExperts>> {
        self.prepare_device_experts(layer)
    }

    fn run_experts(&self, x: &Self::Tensor, experts: &Self::DeviceExperts) -> Result<Self::Tensor> {
        self.run_device_experts(x, experts)
    }

    fn routed_counts(&self, experts: &Self::DeviceExperts) -> Result<Option<Vec<u64>>> {
        self.device_routed_counts(experts)
    }

    fn scatter_add_rows(
        &self,
        out: &mut Self::Tensor,
        y: &Self::Tensor,
        rows: &[usize],
        weights: &[f32],
    ) -> Result<()> {
        check_scatter((out.rows, out.cols), (y.rows, y.cols), rows, weights)?;
        if rows.is_empty() {
            return Ok(());
        }
        let idx = self.indices(rows.iter().copied(), |p| &p.rows)?;
        let w = self.upload(weights.to_vec(), 1, weights.len())?;
        let args =
            [Arg::Buf(&out.buf), Arg::Buf(&y.buf), Arg::Buf(&idx), Arg::Buf(&w.buf), Arg::I32(dim(y.cols)?)];
        self.launch(Kernel::ScatterAddRows, Launch::rows(rows.len(), ROW_THREADS), &args)
    }
}

impl<G: Gpu> StepGraphs for CudaBackend<G> {
    fn replay_decode(
        &self,
        step: &Step,
        output: GraphOutput,
        body: &mut StepBody<'_, Self::Tensor>,
    ) -> Result<Option<Vec<f32>>> {
        self.replay_decode_step(step, output, body)
    }
}

#[cfg(all(test, feature = "cuda-emulator"))]
mod tests;
