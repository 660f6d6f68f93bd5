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

    /// Entry `i` of the first dimension of a tensor of 2 or more dimensions (one expert of
    /// a stacked `[experts, ...]` tensor), still a view into the mapping.
    pub fn index(&self, i: usize) -> Result<HostTensor> {
        let (&n, rest) = self.shape.split_first().filter(|(_, rest)| !rest.is_empty()).ok_or_else(|| {
            Error::Internal(format!("{}: index() of a {}-D tensor", self.name, self.shape.len()))
        })?;
        if i >= n {
            return Err(Error::Internal(format!("{}: entry {i} of {n}", self.name)));
        }
        let bytes = rest.iter().product::<usize>() * self.dtype.size();
        let start = self.range.start + i * bytes;
        Ok(HostTensor {
            name: format!("{}[{i}]", self.name),
            dtype: self.dtype,
            shape: rest.to_vec(),
            file: self.file.clone(),
            source: self.source.clone(),
            range: start..start + bytes,
        })
    }

    /// Columns `cols` (in that order) of a 2-D `[n, width]` tensor as the rows of a
    /// `[cols.len(), n]` one: a checkpoint stored inputs-first read as `[out, in]`. A copy
    /// in the same dtype.
    pub fn transposed_columns(&self, cols: &[usize]) -> Result<HostTensor> {
        let [n, width] = self.shape[..] else {
            return Err(Error::Internal(format!("{}: transposed_columns() of a non-matrix", self.name)));
        };
        if let Some(&c) = cols.iter().find(|&&c| c >= width) {
            return Err(Error::Internal(format!("{}: column {c} of {width}", self.name)));
        }
        let e = self.dtype.size();
        let src = self.bytes();
        let mut out = Vec::with_capacity(n * cols.len() * e);
        for &c in cols {
            for r in 0..n {
                out.extend_from_slice(&src[(r * width + c) * e..(r * width + c + 1) * e]);
            }
        }
        let len = out.len();
        Ok(HostTensor {
            name: self.name.clone(),
            dtype: self.dtype,
            shape: vec![cols.len(), n],
            file: self.file.clone(),
            source: Source::Owned(Arc::new(out)),
            range: 0..len,
        })
    }

    /// Rows `rows` (in that order, a row may repeat) of a 2-D tensor: a copy.
    pub fn select_rows(&self, rows: &[usize]) -> Result<HostTensor> {
        let [n, width] = self.shape[..] else {
            return Err(Error::Internal(format!("{}: select_rows() of a non-matrix", self.name)));
        };
        if let Some(&r) = rows.iter().find(|&&r| r >= n) {
            return Err(Error::Internal(format!("{}: row {r} of {n}", self.name)));
        }
        let row_bytes = width * self.dtype.size();
        let src = self.bytes();
        let out: Vec<u8> =
            rows.iter().flat_map(|&r| src[r * row_bytes..(r + 1) * row_bytes].iter().copied()).collect();
        let len = out.len();
        Ok(HostTensor {
            name: self.name.clone(),
            dtype: self.dtype,
            shape: vec![rows.len(), width],
            file: self.file.clone(),
            source: Source::Owned(Arc::new(out)),
            range: 0..len,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stacked_entries_and_transposed_columns() {
        // [2, 2, 3]: entry e, row r, column c holds 100e + 10r + c.
        let data: Vec<f32> = (0..2)
            .flat_map(|e| (0..2).flat_map(move |r| (0..3).map(move |c| (100 * e + 10 * r + c) as f32)))
            .collect();
        let t = HostTensor::from_f32("w", &[2, 2, 3], &data).cast(DType::BF16);
        let one = t.index(1).unwrap();
        assert_eq!(one.shape, [2, 3]);
        assert_eq!(one.to_f32_vec(), [100.0, 101.0, 102.0, 110.0, 111.0, 112.0]);
        let cols = one.transposed_columns(&[2, 0]).unwrap();
        assert_eq!((cols.shape.clone(), cols.dtype), (vec![2, 2], DType::BF16));
        assert_eq!(cols.to_f32_vec(), [102.0, 112.0, 100.0, 110.0]);
        assert!(t.index(2).is_err() && one.transposed_columns(&[3]).is_err());
        let picked = one.select_rows(&[1, 0, 1]).unwrap();
        assert_eq!(picked.shape, [3, 3]);
        assert_eq!(picked.to_f32_vec()[..4], [110.0, 111.0, 112.0, 100.0]);
        assert!(one.select_rows(&[2]).is_err());
        assert!(HostTensor::from_f32("v", &[3], &[1.0, 2.0, 3.0]).index(0).is_err());
    }
}
