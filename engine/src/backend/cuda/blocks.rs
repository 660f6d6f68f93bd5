//! Copies of blocks of a tensor's elements on the device: column slices (one head of
//! per-head activations) and concatenations by columns or by rows (latent attention's
//! queries, LongRoPE's mixed steps).

use strata_common::{Error, Result};

use super::device::{Arg, Gpu, Launch};
use super::kernels::Kernel;
use super::{dim, CudaBackend, GpuTensor, ROW_THREADS};

impl<G: Gpu> CudaBackend<G> {
    /// `width` columns of every row of `src` from column `src_col` into `dst` at column
    /// `dst_col`, rows from `dst_row` (`at` = `(src_col, dst_col, dst_row)`).
    pub(super) fn copy_block(
        &self,
        src: &GpuTensor<G::Buf>,
        dst: &GpuTensor<G::Buf>,
        (src_col, dst_col, dst_row): (usize, usize, usize),
        width: usize,
    ) -> Result<()> {
        if src.rows == 0 || width == 0 {
            return Ok(()); // no launch of an empty grid
        }
        if src_col + width > src.cols || dst_col + width > dst.cols || dst_row + src.rows > dst.rows {
            return Err(Error::Internal("a block copy outside its tensors".into()));
        }
        let args = [
            Arg::Buf(&src.buf),
            Arg::Buf(&dst.buf),
            Arg::I32(dim(src.cols)?),
            Arg::I32(dim(src_col)?),
            Arg::I32(dim(dst.cols)?),
            Arg::I32(dim(dst_col)?),
            Arg::I32(dim(dst_row)?),
            Arg::I32(dim(width)?),
        ];
        self.launch(Kernel::CopyBlock, Launch::rows(src.rows, ROW_THREADS), &args)
    }
}
