//! NCCL in a build without the `cuda` feature: the names callers use, every way in an
//! error that says how to get the real one. An [`NcclComm`] cannot be made here, so its
//! collectives can never run.

use std::convert::Infallible;

use strata_common::Result;

use crate::backend::cuda::driver::{unavailable, CudaGpu, NoDevice};
use crate::backend::cuda::{CudaBackend, GpuTensor};
use crate::comm::{CommStats, Communicator, DeviceCollectives, Exchange};

type Backend = CudaBackend<CudaGpu>;
type Tensor = GpuTensor<NoDevice>;

/// What [`NcclComm::bench_all_reduce`] measured on one rank.
#[derive(Debug, Clone, Copy)]
pub struct AllReduceBench {
    /// Median seconds per all-reduce.
    pub seconds: f64,
    /// The first all-reduce of ones gave the group size everywhere.
    pub correct: bool,
}

/// An NCCL communicator, which this build cannot join.
pub struct NcclComm {
    never: Infallible,
}

impl NcclComm {
    pub fn new(_device: usize, _bootstrap: Box<dyn Communicator>, _groups: &[Vec<usize>]) -> Result<Self> {
        Err(unavailable())
    }

    pub fn bench_all_reduce(
        &mut self,
        _device: usize,
        _group: &[usize],
        _count: usize,
        _iters: usize,
    ) -> Result<AllReduceBench> {
        match self.never {}
    }
}

/// Number of CUDA devices the driver sees: none this build can use.
pub fn device_count() -> Result<usize> {
    Err(unavailable())
}

pub fn local_group(_first_device: usize, _world: usize, _groups: &[Vec<usize>]) -> Result<Vec<NcclComm>> {
    Err(unavailable())
}

impl DeviceCollectives<Backend> for NcclComm {
    fn in_stream_order(&self) -> bool {
        match self.never {}
    }
    fn all_reduce(&mut self, _: &Backend, _: &mut Tensor, _: &[usize]) -> Result<()> {
        match self.never {}
    }
    fn all_gather(&mut self, _: &Backend, _: &Tensor, _: &[usize]) -> Result<Tensor> {
        match self.never {}
    }
    fn all_to_all(&mut self, _: &Backend, _: &Tensor, _: Exchange<'_>, _: &[usize]) -> Result<Tensor> {
        match self.never {}
    }
    fn send(&mut self, _: &Backend, _: &Tensor, _: usize) -> Result<()> {
        match self.never {}
    }
    fn recv(&mut self, _: &Backend, _: usize, _: usize, _: usize) -> Result<Tensor> {
        match self.never {}
    }
    fn host(&mut self) -> &mut dyn Communicator {
        match self.never {}
    }
    fn stats(&self) -> CommStats {
        match self.never {}
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_way_in_says_the_build_has_no_cuda() {
        let bootstrap = Box::new(crate::comm::Solo);
        let errors = [
            super::NcclComm::new(0, bootstrap, &[]).err().unwrap(),
            super::device_count().unwrap_err(),
            super::local_group(0, 2, &[]).err().unwrap(),
        ];
        for e in errors {
            assert!(e.to_string().contains("--features cuda"), "{e}");
            assert_eq!(e.class(), strata_common::ErrorClass::Unavailable);
        }
    }
}
