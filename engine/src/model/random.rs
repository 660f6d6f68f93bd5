//! Writing random-weight model directories with real architectures.
//!
//! Tests and benchmarks need models of real shapes (up to Llama-3-8B's) that no one may
//! download here. This writes `config.json`, `generation_config.json` and a
//! `model.safetensors` that HF transformers loads as-is. Tensors are streamed to disk one at
//! a time, so writing an 8B-shape model needs no more memory than its largest tensor.
//! Values are uniform with the standard deviation of HF's default initialiser scaled by
//! fan-in, which keeps activations of any depth in a sane range.

use std::io::{BufWriter, Write};
use std::path::Path;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;
use serde_json::json;
use strata_common::{Architecture, Error, Result};

use crate::tensor::DType;

/// Whether `arch`'s MLPs are mixtures of experts (of those `model random` writes).
fn has_experts(arch: Architecture) -> bool {
    matches!(
        arch,
        Architecture::Mixtral | Architecture::Qwen3Moe | Architecture::GptOss | Architecture::DeepseekV3
    )
}

/// DeepSeek-V3's latent attention sized from a head width `hd` as the published model is
/// from 128: the latent 4·hd, query/key heads of hd plus hd/2 rope dims, values hd.
struct Mla {
    kv_lora: usize,
    nope: usize,
    rope: usize,
    v: usize,
}

impl Mla {
    fn of(hd: usize) -> Mla {
        Mla { kv_lora: 4 * hd, nope: hd, rope: hd / 2, v: hd }
    }
}

/// The shape of a random model.
#[derive(Debug, Clone)]
pub struct RandomModelSpec {
    pub arch: Architecture,
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub intermediate: usize,
    pub vocab: usize,
    pub max_position_embeddings: usize,
    pub rope_theta: f64,
    /// Llama 3.1-style rope scaling (as Llama-3.2 ships with).
    pub llama3_rope: bool,
    pub tie_word_embeddings: bool,
    pub dtype: DType,
    pub seed: u64,
    /// Experts of every layer (0: a dense model; Mixtral and Qwen3-MoE have them).
    pub experts: usize,
    /// Experts each token is routed to.
    pub top_k: usize,
    /// Intermediate size of one expert.
    pub expert_intermediate: usize,
    /// Width of a head (0: hidden / heads).
    pub head_dim: usize,
    /// Gemma 3: its local layers' window (every sixth layer is global).
    pub sliding_window: usize,
}

impl RandomModelSpec {
    /// A tiny model for tests and the demo.
    pub fn tiny(arch: Architecture) -> Self {
        RandomModelSpec {
            arch,
            hidden: 64,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            intermediate: 128,
            vocab: 512,
            max_position_embeddings: 2048,
            rope_theta: 10000.0,
            llama3_rope: false,
            tie_word_embeddings: matches!(
                arch,
                Architecture::Qwen2 | Architecture::Qwen3 | Architecture::Gemma3
            ),
            dtype: DType::F32,
            seed: 0,
            experts: if has_experts(arch) { 4 } else { 0 },
            top_k: 2,
            expert_intermediate: 64,
            head_dim: 0,
            sliding_window: 16,
        }
    }

    /// DeepSeek-V3's architecture at about 1B parameters, 0.2B active: latent attention
    /// (a 256-wide latent, heads of 64 + 32 rope dims), one dense layer, then 32 routed
    /// experts of 512 columns in 4 groups (2 chosen, 4 experts a token) and a shared one.
    pub fn deepseek_1b() -> Self {
        RandomModelSpec { arch: Architecture::DeepseekV3, heads: 16, head_dim: 64, ..Self::qwen3_moe_1b() }
    }

    /// gpt-oss's shape at about 1B parameters, 0.2B active: 16 layers alternating a
    /// 128-position window and global attention, 16 heads of 64 with sinks, 32 experts
    /// of 512 columns, 4 a token.
    pub fn gpt_oss_1b() -> Self {
        RandomModelSpec {
            arch: Architecture::GptOss,
            hidden: 1024,
            heads: 16,
            head_dim: 64,
            rope_theta: 150_000.0,
            max_position_embeddings: 131072,
            tie_word_embeddings: false,
            sliding_window: 128,
            ..Self::qwen3_moe_1b()
        }
    }

    /// Gemma-3-1B's shape: 26 layers, five local (512-position window) to one global, one
    /// KV head of 256 (the benchmark shape of windowed KV memory).
    pub fn gemma3_1b() -> Self {
        RandomModelSpec {
            arch: Architecture::Gemma3,
            hidden: 1152,
            layers: 26,
            heads: 4,
            kv_heads: 1,
            intermediate: 6912,
            vocab: 262144,
            max_position_embeddings: 32768,
            rope_theta: 1_000_000.0,
            tie_word_embeddings: true,
            head_dim: 256,
            sliding_window: 512,
            ..Self::llama_1b()
        }
    }

    fn head_width(&self) -> usize {
        if self.head_dim > 0 {
            self.head_dim
        } else {
            self.hidden / self.heads
        }
    }

    /// A Qwen3-MoE-shaped model of about 0.9B parameters, 0.15B of them active a token: 16
    /// layers of 32 experts of 512 columns, 4 a token (the benchmark shape of MoE decode).
    pub fn qwen3_moe_1b() -> Self {
        RandomModelSpec {
            arch: Architecture::Qwen3Moe,
            hidden: 1024,
            layers: 16,
            heads: 16,
            kv_heads: 4,
            intermediate: 3072,
            vocab: 32768,
            max_position_embeddings: 32768,
            rope_theta: 1_000_000.0,
            llama3_rope: false,
            tie_word_embeddings: true,
            dtype: DType::BF16,
            seed: 0,
            experts: 32,
            top_k: 4,
            expert_intermediate: 512,
            head_dim: 0,
            sliding_window: 0,
        }
    }

    /// Llama-3.2-1B's shape.
    pub fn llama_1b() -> Self {
        RandomModelSpec {
            arch: Architecture::Llama,
            hidden: 2048,
            layers: 16,
            heads: 32,
            kv_heads: 8,
            intermediate: 8192,
            vocab: 128256,
            max_position_embeddings: 131072,
            rope_theta: 500000.0,
            llama3_rope: true,
            tie_word_embeddings: true,
            dtype: DType::BF16,
            seed: 0,
            experts: 0,
            top_k: 2,
            expert_intermediate: 0,
            head_dim: 0,
            sliding_window: 0,
        }
    }

    /// Llama-3.1-8B's shape.
    pub fn llama_8b() -> Self {
        RandomModelSpec {
            hidden: 4096,
            layers: 32,
            intermediate: 14336,
            tie_word_embeddings: false,
            ..Self::llama_1b()
        }
    }

    fn validate(&self) -> Result<()> {
        if self.dtype == DType::I8 {
            return Err(Error::invalid(
                "dtype",
                "random models are f32, bf16 or f16 (`strata model quantize` makes int8)",
            ));
        }
        for (name, v) in [
            ("hidden", self.hidden),
            ("layers", self.layers),
            ("heads", self.heads),
            ("kv-heads", self.kv_heads),
            ("intermediate", self.intermediate),
            ("vocab", self.vocab),
        ] {
            if v == 0 {
                return Err(Error::invalid(name, "must be positive"));
            }
        }
        let derived = self.head_dim == 0 && !self.hidden.is_multiple_of(self.heads);
        if derived || !self.head_width().is_multiple_of(2) {
            return Err(Error::invalid(
                "heads",
                format!("hidden ({}) / heads ({}) must be an even integer", self.hidden, self.heads),
            ));
        }
        if matches!(self.arch, Architecture::Phi3 | Architecture::Gemma2) {
            return Err(Error::invalid(
                "arch",
                format!("{} is not one `model random` writes", self.arch.hf_class()),
            ));
        }
        if has_experts(self.arch)
            && (self.top_k == 0 || self.top_k > self.experts || self.expert_intermediate == 0)
        {
            return Err(Error::invalid(
                "experts",
                format!(
                    "{} experts of {} columns, {} a token: at least one expert, column and choice",
                    self.experts, self.expert_intermediate, self.top_k
                ),
            ));
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return Err(Error::invalid(
                "kv-heads",
                format!("{} must divide heads ({})", self.kv_heads, self.heads),
            ));
        }
        Ok(())
    }

    fn config_json(&self) -> serde_json::Value {
        let mut c = json!({
            "architectures": [self.arch.hf_class()],
            "model_type": self.arch.model_type(),
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_width(),
            "vocab_size": self.vocab,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": 1e-5,
            "rope_theta": self.rope_theta,
            "hidden_act": "silu",
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": match self.dtype {
                DType::F32 => "float32",
                DType::BF16 => "bfloat16",
                DType::F16 => "float16",
                DType::I8 => "int8",
            },
            "bos_token_id": 1,
            "eos_token_id": 2,
            "initializer_range": 0.02,
            "attention_dropout": 0.0,
            "use_cache": true,
        });
        if self.llama3_rope {
            c["rope_scaling"] = json!({
                "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192
            });
        }
        if matches!(self.arch, Architecture::Mistral | Architecture::Mixtral) {
            c["sliding_window"] = serde_json::Value::Null;
        }
        match self.arch {
            Architecture::Gemma3 => {
                let types: Vec<&str> = (0..self.layers)
                    .map(|l| if (l + 1) % 6 == 0 { "full_attention" } else { "sliding_attention" })
                    .collect();
                c["hidden_activation"] = json!("gelu_pytorch_tanh");
                c["rms_norm_eps"] = json!(1e-6);
                c["sliding_window"] = json!(self.sliding_window);
                c["layer_types"] = json!(types);
                c["rope_local_base_freq"] = json!(10000.0);
                c["query_pre_attn_scalar"] = json!(self.head_width());
                c["final_logit_softcapping"] = serde_json::Value::Null;
                c["attn_logit_softcapping"] = serde_json::Value::Null;
            }
            Architecture::DeepseekV3 => {
                let m = Mla::of(self.head_width());
                // Groups of two experts or more (each group scores by its top two).
                let groups: usize = if self.experts.is_multiple_of(4) && self.experts >= 8 { 4 } else { 1 };
                c["q_lora_rank"] = serde_json::Value::Null;
                c["kv_lora_rank"] = json!(m.kv_lora);
                c["qk_nope_head_dim"] = json!(m.nope);
                c["qk_rope_head_dim"] = json!(m.rope);
                c["qk_head_dim"] = json!(m.nope + m.rope);
                c["v_head_dim"] = json!(m.v);
                c["head_dim"] = json!(m.rope);
                c["num_key_value_heads"] = json!(self.heads);
                c["n_routed_experts"] = json!(self.experts);
                c["num_experts_per_tok"] = json!(self.top_k);
                c["moe_intermediate_size"] = json!(self.expert_intermediate);
                c["n_shared_experts"] = json!(1);
                c["n_group"] = json!(groups);
                c["topk_group"] = json!(groups.div_ceil(2));
                c["first_k_dense_replace"] = json!(usize::from(self.layers > 1));
                c["norm_topk_prob"] = json!(true);
                c["routed_scaling_factor"] = json!(2.5);
                c["rope_interleave"] = json!(false);
            }
            Architecture::GptOss => {
                let types: Vec<&str> = (0..self.layers)
                    .map(|l| if l % 2 == 0 { "sliding_attention" } else { "full_attention" })
                    .collect();
                c["attention_bias"] = json!(true);
                c["layer_types"] = json!(types);
                c["sliding_window"] = json!(self.sliding_window);
                c["num_local_experts"] = json!(self.experts);
                c["num_experts_per_tok"] = json!(self.top_k);
                c["intermediate_size"] = json!(self.expert_intermediate);
                c["swiglu_limit"] = json!(7.0);
                c["rope_scaling"] = json!({
                    "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                    "original_max_position_embeddings": 4096, "truncate": false
                });
            }
            Architecture::Mixtral => {
                c["num_local_experts"] = json!(self.experts);
                c["num_experts_per_tok"] = json!(self.top_k);
                c["intermediate_size"] = json!(self.expert_intermediate);
            }
            Architecture::Qwen3Moe => {
                c["num_experts"] = json!(self.experts);
                c["num_experts_per_tok"] = json!(self.top_k);
                c["moe_intermediate_size"] = json!(self.expert_intermediate);
                c["decoder_sparse_step"] = json!(1);
                c["mlp_only_layers"] = json!([]);
                c["norm_topk_prob"] = json!(true);
            }
            _ => {}
        }
        c
    }

    /// Every tensor's name and shape, in the order they are written.
    fn tensors(&self) -> Vec<(String, Vec<usize>)> {
        let h = self.hidden;
        let mut t = vec![("model.embed_tokens.weight".to_string(), vec![self.vocab, h])];
        for i in 0..self.layers {
            self.layer_tensors(i, &mut t);
        }
        t.push(("model.norm.weight".to_string(), vec![h]));
        if !self.tie_word_embeddings {
            t.push(("lm_head.weight".to_string(), vec![self.vocab, h]));
        }
        t
    }

    /// The tensors of layer `i`.
    fn layer_tensors(&self, i: usize, t: &mut Vec<(String, Vec<usize>)>) {
        let p = &format!("model.layers.{i}");
        let (h, hd) = (self.hidden, self.head_width());
        t.push((format!("{p}.input_layernorm.weight"), vec![h]));
        if self.arch == Architecture::DeepseekV3 {
            self.latent_tensors(p, t);
            t.push((format!("{p}.post_attention_layernorm.weight"), vec![h]));
            return self.mlp_tensors(p, i, t);
        }
        let (q, kv) = (self.heads * hd, self.kv_heads * hd);
        let bias = matches!(self.arch, Architecture::Qwen2 | Architecture::GptOss);
        for (name, out) in [("q_proj", q), ("k_proj", kv), ("v_proj", kv)] {
            t.push((format!("{p}.self_attn.{name}.weight"), vec![out, h]));
            if bias {
                t.push((format!("{p}.self_attn.{name}.bias"), vec![out]));
            }
        }
        if matches!(self.arch, Architecture::Qwen3 | Architecture::Qwen3Moe | Architecture::Gemma3) {
            t.push((format!("{p}.self_attn.q_norm.weight"), vec![hd]));
            t.push((format!("{p}.self_attn.k_norm.weight"), vec![hd]));
        }
        t.push((format!("{p}.self_attn.o_proj.weight"), vec![h, q]));
        if self.arch == Architecture::GptOss {
            t.push((format!("{p}.self_attn.o_proj.bias"), vec![h]));
            t.push((format!("{p}.self_attn.sinks"), vec![self.heads]));
        }
        t.push((format!("{p}.post_attention_layernorm.weight"), vec![h]));
        if self.arch == Architecture::Gemma3 {
            t.push((format!("{p}.pre_feedforward_layernorm.weight"), vec![h]));
            t.push((format!("{p}.post_feedforward_layernorm.weight"), vec![h]));
        }
        self.mlp_tensors(p, i, t);
    }

    /// DeepSeek-V3's latent attention of layer `p` (no query compression).
    fn latent_tensors(&self, p: &str, t: &mut Vec<(String, Vec<usize>)>) {
        let (h, m) = (self.hidden, Mla::of(self.head_width()));
        let a = format!("{p}.self_attn");
        t.push((format!("{a}.q_proj.weight"), vec![self.heads * (m.nope + m.rope), h]));
        t.push((format!("{a}.kv_a_proj_with_mqa.weight"), vec![m.kv_lora + m.rope, h]));
        t.push((format!("{a}.kv_a_layernorm.weight"), vec![m.kv_lora]));
        t.push((format!("{a}.kv_b_proj.weight"), vec![self.heads * (m.nope + m.v), m.kv_lora]));
        t.push((format!("{a}.o_proj.weight"), vec![h, self.heads * m.v]));
    }

    /// The MLP's tensors (or the experts' and their router's) of layer `i`, named `p`.
    fn mlp_tensors(&self, p: &str, i: usize, t: &mut Vec<(String, Vec<usize>)>) {
        let (h, e, ei) = (self.hidden, self.experts, self.expert_intermediate);
        // DeepSeek's first layer is dense (`first_k_dense_replace`).
        let dense_first = self.arch == Architecture::DeepseekV3 && i == 0 && self.layers > 1;
        let experts = match self.arch {
            _ if dense_first => None,
            Architecture::DeepseekV3 | Architecture::Qwen3Moe => {
                Some(("mlp", ["gate_proj", "up_proj", "down_proj"]))
            }
            Architecture::Mixtral => Some(("block_sparse_moe", ["w1", "w3", "w2"])),
            Architecture::GptOss => {
                // Stacked experts, gate and up interleaved in one projection, with biases.
                t.push((format!("{p}.mlp.router.weight"), vec![e, h]));
                t.push((format!("{p}.mlp.router.bias"), vec![e]));
                t.push((format!("{p}.mlp.experts.gate_up_proj"), vec![e, h, 2 * ei]));
                t.push((format!("{p}.mlp.experts.gate_up_proj_bias"), vec![e, 2 * ei]));
                t.push((format!("{p}.mlp.experts.down_proj"), vec![e, ei, h]));
                t.push((format!("{p}.mlp.experts.down_proj_bias"), vec![e, h]));
                return;
            }
            _ => None,
        };
        let Some((block, [gate, up, down])) = experts else {
            t.push((format!("{p}.mlp.gate_proj.weight"), vec![self.intermediate, h]));
            t.push((format!("{p}.mlp.up_proj.weight"), vec![self.intermediate, h]));
            t.push((format!("{p}.mlp.down_proj.weight"), vec![h, self.intermediate]));
            return;
        };
        t.push((format!("{p}.{block}.gate.weight"), vec![e, h]));
        if self.arch == Architecture::DeepseekV3 {
            t.push((format!("{p}.mlp.gate.e_score_correction_bias"), vec![e]));
            let x = format!("{p}.mlp.shared_experts");
            t.push((format!("{x}.gate_proj.weight"), vec![ei, h]));
            t.push((format!("{x}.up_proj.weight"), vec![ei, h]));
            t.push((format!("{x}.down_proj.weight"), vec![h, ei]));
        }
        for x in 0..e {
            let x = format!("{p}.{block}.experts.{x}");
            t.push((format!("{x}.{gate}.weight"), vec![ei, h]));
            t.push((format!("{x}.{up}.weight"), vec![ei, h]));
            t.push((format!("{x}.{down}.weight"), vec![h, ei]));
        }
    }

    /// Writes config.json, generation_config.json and model.safetensors into `dir`.
    /// `progress` is called after each tensor with (bytes written, bytes total).
    pub fn write(&self, dir: &Path, mut progress: impl FnMut(usize, usize)) -> Result<()> {
        self.validate()?;
        let io = |path: &Path, e: std::io::Error| Error::model_file(path, format!("cannot write: {e}"));
        std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
        let config_path = dir.join("config.json");
        let text = serde_json::to_string_pretty(&self.config_json()).expect("JSON value");
        std::fs::write(&config_path, text).map_err(|e| io(&config_path, e))?;
        let gen_path = dir.join("generation_config.json");
        let gen = json!({"bos_token_id": 1, "eos_token_id": 2, "do_sample": false});
        std::fs::write(&gen_path, gen.to_string()).map_err(|e| io(&gen_path, e))?;

        let tensors = self.tensors();
        let elem = self.dtype.size();
        let dtype_name = self.dtype.name();
        let mut header = serde_json::Map::new();
        let mut offset = 0usize;
        for (name, shape) in &tensors {
            let bytes = shape.iter().product::<usize>() * elem;
            header.insert(
                name.clone(),
                json!({"dtype": dtype_name, "shape": shape, "data_offsets": [offset, offset + bytes]}),
            );
            offset += bytes;
        }
        header.insert("__metadata__".into(), json!({"format": "pt"}));
        let mut header = serde_json::to_vec(&header).expect("JSON value");
        while !(header.len() + 8).is_multiple_of(8) {
            header.push(b' ');
        }
        let path = dir.join("model.safetensors");
        let file = std::fs::File::create(&path).map_err(|e| io(&path, e))?;
        let mut out = BufWriter::with_capacity(1 << 22, file);
        out.write_all(&(header.len() as u64).to_le_bytes()).map_err(|e| io(&path, e))?;
        out.write_all(&header).map_err(|e| io(&path, e))?;
        let total = offset;
        let mut written = 0;
        for (i, (name, shape)) in tensors.iter().enumerate() {
            let values = self.values(i as u64, name, shape);
            let bytes: Vec<u8> = match self.dtype {
                DType::F32 => bytemuck::cast_slice(&values).to_vec(),
                DType::BF16 => values.iter().flat_map(|v| half::bf16::from_f32(*v).to_le_bytes()).collect(),
                DType::F16 => values.iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect(),
                DType::I8 => values.iter().map(|v| v.round().clamp(-128.0, 127.0) as i8 as u8).collect(),
            };
            out.write_all(&bytes).map_err(|e| io(&path, e))?;
            written += bytes.len();
            progress(written, total);
        }
        out.flush().map_err(|e| io(&path, e))?;
        Ok(())
    }

    fn values(&self, index: u64, name: &str, shape: &[usize]) -> Vec<f32> {
        let n: usize = shape.iter().product();
        if name.ends_with("norm.weight") {
            // Gemma's norms scale by (1 + w).
            return vec![if self.arch == Architecture::Gemma3 { 0.0 } else { 1.0 }; n];
        }
        // Uniform with std 1/sqrt(fan_in) (embeddings: std 1), in parallel chunks with
        // their own seeds so the output does not depend on the thread count.
        // Stacked experts (gpt-oss) are `[experts, in, out]`: their fan-in is the middle.
        let stacked = name.ends_with("experts.gate_up_proj") || name.ends_with("experts.down_proj");
        let fan_in = match shape {
            _ if name.contains("embed_tokens") => 1,
            [_, fan_in, _] if stacked => *fan_in,
            _ => *shape.last().unwrap_or(&1),
        };
        let amp = (3.0 / fan_in as f32).sqrt();
        let amp = if name.ends_with("bias") { amp * 0.1 } else { amp };
        const CHUNK: usize = 1 << 16;
        let mut v = vec![0f32; n];
        v.par_chunks_mut(CHUNK).enumerate().for_each(|(c, chunk)| {
            let mut rng = ChaCha8Rng::seed_from_u64(self.seed ^ (index << 32) ^ c as u64);
            for x in chunk {
                *x = rng.random_range(-amp..amp);
            }
        });
        v
    }
}
