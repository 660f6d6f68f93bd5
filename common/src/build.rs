//! What a deployment's replicas are built from: one typed [`Build`], held by the serving
//! revision of a [`ModelSpec`](crate::cluster::ModelSpec), by every
//! [`Revision`](crate::rollout::Revision) and sent to the workers as their load.
//!
//! The registry keeps it as the flat JSON fields records have always had (`model_dir`,
//! `dtype` and `device` as text, empty for "the checkpoint's" and "any", `tp`, `pp`, `ep`,
//! `limits`), so records written before it load unchanged, and records it writes load in
//! coordinators that predate it.

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::device::{DType, DeviceKind};
use crate::error::{Error, Result};
use crate::shard::Parallelism;

/// Engine limits a deployment sets (0 = the worker's default).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineLimits {
    #[serde(default)]
    pub max_num_seqs: u32,
    #[serde(default)]
    pub max_batched_tokens: u32,
    /// KV cache bytes per rank (0: the worker's default).
    #[serde(default)]
    pub kv_cache_bytes: u64,
    /// Requests that may wait for a replica's sequence slots (0: the default, 256); they
    /// wait in the coordinators' fair-admission queues.
    #[serde(default)]
    pub max_waiting: u32,
    /// The longest sequence (prompt + output) a replica accepts (0: the model's context,
    /// less where the KV cache cannot hold it): vLLM's `--max-model-len`, per deployment.
    /// Left out of records while unset, so coordinators of the version before read them
    /// unchanged.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub max_model_len: u32,
}

impl EngineLimits {
    /// These limits with each nonzero one of `over` in place of its own.
    pub fn overlaid(&self, over: &EngineLimits) -> EngineLimits {
        EngineLimits {
            max_num_seqs: nonzero(over.max_num_seqs, self.max_num_seqs),
            max_batched_tokens: nonzero(over.max_batched_tokens, self.max_batched_tokens),
            kv_cache_bytes: nonzero(over.kv_cache_bytes, self.kv_cache_bytes),
            max_waiting: nonzero(over.max_waiting, self.max_waiting),
            max_model_len: nonzero(over.max_model_len, self.max_model_len),
        }
    }
}

fn is_zero(v: &u32) -> bool {
    *v == 0
}

/// `new` unless it is zero (unset), else `old`.
fn nonzero<T: Copy + PartialEq + Default>(new: T, old: T) -> T {
    if new == T::default() {
        old
    } else {
        new
    }
}

/// Most bytes of a deployment's chat template.
pub const MAX_CHAT_TEMPLATE: usize = 256 << 10;

/// What a deployment sets over its model's own chat files: read by the coordinators that
/// render its prompts and read its replies (workers ignore it). Left out of records while
/// unset, so coordinators of the version before read them unchanged.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatOverrides {
    /// A Jinja chat template's source, used instead of the model's ("": the model's).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub template: String,
    /// The format tool calls are read in, by vLLM's parser names ("": judged from the
    /// template).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub tool_call_parser: String,
}

impl ChatOverrides {
    pub fn is_empty(&self) -> bool {
        self.template.is_empty() && self.tool_call_parser.is_empty()
    }
}

/// What `ep` means where a record written before expert parallelism has none.
fn one() -> u32 {
    1
}

/// What a revision's replicas are built from: two revisions with equal builds serve the
/// same model the same way.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Build {
    /// HF model directory, as the workers see it.
    pub model_dir: String,
    /// Weights in memory (None: the checkpoint's own dtype).
    #[serde(default, with = "dtype_text")]
    pub dtype: Option<DType>,
    /// The device kind its ranks run on (None: any, as specs written before deployments
    /// named a device).
    #[serde(default, with = "device_text")]
    pub device: Option<DeviceKind>,
    pub tp: u32,
    pub pp: u32,
    /// Expert parallelism: 1, or `tp` (each rank of a stage holds whole experts).
    #[serde(default = "one")]
    pub ep: u32,
    #[serde(default)]
    pub limits: EngineLimits,
    #[serde(default, skip_serializing_if = "ChatOverrides::is_empty")]
    pub chat: ChatOverrides,
    /// Weight matrices quantized at load: "int8" (CPU workers), or "" for none.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub quantize: String,
}

/// What a request changes in a build: each field set replaces the build's.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BuildChange {
    pub model_dir: Option<String>,
    pub dtype: Option<DType>,
    pub device: Option<DeviceKind>,
    /// 0: unchanged.
    pub tp: u32,
    pub pp: u32,
    pub ep: u32,
    /// Each nonzero limit replaces the build's.
    pub limits: EngineLimits,
    /// Some("") goes back to the model's own.
    pub chat_template: Option<String>,
    pub tool_call_parser: Option<String>,
    /// Some("none") goes back to unquantized weights.
    pub quantize: Option<String>,
}

impl Build {
    /// A build of `model_dir` as a deployment asks for it: unset fields take their
    /// defaults (one rank, one stage, the checkpoint's dtype, `default_device`); `--ep N`
    /// alone means N ranks per stage.
    pub fn requested(change: BuildChange, default_device: Option<DeviceKind>) -> Build {
        let first = Build {
            model_dir: String::new(),
            dtype: None,
            device: default_device,
            tp: 1,
            pp: 1,
            ep: 1,
            limits: EngineLimits::default(),
            chat: ChatOverrides::default(),
            quantize: String::new(),
        };
        first.changed(change)
    }

    /// This build with `change` applied. Expert parallelism follows the stage's width: a
    /// build whose experts were split across its `tp` ranks keeps them split across the
    /// new `tp`, and `ep` alone sets `tp`.
    pub fn changed(&self, change: BuildChange) -> Build {
        let (tp, ep) = match (change.tp, change.ep) {
            (0, 0) => (self.tp, self.ep),
            (t, 0) => (t, if self.ep > 1 { t } else { 1 }),
            (0 | 1, e) if e > 1 => (e, e),
            (t, e) => (nonzero(t, self.tp), e),
        };
        Build {
            model_dir: change.model_dir.unwrap_or_else(|| self.model_dir.clone()),
            dtype: change.dtype.or(self.dtype),
            device: change.device.or(self.device),
            tp,
            pp: nonzero(change.pp, self.pp),
            ep,
            limits: self.limits.overlaid(&change.limits),
            chat: ChatOverrides {
                template: change.chat_template.unwrap_or_else(|| self.chat.template.clone()),
                tool_call_parser: change
                    .tool_call_parser
                    .unwrap_or_else(|| self.chat.tool_call_parser.clone()),
            },
            quantize: match change.quantize.as_deref() {
                None => self.quantize.clone(),
                Some("none") => String::new(),
                Some(q) => q.to_string(),
            },
        }
    }

    pub fn parallelism(&self) -> Parallelism {
        Parallelism { tp: self.tp as usize, pp: self.pp as usize, ep: self.ep.max(1) as usize }
    }

    pub fn world(&self) -> usize {
        self.parallelism().world()
    }

    /// Checks what replicas are built from; names the bad field.
    pub fn validate(&self) -> Result<()> {
        if self.model_dir.is_empty() {
            return Err(Error::invalid("model_dir", "must name the model directory the workers load"));
        }
        if self.dtype == Some(DType::I8) {
            return Err(Error::invalid("dtype", "i8: expected bf16, f16, f32 or empty"));
        }
        if self.tp == 0 || self.pp == 0 {
            return Err(Error::invalid(if self.tp == 0 { "tp" } else { "pp" }, "must be at least 1"));
        }
        if self.ep > 1 && self.ep != self.tp {
            return Err(Error::invalid("ep", format!("{} with tp {}: ep is 1 or tp", self.ep, self.tp)));
        }
        if self.world() > 1024 {
            return Err(Error::invalid("tp", format!("tp × pp = {} ranks is more than 1024", self.world())));
        }
        match self.quantize.as_str() {
            "" => {}
            "int8" if self.device == Some(DeviceKind::Cuda) => {
                return Err(Error::invalid("quantize", "int8 runs on CPU workers; deploy to device cpu"));
            }
            "int8" => {}
            other => return Err(Error::invalid("quantize", format!("{other:?}: give int8 or none"))),
        }
        if self.chat.template.len() > MAX_CHAT_TEMPLATE {
            return Err(Error::invalid(
                "chat_template",
                format!("{} bytes; at most {MAX_CHAT_TEMPLATE}", self.chat.template.len()),
            ));
        }
        // A file named by mistake (a key, a config) must not be shipped and served as one.
        if !self.chat.template.is_empty() && !self.chat.template.contains("messages") {
            return Err(Error::invalid(
                "chat_template",
                "not a chat template: it never reads `messages` (is it the file you meant?)",
            ));
        }
        Ok(())
    }

    /// Whether a worker of `kind` may hold one of its ranks.
    pub fn runs_on(&self, kind: DeviceKind) -> bool {
        self.device.is_none_or(|d| d == kind)
    }
}

/// `Option<DType>` as the registry spells it: "bf16", "f16", "f32"; "" for None.
mod dtype_text {
    use super::*;

    pub fn serialize<S: Serializer>(v: &Option<DType>, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(v.map_or("", DType::as_str))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<Option<DType>, D::Error> {
        let text = String::deserialize(d)?;
        match text.as_str() {
            "" => Ok(None),
            t => DType::parse(t).map(Some).map_err(serde::de::Error::custom),
        }
    }
}

/// `Option<DeviceKind>` as the registry spells it: "cpu", "cuda"; "" for None.
mod device_text {
    use super::*;

    pub fn serialize<S: Serializer>(v: &Option<DeviceKind>, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(v.map_or("", DeviceKind::as_str))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<Option<DeviceKind>, D::Error> {
        let text = String::deserialize(d)?;
        match text.as_str() {
            "" => Ok(None),
            t => DeviceKind::parse(t).map(Some).map_err(serde::de::Error::custom),
        }
    }
}

#[cfg(test)]
mod tests;
