//! What DeepSeek-V3's config.json says beyond the Llama shape, read as transformers reads
//! it (`DeepseekV3Config`), defaults included:
//!
//! - multi-head latent attention: queries through a low-rank pair (`q_lora_rank`; none:
//!   one `q_proj`), keys and values from one `kv_lora_rank`-wide latent per position
//!   (what the KV cache stores, beside the `qk_rope_head_dim` rotated key shared by the
//!   heads); per head `qk_nope_head_dim` + `qk_rope_head_dim` query/key dims and
//!   `v_head_dim` value dims; rope dims interleaved in the weights (`rope_interleave`);
//!   the softmax scale times YaRN's `mscale_all_dim` factor squared;
//! - the mixture of experts: sigmoid scores with a correction bias choose the experts
//!   (`n_group` groups ranked by their two best, `topk_group` kept), the chosen scores
//!   renormalised (`norm_topk_prob`) and scaled (`routed_scaling_factor`), shared experts
//!   beside them (`n_shared_experts`), the first `first_k_dense_replace` layers dense.

use serde_json::{Map, Value};

use super::{opt_bool, opt_f64, opt_usize, positive, req_usize, yarn_mscale, RopeScaling};
use crate::error::{Error, Result};

/// One layer's latent attention.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Latent {
    /// Rank of the queries' low-rank pair (`q_a_proj`, `q_b_proj`); None: `q_proj`.
    pub q_lora_rank: Option<usize>,
    /// Width of the cached latent (`kv_a_proj_with_mqa`'s first part).
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    /// The rope dims of q and k come out of their projections as interleaved pairs.
    pub rope_interleave: bool,
    /// The softmax scale: `(qk_nope + qk_rope)^-½`, times YaRN's mscale squared.
    pub scale: f32,
}

impl Latent {
    /// Values one position holds in the KV cache: the latent and the rotated key.
    pub fn cached_width(&self) -> usize {
        self.kv_lora_rank + self.qk_rope_head_dim
    }
}

pub(super) fn latent(obj: &Map<String, Value>, rope: &RopeScaling) -> Result<Latent> {
    let q_lora_rank = opt_usize(obj, "q_lora_rank")?;
    let nonzero = |key: &str, default: usize| -> Result<usize> {
        match opt_usize(obj, key)?.unwrap_or(default) {
            0 => Err(Error::invalid(key, "must be positive")),
            n => Ok(n),
        }
    };
    let (nope, rope_dim) = (nonzero("qk_nope_head_dim", 128)?, nonzero("qk_rope_head_dim", 64)?);
    if !rope_dim.is_multiple_of(2) {
        return Err(Error::invalid("qk_rope_head_dim", format!("{rope_dim} must be even for RoPE")));
    }
    if q_lora_rank == Some(0) {
        return Err(Error::invalid("q_lora_rank", "must be positive (or null)"));
    }
    // transformers' `yarn_apply_mscale`: a scaled rope's `mscale_all_dim` scales the whole
    // softmax (the rope dims' own `attention_factor` is the rope's).
    let mut scale = 1.0 / ((nope + rope_dim) as f64).sqrt();
    if let RopeScaling::Yarn { factor, .. } = rope {
        let rope_obj = obj.get("rope_parameters").or_else(|| obj.get("rope_scaling"));
        let all = rope_obj.and_then(|r| r.get("mscale_all_dim")).and_then(|v| v.as_f64()).unwrap_or(0.0);
        if all != 0.0 {
            let m = yarn_mscale(*factor, all);
            scale *= m * m;
        }
    }
    Ok(Latent {
        q_lora_rank,
        kv_lora_rank: nonzero("kv_lora_rank", 512)?,
        qk_nope_head_dim: nope,
        qk_rope_head_dim: rope_dim,
        v_head_dim: nonzero("v_head_dim", 128)?,
        rope_interleave: opt_bool(obj, "rope_interleave")?.unwrap_or(true),
        scale: scale as f32,
    })
}

/// DeepSeek-V3's routing, beyond what every MoE has.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GroupedRouting {
    pub n_group: usize,
    pub topk_group: usize,
    pub routed_scaling_factor: f32,
}

/// `(routing, shared experts' intermediate size, dense layers before the first MoE one)`.
pub(super) fn routing(
    obj: &Map<String, Value>,
    num_experts: usize,
    top_k: usize,
) -> Result<(GroupedRouting, usize, usize)> {
    for (key, want) in [("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")] {
        if let Some(v) = obj.get(key).filter(|v| !v.is_null()) {
            if v.as_str() != Some(want) {
                return Err(Error::Unsupported(format!("{key} {v} (DeepSeek-V3 routes by {want})")));
            }
        }
    }
    let n_group = opt_usize(obj, "n_group")?.unwrap_or(8);
    let topk_group = opt_usize(obj, "topk_group")?.unwrap_or(4);
    if n_group == 0 || !num_experts.is_multiple_of(n_group) || num_experts / n_group < 2 {
        return Err(Error::invalid(
            "n_group",
            format!("{n_group} groups of {num_experts} experts (each group needs two or more)"),
        ));
    }
    if topk_group == 0 || topk_group > n_group || topk_group * (num_experts / n_group) < top_k {
        return Err(Error::invalid(
            "topk_group",
            format!("{topk_group} of {n_group} groups cannot hold {top_k} experts a token"),
        ));
    }
    let scale = positive("routed_scaling_factor", opt_f64(obj, "routed_scaling_factor")?.unwrap_or(2.5))?;
    let shared = opt_usize(obj, "n_shared_experts")?.unwrap_or(1) * req_usize(obj, "moe_intermediate_size")?;
    let dense = opt_usize(obj, "first_k_dense_replace")?.unwrap_or(3);
    Ok((GroupedRouting { n_group, topk_group, routed_scaling_factor: scale as f32 }, shared, dense))
}

#[cfg(test)]
mod tests {
    use crate::{Architecture, ModelConfig};

    fn deepseek(extra: &str) -> crate::Result<ModelConfig> {
        ModelConfig::from_json_str(&format!(
            r#"{{"architectures":["DeepseekV3ForCausalLM"],"hidden_size":64,"intermediate_size":96,
                "moe_intermediate_size":16,"num_hidden_layers":4,"num_attention_heads":4,
                "vocab_size":300,"n_routed_experts":16,"num_experts_per_tok":2,"kv_lora_rank":32,
                "q_lora_rank":24,"qk_nope_head_dim":16,"qk_rope_head_dim":8,"v_head_dim":12{extra}}}"#
        ))
    }

    #[test]
    fn what_the_file_leaves_out_takes_transformers_defaults() {
        let c = deepseek("").unwrap();
        assert_eq!(c.architecture, Architecture::DeepseekV3);
        assert_eq!((c.head_dim, c.num_kv_heads), (8, 4), "rope over qk_rope_head_dim; a KV head a head");
        let l = c.latent.unwrap();
        assert_eq!((l.q_lora_rank, l.kv_lora_rank, l.cached_width()), (Some(24), 32, 40));
        assert!(l.rope_interleave);
        assert!((l.scale - 1.0 / 24f32.sqrt()).abs() < 1e-7);
        let moe = c.moe.unwrap();
        let g = moe.grouped.unwrap();
        assert_eq!((g.n_group, g.topk_group, g.routed_scaling_factor), (8, 4, 2.5));
        assert_eq!(moe.layers, [false, false, false, true], "first_k_dense_replace 3");
        assert_eq!(moe.shared_intermediate, 16);
        assert!(moe.norm_topk_prob && !c.tie_word_embeddings);
    }

    #[test]
    fn yarn_scales_the_softmax_by_mscale_all_dim_and_bad_values_are_named() {
        let c = deepseek(
            r#","rope_scaling":{"type":"yarn","factor":40,"mscale":1.0,"mscale_all_dim":1.0,
               "original_max_position_embeddings":4096,"beta_fast":32,"beta_slow":1}"#,
        )
        .unwrap();
        let m = 0.1 * 40f64.ln() + 1.0;
        assert!((c.latent.unwrap().scale as f64 - m * m / 24f64.sqrt()).abs() < 1e-6);
        assert!((c.rope_scaling.attention_factor() - 1.0).abs() < 1e-12, "mscale / mscale_all_dim");
        for (extra, key) in [
            (r#","n_group":3"#, "n_group"),
            (r#","n_group":4,"topk_group":5"#, "topk_group"),
            (r#","scoring_func":"softmax""#, "scoring_func"),
            (r#","qk_rope_head_dim":7"#, "qk_rope_head_dim"),
            (r#","kv_lora_rank":0"#, "kv_lora_rank"),
        ] {
            let e = deepseek(extra).unwrap_err().to_string();
            assert!(e.contains(key), "{extra}: {e}");
        }
    }
}
