//! What Gemma 2's and Gemma 3's config.json say beyond the Llama shape, read as
//! transformers reads them (`Gemma2Config`, `Gemma3TextConfig`), defaults included: a key
//! the file leaves out takes the value transformers gives it, so a checkpoint means the
//! same model here as there.
//!
//! - `layer_types` (`sliding_attention` / `full_attention` per layer; absent: Gemma 2
//!   alternates, starting local; Gemma 3 makes every `sliding_window_pattern`-th layer, 6
//!   by default, global) and `sliding_window`;
//! - Gemma 3's two rope bases: `full_attention` layers rotate with `rope_theta` and the
//!   rope scaling, `sliding_attention` layers with their own base (`rope_local_base_freq`)
//!   unscaled — transformers 5 writes both under `rope_parameters`, one object per layer
//!   type; Gemma 2 has one base for both;
//! - `query_pre_attn_scalar` (the attention scale is its inverse square root), the soft
//!   caps of attention scores and final logits (Gemma 2 caps both by default, at 50 and
//!   30; a `null` turns one off). Bidirectional attention is refused by name.

use serde_json::{Map, Value};

use super::{layer_types, opt_bool, opt_f64, opt_usize, parse_rope, positive, Architecture, RopeScaling};
use crate::error::{Error, Result};

/// Gemma's defaults (transformers' `Gemma2Config`, `Gemma3TextConfig`).
pub(super) const HEAD_DIM: usize = 256;
const SLIDING_WINDOW: usize = 4096;
const PATTERN: usize = 6;
const QUERY_PRE_ATTN_SCALAR: f64 = 256.0;
const GLOBAL_THETA: f64 = 1_000_000.0;
const LOCAL_THETA: f64 = 10_000.0;
const GEMMA2_ATTN_SOFTCAP: f64 = 50.0;
const GEMMA2_FINAL_SOFTCAP: f64 = 30.0;

/// Gemma's attention layout, ropes and soft caps.
pub(super) struct Gemma {
    pub windowed_layers: Vec<bool>,
    pub sliding_window: usize,
    /// Gemma 3's ropes by layer type: `(global theta, global scaling, local theta)`.
    pub ropes: Option<(f64, RopeScaling, f64)>,
    pub query_pre_attn_scalar: f64,
    pub final_logit_softcap: Option<f32>,
    pub attn_logit_softcap: Option<f32>,
}

pub(super) fn options(obj: &Map<String, Value>, num_layers: usize, arch: Architecture) -> Result<Gemma> {
    if opt_bool(obj, "use_bidirectional_attention")?.unwrap_or(false) {
        return Err(Error::Unsupported("use_bidirectional_attention=true".into()));
    }
    let gemma2 = arch == Architecture::Gemma2;
    // Gemma 2 has one rope, read as every family's is (`rope::rope_keys`).
    let ropes = match gemma2 {
        true => None,
        false => Some(ropes(obj)?),
    };
    let windowed_layers = match gemma2 {
        true => layer_types(obj, num_layers, &|i| (i + 1) % 2 != 0)?,
        false => gemma3_layer_types(obj, num_layers)?,
    };
    Ok(Gemma {
        windowed_layers,
        sliding_window: match opt_usize(obj, "sliding_window")? {
            Some(0) => return Err(Error::invalid("sliding_window", "must be positive")),
            Some(w) => w,
            None => SLIDING_WINDOW,
        },
        ropes,
        query_pre_attn_scalar: positive(
            "query_pre_attn_scalar",
            opt_f64(obj, "query_pre_attn_scalar")?.unwrap_or(QUERY_PRE_ATTN_SCALAR),
        )?,
        final_logit_softcap: softcap(obj, "final_logit_softcapping", gemma2.then_some(GEMMA2_FINAL_SOFTCAP))?,
        attn_logit_softcap: softcap(obj, "attn_logit_softcapping", gemma2.then_some(GEMMA2_ATTN_SOFTCAP))?,
    })
}

/// A soft cap: the file's value, `None` where it writes `null`, `default` where it is
/// silent.
fn softcap(obj: &Map<String, Value>, key: &str, default: Option<f64>) -> Result<Option<f32>> {
    let cap = match obj.get(key) {
        None => default,
        Some(_) => opt_f64(obj, key)?,
    };
    Ok(cap.map(|c| positive(key, c)).transpose()?.map(|c| c as f32))
}

/// Gemma 3's local layers: `layer_types`, or the pattern.
fn gemma3_layer_types(obj: &Map<String, Value>, num_layers: usize) -> Result<Vec<bool>> {
    let pattern = match opt_usize(obj, "sliding_window_pattern")? {
        Some(0) => return Err(Error::invalid("sliding_window_pattern", "must be positive")),
        Some(p) => p,
        None => PATTERN,
    };
    layer_types(obj, num_layers, &|i| (i + 1) % pattern != 0)
}

/// `(global theta, global scaling, local theta)`: from `rope_parameters` by layer type
/// (transformers 5), else from `rope_theta`, `rope_scaling` and `rope_local_base_freq`.
fn ropes(obj: &Map<String, Value>) -> Result<(f64, RopeScaling, f64)> {
    let by_type = obj
        .get("rope_parameters")
        .and_then(|r| r.as_object())
        .filter(|r| r.contains_key("full_attention") || r.contains_key("sliding_attention"));
    let theta = |r: Option<&Value>, key: &str, default: f64| -> Result<f64> {
        match r.and_then(|r| r.get("rope_theta")).filter(|v| !v.is_null()) {
            Some(v) => {
                positive(key, v.as_f64().ok_or_else(|| Error::invalid(key, format!("{v} is not a number")))?)
            }
            None => Ok(default),
        }
    };
    let Some(by_type) = by_type else {
        let global = positive("rope_theta", opt_f64(obj, "rope_theta")?.unwrap_or(GLOBAL_THETA))?;
        let local =
            positive("rope_local_base_freq", opt_f64(obj, "rope_local_base_freq")?.unwrap_or(LOCAL_THETA))?;
        let scaling = parse_rope(obj.get("rope_scaling").filter(|v| !v.is_null()))?;
        return Ok((global, scaling, local));
    };
    let full = by_type.get("full_attention").filter(|v| !v.is_null());
    let sliding = by_type.get("sliding_attention").filter(|v| !v.is_null());
    if parse_rope(sliding)? != RopeScaling::None {
        return Err(Error::Unsupported(
            "rope_parameters.sliding_attention: a scaled rope for local layers".into(),
        ));
    }
    Ok((
        theta(full, "rope_parameters.full_attention.rope_theta", GLOBAL_THETA)?,
        parse_rope(full)?,
        theta(sliding, "rope_parameters.sliding_attention.rope_theta", LOCAL_THETA)?,
    ))
}

#[cfg(test)]
mod tests {
    use crate::{Activation, Architecture, ModelConfig, RopeScaling};

    /// A Gemma 3 config.json with only what it must say; `extra` is spliced in.
    fn gemma(extra: &str) -> crate::Result<ModelConfig> {
        ModelConfig::from_json_str(&format!(
            r#"{{"architectures":["Gemma3ForCausalLM"],"hidden_size":64,"intermediate_size":128,
                "num_hidden_layers":7,"num_attention_heads":4,"num_key_value_heads":1,
                "vocab_size":300{extra}}}"#
        ))
    }

    #[test]
    fn what_the_file_leaves_out_takes_transformers_defaults() {
        let c = gemma("").unwrap();
        assert_eq!(c.architecture, Architecture::Gemma3);
        assert_eq!(c.head_dim, super::HEAD_DIM);
        assert_eq!(c.activation, Activation::GeluTanh);
        assert!(c.tie_word_embeddings && c.qk_norm && c.sandwich_norms);
        assert_eq!(c.norm_weight_offset, 1.0);
        assert_eq!(c.embed_scale, Some(8.0));
        // Every sixth layer is global; the others see a 4096-position window.
        assert_eq!(c.windowed_layers, [true, true, true, true, true, false, true]);
        assert_eq!(c.sliding_window, Some(4096));
        assert_eq!((c.rope_theta, c.local_rope_theta), (1_000_000.0, Some(10_000.0)));
        assert_eq!((c.query_pre_attn_scalar, c.final_logit_softcap), (Some(256.0), None));
        assert_eq!(c.attn_logit_softcap, None);
    }

    #[test]
    fn gemma2_alternates_its_layers_and_caps_by_default() {
        let text = |extra: &str| {
            format!(
                r#"{{"architectures":["Gemma2ForCausalLM"],"hidden_size":64,"intermediate_size":128,
                    "num_hidden_layers":4,"num_attention_heads":4,"num_key_value_heads":2,
                    "vocab_size":300{extra}}}"#
            )
        };
        let c = ModelConfig::from_json_str(&text("")).unwrap();
        assert_eq!(c.architecture, Architecture::Gemma2);
        assert_eq!(c.windowed_layers, [true, false, true, false]);
        assert!(!c.qk_norm && c.sandwich_norms && c.tie_word_embeddings);
        assert_eq!((c.attn_logit_softcap, c.final_logit_softcap), (Some(50.0), Some(30.0)));
        assert_eq!((c.rope_theta, c.local_rope_theta, c.head_dim), (10_000.0, None, 256));
        let c = ModelConfig::from_json_str(&text(
            r#","attn_logit_softcapping":null,"final_logit_softcapping":null,"rope_theta":20000.0"#,
        ))
        .unwrap();
        assert_eq!((c.attn_logit_softcap, c.final_logit_softcap, c.rope_theta), (None, None, 20_000.0));
        let e = ModelConfig::from_json_str(&text(r#","attn_logit_softcapping":0"#)).unwrap_err();
        assert!(e.to_string().contains("attn_logit_softcapping"), "{e}");
    }

    #[test]
    fn ropes_read_in_both_spellings() {
        let old = gemma(
            r#","rope_theta":500000.0,"rope_local_base_freq":20000.0,"rope_scaling":{"rope_type":"linear","factor":8.0}"#,
        )
        .unwrap();
        let new = gemma(
            r#","rope_parameters":{"full_attention":{"rope_type":"linear","factor":8.0,"rope_theta":500000.0},
               "sliding_attention":{"rope_type":"default","rope_theta":20000.0}}"#,
        )
        .unwrap();
        for c in [old, new] {
            assert_eq!((c.rope_theta, c.local_rope_theta), (500_000.0, Some(20_000.0)));
            assert_eq!(c.rope_scaling, RopeScaling::Linear { factor: 8.0 });
        }
    }

    #[test]
    fn layer_types_and_the_window_are_read_and_checked() {
        let types = r#","sliding_window":16,"layer_types":["full_attention","sliding_attention","full_attention","sliding_attention","sliding_attention","sliding_attention","full_attention"]"#;
        let c = gemma(types).unwrap();
        assert_eq!(c.windowed_layers, [false, true, false, true, true, true, false]);
        assert_eq!(c.sliding_window, Some(16));
        for (extra, key) in [
            (r#","layer_types":["full_attention"]"#, "layer_types"),
            (
                r#","layer_types":["full_attention","x","full_attention","full_attention","full_attention","full_attention","full_attention"]"#,
                "layer_types",
            ),
            (r#","sliding_window":0"#, "sliding_window"),
            (r#","query_pre_attn_scalar":-1"#, "query_pre_attn_scalar"),
            (r#","hidden_activation":"relu""#, "hidden_activation"),
        ] {
            let e = gemma(extra).unwrap_err().to_string();
            assert!(e.contains(key), "{extra}: {e}");
        }
    }

    #[test]
    fn what_is_not_implemented_is_refused_by_name() {
        for (extra, key) in [
            (r#","use_bidirectional_attention":true"#, "use_bidirectional_attention"),
            (
                r#","rope_parameters":{"sliding_attention":{"rope_type":"linear","factor":2.0}}"#,
                "sliding_attention",
            ),
        ] {
            let e = gemma(extra).unwrap_err();
            assert!(e.to_string().contains(key), "{extra}: {e}");
            assert!(matches!(e, crate::Error::Unsupported(_)), "{extra}: {e:?}");
        }
        let capped = gemma(r#","final_logit_softcapping":30.0,"attn_logit_softcapping":50.0"#).unwrap();
        assert_eq!((capped.final_logit_softcap, capped.attn_logit_softcap), (Some(30.0), Some(50.0)));
    }
}
