//! What every [`Communicator`] must do, written once as checks that run over any group of
//! ranks: the TCP communicator's tests run them on loopback, and `strata gpu-check comm`
//! runs the same checks over NCCL on the GPUs of the machine it is on.
//!
//! A check takes one communicator per rank of a group (ranks `0..world`, in order), runs
//! every rank on its own thread, and returns an error naming the first rank and value
//! that differ from what the contract promises.

use strata_common::{Error, Result};

use super::Communicator;

/// The groups the checks use for `world` ranks: everyone, then the two halves (as the TP
/// groups of a replica's two pipeline stages). A communicator that needs its groups up
/// front (NCCL) must be built with these.
pub fn groups(world: usize) -> Vec<Vec<usize>> {
    let half = world / 2;
    let mut out = vec![(0..world).collect::<Vec<_>>()];
    if half > 0 {
        out.push((0..half).collect());
        out.push((half..world).collect());
    }
    out
}

/// A group's communicators as the checks take them.
pub fn boxed<C: Communicator + 'static>(comms: Vec<C>) -> Vec<Box<dyn Communicator>> {
    comms.into_iter().map(|c| Box::new(c) as Box<dyn Communicator>).collect()
}

/// Runs `f` on every rank at once (collectives need all members) and collects the results
/// in rank order; the first failing rank's error wins.
fn on_every_rank<T: Send>(
    comms: Vec<Box<dyn Communicator>>,
    f: impl Fn(&mut dyn Communicator) -> Result<T> + Sync,
) -> Result<Vec<T>> {
    let f = &f;
    let results: Vec<Result<T>> = std::thread::scope(|s| {
        let handles: Vec<_> = comms.into_iter().map(|mut c| s.spawn(move || f(c.as_mut()))).collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(Error::Internal("a rank's check panicked".into()))))
            .collect()
    });
    results.into_iter().collect()
}

fn differs(check: &str, rank: usize, got: impl std::fmt::Debug, want: impl std::fmt::Debug) -> Error {
    let (got, want) = (format!("{got:?}"), format!("{want:?}"));
    let cut = |s: String| if s.len() > 200 { format!("{}…", &s[..200]) } else { s };
    Error::Internal(format!("{check}: rank {rank} got {} where {} was due", cut(got), cut(want)))
}

/// All-reduce over the whole group of `len` values: every rank ends with the exact sum
/// (the values are small integers, so any summation order is exact).
pub fn all_reduce_sums(comms: Vec<Box<dyn Communicator>>, len: usize) -> Result<()> {
    let world = comms.len();
    let value = |rank: usize, i: usize| (rank * 1000 + i % 1000) as f32;
    let out = on_every_rank(comms, |c| {
        let group: Vec<usize> = (0..c.world()).collect();
        let mut v: Vec<f32> = (0..len).map(|i| value(c.rank(), i)).collect();
        c.all_reduce_sum(&group, &mut v)?;
        Ok(v)
    })?;
    let want: Vec<f32> = (0..len).map(|i| (0..world).map(|r| value(r, i)).sum()).collect();
    for (rank, v) in out.iter().enumerate() {
        if let Some(i) = (0..len).find(|&i| v.get(i) != Some(&want[i])) {
            return Err(differs(&format!("all_reduce_sum of {len} values"), rank, v.get(i), want[i]));
        }
        if v.len() != len {
            return Err(differs("all_reduce_sum length", rank, v.len(), len));
        }
    }
    Ok(())
}

/// Subgroups (the two halves of [`groups`]): all-gather of different-sized parts and
/// all-reduce within each half, all-gather over everyone; broadcast from rank 0 to all;
/// point-to-point sends from each rank of the first half to its peer in the second; a
/// barrier at the end.
pub fn subgroups_gathers_broadcasts_and_sends(comms: Vec<Box<dyn Communicator>>) -> Result<()> {
    let world = comms.len();
    let half = world / 2;
    let parts = |r: usize| vec![r as f32; r + 1];
    let everyone: Vec<usize> = (0..world).collect();
    let half_of = |r: usize| -> Vec<usize> {
        if r < half {
            (0..half).collect()
        } else {
            (half..world).collect()
        }
    };
    let out = on_every_rank(comms, |c| {
        let r = c.rank();
        let mine = half_of(r);
        let gathered = c.all_gather(&mine, &parts(r))?;
        let mut reduced = vec![r as f32 + 1.0; 3];
        c.all_reduce_sum(&mine, &mut reduced)?;
        let all = c.all_gather(&everyone, &parts(r))?;
        let mut msg = if r == 0 { b"plan".to_vec() } else { Vec::new() };
        c.broadcast(&everyone, 0, &mut msg)?;
        if r < half && r + half < world {
            c.send(r + half, &[r as u8; 3])?;
        }
        let got = if r >= half && r - half < half { c.recv(r - half)? } else { Vec::new() };
        c.barrier(&everyone)?;
        Ok((gathered, reduced, all, msg, got))
    })?;
    let all_want: Vec<f32> = everyone.iter().flat_map(|&r| parts(r)).collect();
    for (r, (gathered, reduced, all, msg, got)) in out.into_iter().enumerate() {
        let mine = half_of(r);
        let want: Vec<f32> = mine.iter().flat_map(|&m| parts(m)).collect();
        if gathered != want {
            return Err(differs(&format!("all_gather over {mine:?}"), r, gathered, want));
        }
        let sum: f32 = mine.iter().map(|&m| m as f32 + 1.0).sum();
        if reduced != vec![sum; 3] {
            return Err(differs(&format!("all_reduce_sum over {mine:?}"), r, reduced, vec![sum; 3]));
        }
        if all != all_want {
            return Err(differs("all_gather over everyone", r, all, &all_want));
        }
        if msg != b"plan" {
            return Err(differs("broadcast from rank 0", r, msg, b"plan"));
        }
        let want_got = if r >= half && r - half < half { vec![(r - half) as u8; 3] } else { Vec::new() };
        if got != want_got {
            return Err(differs(&format!("recv on rank {r}"), r, got, want_got));
        }
    }
    Ok(())
}

/// All-to-all with uneven parts (some empty): rank `i` sends rank `j` `(i + 2j + 1) % 3`
/// values tagged with both ranks, and every rank gets each part from the rank it came
/// from, in group order.
pub fn all_to_all_uneven(comms: Vec<Box<dyn Communicator>>) -> Result<()> {
    let part = |from: usize, to: usize| -> Vec<f32> {
        (0..(from + 2 * to + 1) % 3).map(|k| (from * 100 + to * 10 + k) as f32).collect()
    };
    let out = on_every_rank(comms, |c| {
        let group: Vec<usize> = (0..c.world()).collect();
        let parts: Vec<Vec<f32>> = group.iter().map(|&to| part(c.rank(), to)).collect();
        let refs: Vec<&[f32]> = parts.iter().map(|p| &p[..]).collect();
        Ok((c.world(), c.all_to_all(&group, &refs)?))
    })?;
    for (rank, (world, got)) in out.into_iter().enumerate() {
        let want: Vec<Vec<f32>> = (0..world).map(|from| part(from, rank)).collect();
        if got != want {
            return Err(differs("all_to_all with uneven parts", rank, got, want));
        }
    }
    Ok(())
}

/// The checks by name, for reports: each builds its own group with `make(world)`.
pub fn run_all(
    world: usize,
    mut make: impl FnMut(usize) -> Result<Vec<Box<dyn Communicator>>>,
) -> Vec<(String, Result<()>)> {
    let mut out = Vec::new();
    for len in [1usize, 7, 50_000, 1 << 20] {
        let r = make(world).and_then(|c| all_reduce_sums(c, len));
        out.push((format!("all_reduce_sum, {len} values"), r));
    }
    let r = make(world)
        .and_then(subgroups_gathers_broadcasts_and_sends)
        .and_then(|()| make(world).and_then(all_to_all_uneven));
    out.push(("subgroups, all_gather, all_to_all, broadcast, send/recv, barrier".to_string(), r));
    out
}
