//! The backend's side of the collectives: all-reduces, vocabulary gathers and pipeline
//! hand-offs on device buffers where the communicator takes them (NCCL on GPUs, the
//! emulator's stand-in in tests) — in stream order, so a graph captures them like any
//! kernel — and through host memory where it does not.

use strata_common::Result;

use super::device::{Arg, Gpu, Launch};
use super::kernels::Kernel;
use super::{dim, CudaBackend, GpuTensor, ROW_THREADS};
use crate::backend::{recv_through_host, send_through_host, Backend};
use crate::comm::{Collectives, Communicator};

impl<G: Gpu> CudaBackend<G> {
    /// See [`Backend::all_reduce`].
    pub(super) fn all_reduce_tensor(
        &self,
        x: &mut GpuTensor<G::Buf>,
        group: &[usize],
        comm: &mut dyn Collectives,
    ) -> Result<()> {
        if group.len() <= 1 {
            return Ok(());
        }
        // NCCL on the device buffer where the communicator is one; else through the host.
        if self.gpu.all_reduce_sum(&mut x.buf, x.rows * x.cols, group, comm)? {
            return Ok(());
        }
        self.with_host_mut(x, &mut |data| comm.all_reduce_sum(group, data))
    }

    /// See [`Backend::gather_vocab`]: an all-gather of the shards (rank blocks), then one
    /// kernel that interleaves them into whole rows.
    pub(super) fn gather_vocab_tensor(
        &self,
        shard: &GpuTensor<G::Buf>,
        group: &[usize],
        comm: &mut dyn Collectives,
    ) -> Result<Option<GpuTensor<G::Buf>>> {
        let (rows, w, ranks) = (shard.rows, shard.cols, group.len());
        let mut all = self.tensor(ranks * rows, w)?;
        if !self.gpu.all_gather(&shard.buf, &mut all.buf, rows * w, group, comm)? {
            return Ok(None);
        }
        let y = self.tensor(rows, w * ranks)?;
        if rows > 0 {
            let args = [
                Arg::Buf(&all.buf),
                Arg::Buf(&y.buf),
                Arg::I32(dim(rows)?),
                Arg::I32(dim(w)?),
                Arg::I32(dim(ranks)?),
            ];
            self.launch(Kernel::UnshardRows, Launch::rows(rows, ROW_THREADS), &args)?;
        }
        Ok(Some(y))
    }

    /// See [`Backend::send_hidden`].
    pub(super) fn send_tensor(
        &self,
        x: &GpuTensor<G::Buf>,
        to: usize,
        comm: &mut dyn Communicator,
    ) -> Result<()> {
        if self.gpu.send(&x.buf, x.rows * x.cols, to, comm)? {
            return Ok(());
        }
        send_through_host(self, x, to, comm)
    }

    /// See [`Backend::recv_hidden`].
    pub(super) fn recv_tensor(
        &self,
        rows: usize,
        cols: usize,
        from: usize,
        comm: &mut dyn Communicator,
    ) -> Result<GpuTensor<G::Buf>> {
        let mut x = self.tensor(rows, cols)?;
        if self.gpu.recv(&mut x.buf, rows * cols, from, comm)? {
            return Ok(x);
        }
        recv_through_host(self, rows, cols, from, comm)
    }
}
