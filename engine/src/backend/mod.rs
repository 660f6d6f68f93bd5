//! The seam between the model and the hardware, as small traits by concern.
//!
//! [`model`](crate::model) is written once against [`Backend`], which is nothing but the
//! sum of the parts a backend implements:
//!
//! | trait | what it is for |
//! |---|---|
//! | [`Tensors`] | where tensors live: weights loaded, activations to and from the host |
//! | [`TensorOps`] | the math of a layer: matmuls, norms, activations, gathers |
//! | [`AttentionOps`] | the paged KV cache and attention over it, rotary positions |
//! | [`LogitsOps`] | a step's logits reduced where they are: greedy picks, top-k, draws |
//! | [`ExpertOps`] | what a mixture of experts adds: each expert's rows combined back |
//! | [`StepGraphs`] | decode steps captured once and replayed (CUDA graphs) |
//!
//! A backend implements what it supports and takes the defaults for the rest (the host's
//! reductions, no graphs). Communication is not a backend's business: collectives on
//! backend tensors are [`crate::comm::DeviceCollectives`], beside it.
//!
//! Activations are 2-D row-major f32 (`[tokens, features]`); weights stay in the
//! checkpoint's dtype (`[out_features, in_features]`) and are widened inside the matmul.
//! The step's layout (which token belongs to which sequence, its position, its KV slot)
//! is plain host data in [`BatchLayout`]; the paged-KV bookkeeping that fills it lives in
//! [`kv`](crate::kv).

pub mod check;
pub mod cpu;
pub mod cuda;
pub mod host_logits;
pub mod routing;

use std::ops::Range;

use strata_common::{Error, Result};

use crate::logits::{Candidates, Draw, LogitsWanted, Pick};
use crate::step::Step;
use crate::tensor::{DType, HostTensor};

pub use crate::step::{BatchLayout, SeqSlice};
pub use strata_common::{Activation, Device};

/// An elementwise map of a tensor (see [`TensorOps::pointwise`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Pointwise {
    /// `x · s` (Gemma's embeddings, by √hidden).
    Scale(f32),
    /// `c · tanh(x / c)`: soft-capping at `c` (Gemma's final logits).
    SoftCap(f32),
}

impl Pointwise {
    /// The host's value of `x` (the CPU's kernel and the reference of the device's).
    pub fn apply(self, x: f32) -> f32 {
        match self {
            Pointwise::Scale(s) => x * s,
            Pointwise::SoftCap(c) => (x / c).tanh() * c,
        }
    }
}

/// How a rank's backend is built.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BackendOptions {
    pub device: Device,
    /// The model's dtype (`--dtype`), None for the checkpoint's. Weight matrices are kept
    /// in it, and the compute follows it as in HF transformers and vLLM: bf16 weights run
    /// bf16 × bf16 matmuls with f32 accumulation (norms, softmax and residual sums stay
    /// f32; the CPU's KV cache is f32, the GPU's bf16); `F32` keeps the checkpoint's
    /// weights and widens them to f32 inside every matmul, which is bit-for-bit the
    /// upcast model without a second copy.
    pub dtype: Option<DType>,
    /// CPU: quantize weight matrices at load.
    pub quantize: Option<Quantization>,
    /// GPU: run every step op by op instead of replaying decode steps from CUDA graphs
    /// (`--enforce-eager`; for debugging and for measuring what the graphs save).
    pub enforce_eager: bool,
}

/// How weights may be quantized at load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Quantization {
    /// int8, symmetric, one f32 scale per output channel.
    Int8,
}

impl Quantization {
    /// `int8` (the flag's and the config's spelling).
    pub fn parse(s: &str) -> strata_common::Result<Option<Self>> {
        match s {
            "" | "none" => Ok(None),
            "int8" => Ok(Some(Quantization::Int8)),
            other => Err(strata_common::Error::invalid("quantize", format!("{other:?}: give int8 or none"))),
        }
    }
}

/// Rotary embedding frequencies (a model may have several: local and global layers).
#[derive(Debug, Clone, PartialEq)]
pub struct RopeTable {
    /// Inverse frequencies, already rescaled (linear, llama3, YaRN, LongRoPE): one per
    /// rotated pair. Rope rotates the first `2 · inv_freq.len()` dims of each head (all
    /// of them, or `partial_rotary_factor` of them), pairing dim `i` with `i + len`.
    pub inv_freq: Vec<f32>,
    /// Rotated dims are multiplied by this (YaRN's and LongRoPE's attention factor).
    pub scale: f32,
}

/// Shape of the attention a layer computes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionShape {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
    /// A windowed layer attends to this many positions back, its own included.
    pub sliding_window: Option<usize>,
    /// Scaled scores are soft-capped, `c · tanh(s / c)`, before the softmax (Gemma 2).
    pub softcap: Option<f32>,
}

/// Where a backend's tensors live. Every op can fail (a device error, an allocation the
/// device cannot make): the step fails with the error instead of the process panicking.
pub trait Tensors: Send + Sync + 'static {
    /// 2-D f32 activations.
    type Tensor: Send + Sync;
    /// A `[out, in]` weight matrix in its stored dtype.
    type Weight: Send + Sync;

    fn name(&self) -> &'static str;
    /// Whether the ops fan out over rayon's thread pool (the CPU backend). A step then
    /// runs inside the pool, so that each op's parallel loop starts on a worker that takes
    /// part in it, instead of handing the loop to the pool and sleeping until it is done
    /// (two such round trips per matmul: ~230 per decode step of a 16-layer model).
    fn uses_thread_pool(&self) -> bool {
        false
    }
    /// Makes a weight matrix from a checkpoint view (2-D).
    fn load_weight(&self, host: &HostTensor) -> Result<Self::Weight>;
    /// Makes a weight matrix from an int8 checkpoint's values and per-row scales
    /// (`strata model quantize`).
    fn load_weight_int8(&self, q: &HostTensor, _scales: &HostTensor) -> Result<Self::Weight> {
        Err(strata_common::Error::Unsupported(format!(
            "{:?} is int8 (a checkpoint from `strata model quantize`): only the CPU backend runs int8 weights",
            q.name
        )))
    }
    /// Makes a `[1, n]` f32 tensor from a 1-D checkpoint view (norm weights, biases).
    fn load_vector(&self, host: &HostTensor) -> Result<Self::Tensor>;
    /// Bytes a weight occupies in memory.
    fn weight_bytes(&self, w: &Self::Weight) -> usize;
    /// `(rows, cols)` of a tensor.
    fn shape(&self, x: &Self::Tensor) -> (usize, usize);
    /// The same elements, in the same order, as `[rows, cols]` (no copy): per-head work
    /// on `[tokens, heads · head_dim]` activations sees them as `[tokens · heads, head_dim]`.
    fn reshape(&self, x: Self::Tensor, rows: usize, cols: usize) -> Result<Self::Tensor>;
    /// Copies a tensor to host memory, row-major.
    fn to_host(&self, x: &Self::Tensor) -> Result<Vec<f32>>;
    /// A tensor from host data, row-major.
    fn upload(&self, data: Vec<f32>, rows: usize, cols: usize) -> Result<Self::Tensor>;
    /// Runs `f` on the tensor's elements in host memory (a host communicator's
    /// collective); a device backend copies out and back, the CPU's copies nothing.
    fn with_host_mut(&self, x: &mut Self::Tensor, f: &mut dyn FnMut(&mut [f32]) -> Result<()>) -> Result<()>;
}

/// The math of a decoder layer.
pub trait TensorOps: Tensors {
    /// Rows of the embedding table for `ids`; the table holds ids `first_id..` (a
    /// vocabulary shard) and ids outside it get zero rows.
    fn embed(&self, table: &Self::Weight, ids: &[u32], first_id: u32) -> Result<Self::Tensor>;
    /// `x · wᵀ`: `[n, in] × [out, in]ᵀ → [n, out]`.
    fn matmul(&self, x: &Self::Tensor, w: &Self::Weight) -> Result<Self::Tensor>;
    /// `x · wᵀ` for several weights reading the same input (q/k/v, gate/up), so a
    /// backend can prepare the input once.
    fn matmul_many(&self, x: &Self::Tensor, ws: &[&Self::Weight]) -> Result<Vec<Self::Tensor>> {
        ws.iter().map(|w| self.matmul(x, w)).collect()
    }
    /// Adds a `[1, cols]` bias to every row.
    fn add_bias(&self, x: &mut Self::Tensor, bias: &Self::Tensor) -> Result<()>;
    /// `x += y`.
    fn add_assign(&self, x: &mut Self::Tensor, y: &Self::Tensor) -> Result<()>;
    fn rms_norm(&self, x: &Self::Tensor, weight: &Self::Tensor, eps: f32) -> Result<Self::Tensor>;
    /// `x += delta`, then the norm of the new `x`: a residual connection and the norm
    /// after it, which a device backend fuses into one pass over the rows.
    fn add_rms_norm(
        &self,
        x: &mut Self::Tensor,
        delta: &Self::Tensor,
        weight: &Self::Tensor,
        eps: f32,
    ) -> Result<Self::Tensor> {
        self.add_assign(x, delta)?;
        self.rms_norm(x, weight, eps)
    }
    /// `act(gate) · up`, elementwise (a gated MLP's product).
    fn gated(&self, act: Activation, gate: &Self::Tensor, up: &Self::Tensor) -> Result<Self::Tensor>;
    /// `op` applied to every element of `x`, in place.
    fn pointwise(&self, x: &mut Self::Tensor, op: Pointwise) -> Result<()>;
    /// The given rows, in order.
    fn gather_rows(&self, x: &Self::Tensor, rows: &[usize]) -> Result<Self::Tensor>;
    /// `[blocks · n, w]` rank blocks of rows (an all-gather's output) side by side as
    /// `[n, blocks · w]`: block `b`'s row `r` becomes columns `b·w..(b+1)·w` of row `r`
    /// (vocabulary shards into whole rows of logits).
    fn interleave_blocks(&self, x: &Self::Tensor, blocks: usize) -> Result<Self::Tensor>;
    /// Columns `cols` of every row (one head's slice of per-head activations). The
    /// default copies through the host.
    fn columns(&self, x: &Self::Tensor, cols: Range<usize>) -> Result<Self::Tensor> {
        let (rows, width) = self.shape(x);
        if cols.end > width || cols.start > cols.end {
            return Err(Error::Internal(format!("columns {cols:?} of {width}")));
        }
        let host = self.to_host(x)?;
        let out: Vec<f32> =
            host.chunks_exact(width.max(1)).flat_map(|r| r[cols.clone()].iter().copied()).collect();
        self.upload(out, rows, cols.len())
    }
    /// The parts one after another: `[a, n] ; [b, n] ; … → [a + b + …, n]`. The default
    /// copies through the host.
    fn concat_rows(&self, parts: &[&Self::Tensor]) -> Result<Self::Tensor> {
        let cols = parts.first().map_or(0, |p| self.shape(p).1);
        if parts.iter().any(|p| self.shape(p).1 != cols) {
            return Err(Error::Internal("stacking tensors of different widths".into()));
        }
        let mut out = Vec::new();
        for p in parts {
            out.extend(self.to_host(p)?);
        }
        let rows = out.len() / cols.max(1);
        self.upload(out, rows, cols)
    }
    /// The parts' rows side by side: `[n, a] ‖ [n, b] ‖ … → [n, a + b + …]`. The default
    /// copies through the host.
    fn concat_columns(&self, parts: &[&Self::Tensor]) -> Result<Self::Tensor> {
        let rows = parts.first().map_or(0, |p| self.shape(p).0);
        if parts.iter().any(|p| self.shape(p).0 != rows) {
            return Err(Error::Internal("concatenating tensors of different row counts".into()));
        }
        let hosts: Vec<(Vec<f32>, usize)> =
            parts.iter().map(|p| Ok((self.to_host(p)?, self.shape(p).1))).collect::<Result<_>>()?;
        let width: usize = hosts.iter().map(|(_, w)| w).sum();
        let mut out = Vec::with_capacity(rows * width);
        for r in 0..rows {
            for (data, w) in &hosts {
                out.extend_from_slice(&data[r * w..(r + 1) * w]);
            }
        }
        self.upload(out, rows, width)
    }
}

/// The paged KV cache and the attention that reads it.
pub trait AttentionOps: Tensors {
    /// One layer's paged K and V storage.
    type KvLayer: Send + Sync;

    /// Allocates `num_blocks` blocks of `block_size` positions for `kv_dim` values (K and
    /// V each) a position.
    fn alloc_kv(&self, num_blocks: usize, block_size: usize, kv_dim: usize) -> Result<Self::KvLayer>;
    /// As [`alloc_kv`](Self::alloc_kv), but the values are the keys: `kv_dim` values a
    /// position, stored once (latent attention caches one latent vector a position and
    /// attends with it as key and value). `write_kv`'s V rows must then be its K rows.
    fn alloc_kv_shared(&self, num_blocks: usize, block_size: usize, kv_dim: usize) -> Result<Self::KvLayer>;
    /// Bytes one K or V element takes in the cache (the KV budget buys blocks at this size).
    fn kv_element_bytes(&self) -> usize {
        4
    }
    /// Rotates each `head_dim` group of every row by its token's position (rotate-half form).
    fn rope(&self, x: &mut Self::Tensor, head_dim: usize, positions: &[u32], rope: &RopeTable) -> Result<()>;
    /// Stores each new token's K and V rows at its slot.
    fn write_kv(
        &self,
        cache: &mut Self::KvLayer,
        k: &Self::Tensor,
        v: &Self::Tensor,
        layout: &BatchLayout,
    ) -> Result<()>;
    /// RoPE on `q` and `k` (in place), then `k` and `v` into the cache: one pass on a
    /// device backend.
    #[allow(clippy::too_many_arguments)]
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
        self.rope(q, head_dim, &layout.positions, rope)?;
        self.rope(k, head_dim, &layout.positions, rope)?;
        self.write_kv(cache, k, v, layout)
    }
    /// Causal attention of each new token over its sequence's cached positions. `sinks`
    /// (`[1, num_heads]`, gpt-oss) adds one logit per head to each softmax's denominator,
    /// a position that carries no value.
    fn attention(
        &self,
        q: &Self::Tensor,
        cache: &Self::KvLayer,
        layout: &BatchLayout,
        shape: AttentionShape,
        sinks: Option<&Self::Tensor>,
    ) -> Result<Self::Tensor>;
}

/// A step's logits reduced where they are (see [`crate::logits`]). Each takes logits of a
/// vocabulary shard (or the whole vocabulary) whose first column is token `first_id`.
/// The defaults copy the rows to the host and reduce them there ([`host_logits`]).
pub trait LogitsOps: Tensors {
    /// The greedy pick of each row: its largest logit (the first on ties), that token and
    /// the row's log-sum-exp.
    fn greedy_picks(&self, logits: &Self::Tensor, first_id: u32) -> Result<Vec<Pick>> {
        let (rows, cols) = self.shape(logits);
        Ok(host_logits::host_picks(&self.to_host(logits)?, rows, cols, first_id))
    }
    /// The `k` most likely tokens of each of the `rows` rows and the row's log-sum-exp
    /// (see [`crate::logits::top`]).
    fn top_logits(
        &self,
        logits: &Self::Tensor,
        rows: usize,
        k: usize,
        first_id: u32,
    ) -> Result<Vec<Candidates>> {
        let data = self.to_host(logits)?;
        let cols = data.len().checked_div(rows).unwrap_or(0);
        Ok(host_logits::host_top(&data, rows, cols, k, first_id))
    }
    /// Whether [`LogitsOps::mask_logits`] runs where the logits are (a GPU): a replica of
    /// one rank then applies constrained decoding's masks there, and a constrained row is
    /// reduced or drawn from like any other instead of going to the host whole.
    fn masks_on_device(&self) -> bool {
        false
    }
    /// `logits` (one row per mask, a whole vocabulary each) with every token its row's
    /// mask does not allow at −∞; rows without a mask unchanged.
    fn mask_logits(
        &self,
        logits: Self::Tensor,
        masks: &crate::logits::late::RowMasks,
    ) -> Result<Self::Tensor> {
        let (rows, cols) = self.shape(&logits);
        let mut data = self.to_host(&logits)?;
        for (row, mask) in data.chunks_exact_mut(cols.max(1)).zip(masks) {
            if let Some(m) = mask {
                crate::logits::late::mask_row(row, m);
            }
        }
        self.upload(data, rows, cols)
    }
    /// Whether [`LogitsOps::draw_tokens`] runs where the logits are (a GPU): the engine
    /// then draws the tokens of top-p, min-p and temperature sampling there instead of
    /// copying whole rows to the host (see [`crate::logits::draw`]).
    fn draws_on_device(&self) -> bool {
        false
    }
    /// Each row (a whole vocabulary) drawn as its [`Draw`] says: the drawn token, the
    /// row's largest logit and its log-sum-exp.
    fn draw_tokens(&self, logits: &Self::Tensor, draws: &[Draw], first_id: u32) -> Result<Vec<Pick>> {
        let data = self.to_host(logits)?;
        let cols = data.len().checked_div(draws.len()).unwrap_or(0);
        Ok(host_logits::host_draws(&data, cols, draws, first_id))
    }
}

/// One projection of every routed expert of a layer, in expert id order: weights and their
/// biases (all or none).
pub struct ExpertProjection<'a, T: Tensors + ?Sized> {
    pub weights: Vec<&'a T::Weight>,
    pub biases: Option<Vec<&'a T::Tensor>>,
}

/// A layer's routed experts, for a backend that runs them on its device
/// ([`ExpertOps::device_experts`]).
pub struct ExpertLayer<'a, T: Tensors + ?Sized> {
    /// `[experts, hidden]`, f32, and the bias added to its logits.
    pub router: &'a [f32],
    pub router_bias: Option<&'a [f32]>,
    pub routing: &'a routing::Routing,
    pub top_k: usize,
    pub act: Activation,
    pub gate: ExpertProjection<'a, T>,
    pub up: ExpertProjection<'a, T>,
    pub down: ExpertProjection<'a, T>,
}

/// What a mixture of experts needs besides the dense ops: an expert's outputs, weighted,
/// added back to the rows of the tokens that chose it; or, where the backend can, a
/// layer's routed experts run whole on the device.
pub trait ExpertOps: Tensors {
    /// A layer's routed experts as [`ExpertOps::run_experts`] takes them
    /// (`std::convert::Infallible` for a backend that routes on the host).
    type DeviceExperts: Send + Sync;

    /// Prepares `layer` to run on the device; None: the model routes on the host and runs
    /// the experts one by one. The prepared value refers to the layer's weights, which must
    /// outlive it (the model keeps both in the same layer).
    fn device_experts(&self, _layer: ExpertLayer<'_, Self>) -> Result<Option<Self::DeviceExperts>> {
        Ok(None)
    }

    /// The routed experts' combined output for `x` (`[tokens, hidden]`), as the host's
    /// routing and [`ExpertOps::scatter_add_rows`] compute it, without leaving the device.
    fn run_experts(&self, x: &Self::Tensor, experts: &Self::DeviceExperts) -> Result<Self::Tensor>;

    /// Tokens routed to each expert since the counts were last returned, or None when
    /// now is not the time (a backend reads them at most about once a second, and never
    /// while it captures a graph).
    fn routed_counts(&self, experts: &Self::DeviceExperts) -> Result<Option<Vec<u64>>>;

    /// `out[rows[i]] += weights[i] · y[i]` for every row `i` of `y` (each row of `out` at
    /// most once a call), in place.
    fn scatter_add_rows(
        &self,
        out: &mut Self::Tensor,
        y: &Self::Tensor,
        rows: &[usize],
        weights: &[f32],
    ) -> Result<()>;
}

/// The shapes and rows of a [`ExpertOps::scatter_add_rows`], checked before any backend
/// touches memory: one row and weight per row of `y`, every row inside `out`, none twice.
pub fn check_scatter(out: (usize, usize), y: (usize, usize), rows: &[usize], weights: &[f32]) -> Result<()> {
    let fail = |why: String| Err(strata_common::Error::Internal(format!("scatter_add_rows: {why}")));
    if out.1 != y.1 || rows.len() != y.0 || weights.len() != y.0 {
        return fail(format!("{} rows, {} weights for {y:?} into {out:?}", rows.len(), weights.len()));
    }
    let mut seen = vec![false; out.0];
    for &r in rows {
        match seen.get_mut(r) {
            None => return fail(format!("row {r} of {}", out.0)),
            Some(true) => return fail(format!("row {r} twice")),
            Some(s) => *s = true,
        }
    }
    Ok(())
}

/// What a replayed step returns besides its own rows' inputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GraphOutput {
    /// How the logit rows are reduced.
    pub wanted: LogitsWanted,
    /// Whether the step's draws are drawn too (after the reduced rows, as picks).
    pub draw: bool,
    /// Columns of the logits (a vocabulary shard, or the whole one when the step draws)
    /// and the token id of the first; 0 for a step that returns nothing (a pipeline
    /// stage before the last; a TP rank other than 0 of a drawing step).
    pub vocab: usize,
    pub first_id: u32,
}

/// The model's part of a captured step: the logits of the step it is called with (the
/// step padded to a captured batch size), or, for a step without output, anything.
pub type StepBody<'a, T> = dyn FnMut(&Step) -> Result<T> + 'a;

/// Decode steps captured once and replayed (a GPU's graphs; see `cuda::graphs`).
pub trait StepGraphs: Tensors {
    /// Runs `step` from a captured graph where this backend keeps them: `body` computes
    /// the logits of the step it is given — `step` padded to a captured batch size — and
    /// is called only to capture. Returns the logit rows reduced as `output.wanted` says,
    /// in the layout of [`crate::logits::StepLogits::into_f32s`], followed by the rows'
    /// draws as picks when `output.draw` asks; None when the step is to run as usual.
    fn replay_decode(
        &self,
        _step: &Step,
        _output: GraphOutput,
        _body: &mut StepBody<'_, Self::Tensor>,
    ) -> Result<Option<Vec<f32>>> {
        Ok(None)
    }
}

/// The backend traits, for code that calls their methods on a concrete backend.
/// `--device {device}: ` before an unavailable device's message.
pub(crate) fn on_device(device: Device) -> impl FnOnce(strata_common::Error) -> strata_common::Error {
    move |e| match e {
        strata_common::Error::Unavailable(m) => {
            strata_common::Error::Unavailable(format!("--device {device}: {m}"))
        }
        other => other,
    }
}

/// Free and total memory of `device`, bytes: the host's for the CPU, the driver's for a
/// GPU (what a worker offers for weights and KV cache, and what a memory utilization is a
/// fraction of).
pub fn device_memory(device: Device) -> strata_common::Result<(u64, u64)> {
    match device {
        Device::Cpu => {
            let free = strata_common::host::available_memory();
            Ok((free.unwrap_or(0), strata_common::host::total_memory().or(free).unwrap_or(0)))
        }
        Device::Cuda(ordinal) => cuda::driver::memory_info(ordinal).map_err(on_device(device)),
    }
}

pub mod prelude {
    pub use super::{AttentionOps, Backend, ExpertOps, LogitsOps, StepGraphs, TensorOps, Tensors};
}

/// Everything the model needs of a backend: the sum of its parts.
pub trait Backend: TensorOps + AttentionOps + LogitsOps + ExpertOps + StepGraphs {}

impl<B: TensorOps + AttentionOps + LogitsOps + ExpertOps + StepGraphs> Backend for B {}
