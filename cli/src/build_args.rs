//! What a revision is built from, as `strata admin deploy` and `strata admin rollout`
//! take it (one set of flags for both) and show it.

use anyhow::Context;
use strata_common::{wire, DType, DeviceKind};
use strata_proto::admin::v1 as pb;

/// The build flags: each one left out is the default (deploy) or the serving revision's
/// (rollout).
#[derive(clap::Args, Debug, Default)]
pub struct BuildArgs {
    /// Tensor-parallel ranks per pipeline stage [deploy: 1].
    #[arg(long)]
    pub tp: Option<u32>,
    /// Pipeline stages [deploy: 1].
    #[arg(long)]
    pub pp: Option<u32>,
    /// Expert parallelism for a mixture of experts: each MoE layer's experts split across
    /// this many ranks of a stage (with --tp left out, it sets --tp).
    #[arg(long)]
    pub ep: Option<u32>,
    /// Weights in memory: bf16, f16 or f32 [deploy: auto, the checkpoint's].
    #[arg(long, value_parser = parse_dtype)]
    pub dtype: Option<pb::DataType>,
    /// cpu or cuda: ranks go only to workers of this kind with room for their shard and
    /// KV cache [deploy: the coordinator's default_device].
    #[arg(long, value_parser = parse_device)]
    pub device: Option<pb::DeviceKind>,
    /// Most sequences per engine step [deploy: the worker's default].
    #[arg(long)]
    pub max_num_seqs: Option<u32>,
    /// Most tokens per engine step [deploy: the worker's default].
    #[arg(long)]
    pub max_batched_tokens: Option<u32>,
    /// KV cache per rank, e.g. 512MiB [deploy: the worker's].
    #[arg(long)]
    pub kv_cache_memory: Option<String>,
    /// Requests that may wait per replica, in the coordinators' fair-admission queues
    /// [deploy: 256].
    #[arg(long)]
    pub max_waiting: Option<u32>,
    /// The longest sequence (prompt + output) a replica accepts [deploy: the model's
    /// context, less where the KV cache cannot hold it].
    #[arg(long)]
    pub max_model_len: Option<u32>,
    /// A Jinja chat template file the coordinators render this deployment's chat prompts
    /// with, instead of the model's ('' goes back to the model's own) [deploy: the model's].
    #[arg(long, value_name = "FILE")]
    pub chat_template: Option<std::path::PathBuf>,
    /// The format tool calls are read in: hermes, llama3_json, mistral, deepseek_v3 or
    /// openai ('' goes back to judging from the template) [deploy: from the template].
    #[arg(long)]
    pub tool_call_parser: Option<String>,
    /// Quantize weight matrices at load: int8 (CPU workers: one scale per output channel,
    /// half the bytes of bf16) or none [deploy: none].
    #[arg(long, value_parser = ["int8", "none"])]
    pub quantize: Option<String>,
}

fn parse_dtype(s: &str) -> Result<pb::DataType, String> {
    if s.is_empty() || s.eq_ignore_ascii_case("auto") {
        return Ok(pb::DataType::Unspecified);
    }
    Ok(wire::data_type_to_pb(Some(DType::parse(s).map_err(|e| e.to_string())?)))
}

fn parse_device(s: &str) -> Result<pb::DeviceKind, String> {
    Ok(wire::device_kind_to_pb(Some(DeviceKind::parse(s).map_err(|e| e.to_string())?)))
}

impl BuildArgs {
    /// Whether any flag is given.
    pub fn any(&self) -> bool {
        let Self {
            tp,
            pp,
            ep,
            dtype,
            device,
            max_num_seqs,
            max_batched_tokens,
            kv_cache_memory,
            max_waiting,
            max_model_len,
            chat_template,
            tool_call_parser,
            quantize,
        } = self;
        [tp, pp, ep, max_num_seqs, max_batched_tokens, max_waiting, max_model_len].iter().any(|v| v.is_some())
            || dtype.is_some()
            || device.is_some()
            || kv_cache_memory.is_some()
            || chat_template.is_some()
            || tool_call_parser.is_some()
            || quantize.is_some()
    }

    /// The request's `Build` of `model_dir` (empty: unchanged); unset fields are 0.
    pub fn to_pb(&self, model_dir: Option<String>) -> anyhow::Result<pb::Build> {
        let kv_cache_bytes = match &self.kv_cache_memory {
            Some(m) => strata_common::config::parse_memory(m).context("--kv-cache-memory")? as u64,
            None => 0,
        };
        Ok(pb::Build {
            model_dir: model_dir.unwrap_or_default(),
            dtype: self.dtype.unwrap_or_default().into(),
            device: self.device.unwrap_or_default().into(),
            tp: self.tp.unwrap_or(0),
            pp: self.pp.unwrap_or(0),
            ep: self.ep.unwrap_or(0),
            scheduler: Some(pb::SchedulerLimits {
                max_num_seqs: self.max_num_seqs.unwrap_or(0),
                max_batched_tokens: self.max_batched_tokens.unwrap_or(0),
                kv_cache_bytes,
                max_waiting: self.max_waiting.unwrap_or(0),
                max_model_len: self.max_model_len.unwrap_or(0),
            }),
            chat_template: match &self.chat_template {
                None => String::new(),
                Some(p) if p.as_os_str().is_empty() => " ".into(),
                Some(p) => read_template(p)?,
            },
            tool_call_parser: match self.tool_call_parser.as_deref() {
                None => String::new(),
                Some("") => " ".into(),
                Some(name) => name.to_string(),
            },
            quantize: self.quantize.clone().unwrap_or_default(),
        })
    }
}

/// A chat template file's text, bounded as the coordinators bound it.
fn read_template(path: &std::path::Path) -> anyhow::Result<String> {
    let bytes = strata_common::files::read_bounded(path, strata_common::build::MAX_CHAT_TEMPLATE as u64)
        .with_context(|| format!("--chat-template {}", path.display()))?;
    let text =
        String::from_utf8(bytes).with_context(|| format!("--chat-template {}: not UTF-8", path.display()))?;
    if text.trim().is_empty() {
        anyhow::bail!("--chat-template {}: the file is empty", path.display());
    }
    Ok(text)
}

/// A build as a status shows it: dtype and device as text ("" for unspecified).
pub struct Shown {
    pub model_dir: String,
    pub dtype: String,
    pub device: String,
    pub tp: u32,
    pub pp: u32,
    pub ep: u32,
    pub scheduler: pb::SchedulerLimits,
    /// "int8", or "" for none.
    pub quantize: String,
}

impl Shown {
    /// A status's `build`, or (from a coordinator that predates it) its flat fields.
    fn of(b: Option<&pb::Build>, flat: Shown) -> Shown {
        let Some(b) = b else { return flat };
        let text = |v: Result<Option<&'static str>, _>| v.map_or("?", |t| t.unwrap_or("")).to_string();
        let dtype = text(wire::data_type_from_pb(b.dtype).map(|d| d.map(DType::as_str)));
        let device = text(wire::device_kind_from_pb(b.device).map(|d| d.map(DeviceKind::as_str)));
        Shown {
            model_dir: b.model_dir.clone(),
            dtype,
            device,
            tp: b.tp,
            pp: b.pp,
            ep: b.ep,
            scheduler: b.scheduler.unwrap_or_default(),
            quantize: b.quantize.clone(),
        }
    }

    pub fn model(m: &pb::ModelStatus) -> Shown {
        let flat = Shown {
            model_dir: m.model_dir.clone(),
            dtype: m.dtype.clone(),
            device: m.device.clone(),
            tp: m.tp,
            pp: m.pp,
            ep: m.ep,
            scheduler: m.scheduler.unwrap_or_default(),
            quantize: String::new(),
        };
        Shown::of(m.build.as_ref(), flat)
    }

    pub fn revision(v: &pb::RevisionStatus) -> Shown {
        let flat = Shown {
            model_dir: v.model_dir.clone(),
            dtype: v.dtype.clone(),
            device: v.device.clone(),
            tp: v.tp,
            pp: v.pp,
            ep: v.ep,
            scheduler: v.scheduler.unwrap_or_default(),
            quantize: String::new(),
        };
        Shown::of(v.build.as_ref(), flat)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_left_out_are_zero_and_given_ones_are_typed() {
        let none = BuildArgs::default();
        assert!(!none.any());
        let b = none.to_pb(None).unwrap();
        assert_eq!((b.tp, b.dtype, b.device, b.model_dir.as_str()), (0, 0, 0, ""));
        let some = BuildArgs {
            dtype: Some(parse_dtype("BF16").unwrap()),
            device: Some(parse_device("cuda").unwrap()),
            kv_cache_memory: Some("1MiB".into()),
            max_model_len: Some(300),
            ..Default::default()
        };
        assert!(some.any());
        let b = some.to_pb(Some("/m".into())).unwrap();
        assert_eq!((b.dtype(), b.device()), (pb::DataType::Bf16, pb::DeviceKind::Cuda));
        let limits = b.scheduler.unwrap();
        assert_eq!((limits.kv_cache_bytes, limits.max_model_len), (1 << 20, 300));
        assert_eq!(parse_dtype("auto").unwrap(), pb::DataType::Unspecified);
        assert!(parse_dtype("int4").unwrap_err().contains("dtype"));
        assert!(parse_device("tpu").unwrap_err().contains("device"));
        let shown =
            Shown::model(&pb::ModelStatus { build: Some(b), dtype: "old".into(), ..Default::default() });
        assert_eq!(
            (shown.dtype.as_str(), shown.device.as_str()),
            ("bf16", "cuda"),
            "build wins over flat fields"
        );
    }
}
