//! [`HostStaged`]: collectives on any backend's tensors through host memory and a host
//! [`Communicator`] — what CPU ranks use over TCP, and what a device backend falls back to
//! where no communicator of device buffers is at hand. Nothing it does is device work, so
//! a graph cannot capture a step that uses it ([`DeviceCollectives::in_stream_order`] is
//! false). Every length received is checked against the shape it must fill before
//! anything is uploaded.

use strata_common::{Error, Result};

use super::{bytes_f32, f32_bytes, CommStats, Communicator, DeviceCollectives, Exchange};
use crate::backend::Tensors;

pub struct HostStaged {
    host: Box<dyn Communicator>,
}

impl HostStaged {
    pub fn new(host: Box<dyn Communicator>) -> Self {
        HostStaged { host }
    }
}

fn short(what: &str, got: usize, want: usize) -> Error {
    Error::Internal(format!("{what}: {got} values where {want} were due"))
}

impl<B: Tensors> DeviceCollectives<B> for HostStaged {
    fn in_stream_order(&self) -> bool {
        false
    }

    fn all_reduce(&mut self, b: &B, x: &mut B::Tensor, group: &[usize]) -> Result<()> {
        if group.len() <= 1 {
            return Ok(());
        }
        let host = &mut self.host;
        b.with_host_mut(x, &mut |data| host.all_reduce_sum(group, data))
    }

    fn all_gather(&mut self, b: &B, x: &B::Tensor, group: &[usize]) -> Result<B::Tensor> {
        let (rows, cols) = b.shape(x);
        let all = self.host.all_gather(group, &b.to_host(x)?)?;
        let want = rows * cols * group.len();
        if all.len() != want {
            return Err(short("all-gather of tensors of one shape", all.len(), want));
        }
        b.upload(all, rows * group.len(), cols)
    }

    fn all_to_all(&mut self, b: &B, x: &B::Tensor, rows: Exchange<'_>, group: &[usize]) -> Result<B::Tensor> {
        let (n, cols) = b.shape(x);
        rows.check(group.len(), n)?;
        let data = b.to_host(x)?;
        let mut parts = Vec::with_capacity(group.len());
        let mut at = 0;
        for &r in rows.send {
            parts.push(&data[at * cols..(at + r) * cols]);
            at += r;
        }
        let got = self.host.all_to_all(group, &parts)?;
        let mut out = Vec::with_capacity(rows.recv.iter().sum::<usize>() * cols);
        for ((part, &want), &from) in got.iter().zip(rows.recv).zip(group) {
            if part.len() != want * cols {
                return Err(short(&format!("all-to-all rows from rank {from}"), part.len(), want * cols));
            }
            out.extend_from_slice(part);
        }
        b.upload(out, rows.recv.iter().sum(), cols)
    }

    fn send(&mut self, b: &B, x: &B::Tensor, to: usize) -> Result<()> {
        self.host.send(to, f32_bytes(&b.to_host(x)?))
    }

    fn recv(&mut self, b: &B, rows: usize, cols: usize, from: usize) -> Result<B::Tensor> {
        let data = bytes_f32(&self.host.recv(from)?);
        if data.len() != rows * cols {
            return Err(Error::Internal(format!(
                "{} values from rank {from} for [{rows}, {cols}] hidden states",
                data.len()
            )));
        }
        b.upload(data, rows, cols)
    }

    fn host(&mut self) -> &mut dyn Communicator {
        self.host.as_mut()
    }

    fn stats(&self) -> CommStats {
        self.host.stats()
    }
}
