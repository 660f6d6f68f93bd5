//! What gpt-oss's config.json says beyond the Llama shape, read as transformers reads it
//! (`GptOssConfig`), defaults included: 64-wide heads, sliding and full layers alternating
//! (`layer_types`, a 128-position window), rope base 150 000 with YaRN (factor 32 over
//! 4096 positions when the file names no rope; see [`null_means_plain_rope`] for a null
//! one), and the experts' clamped SwiGLU
//! (`swiglu_alpha`, `swiglu_limit`). Attention sinks and the experts' layout are the
//! architecture's own: see `moe` and the engine's attention.

use serde_json::{Map, Value};

use super::{layer_types, opt_f64, opt_usize, positive, yarn_mscale, Activation, RopeScaling};
use crate::error::{Error, Result};

pub(super) const HEAD_DIM: usize = 64;
pub(super) const ROPE_THETA: f64 = 150_000.0;
pub(super) const SLIDING_WINDOW: usize = 128;
const SWIGLU_ALPHA: f64 = 1.702;
const SWIGLU_LIMIT: f64 = 7.0;

/// The rope transformers gives gpt-oss when config.json names none.
pub(super) fn default_rope() -> RopeScaling {
    RopeScaling::Yarn {
        factor: 32.0,
        beta_fast: 32.0,
        beta_slow: 1.0,
        original_max_position_embeddings: 4096.0,
        truncate: false,
        attention_factor: yarn_mscale(32.0, 1.0),
    }
}

/// Whether the file's rope is plain rope, not the default YaRN: transformers 4.x reads an
/// explicit `"rope_scaling": null` as no scaling (the argument's YaRN default is replaced
/// by the null), while 5.x reads a null (or missing) `rope_scaling` and `rope_parameters`
/// as the default YaRN. The version is the file's `transformers_version`; a file that
/// names none is read as the current (5.x) transformers reads it.
pub(super) fn null_means_plain_rope(obj: &Map<String, Value>) -> bool {
    let explicit_null =
        obj.get("rope_scaling").is_some_and(Value::is_null) && !obj.contains_key("rope_parameters");
    let major = obj
        .get("transformers_version")
        .and_then(Value::as_str)
        .and_then(|v| v.split('.').next())
        .and_then(|m| m.trim().parse::<u32>().ok());
    explicit_null && major.is_some_and(|m| m < 5)
}

/// Which layers attend within the window (`layer_types`; absent, alternating from a
/// windowed first layer) and the window.
pub(super) fn windows(obj: &Map<String, Value>, num_layers: usize) -> Result<(Vec<bool>, usize)> {
    let window = match opt_usize(obj, "sliding_window")? {
        Some(0) => return Err(Error::invalid("sliding_window", "must be positive")),
        Some(w) => w,
        None => SLIDING_WINDOW,
    };
    Ok((layer_types(obj, num_layers, &|i| (i + 1) % 2 != 0)?, window))
}

/// The experts' clamped SwiGLU.
pub(super) fn activation(obj: &Map<String, Value>) -> Result<Activation> {
    let alpha = positive("swiglu_alpha", opt_f64(obj, "swiglu_alpha")?.unwrap_or(SWIGLU_ALPHA))?;
    let limit = positive("swiglu_limit", opt_f64(obj, "swiglu_limit")?.unwrap_or(SWIGLU_LIMIT))?;
    Ok(Activation::ClampedSwiglu { alpha: alpha as f32, limit: limit as f32 })
}

#[cfg(test)]
mod tests {
    use crate::{Activation, Architecture, ModelConfig, RopeScaling};

    fn gpt_oss(extra: &str) -> crate::Result<ModelConfig> {
        ModelConfig::from_json_str(&format!(
            r#"{{"architectures":["GptOssForCausalLM"],"hidden_size":64,"intermediate_size":32,
                "num_hidden_layers":4,"num_attention_heads":4,"num_key_value_heads":2,
                "vocab_size":300,"num_local_experts":4,"num_experts_per_tok":2{extra}}}"#
        ))
    }

    /// gpt-oss configs written by transformers 4.57 say `"rope_scaling": null`; 4.x reads it
    /// as plain rope (every token differed when Strata applied the default YaRN), 5.x as the
    /// default YaRN.
    #[test]
    fn a_null_rope_scaling_is_read_as_the_writing_transformers_reads_it() {
        let yarn =
            |c: &ModelConfig| matches!(c.rope_scaling, RopeScaling::Yarn { factor, .. } if factor == 32.0);
        let written_by =
            |v: &str| gpt_oss(&format!(r#","rope_scaling":null,"transformers_version":"{v}""#)).unwrap();
        assert_eq!(written_by("4.57.1").rope_scaling, RopeScaling::None, "4.x: null is plain rope");
        assert_eq!(written_by("4.55.0").rope_scaling, RopeScaling::None);
        assert!(yarn(&written_by("5.0.0")), "5.x: null is the default YaRN");
        assert!(yarn(&gpt_oss(r#","rope_scaling":null"#).unwrap()), "no version: read as 5.x");
        assert!(yarn(&gpt_oss(r#","transformers_version":"4.57.1""#).unwrap()), "absent: the default");
        let nested = r#","rope_scaling":null,"rope_parameters":null,"transformers_version":"4.57.1""#;
        assert!(yarn(&gpt_oss(nested).unwrap()), "rope_parameters is 5.x's key: its null is the default");
    }

    #[test]
    fn what_the_file_leaves_out_takes_transformers_defaults() {
        let c = gpt_oss("").unwrap();
        assert_eq!(c.architecture, Architecture::GptOss);
        assert_eq!(c.head_dim, super::HEAD_DIM);
        assert!(c.qkv_bias && c.o_bias && c.attention_sinks && !c.tie_word_embeddings && !c.qk_norm);
        assert_eq!(c.windowed_layers, [true, false, true, false]);
        assert_eq!(c.sliding_window, Some(128));
        assert_eq!(c.rope_theta, 150_000.0);
        assert_eq!(c.activation, Activation::ClampedSwiglu { alpha: 1.702, limit: 7.0 });
        let RopeScaling::Yarn { factor, truncate, attention_factor, .. } = c.rope_scaling else {
            panic!("{:?}", c.rope_scaling)
        };
        assert_eq!((factor, truncate), (32.0, false));
        assert!((attention_factor - (0.1 * 32f64.ln() + 1.0)).abs() < 1e-12);
        let moe = c.moe.unwrap();
        assert!(moe.names.stacked && moe.names.biased && moe.norm_topk_prob);
        assert_eq!((moe.num_experts, moe.top_k, moe.expert_intermediate), (4, 2, 32));
    }

    #[test]
    fn the_file_overrides_and_bad_values_are_named() {
        let c = gpt_oss(
            r#","attention_bias":false,"sliding_window":16,"swiglu_limit":1.5,
               "layer_types":["full_attention","full_attention","sliding_attention","full_attention"],
               "rope_parameters":{"rope_type":"yarn","rope_theta":1000.0,"factor":4.0,
                                  "original_max_position_embeddings":64,"attention_factor":1.25}"#,
        )
        .unwrap();
        assert!(!c.qkv_bias && !c.o_bias);
        assert_eq!(c.windowed_layers, [false, false, true, false]);
        assert_eq!((c.sliding_window, c.rope_theta), (Some(16), 1000.0));
        assert_eq!(c.rope_scaling.attention_factor(), 1.25);
        assert!(matches!(c.rope_scaling, RopeScaling::Yarn { truncate: true, .. }));
        for (extra, key) in [
            (r#","swiglu_limit":-1"#, "swiglu_limit"),
            (r#","sliding_window":0"#, "sliding_window"),
            (r#","layer_types":["full_attention"]"#, "layer_types"),
            (r#","rope_parameters":{"rope_type":"yarn","factor":4.0}"#, "original_max_position_embeddings"),
        ] {
            let e = gpt_oss(extra).unwrap_err().to_string();
            assert!(e.contains(key), "{extra}: {e}");
        }
    }
}
