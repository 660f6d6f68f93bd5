//! The CUDA emulator's stand-in for NCCL (feature `cuda-emulator`, tests): collectives on
//! emulated device buffers that are device work, as NCCL's kernels are.
//!
//! Device memory is host memory in the emulation, so each collective runs through the
//! host communicator it wraps (TCP between ranks); what this adds is the ordering. Every
//! collective is queued on the rank's emulated device ([`EmulatedGpu::enqueue_host`]):
//! in stream order with the kernels around it, and recorded into a graph being captured,
//! to run again at each replay. Tensor-parallel and pipeline-parallel ranks, each with an
//! emulated device of its own, so take the path a replica takes over NCCL on GPUs — graph
//! capture included. The work a collective queues holds its buffers
//! ([`EmuBuf::alias`]), so memory a graph replays into outlives the step that made it.

use std::sync::{Arc, Mutex};

use strata_common::{Error, Result};

use crate::backend::cuda::emulator::{EmuBuf, EmulatedGpu};
use crate::backend::cuda::{CudaBackend, GpuTensor};
use crate::comm::StepChannel;
use crate::comm::{bytes_f32, f32_bytes, Collectives, CommStats, Communicator, DeviceCollectives, Exchange};

type Backend = CudaBackend<EmulatedGpu>;

/// A host communicator shared by the rank's step code and the work queued on its device.
#[derive(Clone)]
struct Shared(Arc<Mutex<Box<dyn Communicator>>>);

impl Shared {
    fn with<T>(&self, f: impl FnOnce(&mut dyn Communicator) -> T) -> T {
        f(self.0.lock().unwrap_or_else(|p| p.into_inner()).as_mut())
    }
}

impl Collectives for Shared {
    fn rank(&self) -> usize {
        self.with(|c| c.rank())
    }
    fn world(&self) -> usize {
        self.with(|c| c.world())
    }
    fn all_reduce_sum(&mut self, group: &[usize], data: &mut [f32]) -> Result<()> {
        self.with(|c| c.all_reduce_sum(group, data))
    }
    fn all_gather(&mut self, group: &[usize], local: &[f32]) -> Result<Vec<f32>> {
        self.with(|c| c.all_gather(group, local))
    }
    fn all_to_all(&mut self, group: &[usize], parts: &[&[f32]]) -> Result<Vec<Vec<f32>>> {
        self.with(|c| c.all_to_all(group, parts))
    }
    fn barrier(&mut self, group: &[usize]) -> Result<()> {
        self.with(|c| c.barrier(group))
    }
    fn stats(&self) -> CommStats {
        self.with(|c| c.stats())
    }
}

impl StepChannel for Shared {
    fn broadcast(&mut self, group: &[usize], root: usize, data: &mut Vec<u8>) -> Result<()> {
        self.with(|c| c.broadcast(group, root, data))
    }
    fn send(&mut self, to: usize, data: &[u8]) -> Result<()> {
        self.with(|c| c.send(to, data))
    }
    fn recv(&mut self, from: usize) -> Result<Vec<u8>> {
        self.with(|c| c.recv(from))
    }
    fn recv_idle(&mut self, from: usize) -> Result<Vec<u8>> {
        self.with(|c| c.recv_idle(from))
    }
}

/// Collectives of emulated device buffers over a host communicator (see the module).
pub struct EmulatedDeviceComm {
    host: Shared,
}

impl EmulatedDeviceComm {
    pub fn new(host: Box<dyn Communicator>) -> Self {
        EmulatedDeviceComm { host: Shared(Arc::new(Mutex::new(host))) }
    }
}

/// The f32s of an emulated buffer, `count` of them from element `at`, for as long as the
/// work that reads or writes them runs.
///
/// SAFETY (of every use below): the emulated device runs one piece of work at a time in
/// stream order, so nothing else touches the buffer meanwhile; every range lies inside a
/// tensor's `rows × cols` elements, which its buffer holds.
fn floats<'a>(buf: &EmuBuf, at: usize, count: usize) -> &'a mut [f32] {
    assert!((at + count) * 4 <= buf.len().max(4), "{count} f32s from {at} of a {}-byte buffer", buf.len());
    unsafe { std::slice::from_raw_parts_mut((buf.ptr() as *mut f32).add(at), count) }
}

fn elements(x: &GpuTensor<EmuBuf>) -> usize {
    x.rows * x.cols
}

fn mismatch(what: &str, got: usize, want: usize) -> Error {
    Error::Internal(format!("{what}: {got} values where {want} were due"))
}

impl DeviceCollectives<Backend> for EmulatedDeviceComm {
    fn in_stream_order(&self) -> bool {
        true
    }

    fn all_reduce(&mut self, b: &Backend, x: &mut GpuTensor<EmuBuf>, group: &[usize]) -> Result<()> {
        if group.len() <= 1 {
            return Ok(());
        }
        let (buf, n, host, group) = (x.buf().alias(), elements(x), self.host.clone(), group.to_vec());
        b.gpu().enqueue_host(Arc::new(move || host.clone().all_reduce_sum(&group, floats(&buf, 0, n))))
    }

    fn all_gather(
        &mut self,
        b: &Backend,
        x: &GpuTensor<EmuBuf>,
        group: &[usize],
    ) -> Result<GpuTensor<EmuBuf>> {
        let out = b.output(x.rows * group.len(), x.cols)?;
        let (send, recv, n) = (x.buf().alias(), out.buf().alias(), elements(x));
        let (host, group) = (self.host.clone(), group.to_vec());
        b.gpu().enqueue_host(Arc::new(move || {
            let all = host.clone().all_gather(&group, floats(&send, 0, n))?;
            if all.len() != n * group.len() {
                return Err(mismatch("an all-gather of tensors of one shape", all.len(), n * group.len()));
            }
            floats(&recv, 0, all.len()).copy_from_slice(&all);
            Ok(())
        }))?;
        Ok(out)
    }

    fn all_to_all(
        &mut self,
        b: &Backend,
        x: &GpuTensor<EmuBuf>,
        rows: Exchange<'_>,
        group: &[usize],
    ) -> Result<GpuTensor<EmuBuf>> {
        rows.check(group.len(), x.rows)?;
        let cols = x.cols;
        let out = b.output(rows.recv.iter().sum(), cols)?;
        let (send, recv) = (x.buf().alias(), out.buf().alias());
        let (sends, recvs) = (rows.send.to_vec(), rows.recv.to_vec());
        let (host, group) = (self.host.clone(), group.to_vec());
        b.gpu().enqueue_host(Arc::new(move || {
            let data = floats(&send, 0, sends.iter().sum::<usize>() * cols);
            let mut parts = Vec::with_capacity(sends.len());
            let mut at = 0;
            for &r in &sends {
                parts.push(&data[at * cols..(at + r) * cols]);
                at += r;
            }
            let got = host.clone().all_to_all(&group, &parts)?;
            let mut at = 0;
            for ((part, &want), &from) in got.iter().zip(&recvs).zip(&group) {
                if part.len() != want * cols {
                    return Err(mismatch(
                        &format!("all-to-all rows from rank {from}"),
                        part.len(),
                        want * cols,
                    ));
                }
                floats(&recv, at, part.len()).copy_from_slice(part);
                at += part.len();
            }
            Ok(())
        }))?;
        Ok(out)
    }

    fn send(&mut self, b: &Backend, x: &GpuTensor<EmuBuf>, to: usize) -> Result<()> {
        let (buf, n, host) = (x.buf().alias(), elements(x), self.host.clone());
        b.gpu().enqueue_host(Arc::new(move || host.clone().send(to, f32_bytes(floats(&buf, 0, n)))))
    }

    fn recv(&mut self, b: &Backend, rows: usize, cols: usize, from: usize) -> Result<GpuTensor<EmuBuf>> {
        let out = b.output(rows, cols)?;
        let (buf, host) = (out.buf().alias(), self.host.clone());
        b.gpu().enqueue_host(Arc::new(move || {
            let got = bytes_f32(&host.clone().recv(from)?);
            if got.len() != rows * cols {
                return Err(mismatch(
                    &format!("[{rows}, {cols}] hidden states from rank {from}"),
                    got.len(),
                    rows * cols,
                ));
            }
            floats(&buf, 0, got.len()).copy_from_slice(&got);
            Ok(())
        }))?;
        Ok(out)
    }

    fn host(&mut self) -> &mut dyn Communicator {
        &mut self.host
    }

    fn stats(&self) -> CommStats {
        self.host.stats()
    }
}
