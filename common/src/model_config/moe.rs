//! A mixture of experts in config.json: how many experts, how many each token takes, how
//! their weights are named, and which layers have them (Mixtral, gpt-oss: every layer;
//! Qwen3-MoE: every `decoder_sparse_step`-th layer not in `mlp_only_layers`).

use serde_json::{Map, Value};

use super::deepseek::{self, GroupedRouting};
use super::{opt_bool, opt_usize, req_usize, Architecture};
use crate::error::{Error, Result};

/// How a family names an MoE layer's tensors under `model.layers.{i}.`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertNames {
    /// The block: `{block}.{router}.weight` is the router, `{block}.experts.{e}.` the
    /// experts (or, stacked, `{block}.experts.{gate_up,down}_proj`).
    pub block: &'static str,
    pub router: &'static str,
    /// Each expert's gate, up and down projections.
    pub gate: &'static str,
    pub up: &'static str,
    pub down: &'static str,
    /// The experts are stacked in two 3-D tensors (gpt-oss): `experts.gate_up_proj`
    /// `[experts, hidden, 2 · inter]` with gate and up columns interleaved, and
    /// `experts.down_proj` `[experts, inter, hidden]` — inputs before outputs.
    pub stacked: bool,
    /// The router and the experts' projections carry biases (`*.bias`, stacked
    /// `experts.{gate_up,down}_proj_bias`).
    pub biased: bool,
}

/// The mixture of experts of a model's MoE layers.
#[derive(Debug, Clone, PartialEq)]
pub struct Moe {
    pub num_experts: usize,
    /// Experts each token is routed to (`num_experts_per_tok`).
    pub top_k: usize,
    /// Intermediate size of one expert's MLP.
    pub expert_intermediate: usize,
    /// The top-k routing weights are renormalised to sum to 1 (Mixtral always;
    /// Qwen3-MoE when `norm_topk_prob`).
    pub norm_topk_prob: bool,
    /// Which layers are MoE layers (the others have a dense MLP of `intermediate_size`).
    pub layers: Vec<bool>,
    pub names: ExpertNames,
    /// DeepSeek-V3's routing: sigmoid scores, a correction bias (`{router}.e_score_correction_bias`),
    /// groups, a scale. None: a softmax over the router's logits.
    pub grouped: Option<GroupedRouting>,
    /// Intermediate size of the shared experts every token also runs
    /// (`{block}.shared_experts.*`), 0 where there are none.
    pub shared_intermediate: usize,
}

const MIXTRAL: ExpertNames = ExpertNames {
    block: "block_sparse_moe",
    router: "gate",
    gate: "w1",
    up: "w3",
    down: "w2",
    stacked: false,
    biased: false,
};
const QWEN: ExpertNames = ExpertNames {
    block: "mlp",
    router: "gate",
    gate: "gate_proj",
    up: "up_proj",
    down: "down_proj",
    stacked: false,
    biased: false,
};
const GPT_OSS: ExpertNames = ExpertNames {
    block: "mlp",
    router: "router",
    gate: "gate_up_proj",
    up: "gate_up_proj",
    down: "down_proj",
    stacked: true,
    biased: true,
};

/// The MoE of `architecture`'s config, None for a dense family.
pub(super) fn options(
    architecture: Architecture,
    obj: &Map<String, Value>,
    num_layers: usize,
) -> Result<Option<Moe>> {
    let (names, norm_topk_prob, expert_intermediate) = match architecture {
        Architecture::Mixtral => (MIXTRAL, true, req_usize(obj, "intermediate_size")?),
        // A softmax over the chosen experts' logits: the renormalised top-k of the softmax.
        Architecture::GptOss => (GPT_OSS, true, req_usize(obj, "intermediate_size")?),
        Architecture::DeepseekV3 => {
            (QWEN, opt_bool(obj, "norm_topk_prob")?.unwrap_or(true), req_usize(obj, "moe_intermediate_size")?)
        }
        Architecture::Qwen3Moe => (
            QWEN,
            opt_bool(obj, "norm_topk_prob")?.unwrap_or(false),
            req_usize(obj, "moe_intermediate_size")?,
        ),
        _ => return Ok(None),
    };
    // transformers 5 writes `num_local_experts` for both; the Hub's Qwen3-MoE files say
    // `num_experts`.
    let num_experts = match (opt_usize(obj, "num_local_experts")?, architecture) {
        (Some(n), _) => n,
        (None, Architecture::DeepseekV3) => req_usize(obj, "n_routed_experts")?,
        (None, _) => req_usize(obj, "num_experts")?,
    };
    let top_k = req_usize(obj, "num_experts_per_tok")?;
    if num_experts == 0 || top_k == 0 || top_k > num_experts {
        return Err(Error::invalid(
            "num_experts_per_tok",
            format!("{top_k} of {num_experts} experts (1 to the number of experts)"),
        ));
    }
    if expert_intermediate == 0 {
        return Err(Error::invalid("moe_intermediate_size", "must be positive"));
    }
    let (mut grouped, mut shared_intermediate) = (None, 0);
    let layers = match architecture {
        Architecture::DeepseekV3 => {
            let (routing, shared, dense) = deepseek::routing(obj, num_experts, top_k)?;
            (grouped, shared_intermediate) = (Some(routing), shared);
            (0..num_layers).map(|i| i >= dense).collect()
        }
        Architecture::Qwen3Moe => {
            let step = opt_usize(obj, "decoder_sparse_step")?.unwrap_or(1);
            if step == 0 {
                return Err(Error::invalid("decoder_sparse_step", "must be positive"));
            }
            let dense = mlp_only_layers(obj, num_layers)?;
            (0..num_layers).map(|i| !dense.contains(&i) && (i + 1) % step == 0).collect()
        }
        _ => vec![true; num_layers],
    };
    Ok(Some(Moe {
        num_experts,
        top_k,
        expert_intermediate,
        norm_topk_prob,
        layers,
        names,
        grouped,
        shared_intermediate,
    }))
}

fn mlp_only_layers(obj: &Map<String, Value>, num_layers: usize) -> Result<Vec<usize>> {
    let Some(list) = obj.get("mlp_only_layers").filter(|v| !v.is_null()) else { return Ok(Vec::new()) };
    let list =
        list.as_array().ok_or_else(|| Error::invalid("mlp_only_layers", "expected a list of layers"))?;
    list.iter()
        .map(|v| match v.as_u64() {
            Some(i) if (i as usize) < num_layers => Ok(i as usize),
            _ => Err(Error::invalid("mlp_only_layers", format!("{v} is not a layer of {num_layers}"))),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use crate::{Architecture, ModelConfig};

    fn config(arch: &str, extra: &str) -> crate::Result<ModelConfig> {
        ModelConfig::from_json_str(&format!(
            r#"{{"architectures":["{arch}"],"hidden_size":32,"intermediate_size":48,
                "num_hidden_layers":4,"num_attention_heads":4,"num_key_value_heads":2,
                "vocab_size":64,"num_experts_per_tok":2{extra}}}"#
        ))
    }

    #[test]
    fn mixtral_routes_every_layer_and_renormalises() {
        let c = config("MixtralForCausalLM", r#","num_local_experts":8"#).unwrap();
        assert_eq!(c.architecture, Architecture::Mixtral);
        let moe = c.moe.unwrap();
        assert_eq!((moe.num_experts, moe.top_k, moe.expert_intermediate), (8, 2, 48));
        assert!(moe.norm_topk_prob && moe.layers.iter().all(|&l| l));
        assert_eq!(
            (moe.names.block, moe.names.gate, moe.names.up, moe.names.down),
            ("block_sparse_moe", "w1", "w3", "w2")
        );
    }

    #[test]
    fn qwen3_moe_layers_follow_the_sparse_step_and_the_dense_list() {
        let extra = r#","num_experts":4,"moe_intermediate_size":16,"decoder_sparse_step":2,"mlp_only_layers":[3],"norm_topk_prob":true"#;
        let c = config("Qwen3MoeForCausalLM", extra).unwrap();
        assert!(c.qk_norm);
        let moe = c.moe.unwrap();
        assert_eq!((moe.num_experts, moe.expert_intermediate), (4, 16));
        assert_eq!(moe.layers, [false, true, false, false]);
        assert!(moe.norm_topk_prob);
        assert!(config("LlamaForCausalLM", "").unwrap().moe.is_none());
    }

    #[test]
    fn impossible_routing_is_named() {
        for (arch, extra, key) in [
            ("MixtralForCausalLM", r#","num_local_experts":1"#, "num_experts_per_tok"),
            ("MixtralForCausalLM", "", "num_experts"),
            ("Qwen3MoeForCausalLM", r#","num_experts":4"#, "moe_intermediate_size"),
            (
                "Qwen3MoeForCausalLM",
                r#","num_experts":4,"moe_intermediate_size":8,"mlp_only_layers":[9]"#,
                "mlp_only_layers",
            ),
            (
                "Qwen3MoeForCausalLM",
                r#","num_experts":4,"moe_intermediate_size":8,"decoder_sparse_step":0"#,
                "decoder_sparse_step",
            ),
        ] {
            let e = config(arch, extra).unwrap_err().to_string();
            assert!(e.contains(key), "{arch} {extra}: {e}");
        }
    }
}
