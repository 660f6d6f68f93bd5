//! The shard plan: which slice of the model each rank of a `tp × pp` replica holds.
//!
//! Computed once from the model config, identically on every rank, before any weight is
//! read. Layers are split into contiguous pipeline stages (earlier stages take the extra
//! layer when the split is uneven); inside a stage, tensor parallelism splits attention by
//! heads and the MLP by intermediate columns (q/k/v/gate/up by output rows, o/down by input
//! columns), and the embedding and LM head by vocabulary. KV heads are split across the TP
//! group, or replicated when there are fewer KV heads than TP ranks. Shapes that cannot be
//! split evenly are rejected with the field that prevents it.
//!
//! Expert parallelism (`ep`, equal to `tp` when more than 1) splits each MoE layer's experts
//! across a stage's TP ranks instead of each expert's columns: rank `tp_rank` holds experts
//! `tp_rank · E/ep ..`, whole, while attention stays tensor-parallel across the same ranks.
//!
//! Rank numbering: `rank = stage * tp + tp_rank`; rank 0 is the replica's leader.

use std::ops::Range;

use crate::device::DType;
use crate::error::{Error, Result};
use crate::model_config::ModelConfig;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Parallelism {
    pub tp: usize,
    pub pp: usize,
    /// Ranks each MoE layer's experts are split across: 1 (every rank holds a slice of
    /// every expert) or `tp` (each rank holds whole experts).
    pub ep: usize,
}

impl Parallelism {
    pub const NONE: Parallelism = Parallelism { tp: 1, pp: 1, ep: 1 };

    /// `tp × pp` ranks, experts split by columns.
    pub const fn new(tp: usize, pp: usize) -> Self {
        Parallelism { tp, pp, ep: 1 }
    }

    /// `--tp`, `--pp` and `--ep` as a user gives them: `--ep N` alone means N ranks per
    /// stage (attention tensor-parallel across them); with `--tp`, the two must agree.
    pub fn with_ep(tp: usize, pp: usize, ep: usize) -> Result<Self> {
        match (tp, ep) {
            (_, 0) => Err(Error::invalid("ep", "must be at least 1")),
            (_, 1) => Ok(Parallelism::new(tp, pp)),
            (1, n) => Ok(Parallelism { tp: n, pp, ep: n }),
            (t, n) if t == n => Ok(Parallelism { tp: t, pp, ep: n }),
            (t, n) => Err(Error::invalid(
                "ep",
                format!("{n} with tp {t}: experts split across a stage's ranks, so ep equals tp (or tp is left out)"),
            )),
        }
    }

    pub fn world(&self) -> usize {
        self.tp * self.pp
    }
}

/// What one rank holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankShard {
    pub rank: usize,
    pub stage: usize,
    pub tp_rank: usize,
    /// Decoder layers of this rank's stage.
    pub layers: Range<usize>,
    /// Query heads of this rank.
    pub q_heads: Range<usize>,
    /// KV heads of this rank (shared by neighbours when replicated).
    pub kv_heads: Range<usize>,
    /// Intermediate (MLP) columns of this rank.
    pub intermediate: Range<usize>,
    /// Intermediate columns of every expert this rank holds (MoE layers; empty for a
    /// dense model): each expert's MLP is split across the TP group like a dense one, or
    /// whole under expert parallelism.
    pub expert_intermediate: Range<usize>,
    /// The experts this rank holds: all of them, or its share under expert parallelism.
    pub experts: Range<usize>,
    /// Vocabulary rows of the embedding and LM head this rank holds.
    pub vocab: Range<usize>,
}

impl RankShard {
    pub fn is_first_stage(&self) -> bool {
        self.stage == 0
    }
}

#[derive(Debug, Clone)]
pub struct ShardPlan {
    pub par: Parallelism,
    pub ranks: Vec<RankShard>,
}

impl ShardPlan {
    pub fn new(config: &ModelConfig, par: Parallelism) -> Result<Self> {
        let Parallelism { tp, pp, ep } = par;
        if ep != 1 && ep != tp {
            return Err(Error::invalid("ep", format!("{ep} with tp {tp}: ep is 1 or tp")));
        }
        let num_experts = config.moe.as_ref().map_or(0, |m| m.num_experts);
        if ep > 1 && (config.moe.is_none() || !num_experts.is_multiple_of(ep)) {
            return Err(Error::invalid(
                "ep",
                match config.moe {
                    None => "expert parallelism needs a mixture-of-experts model".to_string(),
                    Some(_) => format!("{ep} does not divide the {num_experts} experts"),
                },
            ));
        }
        if tp == 0 || pp == 0 {
            return Err(Error::invalid("tp", "tp and pp must be at least 1"));
        }
        if pp > config.num_layers {
            return Err(Error::invalid(
                "pp",
                format!(
                    "{pp} pipeline stages for {} layers: each stage needs at least one layer",
                    config.num_layers
                ),
            ));
        }
        if !config.num_heads.is_multiple_of(tp) {
            return Err(Error::invalid(
                "tp",
                format!("{tp} does not divide num_attention_heads ({})", config.num_heads),
            ));
        }
        let kv = config.num_kv_heads;
        if !kv.is_multiple_of(tp) && tp % kv != 0 {
            return Err(Error::invalid(
                "tp",
                format!("{tp} neither divides num_key_value_heads ({kv}) nor is a multiple of it"),
            ));
        }
        if !config.intermediate_size.is_multiple_of(tp) {
            return Err(Error::invalid(
                "tp",
                format!("{tp} does not divide intermediate_size ({})", config.intermediate_size),
            ));
        }
        let expert_inter = config.moe.as_ref().map_or(0, |m| m.expert_intermediate);
        // Expert parallelism keeps every expert whole: its columns are split over no one.
        let column_ranks = if ep > 1 { 1 } else { tp };
        if !expert_inter.is_multiple_of(column_ranks) {
            return Err(Error::invalid(
                "tp",
                format!("{tp} does not divide the experts' intermediate size ({expert_inter})"),
            ));
        }
        let expert_per = expert_inter / column_ranks;
        let experts_per = num_experts / ep;
        let q_per = config.num_heads / tp;
        let group = config.num_heads / kv;
        let inter_per = config.intermediate_size / tp;
        let vocab_per = config.vocab_size.div_ceil(tp);
        let mut ranks = Vec::with_capacity(tp * pp);
        for stage in 0..pp {
            let layers = split(config.num_layers, pp, stage);
            for tp_rank in 0..tp {
                let q_heads = tp_rank * q_per..(tp_rank + 1) * q_per;
                let kv_heads = q_heads.start / group..q_heads.end.div_ceil(group);
                let vocab_start = (tp_rank * vocab_per).min(config.vocab_size);
                ranks.push(RankShard {
                    rank: stage * tp + tp_rank,
                    stage,
                    tp_rank,
                    layers: layers.clone(),
                    q_heads,
                    kv_heads,
                    intermediate: tp_rank * inter_per..(tp_rank + 1) * inter_per,
                    expert_intermediate: match ep {
                        1 => tp_rank * expert_per..(tp_rank + 1) * expert_per,
                        _ => 0..expert_inter,
                    },
                    experts: match ep {
                        1 => 0..num_experts,
                        _ => tp_rank * experts_per..(tp_rank + 1) * experts_per,
                    },
                    vocab: vocab_start..(vocab_start + vocab_per).min(config.vocab_size),
                });
            }
        }
        Ok(ShardPlan { par, ranks })
    }

    pub fn rank(&self, rank: usize) -> &RankShard {
        &self.ranks[rank]
    }

    /// Ranks of a pipeline stage (its TP group), in TP order.
    pub fn stage_ranks(&self, stage: usize) -> Range<usize> {
        stage * self.par.tp..(stage + 1) * self.par.tp
    }
}

/// Bytes per element of weights in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WeightBytes {
    /// 2-D tensors (projections, embedding, LM head); 1 means int8 with an f32 scale per
    /// row.
    pub matrix: u64,
    /// 1-D tensors (norms, biases).
    pub vector: u64,
}

impl WeightBytes {
    /// How a model's weights sit in memory: int8 for a `strata model quantize` checkpoint,
    /// else the requested dtype (None: the checkpoint's) where it is narrower than the
    /// checkpoint's (a wider one is widened inside the matmuls, not stored).
    pub fn of(config: &ModelConfig, dtype: Option<DType>) -> Self {
        let size = |d: &str| match d.to_ascii_lowercase().as_str() {
            "bf16" | "bfloat16" | "f16" | "fp16" | "float16" => Some(2),
            "f32" | "fp32" | "float32" => Some(4),
            _ => None,
        };
        let stored = config.dtype.as_deref().and_then(size).unwrap_or(4);
        let vector = dtype.map_or(stored, |d| (d.size() as u64).min(stored));
        let int8 = config.quantization.as_deref() == Some("strata-int8");
        WeightBytes { matrix: if int8 { 1 } else { vector }, vector }
    }
}

impl RankShard {
    /// Bytes of the weights this rank holds (what a worker needs before its KV cache;
    /// ignores allocator padding and activations).
    pub fn weight_bytes(&self, c: &ModelConfig, b: WeightBytes, last_stage: bool) -> u64 {
        let len = |r: &Range<usize>| r.len() as u64;
        let (h, d) = (c.hidden_size as u64, c.head_dim as u64);
        let (q, kv, inter) = (len(&self.q_heads) * d, len(&self.kv_heads) * d, len(&self.intermediate));
        // rows × columns of a matrix, with int8's f32 scale per row.
        let matrix = |rows: u64, cols: u64| rows * cols * b.matrix + if b.matrix == 1 { rows * 4 } else { 0 };
        let mut attention = match &c.latent {
            Some(l) => {
                let norms = l.kv_lora_rank + l.q_lora_rank.unwrap_or(0);
                latent_bytes(l, len(&self.q_heads), h, matrix) + norms as u64 * b.vector
            }
            None => matrix(q, h) + 2 * matrix(kv, h) + matrix(h, q),
        };
        // Norms: before attention and MLP, after both in a sandwich; q and k per head.
        let norms = if c.sandwich_norms { 4 } else { 2 } * h + if c.qk_norm { 2 * d } else { 0 };
        attention += norms * b.vector;
        if c.qkv_bias {
            attention += match &c.latent {
                // Latent attention's biased projections: q_a_proj and kv_a_proj_with_mqa.
                Some(l) => (l.q_lora_rank.unwrap_or(0) + l.cached_width()) as u64,
                None => q + 2 * kv,
            } * b.vector;
        }
        if c.o_bias {
            attention += h * b.vector;
        }
        if c.attention_sinks {
            attention += len(&self.q_heads) * b.vector;
        }
        let mut dense = 2 * matrix(inter, h) + matrix(h, inter);
        if c.mlp_bias {
            dense += (2 * inter + h) * b.vector;
        }
        // Experts: each one's share of columns, and the router (as the checkpoint has it).
        let experts = c.moe.as_ref().map_or(0, |m| {
            let ei = len(&self.expert_intermediate);
            // The shared experts: the same share of their columns.
            let si = (m.shared_intermediate * self.expert_intermediate.len())
                .checked_div(m.expert_intermediate)
                .unwrap_or(0) as u64;
            // Per expert, biased ones' biases (gate, up, down); per layer, the router's bias
            // or the correction bias.
            let biases = if m.names.biased { 2 * ei + h } else { 0 };
            let router_vectors = u64::from(m.names.biased) + u64::from(m.grouped.is_some());
            len(&self.experts) * (2 * matrix(ei, h) + matrix(h, ei) + biases * b.vector)
                + (2 * matrix(si, h) + matrix(h, si))
                + m.num_experts as u64 * (h + router_vectors) * b.vector
        });
        let moe_layer = |i: usize| c.moe.as_ref().is_some_and(|m| m.layers.get(i) == Some(&true));
        let layers: u64 =
            self.layers.clone().map(|i| attention + if moe_layer(i) { experts } else { dense }).sum();
        let vocab = matrix(len(&self.vocab), h);
        let mut total = layers;
        if self.is_first_stage() {
            total += vocab;
        }
        if last_stage {
            // The LM head (a tied one is the embedding, held once when one stage is both).
            let shared = c.tie_word_embeddings && self.is_first_stage();
            total += h * b.vector + if shared { 0 } else { vocab };
        }
        total
    }
}

/// One layer's latent attention weights on a rank holding `heads` heads (the query and
/// latent projections whole, the per-head ones its heads').
fn latent_bytes(l: &crate::Latent, heads: u64, h: u64, matrix: impl Fn(u64, u64) -> u64) -> u64 {
    let (lora, r, nope, v) =
        (l.kv_lora_rank as u64, l.qk_rope_head_dim as u64, l.qk_nope_head_dim as u64, l.v_head_dim as u64);
    let q = match l.q_lora_rank {
        Some(rank) => matrix(rank as u64, h) + matrix(heads * (nope + r), rank as u64),
        None => matrix(heads * (nope + r), h),
    };
    q + matrix(lora + r, h) + matrix(heads * (nope + v), lora) + matrix(h, heads * v)
}

impl ShardPlan {
    /// The most weight bytes any rank holds.
    pub fn max_weight_bytes(&self, config: &ModelConfig, bytes: WeightBytes) -> u64 {
        let last = self.par.pp - 1;
        self.ranks.iter().map(|r| r.weight_bytes(config, bytes, r.stage == last)).max().unwrap_or(0)
    }
}

/// Part `i` of `n` contiguous parts of `len`; earlier parts take the remainder.
fn split(len: usize, n: usize, i: usize) -> Range<usize> {
    let base = len / n;
    let extra = len % n;
    let start = i * base + i.min(extra);
    start..start + base + usize::from(i < extra)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(heads: usize, kv: usize, layers: usize) -> ModelConfig {
        ModelConfig::from_json_str(&format!(
            r#"{{"architectures":["LlamaForCausalLM"],"hidden_size":{},"intermediate_size":96,
               "num_hidden_layers":{layers},"num_attention_heads":{heads},"num_key_value_heads":{kv},
               "vocab_size":101}}"#,
            heads * 8
        ))
        .unwrap()
    }

    #[test]
    fn splits_heads_columns_layers_and_vocab() {
        let plan = ShardPlan::new(&config(8, 4, 5), Parallelism::new(2, 2)).unwrap();
        assert_eq!(plan.ranks.len(), 4);
        let r = plan.rank(3);
        assert_eq!((r.stage, r.tp_rank), (1, 1));
        assert_eq!(plan.rank(0).layers, 0..3, "the first stage takes the extra layer");
        assert_eq!(r.layers, 3..5);
        assert_eq!(r.q_heads, 4..8);
        assert_eq!(r.kv_heads, 2..4);
        assert_eq!(r.intermediate, 48..96);
        assert_eq!(plan.rank(0).vocab, 0..51);
        assert_eq!(r.vocab, 51..101);
        assert_eq!(plan.stage_ranks(1), 2..4);
    }

    #[test]
    fn replicates_kv_heads_when_fewer_than_ranks() {
        let plan = ShardPlan::new(&config(8, 2, 2), Parallelism::new(4, 1)).unwrap();
        let kv: Vec<_> = plan.ranks.iter().map(|r| r.kv_heads.clone()).collect();
        assert_eq!(kv, vec![0..1, 0..1, 1..2, 1..2]);
        let mqa = ShardPlan::new(&config(4, 1, 2), Parallelism::new(4, 1)).unwrap();
        assert!(mqa.ranks.iter().all(|r| r.kv_heads == (0..1)));
    }

    #[test]
    fn rejects_uneven_splits_naming_the_field() {
        let e = ShardPlan::new(&config(6, 6, 2), Parallelism::new(4, 1)).unwrap_err();
        assert!(e.to_string().contains("num_attention_heads"), "{e}");
        let e = ShardPlan::new(&config(8, 8, 2), Parallelism::new(1, 3)).unwrap_err();
        assert!(e.to_string().contains("layers"), "{e}");
        let e = ShardPlan::new(&config(12, 6, 2), Parallelism::new(4, 1)).unwrap_err();
        assert!(e.to_string().contains("num_key_value_heads"), "{e}");
    }

    fn llama_1b(extra: &str) -> ModelConfig {
        ModelConfig::from_json_str(&format!(
            r#"{{"architectures":["LlamaForCausalLM"],"hidden_size":2048,"intermediate_size":8192,
               "num_hidden_layers":16,"num_attention_heads":32,"num_key_value_heads":8,
               "vocab_size":128256,"tie_word_embeddings":true,"torch_dtype":"bfloat16"{extra}}}"#
        ))
        .unwrap()
    }

    #[test]
    fn weight_bytes_count_every_parameter_once() {
        // Llama-3.2-1B has 1,235,814,400 parameters (tied embeddings), 2 bytes each in bf16.
        let c = llama_1b("");
        let one = ShardPlan::new(&c, Parallelism::NONE).unwrap();
        assert_eq!(one.max_weight_bytes(&c, WeightBytes::of(&c, None)), 1_235_814_400 * 2);
        // f32 on a bf16 checkpoint is widened in the matmuls, not stored.
        assert_eq!(WeightBytes::of(&c, Some(DType::F32)), WeightBytes { matrix: 2, vector: 2 });
        // Two stages: each holds half the layers; the last also the (tied) LM head.
        let pp = ShardPlan::new(&c, Parallelism::new(1, 2)).unwrap();
        let b = WeightBytes::of(&c, None);
        let per: Vec<u64> = pp.ranks.iter().map(|r| r.weight_bytes(&c, b, r.stage == 1)).collect();
        let (layer, vocab) = (60_821_504 * 2, 128_256 * 2048 * 2);
        assert_eq!(per, vec![8 * layer + vocab, 8 * layer + vocab + 2048 * 2]);
        // Tensor parallel: roughly a quarter each (norms are replicated).
        let tp = ShardPlan::new(&c, Parallelism::new(4, 1)).unwrap();
        let most = tp.max_weight_bytes(&c, b);
        assert!(most > 1_235_814_400 / 2 && most < 1_235_814_400 / 2 + (1 << 20), "{most}");
    }

    #[test]
    fn int8_checkpoints_count_a_byte_and_a_row_scale() {
        let c = llama_1b(r#","quantization_config":{"quant_method":"strata-int8"}"#);
        let b = WeightBytes::of(&c, None);
        assert_eq!(b, WeightBytes { matrix: 1, vector: 2 });
        let one = ShardPlan::new(&c, Parallelism::NONE).unwrap().max_weight_bytes(&c, b);
        let rows = 128_256 + 16 * (2048 + 2 * 512 + 2048 + 2 * 8192 + 2048);
        let vectors = (16 * 2 + 1) * 2048;
        assert_eq!(one, (1_235_814_400 - vectors) + 4 * rows + 2 * vectors);
    }
}
