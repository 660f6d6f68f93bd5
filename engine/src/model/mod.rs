//! The decoder, written once against the [`Backend`] traits and assembled from parts that
//! config.json chooses ([`parts`]): Llama, Mistral and Qwen2 are configurations of it.
//!
//! A rank runs its shard of a [`Step`] with [`Model::run_step`]: the first stage embeds,
//! every stage runs its layers, a stage before the last hands its hidden states on, and
//! the last computes the logits of the step's logit rows (normally each sequence's last
//! token: the LM head is the largest matmul of a decode step). A step is any mix of
//! sequences, each contributing any number of new tokens at its own position (a prefill
//! chunk or one decode token). A pure decode step replays a captured graph where the
//! backend keeps them and the rank's collectives are device work a graph can record.
//! The rank's collectives are whatever [`DeviceCollectives`] it was given — a one-rank
//! replica's are [`crate::comm::Solo`]'s, and the code is the same.

mod dequant;
mod experts;
mod latent;
pub mod loader;
mod output;
pub mod parts;
pub mod quantize;
pub mod random;
mod rope;
pub mod weights;

use std::path::Path;
use std::time::Instant;

use strata_common::{Error, ModelConfig, Parallelism, RankShard, Result, ShardPlan};
use tracing::info;

use crate::backend::{Backend, BatchLayout, GraphOutput, Pointwise, RopeTable};
use crate::comm::DeviceCollectives;
use crate::logits::{LogitsWanted, StepLogits, StepOutput};
use crate::metrics::{RankMetrics, ReplicaLabels};
use crate::step::{KvBlocks, Step};
use crate::tensor::DType;
use loader::ShardLoader;
use parts::{KvPlace, Layer, LayerSpec, Norm, NormKind, PartCx};
use weights::Checkpoint;

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

    /// Whether this rank returns the step's output: the last stage's TP rank 0.
    pub fn leads_output(&self) -> bool {
        self.is_last_stage() && self.shard.tp_rank == 0
    }
}

pub struct Model<B: Backend> {
    pub config: ModelConfig,
    pub shard: ModelShard,
    backend: B,
    /// This rank's vocabulary rows of the embedding (first stage; last stage when tied).
    embed: Option<B::Weight>,
    /// Gemma's `√hidden` embedding multiplier, rounded to the table's dtype as
    /// transformers rounds it before multiplying.
    embed_scale: Option<f32>,
    layers: Vec<Layer<B>>,
    /// Each of this rank's layers' KV group and the storage it reads (see
    /// [`strata_common::KvGroups`]).
    kv_map: Vec<KvPlace>,
    norm: Norm<B>,
    /// This rank's vocabulary rows of the LM head (last stage); None when tied.
    lm_head: Option<B::Weight>,
    /// The rope tables the layers' attention parts name.
    ropes: Vec<RopeTable>,
    /// LongRoPE: the context at which steps switch to the long factors, and those tables.
    long_ropes: Option<(usize, Vec<RopeTable>)>,
    weight_bytes: usize,
    /// Expert weights a batch-1 decode step leaves unread (see [`loader::ShardLoader`]).
    idle_expert_bytes: usize,
    /// This rank's step and all-reduce metrics.
    pub metrics: RankMetrics,
}

impl<B: Backend> Model<B> {
    /// Loads a whole HF model directory: config.json, generation_config.json, safetensors.
    pub fn load(dir: &Path, backend: B) -> Result<Self> {
        let config = ModelConfig::from_dir(dir)?;
        let mut ckpt = Checkpoint::open(dir)?;
        ckpt.set_fp8_block(config.fp8_block);
        let shard = ModelShard::whole(&config);
        Self::from_checkpoint(config, &ckpt, backend, shard)
    }

    /// Loads only rank `rank`'s shard of a `par` replica.
    pub fn load_shard(dir: &Path, backend: B, par: Parallelism, rank: usize) -> Result<Self> {
        let config = ModelConfig::from_dir(dir)?;
        let plan = ShardPlan::new(&config, par)?;
        let mut ckpt = Checkpoint::open(dir)?;
        ckpt.set_fp8_block(config.fp8_block);
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
        let specs = LayerSpec::of(&config)?;
        let c = &config;
        let s = &ms.shard;
        let (first, last) = (s.is_first_stage(), ms.is_last_stage());
        let mut load =
            ShardLoader { backend: &backend, ckpt, config: c, shard: s, bytes: 0, idle_expert_bytes: 0 };
        let embed = match first || (last && c.tie_word_embeddings) {
            true => Some(load.vocab_rows("model.embed_tokens.weight")?),
            false => None,
        };
        let embed_scale = c.embed_scale.map(|scale| in_dtype(scale, ckpt.model_dtype()));
        let lm_head = if last { load.lm_head()? } else { None };
        let mut layers = Vec::with_capacity(s.layers.len());
        for i in s.layers.clone() {
            layers.push(load.layer(i, &specs[i])?);
            tracing::debug!(layer = i, of = c.num_layers, "layer loaded");
        }
        let norm = load.norm("model.norm.weight", final_norm(&specs, c))?;
        let (bytes, idle_expert_bytes) = (load.bytes, load.idle_expert_bytes);
        let groups = c.kv_groups();
        let slots = groups.slots_of(s.layers.clone());
        let kv_map = s
            .layers
            .clone()
            .map(|l| KvPlace {
                group: groups.group_of[l],
                storage: slots.binary_search(&groups.slot_of[l]).expect("a layer's slot is among the rank's"),
            })
            .collect();
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
            ropes: rope::rope_tables(c),
            long_ropes: rope::long_rope_tables(c),
            config,
            shard: ms,
            backend,
            embed,
            embed_scale,
            layers,
            kv_map,
            norm,
            lm_head,
            weight_bytes: bytes,
            idle_expert_bytes,
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

    /// Bytes of weights one decode step of one token reads: everything but the embedding
    /// table, of which it reads one row (unless the LM head is tied to it), and but the
    /// experts the token was not routed to (the active weights of a mixture of experts).
    pub fn decode_bytes_per_token(&self) -> usize {
        let read = match (&self.embed, &self.lm_head) {
            (Some(e), Some(_)) => self.weight_bytes - self.backend.weight_bytes(e),
            (Some(e), None) if !self.shard.is_last_stage() => {
                self.weight_bytes - self.backend.weight_bytes(e)
            }
            _ => self.weight_bytes,
        };
        read - self.idle_expert_bytes
    }

    /// Allocates this shard's paged KV cache: one storage per local layer, or per slot
    /// its layers share where they form several KV groups.
    pub fn alloc_kv(&self, kv: KvBlocks) -> Result<Vec<B::KvLayer>> {
        let (width, shared) = self.config.kv_layer_width(self.shard.shard.kv_heads.len());
        (0..KvPlace::storages(&self.kv_map))
            .map(|_| match shared {
                true => self.backend.alloc_kv_shared(kv.num_blocks, kv.block_size, width),
                false => self.backend.alloc_kv(kv.num_blocks, kv.block_size, width),
            })
            .collect()
    }

    /// This rank's part of `step`: the step's output on the rank that
    /// [leads it](ModelShard::leads_output), None on the others. A pure decode step replays
    /// from a graph where the backend keeps them and `comm`'s collectives are device work
    /// in stream order; every other step runs op by op.
    pub fn run_step(
        &self,
        step: &Step,
        kv: &mut [B::KvLayer],
        comm: &mut dyn DeviceCollectives<B>,
    ) -> Result<Option<StepOutput>> {
        let lead = self.shard.leads_output();
        if let Some(out) = self.replayed(step, kv, comm)? {
            return Ok(lead.then_some(out));
        }
        let x = self.stage_input(&step.ids, comm)?;
        let x = self.run_layers(x, &step.layout, kv, comm)?;
        if !self.shard.is_last_stage() {
            comm.send(&self.backend, &x, self.next_stage_rank())?;
            return Ok(None);
        }
        let mut out = self.step_output(&x, step, comm)?;
        if lead && !step.hidden_rows.is_empty() {
            out.hidden = self.final_hidden(&x, &step.hidden_rows)?;
        }
        Ok(lead.then_some(out))
    }

    /// A pure decode step replayed from a captured graph (see
    /// [`crate::backend::StepGraphs`]) where the backend keeps them and the collectives
    /// are device work the graph captures. Returns what [`Model::step_output`] returns on
    /// the last stage, an empty output on the others; None when the step is to run op by
    /// op.
    fn replayed(
        &self,
        step: &Step,
        kv: &mut [B::KvLayer],
        comm: &mut dyn DeviceCollectives<B>,
    ) -> Result<Option<StepOutput>> {
        // A captured graph keeps its rope tables: LongRoPE's switch runs op by op.
        if !comm.in_stream_order() || self.long_ropes.is_some() {
            return Ok(None);
        }
        let last = self.shard.is_last_stage();
        let drawing = last && step.draws_tokens();
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
        let wanted = if last { step.wanted } else { LogitsWanted::Full };
        let graph = GraphOutput { wanted, draw: drawing, vocab, first_id };
        let replayed = self.backend.replay_decode(step, graph, &mut |s: &Step| {
            let x = self.stage_input(&s.ids, &mut *comm)?;
            let x = self.run_layers(x, &s.layout, kv, &mut *comm)?;
            if !last {
                comm.send(&self.backend, &x, self.next_stage_rank())?;
                return Ok(x);
            }
            let head = self.head_logits(&x, &s.logit_rows)?;
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
        let mut out = StepOutput::from_f32s(wanted, if drawing { step.draws.len() } else { 0 }, 0, data)?;
        if !drawing {
            out.logits = self.merge_shards(out.logits, step.logit_rows.len(), wanted, comm)?;
        }
        Ok(Some(out))
    }

    /// This stage's input for the step's `ids`: their embeddings on the first stage (the
    /// vocabulary shards' rows summed across TP), the previous stage's hidden states on
    /// the others.
    fn stage_input(&self, ids: &[u32], comm: &mut dyn DeviceCollectives<B>) -> Result<B::Tensor> {
        let s = &self.shard.shard;
        if s.stage > 0 {
            let from = (s.stage - 1) * self.shard.tp() + s.tp_rank;
            return comm.recv(&self.backend, ids.len(), self.config.hidden_size, from);
        }
        let table = self
            .embed
            .as_ref()
            .ok_or_else(|| Error::Internal("embeddings on a stage without the embedding".into()))?;
        let mut x = self.backend.embed(table, ids, s.vocab.start as u32)?;
        self.all_reduce(&mut x, ids.len(), comm)?;
        if let Some(scale) = self.embed_scale {
            self.backend.pointwise(&mut x, Pointwise::Scale(scale))?;
        }
        Ok(x)
    }

    /// The rank of the next stage this one hands its hidden states to (same TP rank).
    fn next_stage_rank(&self) -> usize {
        (self.shard.shard.stage + 1) * self.shard.tp() + self.shard.shard.tp_rank
    }

    /// Runs this shard's decoder layers over hidden states `x`.
    fn run_layers(
        &self,
        x: B::Tensor,
        layout: &BatchLayout,
        kv: &mut [B::KvLayer],
        comm: &mut dyn DeviceCollectives<B>,
    ) -> Result<B::Tensor> {
        let group = &self.shard.tp_group[..];
        // LongRoPE: a sequence reaching past the original context in this step rotates
        // its new tokens with the long factors (as transformers decides for a forward
        // pass: by its length so far); a step may hold sequences of both kinds.
        let (mut ropes, mut mixed_ropes) = (&self.ropes[..], None);
        if let Some((original, long)) = &self.long_ropes {
            let mut rows = vec![false; layout.positions.len()];
            for s in &layout.seqs {
                let takes_long = s.context_before + s.num_tokens > *original;
                rows.get_mut(s.token_start..s.token_start + s.num_tokens)
                    .ok_or_else(|| Error::Internal("a sequence's rows lie outside the step".into()))?
                    .fill(takes_long);
            }
            match (rows.iter().all(|&r| r), rows.iter().any(|&r| r)) {
                (true, _) => ropes = &long[..],
                (false, true) => mixed_ropes = Some((&long[..], rows)),
                (false, false) => {}
            }
        }
        let mut cx = PartCx {
            b: &self.backend,
            layout,
            kv_group: 0,
            ropes,
            mixed_ropes,
            comm,
            group,
            metrics: &self.metrics,
        };
        parts::run(&mut cx, &self.layers, &self.kv_map, kv, x)
    }

    /// Sums `x` (`rows` hidden states) across the TP group, timed on this rank. On a
    /// device backend the time is until the collective is queued on the stream.
    fn all_reduce(&self, x: &mut B::Tensor, rows: usize, comm: &mut dyn DeviceCollectives<B>) -> Result<()> {
        if self.shard.tp() == 1 {
            return Ok(());
        }
        let bytes = rows * self.config.hidden_size * std::mem::size_of::<f32>();
        let _span = tracing::trace_span!("all_reduce", bytes = bytes as i64).entered();
        let started = Instant::now();
        comm.all_reduce(&self.backend, x, &self.shard.tp_group)?;
        self.metrics.all_reduce(started.elapsed(), bytes);
        Ok(())
    }
}

/// The final norm is of the layers' kind (every family so far norms the same way
/// throughout).
fn final_norm(specs: &[LayerSpec], config: &ModelConfig) -> NormKind {
    specs.last().map_or(NormKind::Rms { eps: config.rms_norm_eps as f32 }, |s| s.norm)
}

/// `value` rounded to what `dtype` holds (f32 for int8 tables, whose scales are f32).
fn in_dtype(value: f32, dtype: DType) -> f32 {
    match dtype {
        DType::BF16 => half::bf16::from_f32(value).to_f32(),
        DType::F16 => half::f16::from_f32(value).to_f32(),
        _ => value,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gemma_embedding_scale_rounds_to_the_tables_dtype() {
        let scale = (1152f32).sqrt();
        assert_eq!(in_dtype(scale, DType::BF16), 34.0);
        assert_eq!(in_dtype(scale, DType::F16), half::f16::from_f32(scale).to_f32());
        assert_eq!(in_dtype(scale, DType::F32), scale);
    }
}
