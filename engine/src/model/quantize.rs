//! `strata model quantize`: an int8 copy of a checkpoint.
//!
//! Every weight matrix (2-D tensor) is quantized exactly as `--quantize int8` does at load
//! (symmetric, one scale per output row, `max |w| / 127`) and stored as an `I8` tensor of
//! the same name beside an `F32` `<name>_scale` of one value per row; 1-D tensors (norms,
//! biases) are copied as they are. The directory's other files are copied, and
//! config.json gains a `quantization_config` that says so. Loading the copy gives the
//! same numbers as quantizing at load, from half the bytes of bf16 on disk and without
//! mapping the wider checkpoint.

use std::path::Path;

use safetensors::tensor::TensorView;
use strata_common::{Error, Result};

use super::weights::Checkpoint;
use crate::backend::cpu::CpuWeight;
use crate::tensor::DType;

/// What [`write_int8`] wrote.
#[derive(Debug, Clone, serde::Serialize)]
pub struct QuantizeReport {
    pub matrices: usize,
    pub other_tensors: usize,
    pub bytes_in: usize,
    pub bytes_out: usize,
}

/// Writes an int8 copy of the model in `src` to `dst`; `progress(done, total)` after each
/// tensor.
pub fn write_int8(src: &Path, dst: &Path, mut progress: impl FnMut(usize, usize)) -> Result<QuantizeReport> {
    let same =
        |a: &Path, b: &Path| a.canonicalize().ok().zip(b.canonicalize().ok()).is_some_and(|(a, b)| a == b);
    if same(src, dst) {
        return Err(Error::invalid("out", "is the model directory itself; give a new directory"));
    }
    let ckpt = Checkpoint::open(src)?;
    if ckpt.has_packed() {
        return Err(Error::Unsupported(
            "quantizing a checkpoint stored in FP8 or MXFP4: serve it with `--quantize int8` \
             (its weights are dequantized at load, then quantized)"
                .into(),
        ));
    }
    let mut names: Vec<&str> = ckpt.names().collect();
    names.sort_unstable();
    let mut out: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    let mut report = QuantizeReport { matrices: 0, other_tensors: 0, bytes_in: 0, bytes_out: 0 };
    for (i, name) in names.iter().enumerate() {
        let t = ckpt.tensor(name)?;
        report.bytes_in += t.bytes().len();
        if t.dtype == DType::I8 || name.ends_with("_scale") {
            return Err(Error::model_file(src, format!("{name:?}: this checkpoint is already quantized")));
        }
        if t.shape.len() == 2 {
            let w = CpuWeight::from_host(&t)?.quantized_int8();
            let (q, scales) =
                w.int8_parts().ok_or_else(|| Error::Internal("int8 weight without parts".into()))?;
            out.push((
                name.to_string(),
                safetensors::Dtype::I8,
                t.shape.clone(),
                bytemuck::cast_slice(q).to_vec(),
            ));
            let scale_bytes = bytemuck::cast_slice(scales).to_vec();
            out.push((format!("{name}_scale"), safetensors::Dtype::F32, vec![t.shape[0]], scale_bytes));
            report.matrices += 1;
        } else {
            let dtype = match t.dtype {
                DType::F32 => safetensors::Dtype::F32,
                DType::F16 => safetensors::Dtype::F16,
                DType::BF16 => safetensors::Dtype::BF16,
                DType::I8 => safetensors::Dtype::I8,
            };
            out.push((name.to_string(), dtype, t.shape.clone(), t.bytes().to_vec()));
            report.other_tensors += 1;
        }
        progress(i + 1, names.len());
    }
    report.bytes_out = out.iter().map(|t| t.3.len()).sum();
    std::fs::create_dir_all(dst).map_err(|e| Error::model_file(dst, format!("cannot create: {e}")))?;
    copy_other_files(src, dst)?;
    let views = out
        .iter()
        .map(|(name, dtype, shape, data)| Ok((name.as_str(), TensorView::new(*dtype, shape.clone(), data)?)))
        .collect::<std::result::Result<Vec<_>, safetensors::SafeTensorError>>()
        .map_err(|e| Error::Internal(format!("int8 tensor views: {e}")))?;
    let path = dst.join("model.safetensors");
    safetensors::serialize_to_file(views, None, &path)
        .map_err(|e| Error::model_file(&path, format!("cannot write: {e}")))?;
    Ok(report)
}

/// Copies the files of `src` that are not weights (config, tokenizer, templates) to `dst`,
/// adding `quantization_config` to config.json.
fn copy_other_files(src: &Path, dst: &Path) -> Result<()> {
    let io = |path: &Path, e: std::io::Error| Error::model_file(path, format!("{e}"));
    for entry in std::fs::read_dir(src).map_err(|e| io(src, e))? {
        let path = entry.map_err(|e| io(src, e))?.path();
        let name = path.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
        if !path.is_file() || name.ends_with(".safetensors") || name == "model.safetensors.index.json" {
            continue;
        }
        let target = dst.join(&name);
        if name == "config.json" {
            let text = std::fs::read_to_string(&path).map_err(|e| io(&path, e))?;
            let mut config: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| Error::model_file(&path, format!("invalid JSON: {e}")))?;
            let Some(obj) = config.as_object_mut() else {
                return Err(Error::model_file(&path, "is not a JSON object"));
            };
            obj.insert(
                "quantization_config".into(),
                serde_json::json!({
                    "quant_method": "strata-int8",
                    "bits": 8,
                    "scheme": "symmetric, one f32 scale per output row in <name>_scale",
                }),
            );
            let text = serde_json::to_string_pretty(&config).map_err(|e| Error::Internal(e.to_string()))?;
            std::fs::write(&target, text).map_err(|e| io(&target, e))?;
        } else {
            std::fs::copy(&path, &target).map_err(|e| io(&target, e))?;
        }
    }
    Ok(())
}
