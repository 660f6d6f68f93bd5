//! How rotary position frequencies are rescaled, as config.json's `rope_scaling` (or
//! transformers 5's `rope_parameters`) says: linear, Llama 3.1's, YaRN. Any other type is
//! refused by name.

use serde_json::{Map, Value};

use super::{gpt_oss, opt_f64, opt_usize, positive, Architecture};
use crate::error::{Error, Result};

/// What config.json says of rotary embeddings, whichever spelling it uses.
pub(super) struct RopeKeys {
    pub theta: f64,
    pub scaling: RopeScaling,
    /// `partial_rotary_factor`, where given.
    pub partial: Option<f64>,
}

/// The rope's base, scaling and partial factor: transformers 5 nests them inside
/// `rope_parameters`, 4.x writes `rope_theta` beside `rope_scaling`. Gemma 3's ropes are
/// read by layer type (`gemma`); gpt-oss's default is its YaRN.
pub(super) fn rope_keys(
    obj: &Map<String, Value>,
    architecture: Architecture,
    head_dim: usize,
    max_positions: usize,
) -> Result<RopeKeys> {
    let rope = obj.get("rope_parameters").or_else(|| obj.get("rope_scaling")).filter(|v| !v.is_null());
    let gpt_oss = architecture == Architecture::GptOss;
    let default_theta = if gpt_oss { gpt_oss::ROPE_THETA } else { 10000.0 };
    let theta = match opt_f64(obj, "rope_theta")? {
        Some(t) => t,
        None => rope.and_then(|r| r.get("rope_theta")).and_then(|t| t.as_f64()).unwrap_or(default_theta),
    };
    // RoPE over the first part of each head (Phi-4-mini: partial_rotary_factor 0.75).
    let partial = match opt_f64(obj, "partial_rotary_factor")? {
        Some(f) => Some(f),
        None => rope.and_then(|r| r.get("partial_rotary_factor")).and_then(|v| v.as_f64()),
    };
    let kind = rope.and_then(|r| r.get("rope_type").or_else(|| r.get("type"))).and_then(|v| v.as_str());
    let scaling = match (architecture, rope) {
        (Architecture::Gemma3, _) => RopeScaling::None, // by layer type (`gemma`)
        (Architecture::GptOss, None) if gpt_oss::null_means_plain_rope(obj) => RopeScaling::None,
        (Architecture::GptOss, None) => gpt_oss::default_rope(),
        (_, Some(r)) if matches!(kind, Some("longrope" | "su")) => {
            let rot = rotary_dim(partial, head_dim)?;
            long_rope(r, opt_usize(obj, "original_max_position_embeddings")?, max_positions, rot / 2)?
        }
        _ => parse_rope(rope)?,
    };
    Ok(RopeKeys { theta, scaling, partial })
}

/// The dims of each head that rope rotates. Of the families here, transformers rotates
/// part of a head only in Phi-3's; a partial factor elsewhere is refused.
pub(super) fn rotated_dims(
    architecture: Architecture,
    latent: bool,
    partial: Option<f64>,
    head_dim: usize,
) -> Result<usize> {
    match (latent, architecture) {
        (false, Architecture::Phi3) => rotary_dim(partial, head_dim),
        _ if partial.is_some_and(|f| f != 1.0) => Err(Error::Unsupported(format!(
            "partial_rotary_factor {} for {}",
            partial.unwrap_or(1.0),
            architecture.hf_class()
        ))),
        _ => Ok(head_dim),
    }
}

/// How rotary position frequencies are rescaled for long contexts.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    None,
    /// Position interpolation: every inverse frequency divided by `factor`.
    Linear {
        factor: f64,
    },
    /// Llama 3.1's frequency-dependent scaling.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
    /// YaRN: frequencies past the `beta_fast`..`beta_slow` rotation range interpolated by
    /// `factor`, those inside it kept, a linear ramp between; queries and keys scaled by
    /// `attention_factor` (here folded into the attention scale, squared).
    Yarn {
        factor: f64,
        beta_fast: f64,
        beta_slow: f64,
        original_max_position_embeddings: f64,
        truncate: bool,
        attention_factor: f64,
    },
    /// LongRoPE (Phi-3 "su", Phi-4-mini): each frequency divided by its own factor,
    /// `short_factor` while a step's positions lie inside the original context, and
    /// `long_factor` once one lies beyond it (transformers switches the same way);
    /// rotated dims scaled by `attention_factor`.
    LongRope {
        short_factor: Vec<f64>,
        long_factor: Vec<f64>,
        original_max_position_embeddings: usize,
        attention_factor: f64,
    },
}

impl RopeScaling {
    /// What rotated queries and keys are each multiplied by (YaRN's and LongRoPE's
    /// `attention_factor`; 1 for the others).
    pub fn attention_factor(&self) -> f64 {
        match self {
            RopeScaling::Yarn { attention_factor, .. } | RopeScaling::LongRope { attention_factor, .. } => {
                *attention_factor
            }
            _ => 1.0,
        }
    }
}

pub(super) fn parse_rope(rope: Option<&Value>) -> Result<RopeScaling> {
    let Some(rope) = rope else {
        return Ok(RopeScaling::None);
    };
    let kind =
        rope.get("rope_type").or_else(|| rope.get("type")).and_then(|v| v.as_str()).unwrap_or("default");
    let num = |key: &str| -> Result<f64> {
        let v = rope.get(key).and_then(|v| v.as_f64()).ok_or_else(|| {
            Error::invalid(format!("rope_scaling.{key}"), format!("required for rope_type {kind:?}"))
        })?;
        positive(&format!("rope_scaling.{key}"), v)
    };
    match kind {
        "default" => Ok(RopeScaling::None),
        "linear" => Ok(RopeScaling::Linear { factor: num("factor")? }),
        "llama3" => {
            let (low, high) = (num("low_freq_factor")?, num("high_freq_factor")?);
            if high <= low {
                return Err(Error::invalid(
                    "rope_scaling.high_freq_factor",
                    format!("{high} must exceed low_freq_factor ({low})"),
                ));
            }
            Ok(RopeScaling::Llama3 {
                factor: num("factor")?,
                low_freq_factor: low,
                high_freq_factor: high,
                original_max_position_embeddings: num("original_max_position_embeddings")?,
            })
        }
        "yarn" => yarn(rope, num("factor")?),
        "longrope" | "su" => Err(Error::Unsupported(
            "rope_scaling type \"longrope\" for a rope by layer type (Gemma 3)".into(),
        )),
        other => Err(Error::Unsupported(format!(
            "rope_scaling type {other:?} (supported: default, linear, llama3, yarn)"
        ))),
    }
}

/// YaRN's parameters, transformers' defaults for those left out (`beta_fast` 32,
/// `beta_slow` 1, `truncate` true); `attention_factor` given, or from `mscale` and
/// `mscale_all_dim` when both are, or from the factor alone.
fn yarn(rope: &Value, factor: f64) -> Result<RopeScaling> {
    let opt = |key: &str| -> Result<Option<f64>> {
        match rope.get(key).filter(|v| !v.is_null()) {
            None => Ok(None),
            Some(v) => match v.as_f64() {
                Some(x) if x.is_finite() => Ok(Some(x)),
                _ => Err(Error::invalid(format!("rope_scaling.{key}"), format!("{v} is not a number"))),
            },
        }
    };
    let original = opt("original_max_position_embeddings")?.ok_or_else(|| {
        Error::invalid("rope_scaling.original_max_position_embeddings", "required for rope_type \"yarn\"")
    })?;
    let attention_factor = match (opt("attention_factor")?, opt("mscale")?, opt("mscale_all_dim")?) {
        (Some(a), _, _) => a,
        (None, Some(m), Some(all)) if m != 0.0 && all != 0.0 => {
            yarn_mscale(factor, m) / yarn_mscale(factor, all)
        }
        _ => yarn_mscale(factor, 1.0),
    };
    let truncate = match rope.get("truncate").filter(|v| !v.is_null()) {
        None => true,
        Some(v) => v.as_bool().ok_or_else(|| Error::invalid("rope_scaling.truncate", format!("{v}")))?,
    };
    Ok(RopeScaling::Yarn {
        factor,
        beta_fast: positive(
            "rope_scaling.beta_fast",
            opt("beta_fast")?.filter(|&b| b != 0.0).unwrap_or(32.0),
        )?,
        beta_slow: positive(
            "rope_scaling.beta_slow",
            opt("beta_slow")?.filter(|&b| b != 0.0).unwrap_or(1.0),
        )?,
        original_max_position_embeddings: positive(
            "rope_scaling.original_max_position_embeddings",
            original,
        )?,
        truncate,
        attention_factor: positive("rope_scaling.attention_factor", attention_factor)?,
    })
}

/// YaRN's `0.1 · mscale · ln(scale) + 1` (1 where the context is not stretched).
pub(super) fn yarn_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

/// LongRoPE's parameters: per-frequency `short_factor` and `long_factor` (as many as the
/// rotated pairs), `original_max_position_embeddings` (inside `rope_scaling` or beside it,
/// transformers 4.x), `attention_factor` given or `√(1 + ln s / ln original)` with `s =
/// factor` or `max_position_embeddings / original` (1 where `s ≤ 1`).
pub(super) fn long_rope(
    rope: &Value,
    top_original: Option<usize>,
    max_positions: usize,
    pairs: usize,
) -> Result<RopeScaling> {
    let list = |key: &str| -> Result<Vec<f64>> {
        let v = rope.get(key).and_then(|v| v.as_array()).ok_or_else(|| {
            Error::invalid(format!("rope_scaling.{key}"), "a list of factors is required for longrope")
        })?;
        let factors: Vec<f64> =
            v.iter().filter_map(|x| x.as_f64()).filter(|x| x.is_finite() && *x > 0.0).collect();
        if factors.len() != v.len() || factors.len() != pairs {
            return Err(Error::invalid(
                format!("rope_scaling.{key}"),
                format!("{} entries; the rotated dims need {pairs} positive numbers", v.len()),
            ));
        }
        Ok(factors)
    };
    let original = rope
        .get("original_max_position_embeddings")
        .and_then(|v| v.as_u64())
        .map(|v| v as usize)
        .or(top_original)
        .filter(|&n| n > 1)
        .ok_or_else(|| {
            Error::invalid(
                "original_max_position_embeddings",
                "required (above 1) for rope_type \"longrope\"",
            )
        })?;
    let attention_factor = match rope.get("attention_factor").and_then(|v| v.as_f64()) {
        Some(a) => positive("rope_scaling.attention_factor", a)?,
        None => {
            let scale = match rope.get("factor").and_then(|v| v.as_f64()) {
                Some(f) => positive("rope_scaling.factor", f)?,
                None => max_positions as f64 / original as f64,
            };
            if scale <= 1.0 {
                1.0
            } else {
                (1.0 + scale.ln() / (original as f64).ln()).sqrt()
            }
        }
    };
    Ok(RopeScaling::LongRope {
        short_factor: list("short_factor")?,
        long_factor: list("long_factor")?,
        original_max_position_embeddings: original,
        attention_factor,
    })
}

/// The rotated dims of a head: `factor × head_dim` (transformers truncates), even and
/// positive.
fn rotary_dim(factor: Option<f64>, head_dim: usize) -> Result<usize> {
    let Some(f) = factor else { return Ok(head_dim) };
    let dim = (head_dim as f64 * f) as usize;
    if !(f > 0.0 && f <= 1.0) || dim == 0 || !dim.is_multiple_of(2) {
        return Err(Error::invalid(
            "partial_rotary_factor",
            format!("{f} of a {head_dim}-dim head must leave an even number of rotated dims"),
        ));
    }
    Ok(dim)
}
