//! A decoder layer as parts: an attention kind, an MLP kind and the norms around them,
//! chosen from config.json ([`LayerSpec::of`]) and written once against the backend.
//!
//! Llama, Mistral, Qwen2, Qwen3 and Gemma 3 are configurations of the same parts:
//! grouped-query attention with or without biases, a sliding window (per layer), per-head
//! norms of queries and keys, its own scale and rope table; a gated MLP (SiLU or GELU's
//! tanh form, or gpt-oss's clamped SwiGLU) with or without biases; soft-capped scores
//! (Gemma 2) and per-head sinks (gpt-oss); RMS norms before each part and, in Gemma's
//! "sandwich", after it too. A new family adds a kind here — an attention kind (q/k norms, latent
//! attention, sinks), an MLP kind (a mixture of experts), a norm kind — and the spec that
//! chooses it; the step code in [`super`] does not change. Each layer has a spec of its
//! own, so a model may mix kinds (local and global attention, dense layers before MoE
//! ones), and each attention part names the rope table it rotates with.
//!
//! Tensor parallelism lives in the parts too: column-parallel projections produce this
//! rank's heads or intermediate rows, and the row-parallel projection that ends each part
//! hands its partial sum to the caller's all-reduce.

use strata_common::{Error, ModelConfig, Result};

use super::experts::Experts;
use super::latent::LatentAttention;
use crate::backend::{AttentionShape, Backend, BatchLayout, RopeTable};
use crate::comm::DeviceCollectives;
use crate::metrics::RankMetrics;

/// How a layer's norms are computed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum NormKind {
    /// `x / rms(x) · w` (Llama, Mistral, Qwen2, Qwen3).
    Rms { eps: f32 },
}

pub use strata_common::Activation;

/// How a layer attends.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum AttentionKind {
    /// Softmax attention over the paged KV cache, KV heads shared by groups of query heads
    /// (MHA, GQA and MQA alike).
    Grouped,
    /// Multi-head latent attention, the cache holding the latent ([`super::latent`]).
    Latent(strata_common::Latent),
}

/// One layer's attention: its kind and what configures it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionSpec {
    pub kind: AttentionKind,
    pub qkv_bias: bool,
    pub o_bias: bool,
    /// Positions a windowed layer sees back, its own included (None: all).
    pub sliding_window: Option<usize>,
    /// Each head's query and key pass a norm of their own before RoPE (Qwen3), its
    /// weight one `head_dim` vector shared by the heads.
    pub qk_norm: bool,
    /// Which of the model's rope tables rotates its queries and keys.
    pub rope: usize,
    /// What the scores `q · k` are multiplied by (`head_dim^-½` unless the model says;
    /// YaRN's and LongRoPE's attention factor scales the rotated dims, in the rope table).
    pub scale: f32,
    /// Scaled scores are soft-capped at this (Gemma 2).
    pub softcap: Option<f32>,
    /// Each head has a learned sink (`self_attn.sinks`, gpt-oss).
    pub sinks: bool,
}

/// How a layer's MLP is built.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum MlpKind {
    /// `down(act(gate(x)) · up(x))`.
    Gated(Activation),
    /// A mixture of `experts` gated MLPs, each token routed to `top_k` of them
    /// ([`super::experts`]).
    Experts { act: Activation, experts: usize, top_k: usize, norm_topk_prob: bool },
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MlpSpec {
    pub kind: MlpKind,
    pub bias: bool,
}

/// Everything that decides one layer's computation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerSpec {
    pub norm: NormKind,
    pub attention: AttentionSpec,
    pub mlp: MlpSpec,
    /// The attention's and the MLP's outputs are normed before the residual add too.
    pub sandwich_norms: bool,
}

impl LayerSpec {
    /// Every layer's parts, as config.json describes the model.
    pub fn of(config: &ModelConfig) -> Result<Vec<LayerSpec>> {
        if config.head_dim == 0 || !config.num_heads.is_multiple_of(config.num_kv_heads.max(1)) {
            return Err(Error::invalid(
                "config.json",
                format!(
                    "{} attention heads cannot share {} KV heads of dimension {}",
                    config.num_heads, config.num_kv_heads, config.head_dim
                ),
            ));
        }
        if config.windowed_layers.len() != config.num_layers {
            return Err(Error::invalid(
                "config.json",
                format!("{} layers' windows for {} layers", config.windowed_layers.len(), config.num_layers),
            ));
        }
        let scale = match config.query_pre_attn_scalar {
            Some(s) => (s as f32).powf(-0.5),
            None => 1.0 / (config.head_dim as f32).sqrt(),
        };
        let moe_layers = config.moe.as_ref().map(|m| m.layers.clone()).unwrap_or_default();
        let mlp = |i: usize| match (&config.moe, moe_layers.get(i)) {
            (Some(m), Some(true)) => MlpSpec {
                kind: MlpKind::Experts {
                    act: config.activation,
                    experts: m.num_experts,
                    top_k: m.top_k,
                    norm_topk_prob: m.norm_topk_prob,
                },
                bias: m.names.biased,
            },
            _ => MlpSpec { kind: MlpKind::Gated(config.activation), bias: config.mlp_bias },
        };
        let layer = |(i, windowed): (usize, bool)| {
            // The second table is the windowed layers' own base, where there is one.
            let rope = usize::from(windowed && config.local_rope_theta.is_some());
            LayerSpec {
                norm: NormKind::Rms { eps: config.rms_norm_eps as f32 },
                attention: AttentionSpec {
                    kind: match config.latent {
                        Some(dims) => AttentionKind::Latent(dims),
                        None => AttentionKind::Grouped,
                    },
                    qkv_bias: config.qkv_bias,
                    o_bias: config.o_bias,
                    sliding_window: if windowed { config.sliding_window } else { None },
                    qk_norm: config.qk_norm,
                    rope,
                    scale,
                    softcap: config.attn_logit_softcap,
                    sinks: config.attention_sinks,
                },
                mlp: mlp(i),
                sandwich_norms: config.sandwich_norms,
            }
        };
        Ok(config.windowed_layers.iter().copied().enumerate().map(layer).collect())
    }
}

/// A projection: a weight matrix and maybe a bias.
pub(in crate::model) struct Linear<B: Backend> {
    pub weight: B::Weight,
    pub bias: Option<B::Tensor>,
}

impl<B: Backend> Linear<B> {
    pub(in crate::model) fn apply(&self, b: &B, x: &B::Tensor) -> Result<B::Tensor> {
        let mut y = b.matmul(x, &self.weight)?;
        if let Some(bias) = &self.bias {
            b.add_bias(&mut y, bias)?;
        }
        Ok(y)
    }

    /// Several projections of the same input, side by side.
    pub(in crate::model) fn apply_many<const N: usize>(
        b: &B,
        x: &B::Tensor,
        ls: [&Self; N],
    ) -> Result<[B::Tensor; N]> {
        let ws: Vec<&B::Weight> = ls.iter().map(|l| &l.weight).collect();
        let mut ys = b.matmul_many(x, &ws)?;
        for (y, l) in ys.iter_mut().zip(ls) {
            if let Some(bias) = &l.bias {
                b.add_bias(y, bias)?;
            }
        }
        ys.try_into().map_err(|_| Error::Internal("matmul_many returned the wrong number of outputs".into()))
    }
}

/// A norm's weight and kind.
pub(super) struct Norm<B: Backend> {
    pub weight: B::Tensor,
    pub kind: NormKind,
}

impl<B: Backend> Norm<B> {
    pub fn apply(&self, b: &B, x: &B::Tensor) -> Result<B::Tensor> {
        match self.kind {
            NormKind::Rms { eps } => b.rms_norm(x, &self.weight, eps),
        }
    }

    /// The norm of each `width`-wide group of `x`'s row (a head), its weight `width` long.
    pub fn apply_per_head(&self, b: &B, x: B::Tensor, width: usize) -> Result<B::Tensor> {
        let (rows, cols) = b.shape(&x);
        if width == 0 || !cols.is_multiple_of(width) {
            return Err(Error::Internal(format!("a per-head norm of {width} over rows of {cols}")));
        }
        let heads = b.reshape(x, rows * (cols / width), width)?;
        b.reshape(self.apply(b, &heads)?, rows, cols)
    }

    /// `x += delta`, then the norm of the sum (one pass where the backend fuses them).
    pub fn add_apply(&self, b: &B, x: &mut B::Tensor, delta: &B::Tensor) -> Result<B::Tensor> {
        match self.kind {
            NormKind::Rms { eps } => b.add_rms_norm(x, delta, &self.weight, eps),
        }
    }
}

/// What a part needs of the step around it.
pub(super) struct PartCx<'a, B: Backend> {
    pub b: &'a B,
    /// The step's layout (KV group 0's; the others' inside it).
    pub layout: &'a BatchLayout,
    /// The KV group of the layer running now.
    pub kv_group: usize,
    pub ropes: &'a [RopeTable],
    /// LongRoPE with sequences on both sides of the original context in one step: the
    /// long tables and, per row, whether its sequence takes them (`ropes` holds the short).
    pub mixed_ropes: Option<(&'a [RopeTable], Vec<bool>)>,
    /// This rank's collectives, and its stage's TP group (which is also the group its
    /// experts are split across under expert parallelism), ascending.
    pub comm: &'a mut dyn DeviceCollectives<B>,
    pub group: &'a [usize],
    pub metrics: &'a RankMetrics,
}

impl<B: Backend> PartCx<'_, B> {
    /// Rope on `x` (`head_dim`-wide heads) with table `index`: each row's own table when
    /// the step mixes LongRoPE's short and long ones (rows of a run rotated together).
    pub fn rope(&self, x: B::Tensor, head_dim: usize, index: usize) -> Result<B::Tensor> {
        let positions = &self.layout.positions;
        let Some((long, rows)) = &self.mixed_ropes else {
            let mut x = x;
            self.b.rope(&mut x, head_dim, positions, rope_table(self.ropes, index)?)?;
            return Ok(x);
        };
        let (short, long) = (rope_table(self.ropes, index)?, rope_table(long, index)?);
        let mut parts = Vec::new();
        let mut start = 0;
        while start < rows.len() {
            let end = (start..rows.len()).find(|&r| rows[r] != rows[start]).unwrap_or(rows.len());
            let mut part = self.b.gather_rows(&x, &(start..end).collect::<Vec<_>>())?;
            self.b.rope(
                &mut part,
                head_dim,
                &positions[start..end],
                if rows[start] { long } else { short },
            )?;
            parts.push(part);
            start = end;
        }
        self.b.concat_rows(&parts.iter().collect::<Vec<_>>())
    }

    /// Sums a row-parallel projection's partial output `x` across the TP group, timed on
    /// this rank (on a device, until the collective is queued on the stream).
    pub fn reduce(&mut self, x: &mut B::Tensor) -> Result<()> {
        if self.group.len() <= 1 {
            return Ok(());
        }
        let (rows, cols) = self.b.shape(x);
        let bytes = rows * cols * std::mem::size_of::<f32>();
        let _span = tracing::trace_span!("all_reduce", bytes = bytes as i64).entered();
        let started = std::time::Instant::now();
        self.comm.all_reduce(self.b, x, self.group)?;
        self.metrics.all_reduce(started.elapsed(), bytes);
        Ok(())
    }
}

/// Table `index` of `ropes`.
fn rope_table(ropes: &[RopeTable], index: usize) -> Result<&RopeTable> {
    ropes.get(index).ok_or_else(|| Error::Internal(format!("rope table {index} of {}", ropes.len())))
}

/// A layer's attention, this rank's heads of it.
pub(super) struct Attention<B: Backend> {
    pub spec: AttentionSpec,
    pub shape: AttentionShape,
    pub q: Linear<B>,
    pub k: Linear<B>,
    pub v: Linear<B>,
    pub o: Linear<B>,
    /// The per-head norms of queries and keys, where the spec asks for them.
    pub qk_norm: Option<[Norm<B>; 2]>,
    /// This rank's heads' sinks (`[1, heads]`), where the spec asks for them.
    pub sinks: Option<B::Tensor>,
}

impl<B: Backend> Attention<B> {
    /// Attention of `normed` over the cache (this step's K and V written into it), summed
    /// across the TP group.
    pub fn forward(
        &self,
        cx: &mut PartCx<'_, B>,
        normed: &B::Tensor,
        cache: &mut B::KvLayer,
    ) -> Result<B::Tensor> {
        let b = cx.b;
        match self.spec.kind {
            AttentionKind::Latent(_) => Err(Error::Internal("latent attention loaded as grouped".into())),
            AttentionKind::Grouped => {
                let rope = rope_table(cx.ropes, self.spec.rope)?;
                // The layer's KV group's slots and block tables.
                let layout = cx.layout.for_group(cx.kv_group);
                let [mut q, mut k, v] = Linear::apply_many(b, normed, [&self.q, &self.k, &self.v])?;
                if let Some([q_norm, k_norm]) = &self.qk_norm {
                    q = q_norm.apply_per_head(b, q, self.shape.head_dim)?;
                    k = k_norm.apply_per_head(b, k, self.shape.head_dim)?;
                }
                if cx.mixed_ropes.is_some() {
                    q = cx.rope(q, self.shape.head_dim, self.spec.rope)?;
                    k = cx.rope(k, self.shape.head_dim, self.spec.rope)?;
                    b.write_kv(cache, &k, &v, layout)?;
                } else {
                    b.rope_write_kv(&mut q, &mut k, &v, cache, layout, self.shape.head_dim, rope)?;
                }
                let attn = b.attention(&q, cache, layout, self.shape, self.sinks.as_ref())?;
                let mut o = self.o.apply(b, &attn)?;
                cx.reduce(&mut o)?;
                Ok(o)
            }
        }
    }
}

/// A layer's attention part, of its kind.
pub(super) enum AttentionPart<B: Backend> {
    Grouped(Attention<B>),
    Latent(LatentAttention<B>),
}

impl<B: Backend> AttentionPart<B> {
    fn forward(
        &self,
        cx: &mut PartCx<'_, B>,
        normed: &B::Tensor,
        cache: &mut B::KvLayer,
    ) -> Result<B::Tensor> {
        match self {
            AttentionPart::Grouped(a) => a.forward(cx, normed, cache),
            AttentionPart::Latent(a) => a.forward(cx, normed, cache),
        }
    }
}

/// A layer's MLP, this rank's intermediate rows of it.
pub(super) enum Mlp<B: Backend> {
    Gated { act: Activation, gate: Linear<B>, up: Linear<B>, down: Linear<B> },
    Experts(Box<Experts<B>>),
}

impl<B: Backend> Mlp<B> {
    /// The MLP of `x`, summed across the TP group.
    pub fn forward(&self, cx: &mut PartCx<'_, B>, x: &B::Tensor) -> Result<B::Tensor> {
        let b = cx.b;
        match self {
            Mlp::Gated { act, gate, up, down } => {
                let [g, u] = Linear::apply_many(b, x, [gate, up])?;
                let mut y = down.apply(b, &b.gated(*act, &g, &u)?)?;
                cx.reduce(&mut y)?;
                Ok(y)
            }
            Mlp::Experts(experts) => experts.forward(cx, x),
        }
    }
}

/// Where a layer's K and V live: its KV group (whose layout it reads) and the storage
/// (its own, or its slot's, shared with other groups' layers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct KvPlace {
    pub group: usize,
    pub storage: usize,
}

impl KvPlace {
    /// The storages the layers placed at `places` read.
    pub fn storages(places: &[KvPlace]) -> usize {
        places.iter().map(|p| p.storage + 1).max().unwrap_or(0)
    }
}

/// One decoder layer: pre-norm attention and pre-norm MLP, each added to the residual —
/// in a sandwich, each output normed again before the add.
pub(super) struct Layer<B: Backend> {
    pub input_norm: Norm<B>,
    pub attention: AttentionPart<B>,
    pub attention_out_norm: Option<Norm<B>>,
    pub post_norm: Norm<B>,
    pub mlp: Mlp<B>,
    pub mlp_out_norm: Option<Norm<B>>,
}

/// `y`, or its norm where the layer norms its parts' outputs.
fn out_norm<B: Backend>(b: &B, norm: &Option<Norm<B>>, y: B::Tensor) -> Result<B::Tensor> {
    match norm {
        Some(n) => n.apply(b, &y),
        None => Ok(y),
    }
}

/// Runs `layers` over the residual stream `x`. Each residual add is fused with the norm
/// that reads its result (a device backend does both in one pass); the last layer's sum
/// goes on un-normed.
pub(super) fn run<B: Backend>(
    cx: &mut PartCx<'_, B>,
    layers: &[Layer<B>],
    kv_map: &[KvPlace],
    kv: &mut [B::KvLayer],
    mut x: B::Tensor,
) -> Result<B::Tensor> {
    let Some(first) = layers.first() else { return Ok(x) };
    if kv.len() != KvPlace::storages(kv_map) || kv_map.len() != layers.len() {
        return Err(Error::Internal(format!("{} KV storages for {} layers", kv.len(), layers.len())));
    }
    let b = cx.b;
    let mut normed = first.input_norm.apply(b, &x)?;
    for (i, (layer, place)) in layers.iter().zip(kv_map).enumerate() {
        cx.kv_group = place.group;
        let cache = &mut kv[place.storage];
        let attn = out_norm(b, &layer.attention_out_norm, layer.attention.forward(cx, &normed, cache)?)?;
        let post = layer.post_norm.add_apply(b, &mut x, &attn)?;
        let mlp = out_norm(b, &layer.mlp_out_norm, layer.mlp.forward(cx, &post)?)?;
        match layers.get(i + 1) {
            Some(next) => normed = next.input_norm.add_apply(b, &mut x, &mlp)?,
            None => b.add_assign(&mut x, &mlp)?,
        }
    }
    Ok(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama_mistral_and_qwen2_are_configurations_of_one_decoder() {
        use strata_common::Architecture;
        for arch in [Architecture::Llama, Architecture::Mistral, Architecture::Qwen2] {
            let dir = tempfile::tempdir().unwrap();
            RandomModelSpec::tiny(arch).write(dir.path(), |_, _| {}).unwrap();
            let config = ModelConfig::from_dir(dir.path()).unwrap();
            let specs = LayerSpec::of(&config).unwrap();
            assert_eq!(specs.len(), config.num_layers);
            let s = specs[0];
            assert_eq!(s.attention.kind, AttentionKind::Grouped);
            assert_eq!(s.mlp.kind, MlpKind::Gated(Activation::Silu));
            // What differs between the families is configuration, not code.
            assert_eq!(s.attention.qkv_bias, arch == Architecture::Qwen2, "{arch:?}");
            assert_eq!(s.attention.sliding_window, config.sliding_window, "{arch:?}");
        }
    }

    /// The config `model random` writes for `spec`, read back.
    fn random_config(spec: RandomModelSpec) -> ModelConfig {
        let dir = tempfile::tempdir().unwrap();
        spec.write(dir.path(), |_, _| {}).unwrap();
        ModelConfig::from_dir(dir.path()).unwrap()
    }

    /// A random Gemma 3 (six layers: five local, one global) reads as Gemma 3 — sandwich
    /// norms, q/k norms, GELU (tanh), explicit head width — and its layers form a global
    /// KV group and five windowed ones sharing one storage slot (it generates in
    /// `cli_generate::random_models_load_and_generate`).
    #[test]
    fn a_random_gemma3_is_gemma3() {
        let config = random_config(RandomModelSpec {
            layers: 6,
            head_dim: 32,
            ..RandomModelSpec::tiny(Architecture::Gemma3)
        });
        assert_eq!((config.architecture, config.head_dim), (Architecture::Gemma3, 32));
        assert!(config.sandwich_norms && config.qk_norm && config.tie_word_embeddings);
        assert_eq!(config.windowed_layers, [true, true, true, true, true, false]);
        let groups = config.kv_groups();
        assert_eq!(groups.windows, [None, Some(16), Some(16), Some(16), Some(16), Some(16)]);
        assert_eq!(groups.slots_of(0..6), [0]);
    }

    /// A random gpt-oss reads as gpt-oss — sinks, biased attention, alternating windows,
    /// stacked experts; `model random` refuses what it cannot write.
    #[test]
    fn a_random_gpt_oss_is_gpt_oss() {
        let config =
            random_config(RandomModelSpec { layers: 4, ..RandomModelSpec::tiny(Architecture::GptOss) });
        assert_eq!(config.architecture, Architecture::GptOss);
        assert_eq!(config.windowed_layers, [true, false, true, false]);
        let specs = LayerSpec::of(&config).unwrap();
        assert!(specs[0].attention.sinks && specs[0].attention.qkv_bias, "{:?}", specs[0].attention);
        assert_eq!(config.kv_groups().windows, [None, Some(16)]);
        let dir = tempfile::tempdir().unwrap();
        let phi3 = RandomModelSpec::tiny(Architecture::Phi3).write(dir.path(), |_, _| {});
        assert!(phi3.unwrap_err().to_string().contains("not one `model random` writes"));
    }

    /// A random DeepSeek-V3 reads as DeepSeek-V3: latent attention sized from its head
    /// width, a dense first layer, then experts with grouped routing.
    #[test]
    fn a_random_deepseek_v3_is_deepseek_v3() {
        let config =
            random_config(RandomModelSpec { layers: 3, ..RandomModelSpec::tiny(Architecture::DeepseekV3) });
        assert_eq!(config.architecture, Architecture::DeepseekV3);
        let latent = config.latent.unwrap();
        assert_eq!((latent.kv_lora_rank, latent.qk_rope_head_dim, latent.v_head_dim), (64, 8, 16));
        let specs = LayerSpec::of(&config).unwrap();
        assert!(matches!(specs[0].attention.kind, AttentionKind::Latent(_)));
        assert!(matches!(specs[0].mlp.kind, MlpKind::Gated(_)), "the first layer is dense");
        assert!(matches!(specs[1].mlp.kind, MlpKind::Experts { experts: 4, top_k: 2, .. }));
    }

    #[test]
    fn heads_that_cannot_share_kv_heads_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        RandomModelSpec::tiny(strata_common::Architecture::Llama).write(dir.path(), |_, _| {}).unwrap();
        let mut config = ModelConfig::from_dir(dir.path()).unwrap();
        config.num_kv_heads = config.num_heads + 1;
        let e = LayerSpec::of(&config).unwrap_err().to_string();
        assert!(e.contains("KV heads"), "{e}");
    }

    use crate::model::random::RandomModelSpec;
    use strata_common::Architecture;
}
