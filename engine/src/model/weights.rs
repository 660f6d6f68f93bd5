//! Memory-mapped safetensors checkpoints.
//!
//! Opens `model.safetensors` or the shards listed in `model.safetensors.index.json`,
//! maps each file read-only and indexes its tensors by name. A [`HostTensor`] is a view
//! into a mapping: nothing is copied until a backend decides to, so a rank that touches
//! only its slices only ever pages those in. Every failure names the file and tensor.
//!
//! Weights stored quantized in the formats models are published in — FP8 (E4M3) with
//! block scales (DeepSeek-V3, Qwen3-FP8) and MXFP4 experts (gpt-oss) — are read through
//! [`super::dequant`]: `get` returns them dequantized to the model's dtype, as
//! transformers does when it loads them with `dequantize=True`; their raw bytes never
//! reach a backend.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use strata_common::{Error, Result};

use crate::tensor::{DType, HostTensor};

/// All tensors of a checkpoint, by name.
pub struct Checkpoint {
    tensors: HashMap<String, HostTensor>,
    /// Tensors in a quantized storage format, their bytes carried as I8 (see `Packed`).
    packed: HashMap<String, (Packed, HostTensor)>,
    /// FP8 weights' scale blocks (`quantization_config.weight_block_size`).
    fp8_block: Option<[usize; 2]>,
    dir: PathBuf,
}

/// A storage format read only through dequantization.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Packed {
    /// Bytes (MXFP4 blocks and scales).
    U8,
    /// FP8 E4M3 values.
    F8E4M3,
}

impl Checkpoint {
    /// Opens the safetensors files of a model directory.
    pub fn open(dir: &Path) -> Result<Self> {
        let index = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        let files: Vec<PathBuf> = if index.exists() {
            let text = strata_common::files::read_text(&index, strata_common::files::MAX_JSON_FILE)?;
            let value: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| Error::model_file(&index, format!("invalid JSON: {e}")))?;
            let map = value
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| Error::model_file(&index, "missing object \"weight_map\""))?;
            let mut files: Vec<PathBuf> = Vec::new();
            for (name, file) in map {
                let file = file.as_str().ok_or_else(|| {
                    Error::model_file(&index, format!("weight_map[{name:?}] is not a file name"))
                })?;
                let path = dir.join(file);
                if !files.contains(&path) {
                    files.push(path);
                }
            }
            files
        } else if single.exists() {
            vec![single]
        } else {
            return Err(Error::model_file(
                dir,
                "no model.safetensors or model.safetensors.index.json in this directory",
            ));
        };
        let (mut tensors, mut packed) = (HashMap::new(), HashMap::new());
        for file in files {
            for (t, kind) in read_file(&file)? {
                match kind {
                    Some(kind) => {
                        packed.insert(t.name.clone(), (kind, t));
                    }
                    None => {
                        tensors.insert(t.name.clone(), t);
                    }
                }
            }
        }
        Ok(Checkpoint { tensors, packed, fp8_block: None, dir: dir.to_owned() })
    }

    /// Bytes of every tensor as loaded: FP8 and MXFP4 weights at the model's dtype, their
    /// scales not at all (what placement's estimate from config.json must equal).
    pub fn loaded_bytes(&self) -> u64 {
        let dtype = self.model_dtype().size() as u64;
        let scale_of_packed =
            |n: &str| n.strip_suffix("_scale_inv").is_some_and(|w| self.packed.contains_key(w));
        let plain: u64 = self
            .tensors
            .iter()
            .filter(|(n, _)| !scale_of_packed(n))
            .map(|(_, t)| t.bytes().len() as u64)
            .sum();
        let packed: u64 = self
            .packed
            .iter()
            .map(|(name, (kind, t))| match kind {
                Packed::F8E4M3 => t.numel() as u64 * dtype,
                Packed::U8 if name.ends_with("_blocks") => t.numel() as u64 * 2 * dtype,
                Packed::U8 => 0,
            })
            .sum();
        plain + packed
    }

    /// Whether some weights are stored quantized (FP8, MXFP4).
    pub fn has_packed(&self) -> bool {
        !self.packed.is_empty()
    }

    /// FP8 weights' scale blocks, `[rows, columns]` (from the model config).
    pub fn set_fp8_block(&mut self, block: Option<[usize; 2]>) {
        self.fp8_block = block;
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name) || self.packed.contains_key(name)
    }

    /// Names of every tensor, in no particular order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// The tensor `name`, whatever its shape.
    pub fn tensor(&self, name: &str) -> Result<HostTensor> {
        match self.tensors.get(name) {
            Some(t) => Ok(t.clone()),
            None => self.dequantized(name),
        }
    }

    /// Checks that tensor `name` has the shape the model config implies, without reading or
    /// dequantizing it: call it before sizing anything by a config's dimensions (a config
    /// value of 10⁹ must be a shape error, not a 8 GB allocation).
    pub fn check_shape(&self, name: &str, shape: &[usize]) -> Result<()> {
        let t = match (self.tensors.get(name), self.packed.get(name)) {
            (Some(t), _) | (None, Some((_, t))) => t,
            (None, None) => {
                return Err(Error::model_file(
                    &self.dir,
                    format!("tensor {name:?} is missing from the checkpoint"),
                ))
            }
        };
        if t.shape != shape {
            return Err(Error::model_file(
                t.file.as_path(),
                format!("tensor {name:?} has shape {:?}, config.json implies {shape:?}", t.shape),
            ));
        }
        Ok(())
    }

    /// The tensor `name`, checked against the shape the model config implies.
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<HostTensor> {
        let owned;
        let t = match self.tensors.get(name) {
            Some(t) => t,
            None => {
                owned = self.dequantized(name)?;
                &owned
            }
        };
        if t.shape != shape {
            return Err(Error::model_file(
                t.file.as_path(),
                format!("tensor {name:?} has shape {:?}, config.json implies {shape:?}", t.shape),
            ));
        }
        Ok(t.clone())
    }
}

impl Checkpoint {
    /// The model's dtype: its embedding's (what dequantized weights are stored as).
    pub fn model_dtype(&self) -> DType {
        self.tensors.get("model.embed_tokens.weight").map_or(DType::BF16, |t| t.dtype)
    }

    /// An FP8 weight dequantized with its `_scale_inv` blocks.
    fn dequantized(&self, name: &str) -> Result<HostTensor> {
        let missing =
            || Error::model_file(&self.dir, format!("tensor {name:?} is missing from the checkpoint"));
        let (kind, t) = self.packed.get(name).ok_or_else(missing)?;
        let scales = self.tensors.get(&format!("{name}_scale_inv"));
        match (kind, scales, self.fp8_block) {
            (Packed::F8E4M3, Some(scales), Some(block)) => {
                super::dequant::fp8_blocks(t, scales, block, self.model_dtype())
            }
            _ => Err(Error::model_file(
                t.file.as_path(),
                format!(
                    "tensor {name:?} is stored as {kind:?}, read only as FP8 with `{name}_scale_inv` \
                     and quantization_config.weight_block_size, or as MXFP4 experts"
                ),
            )),
        }
    }

    /// Expert `e` of MXFP4 experts `{prefix}_blocks` (`[experts, rows, cols / 32, 16]`
    /// bytes) and `{prefix}_scales` (`[experts, rows, cols / 32]`), as a `[rows, cols]`
    /// matrix; `None` where `prefix` is not stored so.
    pub fn mxfp4_expert(
        &self,
        prefix: &str,
        e: usize,
        experts: usize,
        rows: usize,
        cols: usize,
    ) -> Result<Option<HostTensor>> {
        let (blocks, scales) = (format!("{prefix}_blocks"), format!("{prefix}_scales"));
        let (Some((Packed::U8, b)), Some((Packed::U8, s))) =
            (self.packed.get(&blocks), self.packed.get(&scales))
        else {
            return Ok(None);
        };
        let groups = cols.div_ceil(32);
        for (t, want) in [(b, vec![experts, rows, groups, 16]), (s, vec![experts, rows, groups])] {
            if t.shape != want {
                return Err(Error::model_file(
                    t.file.as_path(),
                    format!("tensor {:?} has shape {:?}, config.json implies {want:?}", t.name, t.shape),
                ));
            }
        }
        let name = format!("{prefix}.{e}");
        super::dequant::mxfp4(&name, &b.index(e)?, &s.index(e)?, rows, cols, self.model_dtype()).map(Some)
    }
}

/// Largest safetensors header read (the format's own limit).
const MAX_HEADER: u64 = 100_000_000;

fn read_file(path: &Path) -> Result<Vec<(HostTensor, Option<Packed>)>> {
    // A FIFO or device would block the open or never end: regular files only, opened
    // without blocking and checked on the open file.
    let (file, _) = strata_common::files::open_regular(path, u64::MAX)?;
    // SAFETY: the mapping is read-only; a checkpoint modified while being served is
    // outside what any inference server can defend against.
    let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::model_file(path, format!("cannot map: {e}")))?;
    if map.len() < 8 {
        return Err(Error::model_file(path, "truncated: shorter than the 8-byte header length"));
    }
    let header_len = u64::from_le_bytes(map[..8].try_into().unwrap_or_default());
    if header_len > MAX_HEADER {
        return Err(Error::model_file(
            path,
            format!("a header of {header_len} bytes exceeds the {MAX_HEADER}-byte limit"),
        ));
    }
    let header_len = header_len as usize;
    if header_len > map.len() - 8 {
        return Err(Error::model_file(
            path,
            format!("truncated: header claims {header_len} bytes, file has {}", map.len()),
        ));
    }
    let header: serde_json::Value = serde_json::from_slice(&map[8..8 + header_len])
        .map_err(|e| Error::model_file(path, format!("invalid safetensors header: {e}")))?;
    let header = header
        .as_object()
        .ok_or_else(|| Error::model_file(path, "safetensors header is not a JSON object"))?;
    let data_start = 8 + header_len;
    let map = Arc::new(map);
    let file = Arc::new(path.to_owned());
    let mut out = Vec::new();
    for (name, info) in header {
        if name == "__metadata__" {
            continue;
        }
        let info: safetensors::tensor::TensorInfo = serde_json::from_value(info.clone())
            .map_err(|e| Error::model_file(path, format!("tensor {name:?}: bad header entry: {e}")))?;
        let (dtype, packed, range) = tensor_extent(path, name, &info, map.len() - data_start)?;
        let range = data_start + range.start..data_start + range.end;
        out.push((HostTensor::mapped(name, dtype, info.shape, file.clone(), map.clone(), range), packed));
    }
    // Two tensors sharing bytes would alias weights a checkpoint writer never meant to.
    let mut extents: Vec<(&str, std::ops::Range<usize>)> =
        out.iter().map(|(t, _)| (t.name.as_str(), t.byte_range())).collect();
    extents.sort_by_key(|(_, r)| (r.start, r.end));
    for pair in extents.windows(2) {
        if pair[1].1.start < pair[0].1.end {
            return Err(Error::model_file(
                path,
                format!("tensors {:?} and {:?} overlap in the file", pair[0].0, pair[1].0),
            ));
        }
    }
    Ok(out)
}

/// A header entry's dtype (bytes carried as I8 for a packed format) and byte range within
/// the data section (`data_len` bytes), with every product and sum checked: a hostile
/// header is an error, never an overflow.
fn tensor_extent(
    path: &Path,
    name: &str,
    info: &safetensors::tensor::TensorInfo,
    data_len: usize,
) -> Result<(DType, Option<Packed>, std::ops::Range<usize>)> {
    let (dtype, packed) = match info.dtype {
        safetensors::Dtype::F32 => (DType::F32, None),
        safetensors::Dtype::F16 => (DType::F16, None),
        safetensors::Dtype::BF16 => (DType::BF16, None),
        safetensors::Dtype::I8 => (DType::I8, None),
        safetensors::Dtype::U8 => (DType::I8, Some(Packed::U8)),
        safetensors::Dtype::F8_E4M3 => (DType::I8, Some(Packed::F8E4M3)),
        other => {
            return Err(Error::model_file(
                path,
                format!("tensor {name:?} has dtype {other:?}; supported: F32, F16, BF16, I8, U8 and F8_E4M3 (quantized weights)"),
            ))
        }
    };
    let (begin, end) = info.data_offsets;
    let bytes = info.shape.iter().try_fold(dtype.size(), |n, d| n.checked_mul(*d)).ok_or_else(|| {
        Error::model_file(path, format!("tensor {name:?}: shape {:?} is too large", info.shape))
    })?;
    if end < begin || end - begin != bytes {
        return Err(Error::model_file(
            path,
            format!(
                "tensor {name:?}: data_offsets {begin}..{end} do not hold shape {:?} of {}",
                info.shape,
                dtype.name()
            ),
        ));
    }
    if end > data_len {
        return Err(Error::model_file(
            path,
            format!("truncated: tensor {name:?} ends at data byte {end} but the data section has {data_len}"),
        ));
    }
    Ok((dtype, packed, begin..end))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// A safetensors file: the 8-byte length, `header`, then `data` bytes.
    fn file(dir: &Path, header: &[u8], data: usize) -> PathBuf {
        let p = dir.join("m.safetensors");
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header);
        bytes.resize(bytes.len() + data, 0);
        std::fs::write(&p, bytes).unwrap();
        p
    }

    fn error(header: &str, data: usize) -> String {
        let dir = tempfile::tempdir().unwrap();
        read_file(&file(dir.path(), header.as_bytes(), data)).unwrap_err().to_string()
    }

    #[test]
    fn overlapping_and_oversized_tensors_are_refused() {
        let e = error(
            r#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},"b":{"dtype":"F32","shape":[4],"data_offsets":[8,24]}}"#,
            24,
        );
        assert!(e.contains("overlap"), "{e}");
        let e =
            error(r#"{"a":{"dtype":"F32","shape":[1099511627776,1099511627776],"data_offsets":[0,16]}}"#, 16);
        assert!(e.contains("too large"), "{e}");
        let e = error(r#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#, 8);
        assert!(e.contains("truncated"), "{e}");
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("m.safetensors");
        std::fs::write(&p, [0xff; 16]).unwrap();
        assert!(read_file(&p).unwrap_err().to_string().contains("limit"));
    }

    #[test]
    fn mutated_headers_never_panic() {
        let good = br#"{"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},"b":{"dtype":"BF16","shape":[4],"data_offsets":[16,24]}}"#;
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(read_file(&file(dir.path(), good, 24)).unwrap().len(), 2);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        for _ in 0..2000 {
            let mut header = good.to_vec();
            for _ in 0..rng.random_range(1..4) {
                let i = rng.random_range(0..header.len());
                header[i] = match rng.random_range(0..3) {
                    0 => rng.random(),
                    1 => b"0123456789"[rng.random_range(0..10)],
                    _ => b'9',
                };
            }
            let p = file(dir.path(), &header, rng.random_range(0..64));
            let _ = read_file(&p); // an error or tensors, never a panic
        }
    }
}
