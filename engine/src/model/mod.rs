//! The Llama-family decoder (Llama, Mistral, Qwen2), written once against [`Backend`].
//!
//! A step — [`Model::embed_tokens`], [`Model::run_layers`], [`Model::logits`] — runs any
//! mix of sequences, each contributing any number of new tokens at its own position (a prefill chunk or one
//! decode token), laid out by a [`BatchLayout`]. Logits are computed only for the rows the
//! caller asks for — normally each sequence's last token — since the LM head is the
//! largest matmul of a decode step.

pub mod quantize;
pub mod random;
mod rope;
pub mod weights;

use std::ops::Range;
use std::path::Path;
use std::time::Instant;

use strata_common::{Error, ModelConfig, Parallelism, RankShard, Result, ShardPlan};
use tracing::info;

use crate::backend::{AttentionShape, Backend, BatchLayout, DecodeStep, RopeTable};
use crate::comm::{Collectives, Communicator};
use crate::logits::top::{merge, top_from_f32s};
use crate::logits::{picks_from_f32s, Draw, LogitsWanted, StepLogits, StepOutput};
use crate::metrics::{RankMetrics, ReplicaLabels};
use weights::{Checkpoint, HostTensor};

struct Linear<B: Backend> {
    weight: B::Weight,
    bias: Option<B::Tensor>,
}

struct Layer<B: Backend> {
    input_norm: B::Tensor,
    q: Linear<B>,
    k: Linear<B>,
    v: Linear<B>,
    o: Linear<B>,
    post_norm: B::Tensor,
    gate: Linear<B>,
    up: Linear<B>,
    down: Linear<B>,
}

/// What part of the model this instance holds (everything, for a single rank).
#[derive(Debug, Clone)]
pub struct ModelShard {
    pub shard: RankShard,
    pub par: Parallelism,
    /// Ranks of this shard's pipeline stage (its TP group), ascending.
    pub tp_group: Vec<usize>,
}

impl ModelShard {
    pub fn whole(config: &ModelConfig) -> Self {
        let plan = ShardPlan::new(config, Parallelism::NONE).expect("one rank always fits");
        ModelShard { shard: plan.rank(0).clone(), par: Parallelism::NONE, tp_group: vec![0] }
    }

    pub fn tp(&self) -> usize {
        self.par.tp
    }

    pub fn is_last_stage(&self) -> bool {
        self.shard.stage + 1 == self.par.pp
    }
}

pub struct Model<B: Backend> {
    pub config: ModelConfig,
    pub shard: ModelShard,
    backend: B,
    /// This rank's vocabulary rows of the embedding (first stage; last stage when tied).
    embed: Option<B::Weight>,
    layers: Vec<Layer<B>>,
    norm: B::Tensor,
    /// This rank's vocabulary rows of the LM head (last stage); None when tied.
    lm_head: Option<B::Weight>,
    rope: RopeTable,
    weight_bytes: usize,
    /// This rank's step and all-reduce metrics.
    pub metrics: RankMetrics,
}

impl<B: Backend> Model<B> {
    /// Loads a whole HF model directory: config.json, generation_config.json, safetensors.
    pub fn load(dir: &Path, backend: B) -> Result<Self> {
        let config = ModelConfig::from_dir(dir)?;
        let ckpt = Checkpoint::open(dir)?;
        let shard = ModelShard::whole(&config);
        Self::from_checkpoint(config, &ckpt, backend, shard)
    }

    /// Loads only rank `rank`'s shard of a `par` replica.
    pub fn load_shard(dir: &Path, backend: B, par: Parallelism, rank: usize) -> Result<Self> {
        let config = ModelConfig::from_dir(dir)?;
        let plan = ShardPlan::new(&config, par)?;
        let ckpt = Checkpoint::open(dir)?;
        let shard = plan.rank(rank).clone();
        let tp_group = plan.stage_ranks(shard.stage).collect();
        Self::from_checkpoint(config, &ckpt, backend, ModelShard { shard, par, tp_group })
    }

    pub fn from_checkpoint(
        config: ModelConfig,
        ckpt: &Checkpoint,
        backend: B,
        ms: ModelShard,
    ) -> Result<Self> {
        let started = Instant::now();
        let c = &config;
        let s = &ms.shard;
        let (first, last) = (s.is_first_stage(), ms.is_last_stage());
        let mut load = ShardLoader { backend: &backend, ckpt, config: c, shard: s, bytes: 0 };
        let embed = if first || (last && c.tie_word_embeddings) {
            Some(load.vocab_rows("model.embed_tokens.weight")?)
        } else {
            None
        };
        let lm_head = if !last || c.tie_word_embeddings {
            None
        } else if ckpt.contains("lm_head.weight") {
            Some(load.vocab_rows("lm_head.weight")?)
        } else {
            return Err(Error::model_file(
                ckpt.dir(),
                "tensor \"lm_head.weight\" is missing and tie_word_embeddings is false",
            ));
        };
        let mut layers = Vec::with_capacity(s.layers.len());
        for i in s.layers.clone() {
            layers.push(load.layer(i)?);
            tracing::debug!(layer = i, of = c.num_layers, "layer loaded");
        }
        let norm = vector(&backend, ckpt, "model.norm.weight", c.hidden_size)?;
        let bytes = load.bytes;
        info!(
            backend = backend.name(),
            rank = s.rank,
            layers = ?s.layers,
            weight_mib = bytes / (1 << 20),
            elapsed_ms = started.elapsed().as_millis() as u64,
            "model loaded"
        );
        let rank = s.rank;
        Ok(Model {
            rope: rope::rope_table(c),
            config,
            shard: ms,
            backend,
            embed,
            layers,
            norm,
            lm_head,
            weight_bytes: bytes,
            metrics: RankMetrics::new(&ReplicaLabels::default(), rank),
        })
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Files this rank's metrics under `labels` (its model and replica).
    pub fn label(&mut self, labels: &ReplicaLabels) {
        self.metrics = RankMetrics::new(labels, self.shard.shard.rank);
    }

    /// Bytes of weights held by this model (shard).
    pub fn weight_bytes(&self) -> usize {
        self.weight_bytes
    }

    /// Bytes of weights one decode step reads: everything but the embedding table, of
    /// which it reads one row per token (unless the LM head is tied to it).
    pub fn decode_bytes_per_token(&self) -> usize {
        match (&self.embed, &self.lm_head) {
            (Some(e), Some(_)) => self.weight_bytes - self.backend.weight_bytes(e),
            (Some(e), None) if !self.shard.is_last_stage() => {
                self.weight_bytes - self.backend.weight_bytes(e)
            }
            _ => self.weight_bytes,
        }
    }

    /// Allocates this shard's paged KV cache: one storage per local layer.
    pub fn alloc_kv(&self, num_blocks: usize, block_size: usize) -> Result<Vec<B::KvLayer>> {
        (0..self.layers.len()).map(|_| self.backend.alloc_kv(num_blocks, block_size, self.kv_dim())).collect()
    }

    fn kv_dim(&self) -> usize {
        self.shard.shard.kv_heads.len() * self.config.head_dim
    }

    /// Embeds the step's tokens (first stage); vocabulary shards are summed across TP.
    pub fn embed_tokens(&self, ids: &[u32], comm: &mut dyn Collectives) -> Result<B::Tensor> {
        let table = self
            .embed
            .as_ref()
            .ok_or_else(|| Error::Internal("embed_tokens on a stage without the embedding".into()))?;
        let mut x = self.backend.embed(table, ids, self.shard.shard.vocab.start as u32)?;
        self.all_reduce(&mut x, ids.len(), comm)?;
        Ok(x)
    }

    /// A whole model's step on one rank: embedding, layers and the logits `wanted` of
    /// `logit_rows`. A pure decode step replays a captured graph where the backend keeps
    /// them (see [`Backend::replay_decode`]); every other step runs op by op.
    pub fn forward(
        &self,
        ids: &[u32],
        layout: &BatchLayout,
        kv: &mut [B::KvLayer],
        logit_rows: &[usize],
        wanted: LogitsWanted,
        draws: &[Draw],
    ) -> Result<StepOutput> {
        if !draws.is_empty() && draws.len() != logit_rows.len() {
            return Err(Error::Internal(format!(
                "{} draws for {} logit rows",
                draws.len(),
                logit_rows.len()
            )));
        }
        if let Some(out) = self.replayed(ids, layout, kv, (logit_rows, wanted, draws), &mut NoComm)? {
            return Ok(out);
        }
        let mut none = NoComm;
        let x = self.embed_tokens(ids, &mut none)?;
        let x = self.run_layers(x, layout, kv, &mut none)?;
        self.step_output(&x, (logit_rows, wanted, draws), &mut none)
    }

    /// A pure decode step replayed from a captured graph (see [`Backend::replay_decode`])
    /// where the backend keeps them and a multi-rank replica's collectives and stage
    /// hand-offs are device work the graph captures. Returns what [`Model::step_output`]
    /// returns on the last stage, nothing on the others; None when the step is to run op
    /// by op.
    pub fn replayed(
        &self,
        ids: &[u32],
        layout: &BatchLayout,
        kv: &mut [B::KvLayer],
        (logit_rows, wanted, draws): (&[usize], LogitsWanted, &[Draw]),
        comm: &mut dyn Communicator,
    ) -> Result<Option<StepOutput>> {
        if self.shard.par.world() > 1 && !self.backend.captures_collectives(comm) {
            return Ok(None);
        }
        let last = self.shard.is_last_stage();
        let drawing = last && !draws.is_empty();
        // A drawing step reduces the whole vocabulary (gathered in the graph), and only the
        // last stage's TP rank 0 needs its result: the other ranks join the gather and
        // stop there. Any other step reduces this rank's shard, merged across TP after
        // the replay. A stage before the last hands its hidden states on. A step without
        // output has `vocab` 0.
        let output = last && (!drawing || self.shard.shard.tp_rank == 0);
        let (vocab, first_id) = match (output, drawing) {
            (false, _) => (0, 0),
            (true, false) => (self.shard.shard.vocab.len(), self.shard.shard.vocab.start as u32),
            (true, true) => (self.config.vocab_size, 0),
        };
        let draws = if last { draws } else { &[] };
        let wanted = if last { wanted } else { LogitsWanted::Full };
        let step = DecodeStep { ids, layout, logit_rows, wanted, draws, vocab, first_id };
        let replayed = self.backend.replay_decode(&step, &mut |ids, layout, rows| {
            let x = self.stage_input(ids, &mut *comm)?;
            let x = self.run_layers(x, layout, kv, &mut *comm)?;
            if !last {
                self.backend.send_hidden(&x, self.next_stage_rank(), &mut *comm)?;
                return Ok(x);
            }
            let head = self.head_logits(&x, rows)?;
            if !drawing {
                return Ok(head);
            }
            self.whole_vocab(head, &mut *comm)
        })?;
        let Some(data) = replayed else { return Ok(None) };
        self.metrics.graph_step();
        if !output {
            return Ok(Some(StepLogits::Full(Vec::new()).into()));
        }
        let mut out = StepOutput::from_f32s(wanted, draws.len(), data)?;
        if draws.is_empty() {
            out.logits = self.merge_shards(out.logits, logit_rows.len(), wanted, comm)?;
        }
        Ok(Some(out))
    }

    /// This stage's input for the step's `ids`: their embeddings on the first stage, the
    /// previous stage's hidden states on the others.
    pub fn stage_input(&self, ids: &[u32], comm: &mut dyn Communicator) -> Result<B::Tensor> {
        let s = &self.shard.shard;
        if s.stage == 0 {
            return self.embed_tokens(ids, comm);
        }
        let from = (s.stage - 1) * self.shard.tp() + s.tp_rank;
        self.backend.recv_hidden(ids.len(), self.config.hidden_size, from, comm)
    }

    /// The rank of the next stage this one hands its hidden states to (same TP rank).
    pub fn next_stage_rank(&self) -> usize {
        (self.shard.shard.stage + 1) * self.shard.tp() + self.shard.shard.tp_rank
    }

    /// The step's output from the last stage's hidden states `x`: the logits `wanted` of
    /// `logit_rows`, merged across TP, and where `draws` asks, tokens drawn on the device
    /// from the whole vocabulary (gathered across TP on the device first).
    pub fn step_output(
        &self,
        x: &B::Tensor,
        (logit_rows, wanted, draws): (&[usize], LogitsWanted, &[Draw]),
        comm: &mut dyn Collectives,
    ) -> Result<StepOutput> {
        if draws.is_empty() {
            return Ok(self.step_logits(x, logit_rows, wanted, comm)?.into());
        }
        let head = self.whole_vocab(self.head_logits(x, logit_rows)?, comm)?;
        if self.shard.shard.tp_rank != 0 {
            return Ok(StepLogits::Full(Vec::new()).into()); // the gather was this rank's part
        }
        let drawn = self.backend.draw_tokens(&head, draws, 0)?;
        Ok(StepOutput { logits: self.shard_logits(&head, logit_rows.len(), wanted, 0)?, drawn })
    }

    /// Logits of this rank's vocabulary shard as the whole vocabulary's: gathered across
    /// TP on the device (equal shards; what draws on the device need).
    fn whole_vocab(&self, head: B::Tensor, comm: &mut dyn Collectives) -> Result<B::Tensor> {
        if self.shard.tp() == 1 {
            return Ok(head);
        }
        if self.shard.shard.vocab.len() * self.shard.tp() != self.config.vocab_size {
            return Err(Error::Unsupported(format!(
                "tokens drawn on the device across {} ranks need a vocabulary they divide ({})",
                self.shard.tp(),
                self.config.vocab_size
            )));
        }
        self.backend.gather_vocab(&head, &self.shard.tp_group, comm)?.ok_or_else(|| {
            Error::Internal("tokens drawn on the device need a communicator of device buffers".into())
        })
    }

    /// Runs this shard's decoder layers over hidden states `x`.
    pub fn run_layers(
        &self,
        mut x: B::Tensor,
        layout: &BatchLayout,
        kv: &mut [B::KvLayer],
        comm: &mut dyn Collectives,
    ) -> Result<B::Tensor> {
        let b = &self.backend;
        let c = &self.config;
        let s = &self.shard.shard;
        let shape = AttentionShape {
            num_heads: s.q_heads.len(),
            num_kv_heads: s.kv_heads.len(),
            head_dim: c.head_dim,
            scale: 1.0 / (c.head_dim as f32).sqrt(),
            sliding_window: c.sliding_window,
        };
        let eps = c.rms_norm_eps as f32;
        let Some(first) = self.layers.first() else { return Ok(x) };
        // Each residual add is fused with the norm that reads its result (a device backend
        // does both in one pass); the last layer's sum goes on un-normed.
        let mut normed = b.rms_norm(&x, &first.input_norm, eps)?;
        for (i, (layer, cache)) in self.layers.iter().zip(kv.iter_mut()).enumerate() {
            let [mut q, mut k, v] = self.linears(&normed, [&layer.q, &layer.k, &layer.v])?;
            b.rope_write_kv(&mut q, &mut k, &v, cache, layout, c.head_dim, &self.rope)?;
            let attn = b.attention(&q, cache, layout, shape)?;
            let mut o = self.linear(&attn, &layer.o)?;
            self.all_reduce(&mut o, layout.positions.len(), comm)?;
            let post = b.add_rms_norm(&mut x, &o, &layer.post_norm, eps)?;

            let [gate, up] = self.linears(&post, [&layer.gate, &layer.up])?;
            let mut down = self.linear(&b.silu_mul(&gate, &up)?, &layer.down)?;
            self.all_reduce(&mut down, layout.positions.len(), comm)?;
            match self.layers.get(i + 1) {
                Some(next) => normed = b.add_rms_norm(&mut x, &down, &next.input_norm, eps)?,
                None => b.add_assign(&mut x, &down)?,
            }
        }
        Ok(x)
    }

    /// What `wanted` asks of the logits of `rows` of `x` (last stage): reduced on this
    /// rank's vocabulary shard, then merged across TP.
    pub fn step_logits(
        &self,
        x: &B::Tensor,
        rows: &[usize],
        wanted: LogitsWanted,
        comm: &mut dyn Collectives,
    ) -> Result<StepLogits> {
        let first_id = self.shard.shard.vocab.start as u32;
        let local = self.shard_logits(&self.head_logits(x, rows)?, rows.len(), wanted, first_id)?;
        self.merge_shards(local, rows.len(), wanted, comm)
    }

    /// `n` rows of logits (`head`, a vocabulary shard whose first column is token
    /// `first_id`), reduced as `wanted` says: whole rows, greedy picks or top-k candidates.
    fn shard_logits(
        &self,
        head: &B::Tensor,
        n: usize,
        wanted: LogitsWanted,
        first_id: u32,
    ) -> Result<StepLogits> {
        let b = &self.backend;
        Ok(match wanted {
            LogitsWanted::Full => StepLogits::Full(b.to_host(head)?),
            LogitsWanted::Greedy => StepLogits::Greedy(b.greedy_picks(head, first_id)?),
            LogitsWanted::Top(k) => StepLogits::Top(b.top_logits(head, n, k, first_id)?),
        })
    }

    /// Every TP rank's [`Model::shard_logits`] of `n` rows merged into the whole
    /// vocabulary's: whole rows are gathered and interleaved; picks (three numbers a row)
    /// and top-k candidates (`2k + 1`) are gathered and merged, so a reduced step never
    /// moves a shard's logits.
    pub fn merge_shards(
        &self,
        local: StepLogits,
        n: usize,
        wanted: LogitsWanted,
        comm: &mut dyn Collectives,
    ) -> Result<StepLogits> {
        let tp = self.shard.tp();
        if tp == 1 {
            return Ok(local);
        }
        let gathered = comm.all_gather(&self.shard.tp_group, &local.into_f32s(wanted))?;
        let short = |what: &str, got: usize| {
            Error::Internal(format!("{got} {what} gathered for {n} rows × {tp} ranks"))
        };
        match wanted {
            LogitsWanted::Full => Ok(StepLogits::Full(self.interleave_shards(&gathered, n)?)),
            LogitsWanted::Greedy => {
                let all = picks_from_f32s(&gathered)?;
                if all.len() != n * tp {
                    return Err(short("picks", all.len()));
                }
                // Rank blocks in vocabulary order: the earlier shard wins ties.
                Ok(StepLogits::Greedy(
                    (0..n).map(|t| (1..tp).fold(all[t], |acc, r| acc.merge(all[r * n + t]))).collect(),
                ))
            }
            LogitsWanted::Top(k) => {
                let all = top_from_f32s(&gathered, k)?;
                if all.len() != n * tp {
                    return Err(short("candidate rows", all.len()));
                }
                let merged =
                    (0..n).map(|t| merge(&(0..tp).map(|r| all[r * n + t].clone()).collect::<Vec<_>>(), k));
                Ok(StepLogits::Top(merged.collect()))
            }
        }
    }

    /// Gathered whole rows — rank blocks of `[n, vocab_r]` — interleaved into `[n, vocab]`.
    fn interleave_shards(&self, gathered: &[f32], n: usize) -> Result<Vec<f32>> {
        let vocab = self.config.vocab_size;
        if gathered.len() != n * vocab {
            return Err(Error::Internal(format!(
                "{} logits gathered for {n} rows of {vocab}",
                gathered.len()
            )));
        }
        let per = vocab.div_ceil(self.shard.tp());
        let mut out = vec![0f32; n * vocab];
        let mut offset = 0;
        for r in 0..self.shard.tp() {
            let v0 = (r * per).min(vocab);
            let width = (v0 + per).min(vocab) - v0;
            for t in 0..n {
                out[t * vocab + v0..t * vocab + v0 + width]
                    .copy_from_slice(&gathered[offset + t * width..offset + (t + 1) * width]);
            }
            offset += n * width;
        }
        Ok(out)
    }

    /// This rank's vocabulary shard of the logits of `rows`: final norm and LM head.
    fn head_logits(&self, x: &B::Tensor, rows: &[usize]) -> Result<B::Tensor> {
        let b = &self.backend;
        let last = b.gather_rows(x, rows)?;
        let normed = b.rms_norm(&last, &self.norm, self.config.rms_norm_eps as f32)?;
        let head = self
            .lm_head
            .as_ref()
            .or(self.embed.as_ref())
            .ok_or_else(|| Error::Internal("logits on a stage without the LM head".into()))?;
        b.matmul(&normed, head)
    }

    /// Sums `x` (`rows` hidden states) across the TP group, timed on this rank. On a
    /// device backend the time is until the collective is queued on the stream.
    fn all_reduce(&self, x: &mut B::Tensor, rows: usize, comm: &mut dyn Collectives) -> Result<()> {
        if self.shard.tp() == 1 {
            return Ok(());
        }
        let bytes = rows * self.config.hidden_size * std::mem::size_of::<f32>();
        let _span = tracing::trace_span!("all_reduce", bytes = bytes as i64).entered();
        let started = Instant::now();
        self.backend.all_reduce(x, &self.shard.tp_group, comm)?;
        self.metrics.all_reduce(started.elapsed(), bytes);
        Ok(())
    }

    /// Several linear layers of the same input.
    fn linears<const N: usize>(&self, x: &B::Tensor, ls: [&Linear<B>; N]) -> Result<[B::Tensor; N]> {
        let ws: Vec<&B::Weight> = ls.iter().map(|l| &l.weight).collect();
        let mut ys = self.backend.matmul_many(x, &ws)?;
        for (y, l) in ys.iter_mut().zip(ls) {
            if let Some(bias) = &l.bias {
                self.backend.add_bias(y, bias)?;
            }
        }
        ys.try_into().map_err(|_| Error::Internal("matmul_many returned the wrong number of outputs".into()))
    }

    fn linear(&self, x: &B::Tensor, l: &Linear<B>) -> Result<B::Tensor> {
        let mut y = self.backend.matmul(x, &l.weight)?;
        if let Some(bias) = &l.bias {
            self.backend.add_bias(&mut y, bias)?;
        }
        Ok(y)
    }
}

/// The collectives of a single rank: each is the identity.
pub struct NoComm;

impl Collectives for NoComm {
    fn rank(&self) -> usize {
        0
    }
    fn world(&self) -> usize {
        1
    }
    fn all_reduce_sum(&mut self, _: &[usize], _: &mut [f32]) -> Result<()> {
        Ok(())
    }
    fn all_gather(&mut self, _: &[usize], local: &[f32]) -> Result<Vec<f32>> {
        Ok(local.to_vec())
    }
    fn barrier(&mut self, _: &[usize]) -> Result<()> {
        Ok(())
    }
    fn stats(&self) -> crate::comm::CommStats {
        crate::comm::CommStats::default()
    }
}

impl crate::comm::StepChannel for NoComm {
    fn broadcast(&mut self, _: &[usize], _: usize, _: &mut Vec<u8>) -> Result<()> {
        Ok(())
    }
    fn send(&mut self, to: usize, _: &[u8]) -> Result<()> {
        Err(Error::Internal(format!("a one-rank replica has no rank {to} to send to")))
    }
    fn recv(&mut self, from: usize) -> Result<Vec<u8>> {
        Err(Error::Internal(format!("a one-rank replica has no rank {from} to receive from")))
    }
}

/// Loads one rank's slices of a checkpoint's tensors onto a backend, counting bytes.
struct ShardLoader<'a, B: Backend> {
    backend: &'a B,
    ckpt: &'a Checkpoint,
    config: &'a ModelConfig,
    shard: &'a RankShard,
    bytes: usize,
}

impl<B: Backend> ShardLoader<'_, B> {
    /// Loads `host`, rows `rows` of the `[out, _]` matrix `name`: as int8 with its scales'
    /// same rows when the checkpoint is quantized (`<name>_scale` beside it).
    fn weight(&mut self, name: &str, host: HostTensor, out: usize, rows: Range<usize>) -> Result<B::Weight> {
        let scale = format!("{name}_scale");
        let w = if self.ckpt.contains(&scale) {
            self.backend.load_weight_int8(&host, &self.ckpt.get(&scale, &[out])?.rows(rows)?)?
        } else {
            self.backend.load_weight(&host)?
        };
        self.bytes += self.backend.weight_bytes(&w);
        Ok(w)
    }

    /// This rank's vocabulary rows of an embedding-shaped tensor.
    fn vocab_rows(&mut self, name: &str) -> Result<B::Weight> {
        let c = self.config;
        let rows = self.shard.vocab.clone();
        let host = self.ckpt.get(name, &[c.vocab_size, c.hidden_size])?.rows(rows.clone())?;
        self.weight(name, host, c.vocab_size, rows)
    }

    /// Column-parallel: this rank's output rows (and bias elements).
    fn column(&mut self, name: &str, out: usize, rows: Range<usize>, bias: bool) -> Result<Linear<B>> {
        let h = self.config.hidden_size;
        let weight = format!("{name}.weight");
        let w =
            self.weight(&weight, self.ckpt.get(&weight, &[out, h])?.rows(rows.clone())?, out, rows.clone())?;
        let bias = match bias {
            true => {
                Some(self.backend.load_vector(&self.ckpt.get(&format!("{name}.bias"), &[out])?.rows(rows)?)?)
            }
            false => None,
        };
        Ok(Linear { weight: w, bias })
    }

    /// Row-parallel: this rank's input columns; the bias is added once, by TP rank 0.
    fn row(&mut self, name: &str, inp: usize, cols: Range<usize>, bias: bool) -> Result<Linear<B>> {
        let h = self.config.hidden_size;
        let weight = format!("{name}.weight");
        let full = self.ckpt.get(&weight, &[h, inp])?;
        let host = if cols.len() == inp { full } else { full.columns(cols)? };
        // Per-output-row scales apply to every column slice as they are.
        let w = self.weight(&weight, host, h, 0..h)?;
        let bias = match bias && self.shard.tp_rank == 0 {
            true => Some(vector(self.backend, self.ckpt, &format!("{name}.bias"), h)?),
            false => None,
        };
        Ok(Linear { weight: w, bias })
    }

    fn layer(&mut self, i: usize) -> Result<Layer<B>> {
        let (c, s) = (self.config, self.shard);
        let hd = c.head_dim;
        let (q_dim, kv_dim, inter) = (c.num_heads * hd, c.num_kv_heads * hd, c.intermediate_size);
        let q_rows = s.q_heads.start * hd..s.q_heads.end * hd;
        let kv_rows = s.kv_heads.start * hd..s.kv_heads.end * hd;
        let p = format!("model.layers.{i}");
        Ok(Layer {
            input_norm: vector(
                self.backend,
                self.ckpt,
                &format!("{p}.input_layernorm.weight"),
                c.hidden_size,
            )?,
            post_norm: vector(
                self.backend,
                self.ckpt,
                &format!("{p}.post_attention_layernorm.weight"),
                c.hidden_size,
            )?,
            q: self.column(&format!("{p}.self_attn.q_proj"), q_dim, q_rows.clone(), c.qkv_bias)?,
            k: self.column(&format!("{p}.self_attn.k_proj"), kv_dim, kv_rows.clone(), c.qkv_bias)?,
            v: self.column(&format!("{p}.self_attn.v_proj"), kv_dim, kv_rows, c.qkv_bias)?,
            o: self.row(&format!("{p}.self_attn.o_proj"), q_dim, q_rows, c.o_bias)?,
            gate: self.column(&format!("{p}.mlp.gate_proj"), inter, s.intermediate.clone(), c.mlp_bias)?,
            up: self.column(&format!("{p}.mlp.up_proj"), inter, s.intermediate.clone(), c.mlp_bias)?,
            down: self.row(&format!("{p}.mlp.down_proj"), inter, s.intermediate.clone(), c.mlp_bias)?,
        })
    }
}

fn vector<B: Backend>(backend: &B, ckpt: &Checkpoint, name: &str, len: usize) -> Result<B::Tensor> {
    let host: HostTensor = ckpt.get(name, &[len])?;
    backend.load_vector(&host)
}
