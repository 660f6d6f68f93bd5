//! The model's shape, read from a HuggingFace `config.json` (and `generation_config.json`).
//!
//! One struct covers every family: the Llama shape (Llama, Mistral, Qwen2, Qwen3, Phi-3)
//! and what sets the others apart — Gemma's norms, windows, ropes and soft caps
//! ([`gemma`]), gpt-oss's ([`gpt_oss`]), mixtures of experts ([`moe`]), rope scalings
//! ([`rope`]). Both the `rope_scaling` key (transformers 4.x) and the `rope_parameters`
//! key (transformers 5.x) are understood. Anything this engine cannot run faithfully (a
//! rope type, a quantization format, an attention variant) is rejected here, naming the
//! key, before a single weight is read.

use std::path::Path;

use serde_json::{Map, Value};

use crate::error::{Error, Result};

mod deepseek;
mod gemma;
mod gpt_oss;
mod kv_groups;
mod moe;
mod quant;
mod rope;

pub use deepseek::{GroupedRouting, Latent};
pub use kv_groups::KvGroups;
pub use moe::{ExpertNames, Moe};
pub use rope::RopeScaling;
use rope::{parse_rope, yarn_mscale};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
    /// Gemma 3's text model (`Gemma3ForCausalLM`, the 1B model's class).
    Gemma3,
    /// Mistral's attention with a mixture of experts in every layer.
    Mixtral,
    /// Qwen3's attention with a mixture of experts.
    Qwen3Moe,
    /// Phi-3 and Phi-4-mini: the Llama shape with fused `qkv_proj` and `gate_up_proj`.
    Phi3,
    /// Gemma 2: Gemma 3's parts without q/k norms, one rope base, attention soft-capping.
    Gemma2,
    /// gpt-oss: biased attention with sinks, local and global layers, YaRN rope, and a
    /// mixture of biased experts with a clamped SwiGLU.
    GptOss,
    /// DeepSeek-V3 (and R1): latent attention, grouped sigmoid routing, shared experts.
    DeepseekV3,
}

impl Architecture {
    pub fn hf_class(self) -> &'static str {
        match self {
            Architecture::Llama => "LlamaForCausalLM",
            Architecture::Mistral => "MistralForCausalLM",
            Architecture::Qwen2 => "Qwen2ForCausalLM",
            Architecture::Qwen3 => "Qwen3ForCausalLM",
            Architecture::Gemma3 => "Gemma3ForCausalLM",
            Architecture::Mixtral => "MixtralForCausalLM",
            Architecture::Qwen3Moe => "Qwen3MoeForCausalLM",
            Architecture::Phi3 => "Phi3ForCausalLM",
            Architecture::Gemma2 => "Gemma2ForCausalLM",
            Architecture::GptOss => "GptOssForCausalLM",
            Architecture::DeepseekV3 => "DeepseekV3ForCausalLM",
        }
    }

    pub fn model_type(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Mistral => "mistral",
            Architecture::Qwen2 => "qwen2",
            Architecture::Qwen3 => "qwen3",
            Architecture::Gemma3 => "gemma3_text",
            Architecture::Mixtral => "mixtral",
            Architecture::Qwen3Moe => "qwen3_moe",
            Architecture::Phi3 => "phi3",
            Architecture::Gemma2 => "gemma2",
            Architecture::GptOss => "gpt_oss",
            Architecture::DeepseekV3 => "deepseek_v3",
        }
    }

    fn from_hf(name: &str) -> Option<Self> {
        match name {
            "LlamaForCausalLM" | "llama" => Some(Architecture::Llama),
            "MistralForCausalLM" | "mistral" => Some(Architecture::Mistral),
            "Qwen2ForCausalLM" | "qwen2" => Some(Architecture::Qwen2),
            "Qwen3ForCausalLM" | "qwen3" => Some(Architecture::Qwen3),
            "Gemma3ForCausalLM" | "gemma3_text" => Some(Architecture::Gemma3),
            "MixtralForCausalLM" | "mixtral" => Some(Architecture::Mixtral),
            "Qwen3MoeForCausalLM" | "qwen3_moe" => Some(Architecture::Qwen3Moe),
            "Phi3ForCausalLM" | "phi3" => Some(Architecture::Phi3),
            "Gemma2ForCausalLM" | "gemma2" => Some(Architecture::Gemma2),
            "GptOssForCausalLM" | "gpt_oss" => Some(Architecture::GptOss),
            "DeepseekV3ForCausalLM" | "deepseek_v3" => Some(Architecture::DeepseekV3),
            _ => None,
        }
    }
}

/// The activation of a gated MLP (`hidden_act`, or Gemma's `hidden_activation`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Activation {
    /// `x · sigmoid(x)` (`silu`, `swish`).
    Silu,
    /// GELU in its tanh form (`gelu_pytorch_tanh`, `gelu_new`).
    GeluTanh,
    /// gpt-oss's experts: with `g = min(gate, limit)` and `u = clamp(up, -limit, limit)`,
    /// `(u + 1) · g · sigmoid(alpha · g)` (`swiglu_alpha`, `swiglu_limit`).
    ClampedSwiglu { alpha: f32, limit: f32 },
}

impl Activation {
    fn from_hf(name: &str) -> Option<Self> {
        match name {
            "silu" | "swish" => Some(Activation::Silu),
            "gelu_pytorch_tanh" | "gelu_new" => Some(Activation::GeluTanh),
            _ => None,
        }
    }
}

#[derive(Debug, Clone)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    /// Dims of each head that rope rotates, from the first (`partial_rotary_factor` ×
    /// `head_dim`; all of them unless the file says).
    pub rotary_dim: usize,
    pub tie_word_embeddings: bool,
    /// q, k and v projections carry a bias (Qwen2, or Llama with `attention_bias`).
    pub qkv_bias: bool,
    /// o_proj carries a bias (Llama with `attention_bias`).
    pub o_bias: bool,
    /// gate, up and down projections carry a bias (Llama with `mlp_bias`).
    pub mlp_bias: bool,
    /// Attention sees at most this many most recent positions (Mistral, Qwen2 opt-in).
    pub sliding_window: Option<usize>,
    /// Queries and keys pass an RMSNorm of their own per head, before RoPE (Qwen3, Gemma 3).
    pub qk_norm: bool,
    /// Which layers attend within `sliding_window` (every layer's entry; all of them on
    /// Mistral with a window, Gemma 3's `layer_types`).
    pub windowed_layers: Vec<bool>,
    /// The rope base of windowed layers, when it is not `rope_theta` (Gemma 3's local
    /// layers; unscaled).
    pub local_rope_theta: Option<f64>,
    /// The gated MLP's activation.
    pub activation: Activation,
    /// The attention scale is `query_pre_attn_scalar^-½` rather than `head_dim^-½`
    /// (Gemma).
    pub query_pre_attn_scalar: Option<f64>,
    /// Added to every RMSNorm weight: Gemma's norms scale by `1 + w`.
    pub norm_weight_offset: f32,
    /// Embeddings are multiplied by this (Gemma: √hidden_size).
    pub embed_scale: Option<f32>,
    /// Attention and MLP outputs pass a norm of their own before the residual add (Gemma's
    /// `post_attention_layernorm` and `post_feedforward_layernorm`; its pre-MLP norm is
    /// `pre_feedforward_layernorm`).
    pub sandwich_norms: bool,
    /// The final logits are soft-capped: `c · tanh(logits / c)`.
    pub final_logit_softcap: Option<f32>,
    /// Attention scores are soft-capped the same way, after scaling (Gemma 2).
    pub attn_logit_softcap: Option<f32>,
    /// Each attention head has a learned sink: a logit in the softmax's denominator that
    /// takes no value (gpt-oss's `self_attn.sinks`).
    pub attention_sinks: bool,
    /// The mixture of experts, for MoE families.
    pub moe: Option<Moe>,
    /// Multi-head latent attention (DeepSeek-V3): every layer's attention is latent;
    /// `head_dim` is then the rotated part's width (`qk_rope_head_dim`).
    pub latent: Option<Latent>,
    /// q, k and v are one `qkv_proj` matrix, gate and up one `gate_up_proj` (Phi-3).
    pub fused_projections: bool,
    /// The dtype the checkpoint declares (`torch_dtype` / `dtype`), if any.
    pub dtype: Option<String>,
    /// `quantization_config.quant_method`, if any ("strata-int8": written by
    /// `strata model quantize`).
    pub quantization: Option<String>,
    /// FP8 weights' scale blocks, `[rows, columns]` (`quant_method: "fp8"`).
    pub fp8_block: Option<[usize; 2]>,
    pub bos_token_id: Option<u32>,
    /// End-of-sequence ids from config.json and generation_config.json together.
    pub eos_token_ids: Vec<u32>,
}

impl ModelConfig {
    /// Reads `config.json` and, when present, `generation_config.json` from a model directory.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = crate::files::read_text(&path, crate::files::MAX_JSON_FILE)?;
        let mut config = Self::from_json_str(&text).map_err(|e| relabel(e, &path))?;
        let gen_path = dir.join("generation_config.json");
        if gen_path.exists() {
            let text = crate::files::read_text(&gen_path, crate::files::MAX_JSON_FILE)?;
            let value: Value = serde_json::from_str(&text)
                .map_err(|e| Error::model_file(&gen_path, format!("invalid JSON: {e}")))?;
            for id in
                token_ids(value.get("eos_token_id"), "eos_token_id").map_err(|e| relabel(e, &gen_path))?
            {
                if !config.eos_token_ids.contains(&id) {
                    config.eos_token_ids.push(id);
                }
            }
        }
        Ok(config)
    }

    /// Parses the text of a `config.json`. Errors name the offending key.
    pub fn from_json_str(text: &str) -> Result<Self> {
        let value: Value = serde_json::from_str(text)
            .map_err(|e| Error::invalid("config.json", format!("invalid JSON: {e}")))?;
        let obj = value.as_object().ok_or_else(|| Error::invalid("config.json", "expected a JSON object"))?;
        Self::from_map(obj)
    }

    fn from_map(obj: &Map<String, Value>) -> Result<Self> {
        let architecture = architecture(obj)?;
        let gemma = matches!(architecture, Architecture::Gemma2 | Architecture::Gemma3);
        let gpt_oss = architecture == Architecture::GptOss;
        let activation = activation(obj, architecture)?;

        let hidden_size = req_usize(obj, "hidden_size")?;
        let num_layers = req_usize(obj, "num_hidden_layers")?;
        let default_head_dim = match architecture {
            Architecture::Gemma2 | Architecture::Gemma3 => Some(gemma::HEAD_DIM),
            Architecture::GptOss => Some(gpt_oss::HEAD_DIM),
            _ => None,
        };
        let (num_heads, num_kv_heads, mut head_dim) = match architecture {
            // Latent attention: the heads' dims are the latent's (below); rope turns
            // qk_rope_head_dim of them (transformers' head_dim).
            Architecture::DeepseekV3 => {
                let heads = req_usize(obj, "num_attention_heads")?;
                (heads, heads, 2)
            }
            _ => heads(obj, hidden_size, default_head_dim)?,
        };

        let max_positions = opt_usize(obj, "max_position_embeddings")?.unwrap_or(2048);
        let rope::RopeKeys { theta: rope_theta, scaling: mut rope_scaling, partial } =
            rope::rope_keys(obj, architecture, head_dim, max_positions)?;

        let FamilyOptions { qkv_bias, o_bias, mlp_bias, mut sliding_window, qk_norm } =
            family_options(architecture, obj)?;
        let mut windowed_layers = vec![sliding_window.is_some(); num_layers];
        let (mut rope_theta, mut local_rope_theta, mut query_pre_attn_scalar) = (rope_theta, None, None);
        let (mut final_logit_softcap, mut attn_logit_softcap) = (None, None);
        if gemma {
            let g = gemma::options(obj, num_layers, architecture)?;
            (windowed_layers, sliding_window) = (g.windowed_layers, Some(g.sliding_window));
            if let Some((theta, scaling, local)) = g.ropes {
                (rope_theta, rope_scaling, local_rope_theta) = (theta, scaling, Some(local));
            }
            (query_pre_attn_scalar, final_logit_softcap, attn_logit_softcap) =
                (Some(g.query_pre_attn_scalar), g.final_logit_softcap, g.attn_logit_softcap);
        }
        if gpt_oss {
            let (layers, window) = gpt_oss::windows(obj, num_layers)?;
            (windowed_layers, sliding_window) = (layers, Some(window));
        }
        let fp8_block = quant::check(obj, architecture)?;
        let latent = match architecture {
            Architecture::DeepseekV3 => Some(deepseek::latent(obj, &rope_scaling)?),
            _ => None,
        };
        if let Some(l) = &latent {
            head_dim = l.qk_rope_head_dim;
        }
        let rotary_dim = rope::rotated_dims(architecture, latent.is_some(), partial, head_dim)?;

        let vocab_size = req_usize(obj, "vocab_size")?;
        let config = ModelConfig {
            architecture,
            hidden_size,
            intermediate_size: req_usize(obj, "intermediate_size")?,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            vocab_size,
            max_position_embeddings: max_positions,
            rotary_dim,
            rms_norm_eps: positive("rms_norm_eps", opt_f64(obj, "rms_norm_eps")?.unwrap_or(1e-6))?,
            rope_theta: positive("rope_theta", rope_theta)?,
            rope_scaling,
            // Gemma's LM head is its embedding unless the file says otherwise.
            tie_word_embeddings: opt_bool(obj, "tie_word_embeddings")?.unwrap_or(gemma),
            qkv_bias,
            o_bias,
            mlp_bias,
            sliding_window,
            qk_norm,
            windowed_layers,
            local_rope_theta,
            activation,
            query_pre_attn_scalar,
            norm_weight_offset: if gemma { 1.0 } else { 0.0 },
            embed_scale: gemma.then(|| (hidden_size as f32).sqrt()),
            sandwich_norms: gemma,
            final_logit_softcap,
            attn_logit_softcap,
            attention_sinks: gpt_oss,
            moe: moe::options(architecture, obj, num_layers)?,
            latent,
            fused_projections: architecture == Architecture::Phi3,
            dtype: text(obj.get("torch_dtype").or_else(|| obj.get("dtype"))),
            quantization: text(obj.get("quantization_config").and_then(|q| q.get("quant_method"))),
            fp8_block,
            bos_token_id: token_ids(obj.get("bos_token_id"), "bos_token_id")?.first().copied(),
            eos_token_ids: token_ids(obj.get("eos_token_id"), "eos_token_id")?,
        };
        config.check_sizes()?;
        Ok(config)
    }

    /// The sizes that must not be zero.
    fn check_sizes(&self) -> Result<()> {
        for (name, v) in [
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_layers),
            ("vocab_size", self.vocab_size),
        ] {
            if v == 0 {
                return Err(Error::invalid(name, "must be positive"));
            }
        }
        Ok(())
    }

    /// Values one layer caches a position on a rank holding `kv_heads` KV heads, and
    /// whether they serve as keys and values both (latent attention's latent, stored
    /// once) rather than as keys with as many values beside them.
    pub fn kv_layer_width(&self, kv_heads: usize) -> (usize, bool) {
        match &self.latent {
            Some(l) => (l.cached_width(), true),
            None => (kv_heads * self.head_dim, false),
        }
    }

    /// Whether layer `layer` attends within the sliding window.
    pub fn layer_windowed(&self, layer: usize) -> bool {
        self.sliding_window.is_some() && self.windowed_layers.get(layer) == Some(&true)
    }

    /// Number of query heads per KV head (1 for MHA, `num_heads` for MQA).
    pub fn group_size(&self) -> usize {
        self.num_heads / self.num_kv_heads
    }
}

/// A string value, owned.
fn text(v: Option<&Value>) -> Option<String> {
    v.and_then(|v| v.as_str()).map(str::to_owned)
}

fn relabel(e: Error, path: &Path) -> Error {
    match e {
        Error::InvalidArgument { field, reason } => {
            Error::model_file(path, format!("field {field:?}: {reason}"))
        }
        Error::Unsupported(reason) => Error::Unsupported(format!("{}: {reason}", path.display())),
        other => other,
    }
}

/// Which layers attend within the window, from `layer_types` (`sliding_attention` /
/// `full_attention` per layer); absent, `default(i)` says for layer `i`.
pub(crate) fn layer_types(
    obj: &Map<String, Value>,
    num_layers: usize,
    default: &dyn Fn(usize) -> bool,
) -> Result<Vec<bool>> {
    let Some(types) = obj.get("layer_types").filter(|v| !v.is_null()) else {
        return Ok((0..num_layers).map(default).collect());
    };
    let types = types.as_array().ok_or_else(|| Error::invalid("layer_types", "expected a list"))?;
    if types.len() != num_layers {
        return Err(Error::invalid(
            "layer_types",
            format!("{} entries for {num_layers} layers (num_hidden_layers)", types.len()),
        ));
    }
    types
        .iter()
        .map(|t| match t.as_str() {
            Some("sliding_attention") => Ok(true),
            Some("full_attention") => Ok(false),
            _ => Err(Error::invalid("layer_types", format!("{t} (sliding_attention or full_attention)"))),
        })
        .collect()
}

/// `v` when it is a positive, finite number; otherwise an error naming `key`.
fn positive(key: &str, v: f64) -> Result<f64> {
    if v.is_finite() && v > 0.0 {
        Ok(v)
    } else {
        Err(Error::invalid(key, format!("{v} must be a positive number")))
    }
}

/// The architecture `config.json` names (or its model_type), if Strata implements it.
fn architecture(obj: &Map<String, Value>) -> Result<Architecture> {
    let arch_name = obj
        .get("architectures")
        .and_then(|a| a.as_array())
        .and_then(|a| a.first())
        .and_then(|a| a.as_str())
        .or_else(|| obj.get("model_type").and_then(|m| m.as_str()))
        .ok_or_else(|| Error::invalid("architectures", "missing (and no model_type)"))?;
    Architecture::from_hf(arch_name).ok_or_else(|| {
        Error::Unsupported(format!(
            "architecture {arch_name:?}; supported: LlamaForCausalLM, MistralForCausalLM, \
             Qwen2ForCausalLM, Qwen3ForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM, \
             Phi3ForCausalLM, MixtralForCausalLM, Qwen3MoeForCausalLM, GptOssForCausalLM, \
             DeepseekV3ForCausalLM"
        ))
    })
}

/// The MLP's activation: `hidden_activation` (Gemma's key) or `hidden_act`; absent, the
/// family's default (Gemma: GELU's tanh form; the others: SiLU). gpt-oss's experts always
/// apply their clamped SwiGLU (transformers ignores its `hidden_act`).
fn activation(obj: &Map<String, Value>, architecture: Architecture) -> Result<Activation> {
    if architecture == Architecture::GptOss {
        return gpt_oss::activation(obj);
    }
    let gemma = matches!(architecture, Architecture::Gemma2 | Architecture::Gemma3);
    let key = if gemma && obj.get("hidden_activation").is_some_and(|v| !v.is_null()) {
        "hidden_activation"
    } else {
        "hidden_act"
    };
    match obj.get(key).filter(|v| !v.is_null()) {
        None => Ok(if gemma { Activation::GeluTanh } else { Activation::Silu }),
        Some(v) => v
            .as_str()
            .and_then(Activation::from_hf)
            .ok_or_else(|| Error::Unsupported(format!("{key} {v} (supported: silu, gelu_pytorch_tanh)"))),
    }
}

/// `(num_heads, num_kv_heads, head_dim)`, checked against each other and `hidden_size`;
/// a missing `head_dim` is `default_head_dim` where the family has one, else
/// `hidden_size / num_heads`.
fn heads(
    obj: &Map<String, Value>,
    hidden_size: usize,
    default_head_dim: Option<usize>,
) -> Result<(usize, usize, usize)> {
    let num_heads = req_usize(obj, "num_attention_heads")?;
    let num_kv_heads = opt_usize(obj, "num_key_value_heads")?.unwrap_or(num_heads);
    if num_heads == 0 || num_kv_heads == 0 || !num_heads.is_multiple_of(num_kv_heads) {
        return Err(Error::invalid(
            "num_key_value_heads",
            format!("{num_kv_heads} must be positive and divide num_attention_heads ({num_heads})"),
        ));
    }
    let head_dim = match opt_usize(obj, "head_dim")?.or(default_head_dim) {
        Some(d) => d,
        None => {
            if !hidden_size.is_multiple_of(num_heads) {
                return Err(Error::invalid(
                    "hidden_size",
                    format!("{hidden_size} is not divisible by num_attention_heads ({num_heads})"),
                ));
            }
            hidden_size / num_heads
        }
    };
    if !head_dim.is_multiple_of(2) {
        return Err(Error::invalid("head_dim", format!("{head_dim} must be even for RoPE")));
    }
    Ok((num_heads, num_kv_heads, head_dim))
}

/// What tells the families of the Llama shape apart.
struct FamilyOptions {
    qkv_bias: bool,
    o_bias: bool,
    mlp_bias: bool,
    sliding_window: Option<usize>,
    qk_norm: bool,
}

/// Each family's options, from the keys that family's config.json uses.
fn family_options(architecture: Architecture, obj: &Map<String, Value>) -> Result<FamilyOptions> {
    let attention_bias = opt_bool(obj, "attention_bias")?.unwrap_or(false);
    let (qkv_bias, o_bias) = match architecture {
        Architecture::Qwen2 => (true, false),
        Architecture::Llama
        | Architecture::Qwen3
        | Architecture::Gemma2
        | Architecture::Gemma3
        | Architecture::Qwen3Moe
        | Architecture::DeepseekV3 => (attention_bias, attention_bias),
        // gpt-oss's projections are biased unless the file says otherwise.
        Architecture::GptOss => {
            let b = opt_bool(obj, "attention_bias")?.unwrap_or(true);
            (b, b)
        }
        Architecture::Mistral | Architecture::Mixtral => (attention_bias, false),
        Architecture::Phi3 => (false, false),
    };
    let mlp_bias = match architecture {
        Architecture::Llama => opt_bool(obj, "mlp_bias")?.unwrap_or(false),
        _ => false,
    };
    let sliding_window = match architecture {
        Architecture::Mistral | Architecture::Mixtral | Architecture::Phi3 => {
            match opt_usize(obj, "sliding_window")? {
                Some(0) => {
                    return Err(Error::invalid("sliding_window", "must be positive (null for no window)"))
                }
                w => w,
            }
        }
        Architecture::Qwen2 | Architecture::Qwen3 | Architecture::Qwen3Moe => {
            if opt_bool(obj, "use_sliding_window")?.unwrap_or(false) {
                return Err(Error::Unsupported(format!(
                    "{} use_sliding_window=true (per-layer windows are not implemented)",
                    architecture.hf_class()
                )));
            }
            None
        }
        // Gemma's: gemma::options; gpt-oss's: by layer type, in from_map.
        Architecture::Llama
        | Architecture::Gemma2
        | Architecture::Gemma3
        | Architecture::GptOss
        | Architecture::DeepseekV3 => None,
    };
    let qk_norm = matches!(architecture, Architecture::Qwen3 | Architecture::Gemma3 | Architecture::Qwen3Moe);
    Ok(FamilyOptions { qkv_bias, o_bias, mlp_bias, sliding_window, qk_norm })
}

fn req_usize(obj: &Map<String, Value>, key: &str) -> Result<usize> {
    opt_usize(obj, key)?.ok_or_else(|| Error::invalid(key, "missing"))
}

fn opt_usize(obj: &Map<String, Value>, key: &str) -> Result<Option<usize>> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .map(|n| Some(n as usize))
            .ok_or_else(|| Error::invalid(key, format!("expected a non-negative integer, got {v}"))),
    }
}

fn opt_f64(obj: &Map<String, Value>, key: &str) -> Result<Option<f64>> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => {
            v.as_f64().map(Some).ok_or_else(|| Error::invalid(key, format!("expected a number, got {v}")))
        }
    }
}

fn opt_bool(obj: &Map<String, Value>, key: &str) -> Result<Option<bool>> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_bool()
            .map(Some)
            .ok_or_else(|| Error::invalid(key, format!("expected true or false, got {v}"))),
    }
}

fn token_ids(value: Option<&Value>, key: &str) -> Result<Vec<u32>> {
    let bad = |v: &Value| Error::invalid(key, format!("expected a token id or a list of ids, got {v}"));
    match value {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(v @ Value::Number(_)) => Ok(vec![v.as_u64().ok_or_else(|| bad(v))? as u32]),
        Some(Value::Array(items)) => {
            items.iter().map(|v| v.as_u64().map(|n| n as u32).ok_or_else(|| bad(v))).collect()
        }
        Some(v) => Err(bad(v)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = r#"{"architectures":["LlamaForCausalLM"],"hidden_size":64,
        "intermediate_size":128,"num_hidden_layers":2,"num_attention_heads":4,
        "num_key_value_heads":2,"vocab_size":100,"eos_token_id":[2,3]}"#;

    fn with(extra: &str) -> String {
        format!("{},{}", &BASE[..BASE.len() - 1], &extra[1..])
    }

    #[test]
    fn parses_defaults() {
        let c = ModelConfig::from_json_str(BASE).unwrap();
        assert_eq!(c.head_dim, 16);
        assert_eq!(c.group_size(), 2);
        assert_eq!(c.eos_token_ids, vec![2, 3]);
        assert_eq!(c.rope_theta, 10000.0);
        assert_eq!(c.rope_scaling, RopeScaling::None);
        assert!(!c.qkv_bias);
    }

    #[test]
    fn parses_llama3_rope_in_both_spellings() {
        let old = with(
            r#"{"rope_theta":500000.0,"rope_scaling":{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":8192}}"#,
        );
        let new = with(
            r#"{"rope_parameters":{"rope_theta":500000.0,"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":8192}}"#,
        );
        for text in [old, new] {
            let c = ModelConfig::from_json_str(&text).unwrap();
            assert_eq!(c.rope_theta, 500000.0);
            assert!(matches!(c.rope_scaling, RopeScaling::Llama3 { factor, .. } if factor == 8.0));
        }
    }

    #[test]
    fn rejects_unknown_architecture_and_rope() {
        let e = ModelConfig::from_json_str(&BASE.replace("LlamaForCausalLM", "GPT2LMHeadModel")).unwrap_err();
        assert!(e.to_string().contains("GPT2LMHeadModel"), "{e}");
        let e = ModelConfig::from_json_str(&with(r#"{"rope_scaling":{"type":"yarn","factor":2.0}}"#))
            .unwrap_err();
        assert!(e.to_string().contains("yarn"), "{e}");
    }

    #[test]
    fn names_bad_fields() {
        let e = ModelConfig::from_json_str(&BASE.replace("\"hidden_size\":64,", "")).unwrap_err();
        assert!(e.to_string().contains("hidden_size"), "{e}");
        let e = ModelConfig::from_json_str(
            &BASE.replace("\"num_key_value_heads\":2", "\"num_key_value_heads\":3"),
        )
        .unwrap_err();
        assert!(e.to_string().contains("num_key_value_heads"), "{e}");
        let e = ModelConfig::from_json_str(&with(r#"{"rms_norm_eps":"small"}"#)).unwrap_err();
        assert!(e.to_string().contains("rms_norm_eps"), "{e}");
    }

    #[test]
    fn qwen2_has_qkv_bias() {
        let c = ModelConfig::from_json_str(&BASE.replace("LlamaForCausalLM", "Qwen2ForCausalLM")).unwrap();
        assert!(c.qkv_bias && !c.o_bias);
    }

    #[test]
    fn qwen3_norms_queries_and_keys_and_biases_follow_attention_bias() {
        let qwen3 = BASE.replace("LlamaForCausalLM", "Qwen3ForCausalLM");
        let c = ModelConfig::from_json_str(&qwen3).unwrap();
        assert_eq!(c.architecture, Architecture::Qwen3);
        assert!(c.qk_norm && !c.qkv_bias && !c.o_bias && !c.mlp_bias);
        let biased = with(r#"{"attention_bias":true}"#).replace("LlamaForCausalLM", "Qwen3ForCausalLM");
        let c = ModelConfig::from_json_str(&biased).unwrap();
        assert!(c.qkv_bias && c.o_bias);
        assert!(!ModelConfig::from_json_str(BASE).unwrap().qk_norm, "Llama does not norm q and k");
        let windowed = with(r#"{"use_sliding_window":true,"sliding_window":16}"#)
            .replace("LlamaForCausalLM", "Qwen3ForCausalLM");
        let e = ModelConfig::from_json_str(&windowed).unwrap_err().to_string();
        assert!(e.contains("use_sliding_window"), "{e}");
    }

    #[test]
    fn phi3_fuses_its_projections_and_rotates_part_of_each_head() {
        let mistral = with(r#"{"sliding_window":0}"#).replace("LlamaForCausalLM", "MistralForCausalLM");
        let e = ModelConfig::from_json_str(&mistral).unwrap_err().to_string();
        assert!(e.contains("sliding_window") && e.contains("positive"), "a zero window is refused: {e}");
        let phi3 = with(r#"{"sliding_window":2047}"#).replace("LlamaForCausalLM", "Phi3ForCausalLM");
        let c = ModelConfig::from_json_str(&phi3).unwrap();
        assert_eq!(c.architecture, Architecture::Phi3);
        assert!(c.fused_projections && !c.qkv_bias && !c.qk_norm);
        assert_eq!(c.sliding_window, Some(2047));
        assert!(!ModelConfig::from_json_str(BASE).unwrap().fused_projections);
        for (extra, dims) in [
            (r#"{"partial_rotary_factor":0.75}"#, 12),
            (
                r#"{"rope_parameters":{"rope_type":"default","rope_theta":10000.0,"partial_rotary_factor":0.5}}"#,
                8,
            ),
            (
                r#"{"rope_parameters":{"rope_type":"default","rope_theta":10000.0,"partial_rotary_factor":1.0}}"#,
                16,
            ),
        ] {
            let phi = with(extra).replace("LlamaForCausalLM", "Phi3ForCausalLM");
            assert_eq!(ModelConfig::from_json_str(&phi).unwrap().rotary_dim, dims, "{extra}");
        }
        for extra in [r#"{"partial_rotary_factor":0.1}"#, r#"{"partial_rotary_factor":1.5}"#] {
            let phi = with(extra).replace("LlamaForCausalLM", "Phi3ForCausalLM");
            let e = ModelConfig::from_json_str(&phi).unwrap_err().to_string();
            assert!(e.contains("partial_rotary_factor"), "{extra}: {e}");
        }
        // transformers' Llama rotates whole heads: a partial factor there is refused.
        let e = ModelConfig::from_json_str(&with(r#"{"partial_rotary_factor":0.5}"#)).unwrap_err();
        assert!(matches!(e, Error::Unsupported(_)) && e.to_string().contains("partial_rotary_factor"), "{e}");
        // LongRoPE: a factor per rotated pair, the original context beside rope_scaling.
        let long = |short: &str| {
            with(&format!(
                r#"{{"partial_rotary_factor":0.75,"original_max_position_embeddings":64,"max_position_embeddings":512,
                    "rope_scaling":{{"type":"su","short_factor":{short},"long_factor":[1,2,3,4,5,6]}}}}"#
            ))
            .replace("LlamaForCausalLM", "Phi3ForCausalLM")
        };
        let c = ModelConfig::from_json_str(&long("[1,1,1,1,1,1]")).unwrap();
        let RopeScaling::LongRope { original_max_position_embeddings, attention_factor, .. } = c.rope_scaling
        else {
            panic!("{:?}", c.rope_scaling)
        };
        assert_eq!(original_max_position_embeddings, 64);
        assert!((attention_factor - (1.0 + 8f64.ln() / 64f64.ln()).sqrt()).abs() < 1e-12);
        let e = ModelConfig::from_json_str(&long("[1,1]")).unwrap_err().to_string();
        assert!(e.contains("short_factor"), "{e}");
    }

    #[test]
    fn numbers_outside_their_domain_are_named() {
        let base = r#""architectures":["LlamaForCausalLM"],"hidden_size":8,"num_attention_heads":2,"intermediate_size":16,"num_hidden_layers":1,"vocab_size":10"#;
        for (extra, key) in [
            (r#""rms_norm_eps":0"#, "rms_norm_eps"),
            (r#""rms_norm_eps":-1e-6"#, "rms_norm_eps"),
            (r#""rope_theta":0"#, "rope_theta"),
            (r#""rope_scaling":{"rope_type":"linear","factor":0}"#, "rope_scaling.factor"),
            (
                r#""rope_scaling":{"rope_type":"llama3","factor":8,"low_freq_factor":4,"high_freq_factor":4,"original_max_position_embeddings":8192}"#,
                "rope_scaling.high_freq_factor",
            ),
        ] {
            let e = ModelConfig::from_json_str(&format!("{{{base},{extra}}}")).unwrap_err().to_string();
            assert!(e.contains(key), "{extra}: {e}");
        }
        ModelConfig::from_json_str(&format!("{{{base}}}")).unwrap();
    }

    #[test]
    fn mutated_configs_never_panic() {
        let good = r#"{"architectures":["LlamaForCausalLM"],"model_type":"llama","hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":256,"max_position_embeddings":512,"rms_norm_eps":1e-5,"rope_theta":10000.0,"rope_scaling":{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":64}}"#;
        assert!(ModelConfig::from_json_str(good).is_ok());
        let mut state = 0x9e3779b97f4a7c15u64;
        let mut next = |m: usize| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % m as u64) as usize
        };
        let digits = b"0123456789-.e";
        for _ in 0..5000 {
            let mut bytes = good.as_bytes().to_vec();
            for _ in 0..1 + next(4) {
                let i = next(bytes.len());
                bytes[i] = if next(2) == 0 { digits[next(digits.len())] } else { next(256) as u8 };
            }
            let text = String::from_utf8_lossy(&bytes);
            let _ = ModelConfig::from_json_str(&text); // an error or a checked config
        }
        for n in ["0", "-1", "1e400", "18446744073709551616", "4294967296"] {
            let text = good.replace("\"num_attention_heads\":4", &format!("\"num_attention_heads\":{n}"));
            assert!(ModelConfig::from_json_str(&text).is_err(), "{n}");
        }
    }
}
