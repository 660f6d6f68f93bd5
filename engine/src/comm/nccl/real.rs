//! The NCCL communicator (feature `cuda`): the replica's [`DeviceCollectives`] on GPUs,
//! through `cudarc`.
//!
//! NCCL allows one rank per GPU, so each rank drives one device. Set-up needs every
//! group's NCCL unique id: the replica's leader (rank 0) creates them and hands them out
//! over the bootstrap communicator (the same TCP mesh the replica already uses for step
//! plans), then every member of a group joins that group's NCCL communicator. Collectives
//! take the CUDA backend's tensors and run on NCCL's stream ordered after the work queued
//! on the backend's stream and before what is queued there next (events, no host copy,
//! no host synchronisation), so a graph capture of the backend's stream records them.
//! Host messages (step plans, replies, merges of reduced rows) go over the bootstrap
//! mesh, which is this communicator's [`DeviceCollectives::host`].
//!
//! `cudarc` loads CUDA and NCCL at run time and panics on its first call when a library is
//! missing, so [`probe_libraries`] opens them first and turns absence into an error that
//! names the library and `LD_LIBRARY_PATH`.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use cudarc::nccl::safe::{Comm, Id, ReduceOp};
use strata_common::{Error, Result};

use crate::backend::cuda::device::Gpu;
use crate::backend::cuda::driver::{probe, CudaGpu, Library, DRIVER};
use crate::backend::cuda::{CudaBackend, GpuTensor};
use crate::comm::{CommStats, Communicator, DeviceCollectives, Exchange};

type Backend = CudaBackend<CudaGpu>;
type Tensor = GpuTensor<CudaSlice<u8>>;

/// NCCL's library, under the names it is found by.
pub const NCCL: Library = ("NCCL", &["libnccl.so.2", "libnccl.so"]);

/// Opens each library cudarc will load for NCCL; an error names the first one missing.
fn probe_libraries() -> Result<()> {
    probe(&[DRIVER, NCCL])
}

fn nccl_err(what: &str) -> impl FnOnce(cudarc::nccl::result::NcclError) -> Error + '_ {
    move |e| Error::Unavailable(format!("NCCL {what}: {e:?}"))
}

fn cuda_err(what: &str) -> impl FnOnce(cudarc::driver::DriverError) -> Error + '_ {
    move |e| Error::Unavailable(format!("CUDA {what}: {e:?}"))
}

/// One NCCL communicator handle.
struct GroupComm(Comm);

// SAFETY: an NCCL communicator may be used from any thread, one call at a time; NcclComm
// owns its handles and every use goes through `&mut self` or is read-only on one thread.
unsafe impl Send for GroupComm {}

pub struct NcclComm {
    stream: Arc<CudaStream>,
    /// This rank's NCCL communicator for each group it belongs to, by member list.
    groups: HashMap<Vec<usize>, GroupComm>,
    bootstrap: Box<dyn Communicator>,
    stats: CommStats,
}

impl NcclComm {
    /// Joins NCCL communicators for `groups` on GPU `device`. Every rank passes the same
    /// `groups` in the same order; rank 0 creates their unique ids.
    pub fn new(device: usize, mut bootstrap: Box<dyn Communicator>, groups: &[Vec<usize>]) -> Result<Self> {
        probe_libraries()?;
        let ctx = CudaContext::new(device).map_err(cuda_err("context"))?;
        let stream = ctx.default_stream();
        let everyone: Vec<usize> = (0..bootstrap.world()).collect();
        let rank = bootstrap.rank();
        let mut map = HashMap::new();
        for group in groups {
            let mut id = Vec::new();
            if rank == 0 {
                let fresh = Id::new().map_err(nccl_err("unique id"))?;
                id = fresh.internal().iter().map(|&c| c as u8).collect();
            }
            bootstrap.broadcast(&everyone, 0, &mut id)?;
            let Some(pos) = group.iter().position(|&r| r == rank) else { continue };
            let mut internal = [0 as std::ffi::c_char; 128];
            if id.len() != internal.len() {
                return Err(Error::Internal(format!("NCCL unique id of {} bytes", id.len())));
            }
            for (dst, src) in internal.iter_mut().zip(&id) {
                *dst = *src as std::ffi::c_char;
            }
            let comm = Comm::from_rank(stream.clone(), pos, group.len(), Id::uninit(internal))
                .map_err(nccl_err("communicator init"))?;
            map.insert(group.clone(), GroupComm(comm));
        }
        Ok(NcclComm { stream, groups: map, bootstrap, stats: CommStats::default() })
    }

    /// Sums `data`, f32s on this rank's GPU, across `group` in place. NCCL runs on this
    /// communicator's stream, ordered after the work already queued on `on` (the
    /// backend's stream) and before anything queued there next, through events: no host
    /// copy and no host synchronisation. A one-rank group still runs NCCL (a check of the
    /// plumbing).
    pub fn all_reduce_device(
        &mut self,
        group: &[usize],
        data: &mut cudarc::driver::CudaViewMut<'_, f32>,
        on: &CudaStream,
    ) -> Result<()> {
        let bytes = data.len() * 4;
        self.in_stream_order(on, bytes, |c| {
            c.group(group)?.all_reduce_in_place(data, &ReduceOp::Sum).map_err(nccl_err("all-reduce"))?;
            Ok(())
        })
    }

    /// Gathers `send` (f32s on this rank's GPU, the same count on every rank) from every
    /// rank of `group` into `recv`, rank blocks in group order; ordered on the compute
    /// stream `on` as [`NcclComm::all_reduce_device`] is.
    pub fn all_gather_device(
        &mut self,
        group: &[usize],
        send: &cudarc::driver::CudaView<'_, f32>,
        recv: &mut cudarc::driver::CudaViewMut<'_, f32>,
        on: &CudaStream,
    ) -> Result<()> {
        if recv.len() != send.len() * group.len() {
            return Err(Error::Internal(format!(
                "all-gather of {} f32s from {} ranks into {}",
                send.len(),
                group.len(),
                recv.len()
            )));
        }
        self.in_stream_order(on, send.len() * 4, |c| {
            c.group(group)?.all_gather(send, recv).map_err(nccl_err("all-gather"))?;
            Ok(())
        })
    }

    /// Sends `data` (f32s on this rank's GPU) to rank `to`, through the communicator of
    /// the pair (see [`super::pipeline_pairs`]), ordered on the compute stream `on` as
    /// [`NcclComm::all_reduce_device`] is.
    pub fn send_device(
        &mut self,
        to: usize,
        data: &cudarc::driver::CudaView<'_, f32>,
        on: &CudaStream,
    ) -> Result<()> {
        self.in_stream_order(on, data.len() * 4, |c| {
            let (comm, peer) = c.pair(to)?;
            comm.send(data, peer).map_err(nccl_err("send"))
        })
    }

    /// Receives `data` from rank `from`, the other end of [`NcclComm::send_device`].
    pub fn recv_device(
        &mut self,
        from: usize,
        data: &mut cudarc::driver::CudaViewMut<'_, f32>,
        on: &CudaStream,
    ) -> Result<()> {
        self.in_stream_order(on, 0, |c| {
            let (comm, peer) = c.pair(from)?;
            comm.recv(data, peer).map_err(nccl_err("receive"))?;
            Ok(())
        })
    }

    /// Runs `op` (NCCL calls on this communicator's stream) ordered after the work queued
    /// on the compute stream `on` and before anything queued there next, through events:
    /// no host copy and no host synchronisation. Counts `sent` bytes and the time taken.
    fn in_stream_order(
        &mut self,
        on: &CudaStream,
        sent: usize,
        op: impl FnOnce(&Self) -> Result<()>,
    ) -> Result<()> {
        let started = Instant::now();
        self.stream.join(on).map_err(cuda_err("ordering NCCL after the compute stream"))?;
        op(self)?;
        on.join(&self.stream).map_err(cuda_err("ordering the compute stream after NCCL"))?;
        self.stats.bytes_sent += sent as u64;
        self.stats.busy_ns += started.elapsed().as_nanos() as u64;
        Ok(())
    }

    /// This rank in the replica.
    pub fn rank(&self) -> usize {
        self.bootstrap.rank()
    }

    /// The communicator of this rank and `other`, and `other`'s rank in it.
    fn pair(&self, other: usize) -> Result<(&Comm, i32)> {
        let me = self.rank();
        let group = [me.min(other), me.max(other)];
        Ok((self.group(&group)?, (other > me) as i32))
    }

    fn group(&self, group: &[usize]) -> Result<&Comm> {
        self.groups
            .get(group)
            .map(|g| &g.0)
            .ok_or_else(|| Error::Internal(format!("no NCCL communicator for group {group:?}")))
    }
}

/// The first `count` f32s of a device buffer, for NCCL.
///
/// SAFETY (of both): a tensor's buffer holds f32 activations (a GpuTensor's), at least
/// `rows × cols` of them; `transmute` checks the length against the buffer.
fn view(buf: &CudaSlice<u8>, count: usize) -> Result<cudarc::driver::CudaView<'_, f32>> {
    unsafe { buf.transmute::<f32>(count.max(1)) }
        .ok_or_else(|| Error::Internal(format!("{count} f32s from a smaller buffer")))
}

fn view_mut(buf: &mut CudaSlice<u8>, count: usize) -> Result<cudarc::driver::CudaViewMut<'_, f32>> {
    unsafe { buf.transmute_mut::<f32>(count.max(1)) }
        .ok_or_else(|| Error::Internal(format!("{count} f32s into a smaller buffer")))
}

impl DeviceCollectives<Backend> for NcclComm {
    fn in_stream_order(&self) -> bool {
        true
    }

    fn all_reduce(&mut self, b: &Backend, x: &mut Tensor, group: &[usize]) -> Result<()> {
        if group.len() <= 1 {
            return Ok(());
        }
        let n = x.rows * x.cols;
        let mut data = view_mut(x.buf_mut(), n)?;
        self.all_reduce_device(group, &mut data, b.gpu().stream())
    }

    fn all_gather(&mut self, b: &Backend, x: &Tensor, group: &[usize]) -> Result<Tensor> {
        let n = x.rows * x.cols;
        let mut out = b.output(x.rows * group.len(), x.cols)?;
        if group.len() <= 1 || n == 0 {
            b.gpu().copy(x.buf(), out.buf_mut(), n * 4)?;
            return Ok(out);
        }
        {
            let send = view(x.buf(), n)?;
            let mut recv = view_mut(out.buf_mut(), n * group.len())?;
            self.all_gather_device(group, &send, &mut recv, b.gpu().stream())?;
        }
        Ok(out)
    }

    fn all_to_all(&mut self, b: &Backend, x: &Tensor, rows: Exchange<'_>, group: &[usize]) -> Result<Tensor> {
        rows.check(group.len(), x.rows)?;
        let cols = x.cols;
        let mut out = b.output(rows.recv.iter().sum(), cols)?;
        if group.len() <= 1 {
            b.gpu().copy(x.buf(), out.buf_mut(), x.rows * cols * 4)?;
            return Ok(out);
        }
        let sent = x.rows * cols * 4;
        {
            let src = view(x.buf(), x.rows * cols)?;
            let mut dst = view_mut(out.buf_mut(), rows.recv.iter().sum::<usize>() * cols)?;
            self.in_stream_order(b.gpu().stream(), sent, |c| {
                let comm = c.group(group)?;
                // One NCCL group call: every send and receive of the exchange start together,
                // so no pair waits on another.
                cudarc::nccl::result::group_start().map_err(nccl_err("group start"))?;
                let exchanged = (|| -> Result<()> {
                    let (mut from, mut to) = (0, 0);
                    for (peer, (&s, &r)) in rows.send.iter().zip(rows.recv).enumerate() {
                        if s > 0 {
                            let part = src.slice(from * cols..(from + s) * cols);
                            comm.send(&part, peer as i32).map_err(nccl_err("send"))?;
                        }
                        if r > 0 {
                            let mut part = dst.slice_mut(to * cols..(to + r) * cols);
                            comm.recv(&mut part, peer as i32).map_err(nccl_err("receive"))?;
                        }
                        (from, to) = (from + s, to + r);
                    }
                    Ok(())
                })();
                let ended = cudarc::nccl::result::group_end().map(drop).map_err(nccl_err("group end"));
                exchanged.and(ended)
            })?;
        }
        Ok(out)
    }

    fn send(&mut self, b: &Backend, x: &Tensor, to: usize) -> Result<()> {
        self.send_device(to, &view(x.buf(), x.rows * x.cols)?, b.gpu().stream())
    }

    fn recv(&mut self, b: &Backend, rows: usize, cols: usize, from: usize) -> Result<Tensor> {
        let mut out = b.output(rows, cols)?;
        self.recv_device(from, &mut view_mut(out.buf_mut(), rows * cols)?, b.gpu().stream())?;
        Ok(out)
    }

    fn host(&mut self) -> &mut dyn Communicator {
        self.bootstrap.as_mut()
    }

    fn stats(&self) -> CommStats {
        self.stats.plus(self.bootstrap.stats())
    }
}

/// What [`NcclComm::bench_all_reduce`] measured on one rank.
#[derive(Debug, Clone, Copy)]
pub struct AllReduceBench {
    /// Median seconds per all-reduce.
    pub seconds: f64,
    /// The first all-reduce of ones gave the group size everywhere.
    pub correct: bool,
}

impl NcclComm {
    /// Times in-place all-reduces of `count` f32s on GPU `device` across `group` (every
    /// member calls it at once) through [`NcclComm::all_reduce_device`], the path the CUDA
    /// backend takes, on a stream of its own; checks the first result and one
    /// [`NcclComm::all_gather_device`].
    pub fn bench_all_reduce(
        &mut self,
        device: usize,
        group: &[usize],
        count: usize,
        iters: usize,
    ) -> Result<AllReduceBench> {
        let ctx = CudaContext::new(device).map_err(cuda_err("context"))?;
        let stream = ctx.new_stream().map_err(cuda_err("stream"))?;
        let mut buf = stream.clone_htod(&vec![1f32; count.max(1)]).map_err(cuda_err("copy to device"))?;
        let gathered = self.gathers(group, &stream)?;
        let mut run = |buf: &mut cudarc::driver::CudaSlice<f32>| -> Result<f64> {
            let started = Instant::now();
            self.all_reduce_device(group, &mut buf.as_view_mut(), &stream)?;
            stream.synchronize().map_err(cuda_err("synchronize"))?;
            Ok(started.elapsed().as_secs_f64())
        };
        run(&mut buf)?;
        let mut first = vec![0f32; count.clamp(1, 1024)];
        stream.memcpy_dtoh(&buf.slice(..first.len()), &mut first).map_err(cuda_err("copy to host"))?;
        stream.synchronize().map_err(cuda_err("synchronize"))?;
        let correct = first.iter().all(|&v| v == group.len() as f32) && gathered;
        // Values grow by the group size each time; refill before they could overflow.
        let mut times = Vec::with_capacity(iters);
        for i in 0..iters {
            if i % 8 == 7 {
                stream.memcpy_htod(&vec![1f32; count.max(1)], &mut buf).map_err(cuda_err("refill"))?;
            }
            times.push(run(&mut buf)?);
        }
        times.sort_by(f64::total_cmp);
        Ok(AllReduceBench { seconds: times.get(times.len() / 2).copied().unwrap_or(0.0), correct })
    }

    /// Whether [`NcclComm::all_gather_device`] (the gather of vocabulary shards for tokens
    /// drawn on the device) puts every rank's block in group order.
    fn gathers(&mut self, group: &[usize], stream: &Arc<CudaStream>) -> Result<bool> {
        const BLOCK: usize = 256;
        let me = group.iter().position(|&r| r == self.rank()).unwrap_or(0);
        let send = stream.clone_htod(&[me as f32; BLOCK]).map_err(cuda_err("copy to device"))?;
        let mut recv = stream.alloc_zeros::<f32>(BLOCK * group.len()).map_err(cuda_err("alloc"))?;
        self.all_gather_device(group, &send.as_view(), &mut recv.as_view_mut(), stream)?;
        let mut all = vec![0f32; BLOCK * group.len()];
        stream.memcpy_dtoh(&recv, &mut all).map_err(cuda_err("copy to host"))?;
        stream.synchronize().map_err(cuda_err("synchronize"))?;
        Ok(all.chunks(BLOCK).enumerate().all(|(i, block)| block.iter().all(|&v| v == i as f32)))
    }
}

/// Number of CUDA devices the driver sees.
pub fn device_count() -> Result<usize> {
    probe_libraries()?;
    let n = CudaContext::device_count().map_err(cuda_err("device count"))?;
    Ok(n.max(0) as usize)
}

/// Starts `world` NCCL ranks inside this process (threads), rank r on GPU `first_device + r`,
/// bootstrapped over a loopback TCP group, each holding communicators for `groups`.
pub fn local_group(first_device: usize, world: usize, groups: &[Vec<usize>]) -> Result<Vec<NcclComm>> {
    let tcp = crate::comm::tcp::local_group(world, std::time::Duration::from_secs(60))?;
    std::thread::scope(|s| {
        let handles: Vec<_> = tcp
            .into_iter()
            .enumerate()
            .map(|(rank, c)| s.spawn(move || NcclComm::new(first_device + rank, Box::new(c), groups)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(Error::Internal("NCCL rank set-up panicked".into()))))
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_libraries_are_named_not_panicked_on() {
        // On a machine without CUDA (like CI) this must be a clear error; with CUDA, Ok.
        match probe_libraries() {
            Ok(()) => {}
            Err(e) => {
                let msg = e.to_string();
                assert!(msg.contains("LD_LIBRARY_PATH") && msg.contains("libcuda"), "{msg}");
            }
        }
    }
}
