//! Communication between the ranks of one replica, as seams.
//!
//! - [`DeviceCollectives`]: what the model's math needs, on its backend's tensors — an
//!   all-reduce after the row-parallel matmuls, an all-gather of vocabulary shards, an
//!   all-to-all (expert parallelism's dispatch and combine), and the hidden states one
//!   pipeline stage sends the next. Implementations: NCCL ([`nccl`]: on the backend's
//!   stream, so a graph captures them), the CUDA emulator's stand-in for it
//!   (`nccl::emulated`), [`HostStaged`] (any backend's tensors through host memory and a
//!   host communicator: CPU ranks over TCP) and [`Solo`] (a one-rank replica: nothing to
//!   do). [`device_contract`] holds the checks every implementation must pass.
//! - [`Collectives`] and [`StepChannel`]: the host side, f32 slices and bytes — the
//!   leader's messages to every rank ([`plan`]: KV cache size, steps, shutdown), the
//!   reduced rows ranks merge, and everything [`HostStaged`] moves. A rank's host endpoint
//!   is a [`Communicator`], both at once; [`tcp::TcpComm`] implements it over persistent
//!   loopback or LAN TCP connections, and [`contract`] holds its checks.
//!
//! A rank talks only through its `DeviceCollectives`, whose [`DeviceCollectives::host`]
//! is its host endpoint: nothing in the engine asks what a communicator is underneath.

pub mod contract;
pub mod device_contract;
pub mod handshake;
pub mod nccl;
pub mod plan;
mod staged;
pub mod tcp;

use strata_common::{Error, Result};

use crate::backend::Tensors;

pub use staged::HostStaged;

/// Bytes and time spent in communication, for benchmarks.
#[derive(Debug, Clone, Copy, Default)]
pub struct CommStats {
    pub bytes_sent: u64,
    pub busy_ns: u64,
}

impl CommStats {
    /// Both counters added.
    pub fn plus(self, other: CommStats) -> CommStats {
        CommStats { bytes_sent: self.bytes_sent + other.bytes_sent, busy_ns: self.busy_ns + other.busy_ns }
    }
}

/// Collective operations over a group of ranks, on host memory.
pub trait Collectives: Send {
    fn rank(&self) -> usize;
    fn world(&self) -> usize;
    /// Elementwise sum of `data` across `group` (ascending ranks, including this one);
    /// every member ends with the sum.
    fn all_reduce_sum(&mut self, group: &[usize], data: &mut [f32]) -> Result<()>;
    /// Every member's `local` concatenated in group order (sizes may differ).
    fn all_gather(&mut self, group: &[usize], local: &[f32]) -> Result<Vec<f32>>;
    /// `parts[i]` to the group's i-th member; returns what each member sent this one, in
    /// group order (sizes may differ, and may be 0).
    fn all_to_all(&mut self, group: &[usize], parts: &[&[f32]]) -> Result<Vec<Vec<f32>>>;
    /// Returns once every member of `group` has called it.
    fn barrier(&mut self, group: &[usize]) -> Result<()>;
    fn stats(&self) -> CommStats;
}

/// Point-to-point messages between the ranks of a replica.
pub trait StepChannel: Send {
    /// `root`'s bytes on every member of `group`.
    fn broadcast(&mut self, group: &[usize], root: usize, data: &mut Vec<u8>) -> Result<()>;
    fn send(&mut self, to: usize, data: &[u8]) -> Result<()>;
    fn recv(&mut self, from: usize) -> Result<Vec<u8>>;
    /// Like `recv`, but waits as long as it takes for the message to start (a follower
    /// waiting for the leader's next step while the replica is idle); the peer closing
    /// the connection still ends the wait with an error.
    fn recv_idle(&mut self, from: usize) -> Result<Vec<u8>> {
        self.recv(from)
    }
}

/// One rank's host endpoint: collectives and the step channel.
pub trait Communicator: Collectives + StepChannel {}

impl<T: Collectives + StepChannel + ?Sized> Communicator for T {}

/// The row counts of an all-to-all: `send[i]` rows of the input (in rank blocks, group
/// order) go to the group's i-th member, `recv[i]` rows come from it. Both sides know
/// both (expert parallelism routes every token on every rank), so nothing is exchanged
/// to learn them and a graph can capture the exchange.
#[derive(Debug, Clone, Copy)]
pub struct Exchange<'a> {
    pub send: &'a [usize],
    pub recv: &'a [usize],
}

impl Exchange<'_> {
    /// Checks the counts against a group of `g` and an input of `rows` rows.
    pub fn check(&self, g: usize, rows: usize) -> Result<()> {
        if self.send.len() != g || self.recv.len() != g {
            return Err(Error::Internal(format!(
                "an all-to-all over {g} ranks with {} send and {} receive counts",
                self.send.len(),
                self.recv.len()
            )));
        }
        let sent: usize = self.send.iter().sum();
        if sent != rows {
            return Err(Error::Internal(format!("an all-to-all sends {sent} of its input's {rows} rows")));
        }
        Ok(())
    }
}

/// Collectives on a backend's tensors: what the model calls inside a step. Groups are
/// ascending ranks including this one; every member calls each collective in the same
/// order. Where [`DeviceCollectives::in_stream_order`], they are device work queued
/// after what the backend queued before (no host synchronisation) and a graph capture
/// records them like kernels.
pub trait DeviceCollectives<B: Tensors>: Send {
    /// Whether the collectives run on the device in the backend's stream order, so a graph
    /// can capture a step that uses them (true for a one-rank replica, which has none).
    fn in_stream_order(&self) -> bool;
    /// Sums `x` elementwise across `group`, in place.
    fn all_reduce(&mut self, b: &B, x: &mut B::Tensor, group: &[usize]) -> Result<()>;
    /// Every member's `x` (all of one shape) as rank blocks of rows in group order:
    /// `[g · rows, cols]`.
    fn all_gather(&mut self, b: &B, x: &B::Tensor, group: &[usize]) -> Result<B::Tensor>;
    /// Rows of `x` to the members of `group` as `rows` says; returns the rows received,
    /// rank blocks in group order (`[Σ rows.recv, cols]`).
    fn all_to_all(&mut self, b: &B, x: &B::Tensor, rows: Exchange<'_>, group: &[usize]) -> Result<B::Tensor>;
    /// Sends `x` to rank `to` (the next pipeline stage's).
    fn send(&mut self, b: &B, x: &B::Tensor, to: usize) -> Result<()>;
    /// Receives `[rows, cols]` from rank `from`, the other end of [`DeviceCollectives::send`].
    fn recv(&mut self, b: &B, rows: usize, cols: usize, from: usize) -> Result<B::Tensor>;
    /// This rank's host endpoint: step plans, replies, merges of reduced rows.
    fn host(&mut self) -> &mut dyn Communicator;
    /// Bytes sent and time spent, device and host together.
    fn stats(&self) -> CommStats;
}

/// The communicator of a one-rank replica: every collective over its group of one is the
/// identity, and there is no one to send to. The model calls no collective over a group
/// of one, so a graph never captures one of these; the copies its gather and all-to-all
/// return (through host memory) are for callers that do, such as the contract checks.
#[derive(Debug, Default)]
pub struct Solo;

impl Collectives for Solo {
    fn rank(&self) -> usize {
        0
    }
    fn world(&self) -> usize {
        1
    }
    fn all_reduce_sum(&mut self, group: &[usize], _: &mut [f32]) -> Result<()> {
        alone(group)
    }
    fn all_gather(&mut self, group: &[usize], local: &[f32]) -> Result<Vec<f32>> {
        alone(group)?;
        Ok(local.to_vec())
    }
    fn all_to_all(&mut self, group: &[usize], parts: &[&[f32]]) -> Result<Vec<Vec<f32>>> {
        alone(group)?;
        Ok(parts.iter().map(|p| p.to_vec()).collect())
    }
    fn barrier(&mut self, group: &[usize]) -> Result<()> {
        alone(group)
    }
    fn stats(&self) -> CommStats {
        CommStats::default()
    }
}

impl StepChannel for Solo {
    fn broadcast(&mut self, group: &[usize], _: usize, _: &mut Vec<u8>) -> Result<()> {
        alone(group)
    }
    fn send(&mut self, to: usize, _: &[u8]) -> Result<()> {
        Err(no_peer(to))
    }
    fn recv(&mut self, from: usize) -> Result<Vec<u8>> {
        Err(no_peer(from))
    }
}

impl<B: Tensors> DeviceCollectives<B> for Solo {
    fn in_stream_order(&self) -> bool {
        true
    }
    fn all_reduce(&mut self, _: &B, _: &mut B::Tensor, group: &[usize]) -> Result<()> {
        alone(group)
    }
    fn all_gather(&mut self, b: &B, x: &B::Tensor, group: &[usize]) -> Result<B::Tensor> {
        alone(group)?;
        let (rows, cols) = b.shape(x);
        b.upload(b.to_host(x)?, rows, cols)
    }
    fn all_to_all(&mut self, b: &B, x: &B::Tensor, rows: Exchange<'_>, group: &[usize]) -> Result<B::Tensor> {
        alone(group)?;
        let (n, cols) = b.shape(x);
        rows.check(1, n)?;
        if rows.recv[0] != n {
            return Err(Error::Internal(format!(
                "{} rows to receive from the {n} this rank sends itself",
                rows.recv[0]
            )));
        }
        b.upload(b.to_host(x)?, n, cols)
    }
    fn send(&mut self, _: &B, _: &B::Tensor, to: usize) -> Result<()> {
        Err(no_peer(to))
    }
    fn recv(&mut self, _: &B, _: usize, _: usize, from: usize) -> Result<B::Tensor> {
        Err(no_peer(from))
    }
    fn host(&mut self) -> &mut dyn Communicator {
        self
    }
    fn stats(&self) -> CommStats {
        CommStats::default()
    }
}

fn no_peer(rank: usize) -> Error {
    Error::Internal(format!("a one-rank replica has no rank {rank} to talk to"))
}

/// A one-rank replica's groups hold only rank 0.
fn alone(group: &[usize]) -> Result<()> {
    match group {
        [] | [0] => Ok(()),
        other => Err(Error::Internal(format!("a one-rank replica has no group {other:?}"))),
    }
}

/// f32 slices as bytes (little-endian hosts).
pub fn f32_bytes(v: &[f32]) -> &[u8] {
    bytemuck::cast_slice(v)
}

/// Bytes back into f32s.
pub fn bytes_f32(b: &[u8]) -> Vec<f32> {
    bytemuck::pod_collect_to_vec(b)
}
