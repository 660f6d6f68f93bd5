//! The seam between the model and the hardware.
//!
//! [`model`](crate::model) calls these ops and nothing else, so the Llama forward pass is
//! written once; a backend decides where tensors live and how each op runs. Activations
//! are 2-D row-major f32 (`[tokens, features]`); weights stay in the checkpoint's dtype
//! (`[out_features, in_features]`) and are widened inside the matmul. The step's layout
//! (which token belongs to which sequence, its position, its KV slot) is plain host data
//! in [`BatchLayout`]; the paged-KV bookkeeping that fills it lives in [`kv`](crate::kv).

pub mod check;
pub mod cpu;
pub mod cuda;

use strata_common::Result;

use crate::comm::{Collectives, Communicator};
use crate::model::weights::HostTensor;

pub use strata_common::Device;

/// How a rank's backend is built.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BackendOptions {
    pub device: Device,
    /// The model's dtype (`--dtype`), None for the checkpoint's. Weight matrices are kept
    /// in it, and the compute follows it as in HF transformers and vLLM: bf16 weights run
    /// bf16 × bf16 matmuls with f32 accumulation (norms, softmax and residual sums stay
    /// f32; the CPU's KV cache is f32, the GPU's bf16); `F32` keeps the checkpoint's weights and widens them to f32 inside
    /// every matmul, which is bit-for-bit the upcast model without a second copy.
    pub dtype: Option<crate::model::weights::DType>,
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

/// Rotary embedding frequencies, shared by every layer.
#[derive(Debug, Clone)]
pub struct RopeTable {
    /// `head_dim / 2` inverse frequencies, already rescaled (linear, llama3).
    pub inv_freq: Vec<f32>,
}

/// One sequence's slice of a step.
#[derive(Debug, Clone)]
pub struct SeqSlice {
    /// Rows of this sequence's new tokens in the step's activations.
    pub token_start: usize,
    pub num_tokens: usize,
    /// Tokens of this sequence already in the KV cache before this step.
    pub context_before: usize,
    /// KV cache blocks holding this sequence's positions, in order.
    pub block_table: Vec<u32>,
}

/// Where every token of a step sits: its position and its KV slot.
#[derive(Debug, Clone, Default)]
pub struct BatchLayout {
    pub positions: Vec<u32>,
    /// Flat KV slot (block * block_size + offset) each new token's K and V go to.
    pub slots: Vec<u32>,
    pub seqs: Vec<SeqSlice>,
    pub block_size: usize,
}

impl BatchLayout {
    pub fn num_tokens(&self) -> usize {
        self.positions.len()
    }
}

/// A step offered to [`Backend::replay_decode`].
pub struct DecodeStep<'a> {
    pub ids: &'a [u32],
    pub layout: &'a BatchLayout,
    /// The rows whose logits the step returns.
    pub logit_rows: &'a [usize],
    pub wanted: crate::logits::LogitsWanted,
    /// Each logit row's draw on the device ([`Backend::draw_tokens`]), or empty when no
    /// row is drawn.
    pub draws: &'a [crate::logits::Draw],
    /// Columns of the logits (this rank's vocabulary, or the whole one when the step
    /// draws) and the token id of the first; 0 for a step that returns nothing (a
    /// pipeline stage before the last; a TP rank other than 0 of a drawing step).
    pub vocab: usize,
    pub first_id: u32,
}

/// The model's part of a step given to [`Backend::replay_decode`]: the logits of the
/// step it is called with (token ids, layout, logit rows).
pub type StepBody<'a, T> = dyn FnMut(&[u32], &BatchLayout, &[usize]) -> Result<T> + 'a;

/// Shape of the attention a layer computes.
#[derive(Debug, Clone, Copy)]
pub struct AttentionShape {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
    pub sliding_window: Option<usize>,
}

/// Tensor operations the model needs. Implementations: [`cpu::CpuBackend`] and
/// [`cuda::CudaBackend`]. Every op can fail (a device error, an allocation the device
/// cannot make): the step fails with the error instead of the process panicking.
pub trait Backend: Send + Sync + 'static {
    /// 2-D f32 activations.
    type Tensor: Send + Sync;
    /// A `[out, in]` weight matrix in its stored dtype.
    type Weight: Send + Sync;
    /// One layer's paged K and V storage.
    type KvLayer: Send + Sync;

    fn name(&self) -> &'static str;

    /// Whether the ops fan out over rayon's thread pool (the CPU backend). A single-rank
    /// step then runs inside the pool, so that each op's parallel loop starts on a worker
    /// that takes part in it, instead of handing the loop to the pool and sleeping until
    /// it is done (two such round trips per matmul: ~230 per decode step of a 16-layer
    /// model).
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
    /// Allocates `num_blocks` blocks of `block_size` positions for `kv_heads × head_dim`.
    fn alloc_kv(&self, num_blocks: usize, block_size: usize, kv_dim: usize) -> Result<Self::KvLayer>;
    /// Bytes one K or V element takes in the cache (the KV budget buys blocks at this size).
    fn kv_element_bytes(&self) -> usize {
        4
    }

    /// Bytes a weight occupies in memory.
    fn weight_bytes(&self, w: &Self::Weight) -> usize;

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
    /// Rotates each `head_dim` group of every row by its token's position (rotate-half form).
    fn rope(&self, x: &mut Self::Tensor, head_dim: usize, positions: &[u32], rope: &RopeTable) -> Result<()>;
    /// `silu(gate) * up`.
    fn silu_mul(&self, gate: &Self::Tensor, up: &Self::Tensor) -> Result<Self::Tensor>;
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
    /// Causal attention of each new token over its sequence's cached positions.
    fn attention(
        &self,
        q: &Self::Tensor,
        cache: &Self::KvLayer,
        layout: &BatchLayout,
        shape: AttentionShape,
    ) -> Result<Self::Tensor>;
    /// The given rows, in order.
    fn gather_rows(&self, x: &Self::Tensor, rows: &[usize]) -> Result<Self::Tensor>;
    /// The greedy pick of each row of `logits`, a vocabulary shard whose first column is
    /// token `first_id`: its largest logit (the first on ties), that token and the row's
    /// log-sum-exp, reduced where the logits are (see [`crate::logits`]).
    fn greedy_picks(&self, logits: &Self::Tensor, first_id: u32) -> Result<Vec<crate::logits::Pick>>;
    /// The `k` most likely tokens of each of the `rows` rows of `logits` (a vocabulary
    /// shard whose first column is token `first_id`) and the row's log-sum-exp (see
    /// [`crate::logits::top`]). By default on the host; a GPU selects them on the device.
    fn top_logits(
        &self,
        logits: &Self::Tensor,
        rows: usize,
        k: usize,
        first_id: u32,
    ) -> Result<Vec<crate::logits::Candidates>> {
        let data = self.to_host(logits)?;
        let cols = data.len().checked_div(rows).unwrap_or(0);
        Ok(crate::logits::top::host_top(&data, rows, cols, k, first_id))
    }
    /// Whether [`Backend::draw_tokens`] runs where the logits are (a GPU): the engine then
    /// draws the tokens of top-p, min-p and temperature sampling there instead of copying
    /// whole rows to the host (see [`crate::logits::draw`]).
    fn draws_on_device(&self) -> bool {
        false
    }
    /// Each row of `logits` (a whole vocabulary whose first column is token `first_id`)
    /// drawn as its [`Draw`](crate::logits::Draw) says: the drawn token, the row's largest
    /// logit and its log-sum-exp. By default on the host.
    fn draw_tokens(
        &self,
        logits: &Self::Tensor,
        draws: &[crate::logits::Draw],
        first_id: u32,
    ) -> Result<Vec<crate::logits::Pick>> {
        let data = self.to_host(logits)?;
        let cols = data.len().checked_div(draws.len()).unwrap_or(0);
        Ok(crate::logits::draw::host_draws(&data, cols, draws, first_id))
    }
    /// Runs `step` from a captured graph, where this backend keeps them (a GPU, for pure
    /// decode steps; see `cuda::graphs`): `body` computes the logits of the step it is
    /// given — `step` padded to a captured batch size — and is called only to capture.
    /// Returns the logit rows reduced as `step.wanted` says, in the layout of
    /// [`crate::logits::picks_to_f32s`], [`crate::logits::top::top_to_f32s`] or whole
    /// rows, followed by the rows' draws as picks when `step.draws` asks; None when the
    /// step is to run as usual.
    fn replay_decode(
        &self,
        _step: &DecodeStep<'_>,
        _body: &mut StepBody<'_, Self::Tensor>,
    ) -> Result<Option<Vec<f32>>> {
        Ok(None)
    }
    /// Copies a tensor to host memory, row-major.
    fn to_host(&self, x: &Self::Tensor) -> Result<Vec<f32>>;
    /// A tensor from host data, row-major.
    fn upload(&self, data: Vec<f32>, rows: usize, cols: usize) -> Result<Self::Tensor>;
    /// Runs `f` on the tensor's elements in host memory (a communicator's collective);
    /// device backends copy out and back.
    fn with_host_mut(&self, x: &mut Self::Tensor, f: &mut dyn FnMut(&mut [f32]) -> Result<()>) -> Result<()>;
    /// Sums `x` in place across `group` through `comm`: the collective on a backend tensor,
    /// which is what the model calls. This default goes through host memory; a device
    /// backend whose communicator reduces device buffers (NCCL on the backend's stream)
    /// overrides it and keeps the tensor on the device.
    fn all_reduce(&self, x: &mut Self::Tensor, group: &[usize], comm: &mut dyn Collectives) -> Result<()> {
        self.with_host_mut(x, &mut |data| comm.all_reduce_sum(group, data))
    }
    /// Whether a decode step's [`Backend::all_reduce`]s through `comm` can be captured in
    /// [`Backend::replay_decode`]'s graphs: they run on the device, in stream order (NCCL
    /// on a GPU), so a tensor-parallel rank replays its whole step too.
    fn captures_collectives(&self, _comm: &mut dyn Collectives) -> bool {
        false
    }
    /// The whole vocabulary's logits, `[rows, shard.cols × group.len()]`, from every TP
    /// rank's vocabulary shard (`shard`, all of equal width), gathered on the device
    /// through `comm` where [`Backend::captures_collectives`] says it can; None where
    /// not.
    fn gather_vocab(
        &self,
        _shard: &Self::Tensor,
        _group: &[usize],
        _comm: &mut dyn Collectives,
    ) -> Result<Option<Self::Tensor>> {
        Ok(None)
    }
    /// Sends hidden states `x` to rank `to` (the next pipeline stage's) through `comm`:
    /// device to device where the backend's collectives run there (a graph then captures
    /// the hand-off), else through host memory.
    fn send_hidden(&self, x: &Self::Tensor, to: usize, comm: &mut dyn Communicator) -> Result<()> {
        send_through_host(self, x, to, comm)
    }
    /// Receives `[rows, cols]` hidden states from rank `from` (the previous pipeline
    /// stage's), the other end of [`Backend::send_hidden`].
    fn recv_hidden(
        &self,
        rows: usize,
        cols: usize,
        from: usize,
        comm: &mut dyn Communicator,
    ) -> Result<Self::Tensor> {
        recv_through_host(self, rows, cols, from, comm)
    }
}

/// [`Backend::send_hidden`] through host memory (the step channel's bytes).
pub fn send_through_host<B: Backend + ?Sized>(
    b: &B,
    x: &B::Tensor,
    to: usize,
    comm: &mut dyn Communicator,
) -> Result<()> {
    comm.send(to, crate::comm::f32_bytes(&b.to_host(x)?))
}

/// [`Backend::recv_hidden`] through host memory, its length checked before upload.
pub fn recv_through_host<B: Backend + ?Sized>(
    b: &B,
    rows: usize,
    cols: usize,
    from: usize,
    comm: &mut dyn Communicator,
) -> Result<B::Tensor> {
    let data = crate::comm::bytes_f32(&comm.recv(from)?);
    if data.len() != rows * cols {
        return Err(strata_common::Error::Internal(format!(
            "{} values from rank {from} for [{rows}, {cols}] hidden states",
            data.len()
        )));
    }
    b.upload(data, rows, cols)
}
