//! Memory-mapped safetensors checkpoints.
//!
//! Opens `model.safetensors` or the shards listed in `model.safetensors.index.json`,
//! maps each file read-only and indexes its tensors by name. A [`HostTensor`] is a view
//! into a mapping: nothing is copied until a backend decides to, so a rank that touches
//! only its slices only ever pages those in. Every failure names the file and tensor.

use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use strata_common::{Error, Result};

pub use strata_common::DType;

/// Where a tensor's bytes live: in a file mapping, or copied (a column slice).
#[derive(Clone)]
enum Source {
    Mapped(Arc<Mmap>),
    Owned(Arc<Vec<u8>>),
}

/// A read-only view of one tensor (or a slice of it), normally inside a mapped file.
#[derive(Clone)]
pub struct HostTensor {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub file: Arc<PathBuf>,
    source: Source,
    range: Range<usize>,
}

impl std::fmt::Debug for HostTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}[{:?}; {}]", self.name, self.shape, self.dtype.name())
    }
}

impl HostTensor {
    /// An f32 tensor from host data (tests, device checks).
    pub fn from_f32(name: &str, shape: &[usize], data: &[f32]) -> HostTensor {
        assert_eq!(
            shape.iter().product::<usize>(),
            data.len(),
            "{name}: shape {shape:?} for {} values",
            data.len()
        );
        let bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
        let len = bytes.len();
        HostTensor {
            name: name.to_string(),
            dtype: DType::F32,
            shape: shape.to_vec(),
            file: Arc::new(PathBuf::from("<memory>")),
            source: Source::Owned(Arc::new(bytes)),
            range: 0..len,
        }
    }

    pub fn bytes(&self) -> &[u8] {
        match &self.source {
            Source::Mapped(m) => &m[self.range.clone()],
            Source::Owned(v) => &v[self.range.clone()],
        }
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Rows `rows` of a 2-D tensor (elements, for 1-D), still a view into the mapping.
    pub fn rows(&self, rows: Range<usize>) -> Result<HostTensor> {
        let (n, cols) = match self.shape[..] {
            [n, cols] => (n, cols),
            [n] => (n, 1),
            _ => {
                return Err(Error::Internal(format!(
                    "{}: rows() of a {}-D tensor",
                    self.name,
                    self.shape.len()
                )))
            }
        };
        if rows.end > n || rows.start > rows.end {
            return Err(Error::Internal(format!("{}: rows {rows:?} of {n}", self.name)));
        }
        let row_bytes = cols * self.dtype.size();
        let start = self.range.start + rows.start * row_bytes;
        let shape = if self.shape.len() == 2 { vec![rows.len(), cols] } else { vec![rows.len()] };
        Ok(HostTensor {
            name: self.name.clone(),
            dtype: self.dtype,
            shape,
            file: self.file.clone(),
            source: self.source.clone(),
            range: start..start + rows.len() * row_bytes,
        })
    }

    /// Columns `cols` of a 2-D tensor. Columns are not contiguous, so this copies them
    /// (the copy is the rank's share, `1/tp` of the tensor).
    pub fn columns(&self, cols: Range<usize>) -> Result<HostTensor> {
        let [n, width] = self.shape[..] else {
            return Err(Error::Internal(format!("{}: columns() of a non-matrix", self.name)));
        };
        if cols.end > width || cols.start > cols.end {
            return Err(Error::Internal(format!("{}: columns {cols:?} of {width}", self.name)));
        }
        let e = self.dtype.size();
        let src = self.bytes();
        let mut out = Vec::with_capacity(n * cols.len() * e);
        for r in 0..n {
            out.extend_from_slice(&src[(r * width + cols.start) * e..(r * width + cols.end) * e]);
        }
        let len = out.len();
        Ok(HostTensor {
            name: self.name.clone(),
            dtype: self.dtype,
            shape: vec![n, cols.len()],
            file: self.file.clone(),
            source: Source::Owned(Arc::new(out)),
            range: 0..len,
        })
    }

    /// The same tensor stored as `dtype` (a copy; rounding to nearest even when narrowing).
    pub fn cast(&self, dtype: DType) -> HostTensor {
        if dtype == self.dtype {
            return self.clone();
        }
        let values = self.to_f32_vec();
        let bytes: Vec<u8> = match dtype {
            DType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            DType::BF16 => {
                values.iter().flat_map(|&v| half::bf16::from_f32(v).to_bits().to_le_bytes()).collect()
            }
            DType::F16 => {
                values.iter().flat_map(|&v| half::f16::from_f32(v).to_bits().to_le_bytes()).collect()
            }
        };
        let len = bytes.len();
        HostTensor {
            name: self.name.clone(),
            dtype,
            shape: self.shape.clone(),
            file: self.file.clone(),
            source: Source::Owned(Arc::new(bytes)),
            range: 0..len,
        }
    }

    /// Converts every element to f32 (for small tensors: norms, biases).
    pub fn to_f32_vec(&self) -> Vec<f32> {
        let b = self.bytes();
        match self.dtype {
            DType::F32 => b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            DType::BF16 => b
                .chunks_exact(2)
                .map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
                .collect(),
            DType::F16 => b
                .chunks_exact(2)
                .map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
                .collect(),
        }
    }
}

/// All tensors of a checkpoint, by name.
pub struct Checkpoint {
    tensors: HashMap<String, HostTensor>,
    dir: PathBuf,
}

impl Checkpoint {
    /// Opens the safetensors files of a model directory.
    pub fn open(dir: &Path) -> Result<Self> {
        let index = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        let files: Vec<PathBuf> = if index.exists() {
            let text = std::fs::read_to_string(&index)
                .map_err(|e| Error::model_file(&index, format!("cannot read: {e}")))?;
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
        let mut tensors = HashMap::new();
        for file in files {
            for t in read_file(&file)? {
                tensors.insert(t.name.clone(), t);
            }
        }
        Ok(Checkpoint { tensors, dir: dir.to_owned() })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// The tensor `name`, checked against the shape the model config implies.
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<HostTensor> {
        let t = self.tensors.get(name).ok_or_else(|| {
            Error::model_file(&self.dir, format!("tensor {name:?} is missing from the checkpoint"))
        })?;
        if t.shape != shape {
            return Err(Error::model_file(
                t.file.as_path(),
                format!("tensor {name:?} has shape {:?}, config.json implies {shape:?}", t.shape),
            ));
        }
        Ok(t.clone())
    }
}

fn read_file(path: &Path) -> Result<Vec<HostTensor>> {
    let file = std::fs::File::open(path).map_err(|e| Error::model_file(path, format!("cannot open: {e}")))?;
    // SAFETY: the mapping is read-only; a checkpoint modified while being served is
    // outside what any inference server can defend against.
    let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::model_file(path, format!("cannot map: {e}")))?;
    if map.len() < 8 {
        return Err(Error::model_file(path, "truncated: shorter than the 8-byte header length"));
    }
    let header_len = u64::from_le_bytes(map[..8].try_into().unwrap_or_default()) as usize;
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
        let dtype = match info.dtype {
            safetensors::Dtype::F32 => DType::F32,
            safetensors::Dtype::F16 => DType::F16,
            safetensors::Dtype::BF16 => DType::BF16,
            other => {
                return Err(Error::model_file(
                    path,
                    format!("tensor {name:?} has dtype {other:?}; supported: F32, F16, BF16"),
                ))
            }
        };
        let (begin, end) = info.data_offsets;
        let numel: usize = info.shape.iter().product();
        if end < begin || end - begin != numel * dtype.size() {
            return Err(Error::model_file(
                path,
                format!(
                    "tensor {name:?}: data_offsets {begin}..{end} do not hold shape {:?} of {}",
                    info.shape,
                    dtype.name()
                ),
            ));
        }
        if data_start + end > map.len() {
            return Err(Error::model_file(
                path,
                format!(
                    "truncated: tensor {name:?} ends at byte {} but the file has {}",
                    data_start + end,
                    map.len()
                ),
            ));
        }
        out.push(HostTensor {
            name: name.clone(),
            dtype,
            shape: info.shape,
            file: file.clone(),
            source: Source::Mapped(map.clone()),
            range: data_start + begin..data_start + end,
        });
    }
    Ok(out)
}
