//! What every [`DeviceCollectives`] must do, written once as checks over any group of
//! ranks: the CPU's [`HostStaged`](super::HostStaged) over TCP and [`Solo`](super::Solo)
//! run them in the engine's tests, the CUDA emulator's stand-in for NCCL in the emulator
//! suite, and `strata gpu-check comm` runs them over NCCL on the GPUs of the machine.
//!
//! A check takes one rank per member of a group (ranks `0..world`, in order): its backend
//! and its collectives. Every rank runs on a thread of its own, and the check returns an
//! error naming the first rank and value that differ from what the contract promises.
//! Values are small integers, so every summation order is exact.

use strata_common::{Error, Result};

use super::{DeviceCollectives, Exchange};
use crate::backend::Tensors;

/// One rank of a checked group: its backend and its collectives.
pub type Rank<B> = (B, Box<dyn DeviceCollectives<B>>);

/// The groups the checks use for `world` ranks: everyone, the two halves (a replica's two
/// stages' TP groups), then each neighbour pair (`[r, r + 1]`, the stage hand-offs). A
/// communicator that needs its groups up front (NCCL) must be built with these.
pub fn groups(world: usize) -> Vec<Vec<usize>> {
    let mut out = super::contract::groups(world);
    out.extend((1..world).map(|r| vec![r - 1, r]));
    out.dedup();
    out
}

/// Runs `f` on every rank at once (collectives need all members) and collects the results
/// in rank order; the first failing rank's error wins.
fn on_every_rank<B: Tensors, T: Send>(
    ranks: Vec<Rank<B>>,
    f: impl Fn(usize, usize, &B, &mut dyn DeviceCollectives<B>) -> Result<T> + Sync,
) -> Result<Vec<T>> {
    let (f, world) = (&f, ranks.len());
    let results: Vec<Result<T>> = std::thread::scope(|s| {
        let handles: Vec<_> = ranks
            .into_iter()
            .enumerate()
            .map(|(rank, (b, mut c))| s.spawn(move || f(rank, world, &b, c.as_mut())))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(Error::Internal("a rank's check panicked".into()))))
            .collect()
    });
    results.into_iter().collect()
}

fn differs(check: &str, rank: usize, got: &[f32], want: &[f32]) -> Result<()> {
    if got == want {
        return Ok(());
    }
    let cut = |v: &[f32]| {
        let s = format!("{:?}", &v[..v.len().min(24)]);
        if v.len() > 24 {
            format!("{s}… ({} values)", v.len())
        } else {
            s
        }
    };
    Err(Error::Internal(format!("{check}: rank {rank} got {} where {} was due", cut(got), cut(want))))
}

fn upload<B: Tensors>(b: &B, rows: usize, cols: usize, value: impl Fn(usize) -> f32) -> Result<B::Tensor> {
    b.upload((0..rows * cols).map(value).collect(), rows, cols)
}

/// All-reduce of a `[rows, cols]` tensor over everyone, then within each half at once
/// (two groups reducing side by side): every member ends with its group's exact sum.
pub fn all_reduce<B: Tensors>(ranks: Vec<Rank<B>>, rows: usize, cols: usize) -> Result<()> {
    let value = |rank: usize, i: usize| (rank * 1000 + i % 1000) as f32;
    let halves = |world: usize, rank: usize| -> Vec<usize> {
        let half = (world / 2).max(1);
        if rank < half {
            (0..half).collect()
        } else {
            (half..world).collect()
        }
    };
    let out = on_every_rank(ranks, |rank, world, b, c| {
        let everyone: Vec<usize> = (0..world).collect();
        let mut x = upload(b, rows, cols, |i| value(rank, i))?;
        c.all_reduce(b, &mut x, &everyone)?;
        let mut y = upload(b, rows, cols, |i| value(rank, i))?;
        c.all_reduce(b, &mut y, &halves(world, rank))?;
        Ok((world, b.to_host(&x)?, b.to_host(&y)?))
    })?;
    for (rank, (world, all, half)) in out.into_iter().enumerate() {
        let sum = |group: &[usize]| -> Vec<f32> {
            (0..rows * cols).map(|i| group.iter().map(|&r| value(r, i)).sum()).collect()
        };
        let everyone: Vec<usize> = (0..world).collect();
        differs(&format!("all_reduce of [{rows}, {cols}] over everyone"), rank, &all, &sum(&everyone))?;
        let mine = halves(world, rank);
        differs(&format!("all_reduce over {mine:?}"), rank, &half, &sum(&mine))?;
    }
    Ok(())
}

/// All-gather of `[2, 5]` tensors: rank blocks of rows in group order.
pub fn all_gather<B: Tensors>(ranks: Vec<Rank<B>>) -> Result<()> {
    let (rows, cols) = (2, 5);
    let value = |rank: usize, i: usize| (rank * 100 + i) as f32;
    let out = on_every_rank(ranks, |rank, world, b, c| {
        let everyone: Vec<usize> = (0..world).collect();
        let all = c.all_gather(b, &upload(b, rows, cols, |i| value(rank, i))?, &everyone)?;
        if b.shape(&all) != (rows * world, cols) {
            return Err(Error::Internal(format!("all_gather: rank {rank} got shape {:?}", b.shape(&all))));
        }
        Ok((world, b.to_host(&all)?))
    })?;
    for (rank, (world, got)) in out.into_iter().enumerate() {
        let want: Vec<f32> = (0..world).flat_map(|r| (0..rows * cols).map(move |i| value(r, i))).collect();
        differs("all_gather of [2, 5] over everyone", rank, &got, &want)?;
    }
    Ok(())
}

/// Rows rank `from` sends rank `to` in [`all_to_all_uneven`]: 0, 1 or 2, so some pairs
/// exchange nothing and no two counts need agree.
fn rows_between(from: usize, to: usize) -> usize {
    (from + 2 * to + 1) % 3
}

/// All-to-all with uneven counts (some zero), as expert parallelism's dispatch sends each
/// rank's tokens to their experts' ranks: every row arrives at the rank it was meant for,
/// in rank blocks in group order, each block in the order it was sent.
pub fn all_to_all_uneven<B: Tensors>(ranks: Vec<Rank<B>>) -> Result<()> {
    let cols = 3;
    // Row k of what `from` sends `to`: [from, to, k].
    let row = |from: usize, to: usize, k: usize| [from as f32, to as f32, k as f32];
    let out = on_every_rank(ranks, |rank, world, b, c| {
        let everyone: Vec<usize> = (0..world).collect();
        let send: Vec<usize> = (0..world).map(|to| rows_between(rank, to)).collect();
        let recv: Vec<usize> = (0..world).map(|from| rows_between(from, rank)).collect();
        let data: Vec<f32> =
            (0..world).flat_map(|to| (0..send[to]).flat_map(move |k| row(rank, to, k))).collect();
        let x = b.upload(data, send.iter().sum(), cols)?;
        let got = c.all_to_all(b, &x, Exchange { send: &send, recv: &recv }, &everyone)?;
        Ok((world, b.to_host(&got)?))
    })?;
    for (rank, (world, got)) in out.into_iter().enumerate() {
        let want: Vec<f32> = (0..world)
            .flat_map(|from| (0..rows_between(from, rank)).flat_map(move |k| row(from, rank, k)))
            .collect();
        differs("all_to_all with uneven counts", rank, &got, &want)?;
    }
    Ok(())
}

/// Counts that do not describe the input are refused on every rank, before anything is
/// sent (so no rank waits on a peer that gave up).
pub fn all_to_all_refuses_wrong_counts<B: Tensors>(ranks: Vec<Rank<B>>) -> Result<()> {
    let out = on_every_rank(ranks, |rank, world, b, c| {
        let everyone: Vec<usize> = (0..world).collect();
        let x = upload(b, 2, 3, |i| i as f32)?;
        // Three rows to every member of a two-row input; one count short of the group.
        let (wrong, few) = (vec![3; world], vec![1; world - 1]);
        let sums_wrong = c.all_to_all(b, &x, Exchange { send: &wrong, recv: &wrong }, &everyone);
        let too_few = c.all_to_all(b, &x, Exchange { send: &few, recv: &few }, &everyone);
        Ok((rank, world, sums_wrong.is_err(), too_few.is_err()))
    })?;
    for (rank, world, sums_wrong, too_few) in out {
        if !sums_wrong || !too_few {
            return Err(Error::Internal(format!(
                "all_to_all on rank {rank} of {world} took counts that do not describe its input"
            )));
        }
    }
    Ok(())
}

/// Hidden states handed down a chain of stages: rank `r` receives from `r − 1`, adds `r`,
/// and sends to `r + 1`; every rank sees the sum of the ranks before it.
pub fn send_recv_chain<B: Tensors>(ranks: Vec<Rank<B>>) -> Result<()> {
    let (rows, cols) = (3, 4);
    let out = on_every_rank(ranks, |rank, world, b, c| {
        let mut x = match rank {
            0 => upload(b, rows, cols, |i| i as f32)?,
            _ => c.recv(b, rows, cols, rank - 1)?,
        };
        let got = b.to_host(&x)?;
        b.with_host_mut(&mut x, &mut |v| {
            v.iter_mut().for_each(|e| *e += rank as f32);
            Ok(())
        })?;
        if rank + 1 < world {
            c.send(b, &b.upload(b.to_host(&x)?, rows, cols)?, rank + 1)?;
        }
        Ok(got)
    })?;
    for (rank, got) in out.into_iter().enumerate() {
        let before: usize = (0..rank).sum();
        let want: Vec<f32> = (0..rows * cols).map(|i| (i + before) as f32).collect();
        differs("send/recv down a chain of ranks", rank, &got, &want)?;
    }
    Ok(())
}

/// The host endpoint is the replica's, in the same rank numbering: rank 0 sends every
/// other rank a message through it.
pub fn host_messages<B: Tensors>(ranks: Vec<Rank<B>>) -> Result<()> {
    let out = on_every_rank(ranks, |rank, world, _, c| {
        let host = c.host();
        if host.rank() != rank || host.world() != world {
            return Err(Error::Internal(format!(
                "host endpoint of rank {rank} of {world} says rank {} of {}",
                host.rank(),
                host.world()
            )));
        }
        if rank == 0 {
            (1..world).try_for_each(|r| host.send(r, &[r as u8; 4]))?;
            return Ok(Vec::new());
        }
        host.recv(0)
    })?;
    for (rank, got) in out.into_iter().enumerate().skip(1) {
        if got != [rank as u8; 4] {
            return Err(Error::Internal(format!("rank {rank} got {got:?} from rank 0's host endpoint")));
        }
    }
    Ok(())
}

/// The checks by name, for reports: each builds its own group with `make(world)`.
pub fn run_all<B: Tensors>(
    world: usize,
    mut make: impl FnMut(usize) -> Result<Vec<Rank<B>>>,
) -> Vec<(String, Result<()>)> {
    let mut out = Vec::new();
    for (rows, cols) in [(1, 1), (3, 7), (64, 1024)] {
        let r = make(world).and_then(|g| all_reduce(g, rows, cols));
        out.push((format!("all_reduce, [{rows}, {cols}]"), r));
    }
    type Check<B> = fn(Vec<Rank<B>>) -> Result<()>;
    let checks: [(&str, Check<B>); 5] = [
        ("all_gather", all_gather),
        ("all_to_all, uneven counts", all_to_all_uneven),
        ("all_to_all refuses wrong counts", all_to_all_refuses_wrong_counts),
        ("send/recv down a chain", send_recv_chain),
        ("host endpoint", host_messages),
    ];
    for (name, check) in checks {
        out.push((name.to_string(), make(world).and_then(check)));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;
    use crate::comm::{tcp, CommStats, Communicator, HostStaged, Solo};

    fn staged(world: usize) -> Result<Vec<Rank<CpuBackend>>> {
        let meshes = tcp::local_group(world, std::time::Duration::from_secs(20))?;
        Ok(meshes
            .into_iter()
            .map(|m| {
                (CpuBackend::new(), Box::new(HostStaged::new(Box::new(m))) as Box<dyn DeviceCollectives<_>>)
            })
            .collect())
    }

    #[test]
    fn host_staged_cpu_tensors_keep_the_contract() {
        for world in 1..=4 {
            for (check, result) in run_all(world, staged) {
                result.unwrap_or_else(|e| panic!("world {world}, {check}: {e}"));
            }
        }
    }

    #[test]
    fn a_one_rank_replica_keeps_the_contract() {
        let solo =
            |_: usize| -> Result<Vec<Rank<CpuBackend>>> { Ok(vec![(CpuBackend::new(), Box::new(Solo))]) };
        for (check, result) in run_all(1, solo) {
            result.unwrap_or_else(|e| panic!("{check}: {e}"));
        }
    }

    /// The checks can fail: collectives that skip the sum and keep the rows they were to
    /// send are caught.
    #[test]
    fn collectives_that_skip_their_work_are_caught() {
        struct Lazy(HostStaged);
        impl DeviceCollectives<CpuBackend> for Lazy {
            fn in_stream_order(&self) -> bool {
                false
            }
            fn all_reduce(
                &mut self,
                _: &CpuBackend,
                _: &mut crate::backend::cpu::CpuTensor,
                _: &[usize],
            ) -> Result<()> {
                Ok(())
            }
            fn all_gather(
                &mut self,
                b: &CpuBackend,
                x: &crate::backend::cpu::CpuTensor,
                g: &[usize],
            ) -> Result<crate::backend::cpu::CpuTensor> {
                self.0.all_gather(b, x, g)
            }
            fn all_to_all(
                &mut self,
                b: &CpuBackend,
                x: &crate::backend::cpu::CpuTensor,
                rows: Exchange<'_>,
                g: &[usize],
            ) -> Result<crate::backend::cpu::CpuTensor> {
                rows.check(g.len(), b.shape(x).0)?;
                b.upload(b.to_host(x)?, b.shape(x).0, b.shape(x).1)
            }
            fn send(&mut self, b: &CpuBackend, x: &crate::backend::cpu::CpuTensor, to: usize) -> Result<()> {
                self.0.send(b, x, to)
            }
            fn recv(
                &mut self,
                b: &CpuBackend,
                r: usize,
                c: usize,
                from: usize,
            ) -> Result<crate::backend::cpu::CpuTensor> {
                self.0.recv(b, r, c, from)
            }
            fn host(&mut self) -> &mut dyn Communicator {
                DeviceCollectives::<CpuBackend>::host(&mut self.0)
            }
            fn stats(&self) -> CommStats {
                DeviceCollectives::<CpuBackend>::stats(&self.0)
            }
        }
        let lazy = |world: usize| -> Result<Vec<Rank<CpuBackend>>> {
            let meshes = tcp::local_group(world, std::time::Duration::from_secs(20))?;
            Ok(meshes
                .into_iter()
                .map(|m| {
                    (
                        CpuBackend::new(),
                        Box::new(Lazy(HostStaged::new(Box::new(m)))) as Box<dyn DeviceCollectives<_>>,
                    )
                })
                .collect())
        };
        let results = run_all(2, lazy);
        let failed: Vec<&str> = results.iter().filter(|r| r.1.is_err()).map(|r| r.0.as_str()).collect();
        assert!(failed.iter().any(|c| c.starts_with("all_reduce")), "{failed:?}");
        assert!(failed.contains(&"all_to_all, uneven counts"), "{failed:?}");
    }
}
