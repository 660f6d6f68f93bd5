//! Plain enums every role names: where a rank runs and what dtype weights are in.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Where a rank runs its shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Device {
    #[default]
    Cpu,
    /// CUDA device ordinal.
    Cuda(usize),
}

impl Device {
    /// Parses "cpu", "cuda" (device 0) or "cuda:N".
    pub fn parse(text: &str) -> Result<Device> {
        let bad = || Error::invalid("device", format!("{text:?}: expected cpu, cuda or cuda:N"));
        match text {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            t => match t.strip_prefix("cuda:") {
                Some(n) => n.parse().map(Device::Cuda).map_err(|_| bad()),
                None => Err(bad()),
            },
        }
    }

    /// Its kind (`cuda:3` is cuda).
    pub fn kind(&self) -> DeviceKind {
        match self {
            Device::Cpu => DeviceKind::Cpu,
            Device::Cuda(_) => DeviceKind::Cuda,
        }
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// The device kind a deployment's ranks run on and a worker offers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    #[default]
    Cpu,
    Cuda,
}

impl DeviceKind {
    /// Parses "cpu" or "cuda" (any case).
    pub fn parse(text: &str) -> Result<DeviceKind> {
        match text.to_ascii_lowercase().as_str() {
            "cpu" => Ok(DeviceKind::Cpu),
            "cuda" => Ok(DeviceKind::Cuda),
            _ => Err(Error::invalid("device", format!("{text:?}: expected cpu or cuda"))),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            DeviceKind::Cpu => "cpu",
            DeviceKind::Cuda => "cuda",
        }
    }
}

impl std::fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Element types a checkpoint may store weights in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    F32,
    F16,
    BF16,
    /// int8 weight matrices of a checkpoint written by `strata model quantize`, each with
    /// an f32 `<name>_scale` per output row; never a model's compute dtype.
    I8,
}

impl DType {
    /// Parses "bf16", "f16" or "f32" (any case), or vLLM's and torch's spellings of them
    /// ("bfloat16", "float16", "half", "float32", "float").
    pub fn parse(text: &str) -> Result<DType> {
        match text.to_ascii_lowercase().as_str() {
            "bf16" | "bfloat16" => Ok(DType::BF16),
            "f16" | "fp16" | "float16" | "half" => Ok(DType::F16),
            "f32" | "fp32" | "float32" | "float" => Ok(DType::F32),
            other => Err(Error::invalid("dtype", format!("{other:?}: expected bf16, f16 or f32"))),
        }
    }

    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::I8 => 1,
        }
    }

    /// The name configs and flags use ("bf16").
    pub fn as_str(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I8 => "i8",
        }
    }

    /// The name safetensors uses ("BF16").
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::I8 => "I8",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_and_dtypes_parse_or_name_the_field() {
        assert_eq!(Device::parse("cuda:3").unwrap(), Device::Cuda(3));
        assert_eq!(Device::parse("cuda").unwrap().to_string(), "cuda:0");
        assert!(Device::parse("tpu").unwrap_err().to_string().contains("device"));
        assert_eq!(DType::parse("BF16").unwrap(), DType::BF16);
        // vLLM's --dtype spellings carry over.
        assert_eq!(DType::parse("bfloat16").unwrap(), DType::BF16);
        assert_eq!(DType::parse("half").unwrap(), DType::F16);
        assert_eq!(DType::parse("float32").unwrap(), DType::F32);
        assert!(DType::parse("int4").unwrap_err().to_string().contains("dtype"));
    }
}
