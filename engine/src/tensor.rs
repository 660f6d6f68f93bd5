//! The engine's shared tensor vocabulary: a host view of one checkpoint tensor.
//!
//! A leaf module: the model reads [`HostTensor`]s out of checkpoints, backends turn them
//! into weights, and neither has to know the other to do so.

use std::ops::Range;
use std::path::PathBuf;
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
    /// A view of `range` (bytes) of a mapped file.
    pub(crate) fn mapped(
        name: &str,
        dtype: DType,
        shape: Vec<usize>,
        file: Arc<PathBuf>,
        map: Arc<Mmap>,
        range: Range<usize>,
    ) -> HostTensor {
        HostTensor { name: name.to_string(), dtype, shape, file, source: Source::Mapped(map), range }
    }

    /// Where its bytes lie in their file (or buffer).
    pub(crate) fn byte_range(&self) -> Range<usize> {
        self.range.clone()
    }

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

    /// The same tensor stored as `dtype` (a copy; rounding to nearest even when narrowing;
    /// int8 values convert as plain integers, saturating — scales are the caller's).
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
            DType::I8 => values.iter().map(|&v| v.round().clamp(-128.0, 127.0) as i8 as u8).collect(),
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
            // The stored integers, without their scales.
            DType::I8 => b.iter().map(|&v| v as i8 as f32).collect(),
        }
    }
}
