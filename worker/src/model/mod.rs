//! The Llama-family decoder (Llama, Mistral, Qwen2), written once against [`Backend`].
//!
//! One call of [`Model::forward`] runs a whole step: any mix of sequences, each
//! contributing any number of new tokens at its own position (a prefill chunk or one
//! decode token), laid out by a [`BatchLayout`]. Logits are computed only for the rows the
//! caller asks for — normally each sequence's last token — since the LM head is the
//! largest matmul of a decode step.

pub mod random;
mod rope;
pub mod weights;

use std::path::Path;

use strata_common::{Error, ModelConfig, Result};
use tracing::info;

use crate::backend::{AttentionShape, Backend, BatchLayout, RopeTable};
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

pub struct Model<B: Backend> {
    pub config: ModelConfig,
    backend: B,
    embed: B::Weight,
    layers: Vec<Layer<B>>,
    norm: B::Tensor,
    /// None when the LM head is tied to the embedding.
    lm_head: Option<B::Weight>,
    rope: RopeTable,
    weight_bytes: usize,
}

impl<B: Backend> Model<B> {
    /// Loads a HF model directory: config.json, generation_config.json, safetensors.
    pub fn load(dir: &Path, backend: B) -> Result<Self> {
        let config = ModelConfig::from_dir(dir)?;
        let ckpt = Checkpoint::open(dir)?;
        Self::from_checkpoint(config, &ckpt, backend)
    }

    pub fn from_checkpoint(config: ModelConfig, ckpt: &Checkpoint, backend: B) -> Result<Self> {
        let started = std::time::Instant::now();
        let c = &config;
        let (h, hd) = (c.hidden_size, c.head_dim);
        let q_dim = c.num_heads * hd;
        let kv_dim = c.num_kv_heads * hd;
        let mut bytes = 0usize;

        let mut weight = |name: &str, shape: &[usize]| -> Result<B::Weight> {
            let host = ckpt.get(name, shape)?;
            let w = backend.load_weight(&host)?;
            bytes += backend.weight_bytes(&w);
            Ok(w)
        };
        let embed = weight("model.embed_tokens.weight", &[c.vocab_size, h])?;
        let lm_head = if c.tie_word_embeddings {
            None
        } else if ckpt.contains("lm_head.weight") {
            Some(weight("lm_head.weight", &[c.vocab_size, h])?)
        } else {
            return Err(Error::model_file(
                ckpt.dir(),
                "tensor \"lm_head.weight\" is missing and tie_word_embeddings is false",
            ));
        };
        let mut layers = Vec::with_capacity(c.num_layers);
        for i in 0..c.num_layers {
            let p = format!("model.layers.{i}");
            let mut linear = |name: &str, out: usize, inp: usize, bias: bool| -> Result<Linear<B>> {
                let w = weight(&format!("{p}.{name}.weight"), &[out, inp])?;
                let bias =
                    if bias { Some(vector(&backend, ckpt, &format!("{p}.{name}.bias"), out)?) } else { None };
                Ok(Linear { weight: w, bias })
            };
            let q = linear("self_attn.q_proj", q_dim, h, c.qkv_bias)?;
            let k = linear("self_attn.k_proj", kv_dim, h, c.qkv_bias)?;
            let v = linear("self_attn.v_proj", kv_dim, h, c.qkv_bias)?;
            let o = linear("self_attn.o_proj", h, q_dim, c.o_bias)?;
            let gate = linear("mlp.gate_proj", c.intermediate_size, h, c.mlp_bias)?;
            let up = linear("mlp.up_proj", c.intermediate_size, h, c.mlp_bias)?;
            let down = linear("mlp.down_proj", h, c.intermediate_size, c.mlp_bias)?;
            layers.push(Layer {
                input_norm: vector(&backend, ckpt, &format!("{p}.input_layernorm.weight"), h)?,
                post_norm: vector(&backend, ckpt, &format!("{p}.post_attention_layernorm.weight"), h)?,
                q,
                k,
                v,
                o,
                gate,
                up,
                down,
            });
            tracing::debug!(layer = i, of = c.num_layers, "layer loaded");
        }
        let norm = vector(&backend, ckpt, "model.norm.weight", h)?;
        info!(
            backend = backend.name(),
            layers = c.num_layers,
            weight_mib = bytes / (1 << 20),
            elapsed_ms = started.elapsed().as_millis() as u64,
            "model loaded"
        );
        Ok(Model {
            rope: rope::rope_table(c),
            config,
            backend,
            embed,
            layers,
            norm,
            lm_head,
            weight_bytes: bytes,
        })
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Bytes of weights held by this model.
    pub fn weight_bytes(&self) -> usize {
        self.weight_bytes
    }

    /// Bytes of weights one decode step reads: everything but the embedding table, of
    /// which it reads one row per token (unless the LM head is tied to it).
    pub fn decode_bytes_per_token(&self) -> usize {
        match self.lm_head {
            Some(_) => self.weight_bytes - self.backend.weight_bytes(&self.embed),
            None => self.weight_bytes,
        }
    }

    /// Allocates the paged KV cache: one storage per layer.
    pub fn alloc_kv(&self, num_blocks: usize, block_size: usize) -> Result<Vec<B::KvLayer>> {
        let kv_dim = self.config.num_kv_heads * self.config.head_dim;
        (0..self.config.num_layers).map(|_| self.backend.alloc_kv(num_blocks, block_size, kv_dim)).collect()
    }

    /// Bytes of KV cache one position takes across all layers (f32 K and V).
    pub fn kv_bytes_per_position(&self) -> usize {
        2 * self.config.num_layers * self.config.num_kv_heads * self.config.head_dim * 4
    }

    /// Runs one step and returns the logits of `logit_rows` (`[len, vocab]`, row-major).
    pub fn forward(
        &self,
        ids: &[u32],
        layout: &BatchLayout,
        kv: &mut [B::KvLayer],
        logit_rows: &[usize],
    ) -> Vec<f32> {
        let b = &self.backend;
        let c = &self.config;
        let shape = AttentionShape {
            num_heads: c.num_heads,
            num_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            scale: 1.0 / (c.head_dim as f32).sqrt(),
            sliding_window: c.sliding_window,
        };
        let eps = c.rms_norm_eps as f32;
        let mut x = b.embed(&self.embed, ids);
        for (layer, cache) in self.layers.iter().zip(kv.iter_mut()) {
            let normed = b.rms_norm(&x, &layer.input_norm, eps);
            let mut q = self.linear(&normed, &layer.q);
            let mut k = self.linear(&normed, &layer.k);
            let v = self.linear(&normed, &layer.v);
            b.rope(&mut q, c.head_dim, &layout.positions, &self.rope);
            b.rope(&mut k, c.head_dim, &layout.positions, &self.rope);
            b.write_kv(cache, &k, &v, layout);
            let attn = b.attention(&q, cache, layout, shape);
            let o = self.linear(&attn, &layer.o);
            b.add_assign(&mut x, &o);

            let normed = b.rms_norm(&x, &layer.post_norm, eps);
            let gate = self.linear(&normed, &layer.gate);
            let up = self.linear(&normed, &layer.up);
            let down = self.linear(&b.silu_mul(&gate, &up), &layer.down);
            b.add_assign(&mut x, &down);
        }
        let last = b.gather_rows(&x, logit_rows);
        let normed = b.rms_norm(&last, &self.norm, eps);
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        b.to_host(&b.matmul(&normed, head))
    }

    fn linear(&self, x: &B::Tensor, l: &Linear<B>) -> B::Tensor {
        let mut y = self.backend.matmul(x, &l.weight);
        if let Some(bias) = &l.bias {
            self.backend.add_bias(&mut y, bias);
        }
        y
    }
}

fn vector<B: Backend>(backend: &B, ckpt: &Checkpoint, name: &str, len: usize) -> Result<B::Tensor> {
    let host: HostTensor = ckpt.get(name, &[len])?;
    backend.load_vector(&host)
}
