//! Communication between the ranks of one replica, as two seams.
//!
//! - [`Collectives`]: what the model's math needs — an all-reduce after the row-parallel
//!   matmuls, `all_gather` after the vocabulary-split LM head, over the group of ranks
//!   they run in (a pipeline stage's TP group). The model reduces a backend tensor through
//!   `Backend::all_reduce`, whose default goes through host memory; the CUDA backend
//!   hands an NCCL communicator ([`Collectives::as_any_mut`]) its device buffer instead,
//!   ordered on the backend's stream (no host copy, no host synchronisation), and falls
//!   back to the host path for any other communicator, so the model calls nothing else.
//! - [`StepChannel`]: what the replica's plumbing needs — the leader's messages to every
//!   rank ([`plan`]: KV cache size, step plans, shutdown) and the hidden states pipeline
//!   stages pass on, as bytes.
//!
//! A rank's endpoint is a [`Communicator`]: both at once. [`tcp::TcpComm`] implements both
//! over persistent loopback or LAN TCP connections (CPU workers); the NCCL communicator
//! (feature `cuda`) runs the collectives through NCCL and the channel over the TCP mesh it
//! is bootstrapped from. [`contract`] holds the checks every implementation must pass.

pub mod contract;
pub mod handshake;
#[cfg(feature = "cuda")]
pub mod nccl;
pub mod plan;
pub mod tcp;

use strata_common::Result;

/// Bytes and time spent in communication, for benchmarks.
#[derive(Debug, Clone, Copy, Default)]
pub struct CommStats {
    pub bytes_sent: u64,
    pub busy_ns: u64,
}

/// Collective operations over a group of ranks.
pub trait Collectives: Send {
    fn rank(&self) -> usize;
    fn world(&self) -> usize;
    /// Elementwise sum of `data` across `group` (ascending ranks, including this one);
    /// every member ends with the sum.
    fn all_reduce_sum(&mut self, group: &[usize], data: &mut [f32]) -> Result<()>;
    /// Every member's `local` concatenated in group order (sizes may differ).
    fn all_gather(&mut self, group: &[usize], local: &[f32]) -> Result<Vec<f32>>;
    /// Returns once every member of `group` has called it.
    fn barrier(&mut self, group: &[usize]) -> Result<()>;
    fn stats(&self) -> CommStats;
    /// This communicator as `Any`, for a device backend that hands a device communicator
    /// (NCCL) its buffers directly; None for communicators of host memory (TCP).
    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        None
    }
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

/// One rank's endpoint: collectives and the step channel.
pub trait Communicator: Collectives + StepChannel {}

impl<T: Collectives + StepChannel + ?Sized> Communicator for T {}

/// f32 slices as bytes (little-endian hosts).
pub fn f32_bytes(v: &[f32]) -> &[u8] {
    bytemuck::cast_slice(v)
}

/// Bytes back into f32s.
pub fn bytes_f32(b: &[u8]) -> Vec<f32> {
    bytemuck::pod_collect_to_vec(b)
}
