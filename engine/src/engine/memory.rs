//! How much memory the KV cache gets: a size (`--kv-cache-memory`), or what a fraction of
//! the device's memory leaves once the weights are loaded (`--gpu-memory-utilization`,
//! vLLM's meaning: the fraction covers weights, activations and the cache together).

use strata_common::model_config::ModelConfig;
use strata_common::{Device, Error, Result};
use tracing::info;

use super::EngineConfig;
use crate::scheduler::SchedulerConfig;

/// Bytes a device keeps for what the estimate of activations does not count: on a GPU the
/// BLAS workspaces, CUDA graphs and collective buffers; on the CPU the thread pools' stacks
/// and scratch.
const FIXED_RESERVE_GPU: u64 = 512 << 20;
const FIXED_RESERVE_CPU: u64 = 64 << 20;

/// Most bytes of logits a prompt-logprobs chunk holds (engine/prompt.rs bounds it).
const PROMPT_LOGITS: u64 = 32 << 20;

/// A KV cache in host memory must fit in what the machine has available: asking for more
/// is an error naming the setting, never an allocation that aborts the process.
pub(super) fn check_kv_memory(config: &EngineConfig, kv_bytes: usize) -> Result<()> {
    if config.backend.device != Device::Cpu {
        return Ok(()); // device memory: the device's allocator answers with an error
    }
    match strata_common::host::available_memory() {
        Some(avail) if kv_bytes as u64 > avail => Err(Error::invalid(
            "kv_cache_memory",
            format!("{kv_bytes} bytes exceed the {avail} bytes of memory this machine has available"),
        )),
        _ => Ok(()),
    }
}

/// The KV cache's bytes on each rank: `kv_cache_bytes`, or with a memory utilization, the
/// share of `fraction × total` left after what the device already holds (this process's
/// weights among it) and the activations' peak. On the CPU the ranks of a replica built in
/// this process share the host, so `ranks_sharing` of them split what is left.
pub(super) fn kv_cache_bytes(
    config: &EngineConfig,
    model: &ModelConfig,
    ranks_sharing: usize,
) -> Result<usize> {
    let Some(fraction) = config.memory_utilization else { return Ok(config.kv_cache_bytes) };
    let (free, total) = crate::backend::device_memory(config.backend.device)?;
    let budget = Budget {
        fraction,
        total,
        used: total.saturating_sub(free),
        reserve: activation_bytes(model, &config.scheduler, config.backend.device),
    };
    let bytes = budget.kv_bytes(ranks_sharing.max(1))?;
    info!(
        fraction,
        total_bytes = total,
        in_use_bytes = budget.used,
        reserved_bytes = budget.reserve,
        kv_cache_bytes = bytes,
        "KV cache sized by the memory utilization: {:.1} GiB of {:.1} GiB",
        bytes as f64 / GIB,
        total as f64 / GIB
    );
    Ok(bytes)
}

const GIB: f64 = (1u64 << 30) as f64;

/// What a fraction of a device's memory leaves for the KV cache.
#[derive(Debug, Clone, Copy)]
struct Budget {
    fraction: f64,
    total: u64,
    /// Bytes in use on the device now (the weights just loaded among them).
    used: u64,
    /// Bytes kept for activations and workspaces.
    reserve: u64,
}

impl Budget {
    fn kv_bytes(&self, ranks_sharing: usize) -> Result<usize> {
        let cap = (self.total as f64 * self.fraction) as u64;
        let left = cap.saturating_sub(self.used).saturating_sub(self.reserve);
        if left == 0 {
            return Err(Error::invalid(
                "gpu_memory_utilization",
                format!(
                    "{} of the device's {:.2} GiB is {:.2} GiB, and {:.2} GiB is already in use (the weights among it) with {:.2} GiB kept for activations: nothing is left for the KV cache; raise the fraction or give --kv-cache-memory",
                    self.fraction,
                    self.total as f64 / GIB,
                    cap as f64 / GIB,
                    self.used as f64 / GIB,
                    self.reserve as f64 / GIB,
                ),
            ));
        }
        Ok(usize::try_from(left / ranks_sharing as u64).unwrap_or(usize::MAX))
    }
}

/// An upper estimate of a step's transient memory: the hidden states, attention and MLP
/// intermediates of a full token budget in f32, the sampled rows' logits, a prompt-logprobs
/// chunk, and a fixed reserve for workspaces.
fn activation_bytes(model: &ModelConfig, scheduler: &SchedulerConfig, device: Device) -> u64 {
    let mlp = match &model.moe {
        Some(moe) => {
            (moe.expert_intermediate * moe.top_k + moe.shared_intermediate).max(model.intermediate_size)
        }
        None => model.intermediate_size,
    };
    let attention = (model.num_heads + 2 * model.num_kv_heads) * model.head_dim;
    let per_token = 4 * model.hidden_size + attention + 3 * mlp;
    let tokens = scheduler.max_batched_tokens as u64;
    let logits = scheduler.max_num_seqs.max(1) as u64 * model.vocab_size as u64;
    let fixed = if device == Device::Cpu { FIXED_RESERVE_CPU } else { FIXED_RESERVE_GPU };
    4 * (tokens * per_token as u64 + logits) + PROMPT_LOGITS + fixed
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: u64 = 1 << 30;

    #[test]
    fn the_fraction_covers_weights_and_activations_before_the_cache() {
        let b = Budget { fraction: 0.9, total: 80 * G, used: 16 * G, reserve: 2 * G };
        // 72 GiB under the fraction, 16 held, 2 kept: 54 GiB for the cache.
        assert_eq!(b.kv_bytes(1).unwrap() as u64, 54 * G);
        // Two ranks on one host split it.
        assert_eq!(b.kv_bytes(2).unwrap() as u64, 27 * G);
    }

    #[test]
    fn a_fraction_the_weights_already_exceed_is_an_error_naming_it() {
        let b = Budget { fraction: 0.2, total: 80 * G, used: 16 * G, reserve: 2 * G };
        let e = b.kv_bytes(1).unwrap_err().to_string();
        assert!(e.contains("gpu_memory_utilization") && e.contains("--kv-cache-memory"), "{e}");
    }

    #[test]
    fn activations_grow_with_the_token_budget_and_the_vocabulary() {
        let model = ModelConfig::from_json_str(
            r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "vocab_size": 256, "max_position_embeddings": 128, "rms_norm_eps": 1e-5}"#,
        )
        .unwrap();
        let small = SchedulerConfig { max_batched_tokens: 64, ..Default::default() };
        let big = SchedulerConfig { max_batched_tokens: 4096, ..Default::default() };
        let a = activation_bytes(&model, &small, Device::Cpu);
        let b = activation_bytes(&model, &big, Device::Cpu);
        assert!(a > FIXED_RESERVE_CPU + PROMPT_LOGITS && b > a, "{a} {b}");
        assert!(activation_bytes(&model, &small, Device::Cuda(0)) > a);
    }
}
