//! NCCL as the replica's [`DeviceCollectives`](super::DeviceCollectives) on GPUs, and what
//! stands in for it where there is none.
//!
//! - With the `cuda` feature, [`NcclComm`] runs every collective through NCCL on the
//!   device buffers of the CUDA backend, ordered on its stream (`real.rs`).
//! - Without it, the same names answer that the build has no CUDA (`stub.rs`), so
//!   callers build one way and never test a feature.
//! - With `cuda-emulator` (tests), [`emulated::EmulatedDeviceComm`] gives the CUDA
//!   emulator's devices collectives that are device work, as NCCL's are.

#[cfg(feature = "cuda-emulator")]
pub mod emulated;
#[cfg(feature = "cuda")]
mod real;
#[cfg(not(feature = "cuda"))]
mod stub;

#[cfg(feature = "cuda")]
pub use real::*;
#[cfg(not(feature = "cuda"))]
pub use stub::*;

/// The groups of a `tp × pp` replica's NCCL communicators: each stage's TP group, then
/// each pair of ranks that hand hidden states from one stage to the next (stage `s`'s TP
/// rank `t` to stage `s + 1`'s).
pub fn replica_groups(tp: usize, pp: usize) -> Vec<Vec<usize>> {
    let mut groups: Vec<Vec<usize>> =
        (0..pp).filter(|_| tp > 1).map(|s| (s * tp..(s + 1) * tp).collect()).collect();
    groups.extend(pipeline_pairs(tp, pp));
    groups
}

/// Stage-to-stage pairs of a `tp × pp` replica, `[sender, receiver]`.
pub fn pipeline_pairs(tp: usize, pp: usize) -> Vec<Vec<usize>> {
    (0..pp.saturating_sub(1)).flat_map(|s| (0..tp).map(move |t| vec![s * tp + t, (s + 1) * tp + t])).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replica_groups_name_each_stage_and_each_hand_off() {
        assert_eq!(replica_groups(2, 2), vec![vec![0, 1], vec![2, 3], vec![0, 2], vec![1, 3]]);
        assert_eq!(replica_groups(1, 3), vec![vec![0, 1], vec![1, 2]]);
        assert_eq!(replica_groups(4, 1), vec![vec![0, 1, 2, 3]]);
    }
}
