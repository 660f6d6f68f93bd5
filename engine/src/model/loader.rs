//! Loading one rank's slices of a checkpoint onto a backend, part by part.
//!
//! Tensor parallelism decides the slices: column-parallel projections (q, k, v, gate, up)
//! take this rank's output rows, row-parallel ones (o, down) its input columns, the
//! embedding and LM head its vocabulary rows. A quantized checkpoint's int8 matrices load
//! with their per-row scales (`<name>_scale` beside them). Every byte loaded is counted.

use std::ops::Range;

use strata_common::{Error, ModelConfig, RankShard, Result};

use super::experts::{Expert, Experts};
use super::parts::{
    Attention, AttentionKind, AttentionPart, AttentionSpec, Layer, LayerSpec, Linear, Mlp, MlpKind, MlpSpec,
    Norm, NormKind,
};
use super::weights::Checkpoint;
use crate::backend::routing::Routing;
use crate::backend::{AttentionShape, Backend};
use crate::tensor::HostTensor;

pub(super) struct ShardLoader<'a, B: Backend> {
    pub backend: &'a B,
    pub ckpt: &'a Checkpoint,
    pub config: &'a ModelConfig,
    pub shard: &'a RankShard,
    pub bytes: usize,
    /// Of `bytes`, what experts a step does not read hold: every MoE layer's experts but
    /// the `top_k` a token takes, in proportion (what batch-1 decode leaves unread).
    pub idle_expert_bytes: usize,
}

impl<B: Backend> ShardLoader<'_, B> {
    /// Loads `host`, rows `rows` of the `[out, _]` matrix `name`: as int8 with its scales'
    /// same rows when the checkpoint is quantized.
    pub(super) fn weight(
        &mut self,
        name: &str,
        host: HostTensor,
        out: usize,
        rows: Range<usize>,
    ) -> Result<B::Weight> {
        let scale = format!("{name}_scale");
        let w = if self.ckpt.contains(&scale) {
            self.backend.load_weight_int8(&host, &self.ckpt.get(&scale, &[out])?.rows(rows)?)?
        } else {
            self.backend.load_weight(&host)?
        };
        self.bytes += self.backend.weight_bytes(&w);
        Ok(w)
    }

    /// A `[len]` vector (norm weights, biases).
    pub fn vector(&self, name: &str, len: usize) -> Result<B::Tensor> {
        self.backend.load_vector(&self.ckpt.get(name, &[len])?)
    }

    /// This rank's vocabulary rows of an embedding-shaped tensor.
    pub fn vocab_rows(&mut self, name: &str) -> Result<B::Weight> {
        let c = self.config;
        let rows = self.shard.vocab.clone();
        let host = self.ckpt.get(name, &[c.vocab_size, c.hidden_size])?.rows(rows.clone())?;
        self.weight(name, host, c.vocab_size, rows)
    }

    /// Column-parallel: this rank's output rows (and bias elements).
    fn column(&mut self, name: &str, out: usize, rows: Range<usize>, bias: bool) -> Result<Linear<B>> {
        let h = self.config.hidden_size;
        let weight = format!("{name}.weight");
        let host = self.ckpt.get(&weight, &[out, h])?.rows(rows.clone())?;
        let w = self.weight(&weight, host, out, rows.clone())?;
        let bias = match bias {
            true => {
                Some(self.backend.load_vector(&self.ckpt.get(&format!("{name}.bias"), &[out])?.rows(rows)?)?)
            }
            false => None,
        };
        Ok(Linear { weight: w, bias })
    }

    /// Column-parallel out of a fused matrix (`{name}.weight`, `[total, hidden]`, the parts
    /// stacked by rows): this rank's rows of the part starting at row `offset`.
    fn fused(&mut self, name: &str, total: usize, offset: usize, rows: Range<usize>) -> Result<Linear<B>> {
        let weight = format!("{name}.weight");
        let rows = offset + rows.start..offset + rows.end;
        let host = self.ckpt.get(&weight, &[total, self.config.hidden_size])?.rows(rows.clone())?;
        Ok(Linear { weight: self.weight(&weight, host, total, rows)?, bias: None })
    }

    /// Row-parallel: this rank's input columns; the bias is added once, by TP rank 0.
    pub(super) fn row(
        &mut self,
        name: &str,
        inp: usize,
        cols: Range<usize>,
        bias: bool,
    ) -> Result<Linear<B>> {
        let h = self.config.hidden_size;
        let weight = format!("{name}.weight");
        let full = self.ckpt.get(&weight, &[h, inp])?;
        let host = if cols.len() == inp { full } else { full.columns(cols)? };
        // Per-output-row scales apply to every column slice as they are.
        let w = self.weight(&weight, host, h, 0..h)?;
        let bias = match bias && self.shard.tp_rank == 0 {
            true => Some(self.vector(&format!("{name}.bias"), h)?),
            false => None,
        };
        Ok(Linear { weight: w, bias })
    }

    /// A norm over `len` values: its weight, plus the family's offset (Gemma scales by
    /// `1 + w`, so its stored weights load as `1 + w`).
    pub(super) fn norm_of(&self, name: &str, len: usize, kind: NormKind) -> Result<Norm<B>> {
        let host = self.ckpt.get(name, &[len])?;
        let offset = self.config.norm_weight_offset;
        let weight = match offset {
            0.0 => self.backend.load_vector(&host)?,
            _ => {
                let shifted: Vec<f32> = host.to_f32_vec().iter().map(|w| w + offset).collect();
                self.backend.load_vector(&HostTensor::from_f32(name, &[len], &shifted))?
            }
        };
        Ok(Norm { weight, kind })
    }

    /// A norm over the hidden size.
    pub fn norm(&self, name: &str, kind: NormKind) -> Result<Norm<B>> {
        self.norm_of(name, self.config.hidden_size, kind)
    }

    /// This rank's heads of layer `p`'s attention.
    fn attention(&mut self, p: &str, spec: AttentionSpec, norm: NormKind) -> Result<Attention<B>> {
        let (c, s) = (self.config, self.shard);
        let hd = c.head_dim;
        let (q_dim, kv_dim) = (c.num_heads * hd, c.num_kv_heads * hd);
        let q_rows = s.q_heads.start * hd..s.q_heads.end * hd;
        let kv_rows = s.kv_heads.start * hd..s.kv_heads.end * hd;
        let shape = AttentionShape {
            num_heads: s.q_heads.len(),
            num_kv_heads: s.kv_heads.len(),
            head_dim: hd,
            scale: spec.scale,
            sliding_window: spec.sliding_window,
            softcap: spec.softcap,
        };
        let sinks = match spec.sinks {
            true => {
                let all = self.ckpt.get(&format!("{p}.self_attn.sinks"), &[c.num_heads])?;
                Some(self.backend.load_vector(&all.rows(s.q_heads.clone())?)?)
            }
            false => None,
        };
        let qk_norm = match spec.qk_norm {
            true => Some([
                self.norm_of(&format!("{p}.self_attn.q_norm.weight"), hd, norm)?,
                self.norm_of(&format!("{p}.self_attn.k_norm.weight"), hd, norm)?,
            ]),
            false => None,
        };
        let [q, k, v] = match c.fused_projections {
            // One qkv_proj: q's rows, then k's, then v's.
            true => {
                let (qkv, total) = (format!("{p}.self_attn.qkv_proj"), q_dim + 2 * kv_dim);
                [
                    self.fused(&qkv, total, 0, q_rows.clone())?,
                    self.fused(&qkv, total, q_dim, kv_rows.clone())?,
                    self.fused(&qkv, total, q_dim + kv_dim, kv_rows)?,
                ]
            }
            false => [
                self.column(&format!("{p}.self_attn.q_proj"), q_dim, q_rows.clone(), spec.qkv_bias)?,
                self.column(&format!("{p}.self_attn.k_proj"), kv_dim, kv_rows.clone(), spec.qkv_bias)?,
                self.column(&format!("{p}.self_attn.v_proj"), kv_dim, kv_rows, spec.qkv_bias)?,
            ],
        };
        let o = self.row(&format!("{p}.self_attn.o_proj"), q_dim, q_rows, spec.o_bias)?;
        Ok(Attention { spec, shape, qk_norm, sinks, q, k, v, o })
    }

    /// This rank's intermediate rows of layer `p`'s MLP.
    fn mlp(&mut self, p: &str, layer: usize, spec: MlpSpec) -> Result<Mlp<B>> {
        let (inter, rows) = (self.config.intermediate_size, self.shard.intermediate.clone());
        match spec.kind {
            MlpKind::Gated(act) if self.config.fused_projections => {
                // One gate_up_proj: gate's rows, then up's.
                let gate_up = format!("{p}.mlp.gate_up_proj");
                Ok(Mlp::Gated {
                    act,
                    gate: self.fused(&gate_up, 2 * inter, 0, rows.clone())?,
                    up: self.fused(&gate_up, 2 * inter, inter, rows.clone())?,
                    down: self.row(&format!("{p}.mlp.down_proj"), inter, rows, spec.bias)?,
                })
            }
            MlpKind::Gated(act) => Ok(Mlp::Gated {
                act,
                gate: self.column(&format!("{p}.mlp.gate_proj"), inter, rows.clone(), spec.bias)?,
                up: self.column(&format!("{p}.mlp.up_proj"), inter, rows.clone(), spec.bias)?,
                down: self.row(&format!("{p}.mlp.down_proj"), inter, rows, spec.bias)?,
            }),
            MlpKind::Experts { act, experts, top_k, norm_topk_prob } => {
                let moe = self
                    .config
                    .moe
                    .as_ref()
                    .ok_or_else(|| Error::Internal("experts without a MoE config".into()))?;
                let (names, inter, rows) =
                    (moe.names, moe.expert_intermediate, self.shard.expert_intermediate.clone());
                let block = format!("{p}.{}", names.block);
                let hidden = self.config.hidden_size;
                let router =
                    self.ckpt.get(&format!("{block}.{}.weight", names.router), &[experts, hidden])?;
                let router_bias = match names.biased {
                    true => Some(
                        self.ckpt.get(&format!("{block}.{}.bias", names.router), &[experts])?.to_f32_vec(),
                    ),
                    false => None,
                };
                let local = self.shard.experts.clone();
                let before = self.bytes;
                let mut loaded = Vec::with_capacity(local.len());
                for e in local.clone() {
                    loaded.push(match names.stacked {
                        true => self.stacked_expert(&block, e, experts, inter, rows.clone())?,
                        false => {
                            let x = format!("{block}.experts.{e}");
                            let b = names.biased;
                            Expert {
                                gate: self.column(&format!("{x}.{}", names.gate), inter, rows.clone(), b)?,
                                up: self.column(&format!("{x}.{}", names.up), inter, rows.clone(), b)?,
                                down: self.row(&format!("{x}.{}", names.down), inter, rows.clone(), b)?,
                            }
                        }
                    });
                }
                // A token reads top_k of the layer's experts; the rest of what this rank holds
                // stays unread at batch 1 (under expert parallelism, in proportion).
                let held = self.bytes - before;
                self.idle_expert_bytes += held - held * top_k.min(local.len()) / local.len().max(1);
                // Split by experts when this rank holds only some of them.
                let parallel = local.len() < experts;
                let routing = match moe.grouped {
                    Some(groups) => {
                        let bias = format!("{block}.{}.e_score_correction_bias", names.router);
                        let correction = self.ckpt.get(&bias, &[experts])?.to_f32_vec();
                        Routing::Grouped { norm: norm_topk_prob, groups, correction }
                    }
                    None => Routing::Softmax { norm: norm_topk_prob },
                };
                // The shared experts: the same share of their columns as of each routed
                // expert's (all of them under expert parallelism).
                let shared = match moe.shared_intermediate {
                    0 => None,
                    s => {
                        let x = format!("{block}.shared_experts");
                        let r = rows.start * s / inter..rows.end * s / inter;
                        Some(Expert {
                            gate: self.column(&format!("{x}.gate_proj"), s, r.clone(), false)?,
                            up: self.column(&format!("{x}.up_proj"), s, r.clone(), false)?,
                            down: self.row(&format!("{x}.down_proj"), s, r, false)?,
                        })
                    }
                };
                let mut layer = Experts {
                    layer,
                    act,
                    router: router.to_f32_vec(),
                    router_bias,
                    routing,
                    shared,
                    experts: loaded,
                    first: local.start,
                    top_k,
                    device: None,
                    parallel,
                    group_rank: self.shard.tp_rank,
                    counts_routes: parallel || self.shard.tp_rank == 0,
                    metrics: Default::default(),
                };
                layer.prepare_device(self.backend)?;
                Ok(Mlp::Experts(Box::new(layer)))
            }
        }
    }

    /// Expert `e` of a stacked layout (gpt-oss: `experts.gate_up_proj` `[experts, hidden,
    /// 2 · inter]`, gate and up columns interleaved; `experts.down_proj` `[experts, inter,
    /// hidden]`; a bias beside each; or both as MXFP4 blocks, `[out, in]` per expert):
    /// this rank's intermediate `rows` of it, read as `[out, in]` matrices. The down bias
    /// is added by the rank holding the first columns (the whole expert under expert
    /// parallelism).
    fn stacked_expert(
        &mut self,
        block: &str,
        e: usize,
        experts: usize,
        inter: usize,
        rows: Range<usize>,
    ) -> Result<Expert<B>> {
        let h = self.config.hidden_size;
        let x = format!("{block}.experts");
        let stacked = |name: &str, shape: [usize; 3]| -> Result<Stacked> {
            let [_, inp, out] = shape;
            Ok(match self.ckpt.mxfp4_expert(name, e, experts, out, inp)? {
                Some(rows) => Stacked::OutIn(rows),
                None => Stacked::InOut(self.ckpt.get(name, &shape)?.index(e)?),
            })
        };
        let gate_up = stacked(&format!("{x}.gate_up_proj"), [experts, h, 2 * inter])?;
        let down = stacked(&format!("{x}.down_proj"), [experts, inter, h])?;
        let gate_up_bias =
            self.ckpt.get(&format!("{x}.gate_up_proj_bias"), &[experts, 2 * inter])?.index(e)?.to_f32_vec();
        let (gate_cols, up_cols): (Vec<usize>, Vec<usize>) = rows.clone().map(|r| (2 * r, 2 * r + 1)).unzip();
        let mut part = |what: &str, cols: &[usize]| -> Result<Linear<B>> {
            let name = format!("{x}.{e}.{what}");
            let host = gate_up.out_rows(cols)?;
            let bias: Vec<f32> = cols.iter().map(|&c| gate_up_bias[c]).collect();
            Ok(Linear {
                weight: self.weight(&name, host, 2 * inter, 0..cols.len())?,
                bias: Some(self.backend.load_vector(&HostTensor::from_f32(&name, &[cols.len()], &bias))?),
            })
        };
        let (gate, up) = (part("gate", &gate_cols)?, part("up", &up_cols)?);
        let down_host = match down {
            Stacked::InOut(t) => t.rows(rows.clone())?.transposed_columns(&(0..h).collect::<Vec<_>>())?,
            Stacked::OutIn(t) => t.columns(rows.clone())?,
        };
        let down_bias = match rows.start == 0 {
            true => {
                let all = self.ckpt.get(&format!("{x}.down_proj_bias"), &[experts, h])?;
                Some(self.backend.load_vector(&all.index(e)?.rows(0..h)?)?)
            }
            false => None,
        };
        let weight = self.weight(&format!("{x}.{e}.down"), down_host, h, 0..h)?;
        Ok(Expert { gate, up, down: Linear { weight, bias: down_bias } })
    }

    /// Layer `i`, built from the parts `spec` names. In a sandwich (Gemma),
    /// `post_attention_layernorm` norms the attention's output and
    /// `pre_feedforward_layernorm` is the MLP's input norm; otherwise (Llama)
    /// `post_attention_layernorm` is the MLP's input norm.
    pub fn layer(&mut self, i: usize, spec: &LayerSpec) -> Result<Layer<B>> {
        let p = format!("model.layers.{i}");
        let norm = |name: &str| self.norm(&format!("{p}.{name}.weight"), spec.norm);
        let (attention_out_norm, post_norm, mlp_out_norm) = match spec.sandwich_norms {
            true => (
                Some(norm("post_attention_layernorm")?),
                norm("pre_feedforward_layernorm")?,
                Some(norm("post_feedforward_layernorm")?),
            ),
            false => (None, norm("post_attention_layernorm")?, None),
        };
        Ok(Layer {
            input_norm: norm("input_layernorm")?,
            attention_out_norm,
            post_norm,
            mlp_out_norm,
            attention: match spec.attention.kind {
                AttentionKind::Grouped => {
                    AttentionPart::Grouped(self.attention(&p, spec.attention, spec.norm)?)
                }
                AttentionKind::Latent(dims) => {
                    AttentionPart::Latent(self.latent_attention(&p, dims, spec.norm)?)
                }
            },
            mlp: self.mlp(&p, i, spec.mlp)?,
        })
    }

    /// The LM head of the last stage: its own matrix, or None when it is tied to the
    /// embedding; an error naming the tensor when the checkpoint lacks it.
    pub fn lm_head(&mut self) -> Result<Option<B::Weight>> {
        if self.config.tie_word_embeddings {
            return Ok(None);
        }
        if !self.ckpt.contains("lm_head.weight") {
            return Err(Error::model_file(
                self.ckpt.dir(),
                "tensor \"lm_head.weight\" is missing and tie_word_embeddings is false",
            ));
        }
        self.vocab_rows("lm_head.weight").map(Some)
    }
}

/// One expert's matrix of a stacked layout: `[in, out]` as transformers stores it, or
/// `[out, in]` as MXFP4 blocks dequantize.
enum Stacked {
    InOut(HostTensor),
    OutIn(HostTensor),
}

impl Stacked {
    /// Output rows `rows` as an `[rows, in]` matrix.
    fn out_rows(&self, rows: &[usize]) -> Result<HostTensor> {
        match self {
            Stacked::InOut(t) => t.transposed_columns(rows),
            Stacked::OutIn(t) => t.select_rows(rows),
        }
    }
}
