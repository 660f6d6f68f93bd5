//! `quantization_config`: the formats a checkpoint's weights may be stored in.
//!
//! Strata's own int8 (`strata model quantize`) loads as int8. FP8 with block scales
//! (`quant_method: "fp8"`, DeepSeek-V3/R1, Qwen3-FP8) and gpt-oss's MXFP4 experts are
//! dequantized at load to the model's dtype (the engine's `model::dequant`). Any other
//! format (GPTQ, AWQ, bitsandbytes, compressed-tensors, ...) is refused by name: its
//! weights would otherwise be read as if they were plain.

use serde_json::{Map, Value};

use super::Architecture;
use crate::error::{Error, Result};

/// Checks `quantization_config`; for FP8 returns its scale blocks.
pub(super) fn check(obj: &Map<String, Value>, arch: Architecture) -> Result<Option<[usize; 2]>> {
    let Some(q) = obj.get("quantization_config").filter(|v| !v.is_null()) else { return Ok(None) };
    match q.get("quant_method").and_then(|m| m.as_str()) {
        Some("strata-int8") => Ok(None),
        Some("mxfp4") if arch == Architecture::GptOss => Ok(None),
        Some("mxfp4") => Err(Error::Unsupported(format!(
            "quantization_config.quant_method \"mxfp4\" for {arch:?} (MXFP4 is read for gpt-oss's experts)"
        ))),
        Some("fp8") => fp8_block(q).map(Some),
        Some(method) => Err(Error::Unsupported(format!(
            "quantization_config.quant_method {method:?} (supported: strata-int8, fp8 with \
             weight_block_size, and mxfp4 for gpt-oss; a checkpoint dequantized to bf16 — \
             transformers' save_pretrained after loading with dequantization — loads, and \
             `--quantize int8` or `strata model quantize` shrinks it)"
        ))),
        None => Err(Error::invalid("quantization_config.quant_method", "missing")),
    }
}

/// FP8's `weight_block_size` (two positive sizes) and `fmt` (E4M3 only).
fn fp8_block(q: &Value) -> Result<[usize; 2]> {
    if let Some(fmt) = q.get("fmt").filter(|f| !f.is_null()) {
        if fmt.as_str() != Some("e4m3") {
            return Err(Error::Unsupported(format!("quantization_config.fmt {fmt} (supported: e4m3)")));
        }
    }
    let sizes: Option<Vec<usize>> = q
        .get("weight_block_size")
        .and_then(|b| b.as_array())
        .map(|b| b.iter().filter_map(|v| v.as_u64().filter(|&n| n > 0).map(|n| n as usize)).collect());
    match sizes.as_deref() {
        Some(&[rows, cols]) => Ok([rows, cols]),
        _ => Err(Error::invalid(
            "quantization_config.weight_block_size",
            "expected two positive sizes (per-tensor FP8 scales are not read)",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check_json(arch: Architecture, q: &str) -> Result<Option<[usize; 2]>> {
        let obj: Value = serde_json::from_str(&format!(r#"{{"quantization_config":{q}}}"#)).unwrap();
        check(obj.as_object().unwrap(), arch)
    }

    #[test]
    fn formats_read_load_and_others_are_refused_by_name() {
        let ds = Architecture::DeepseekV3;
        let fp8 = r#"{"quant_method":"fp8","fmt":"e4m3","activation_scheme":"dynamic","weight_block_size":[128,128]}"#;
        assert_eq!(check_json(ds, fp8).unwrap(), Some([128, 128]));
        assert_eq!(check_json(Architecture::GptOss, r#"{"quant_method":"mxfp4"}"#).unwrap(), None);
        for (arch, q, named) in [
            (ds, r#"{"quant_method":"mxfp4"}"#, "mxfp4"),
            (ds, r#"{"quant_method":"fp8","weight_block_size":[128]}"#, "weight_block_size"),
            (ds, r#"{"quant_method":"fp8"}"#, "weight_block_size"),
            (ds, r#"{"quant_method":"fp8","fmt":"e5m2","weight_block_size":[1,1]}"#, "e5m2"),
            (ds, r#"{"quant_method":"gptq","bits":4}"#, "gptq"),
            (ds, r#"{"bits":4}"#, "quant_method"),
        ] {
            let e = check_json(arch, q).unwrap_err().to_string();
            assert!(e.contains(named), "{q}: {e}");
        }
    }
}
