//! The TCP communicator: a full mesh of persistent connections between a replica's ranks.
//!
//! **Set-up (rendezvous).** Rank 0 listens on the rendezvous address. Every other rank
//! binds its own listener, connects to rank 0 and announces `(rank, address)`; rank 0
//! answers everyone with the complete address table; then rank `i` connects to every
//! rank `j < i` (rank 0's link is the rendezvous connection) and accepts from every
//! `j > i`. All of it is bounded by one deadline: a rank that never arrives makes set-up
//! fail with an error naming it, instead of hanging.
//!
//! **Collectives.** All-reduce is the ring algorithm (reduce-scatter, then all-gather):
//! each rank sends and receives `2·(g−1)/g` of the buffer whatever the group size, which
//! is optimal for bandwidth. A two-way exchange drives both directions at once on
//! non-blocking sockets from the calling thread, so two ranks sending to each other cannot
//! deadlock and no helper thread is spawned. Frames are a u64 length and bytes;
//! sockets have `TCP_NODELAY` and a read timeout so a silent peer fails the call.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use strata_common::{Error, Result};

use super::{bytes_f32, f32_bytes, Collectives, CommStats, StepChannel};

pub struct TcpComm {
    rank: usize,
    world: usize,
    recv_timeout: Duration,
    peers: Vec<Option<TcpStream>>,
    /// Receive buffer reused across exchanges (no per-call allocation or page faults).
    scratch: Vec<u8>,
    stats: CommStats,
}

fn io_err(what: impl std::fmt::Display) -> impl FnOnce(std::io::Error) -> Error {
    move |e| Error::Unavailable(format!("{what}: {e}"))
}

/// Largest hello or address table during set-up: a stranger's first bytes never buy more.
const MAX_HANDSHAKE: usize = 64 << 10;
/// Largest frame between joined ranks (a step's activations or logits are far smaller).
const MAX_FRAME: usize = 1 << 31;

fn too_long(len: usize, max: usize) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::InvalidData,
        format!("a frame of {len} bytes exceeds the {max}-byte limit"),
    )
}

/// A frame's announced length, refused when it exceeds `max` (before anything is allocated).
fn frame_len(header: [u8; 8], max: usize) -> std::io::Result<usize> {
    let len = u64::from_le_bytes(header);
    match usize::try_from(len) {
        Ok(len) if len <= max => Ok(len),
        _ => Err(too_long(usize::try_from(len).unwrap_or(usize::MAX), max)),
    }
}

fn write_frame(s: &mut &TcpStream, data: &[u8]) -> std::io::Result<()> {
    s.write_all(&(data.len() as u64).to_le_bytes())?;
    s.write_all(data)
}

fn read_frame(s: &mut &TcpStream, max: usize) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 8];
    s.read_exact(&mut len)?;
    let len = frame_len(len, max)?;
    let mut buf = vec![0u8; len];
    s.read_exact(&mut buf)?;
    Ok(buf)
}

fn accept_before(listener: &TcpListener, deadline: Instant) -> std::io::Result<Option<TcpStream>> {
    listener.set_nonblocking(true)?;
    loop {
        match listener.accept() {
            Ok((s, _)) => {
                s.set_nonblocking(false)?;
                return Ok(Some(s));
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    return Ok(None);
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => return Err(e),
        }
    }
}

fn connect_before(addr: SocketAddr, deadline: Instant) -> std::io::Result<TcpStream> {
    loop {
        match TcpStream::connect_timeout(&addr, Duration::from_millis(500)) {
            Ok(s) => return Ok(s),
            Err(e) if Instant::now() < deadline => {
                tracing::trace!("connect {addr}: {e}; retrying");
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(e),
        }
    }
}

/// How to reach the group and how long to wait for it.
#[derive(Debug, Clone)]
pub struct TcpCommConfig {
    pub rank: usize,
    pub world: usize,
    /// Rank 0's rendezvous address.
    pub rendezvous: SocketAddr,
    /// Set-up must complete within this.
    pub setup_timeout: Duration,
    /// A receive that waits longer than this fails (a live but stuck peer).
    pub recv_timeout: Duration,
}

impl TcpComm {
    /// Joins the group. Rank 0 passes the listener already bound to the rendezvous address
    /// (so callers can bind port 0 and hand the address out); other ranks pass None.
    pub fn connect(cfg: &TcpCommConfig, rendezvous_listener: Option<TcpListener>) -> Result<Self> {
        let deadline = Instant::now() + cfg.setup_timeout;
        let (rank, world) = (cfg.rank, cfg.world);
        let mut peers: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
        if world == 1 {
            return Ok(Self::from_peers(cfg, peers));
        }
        if rank == 0 {
            let listener = match rendezvous_listener {
                Some(l) => l,
                None => TcpListener::bind(cfg.rendezvous)
                    .map_err(io_err(format!("bind rendezvous {}", cfg.rendezvous)))?,
            };
            let mut table = vec![String::new(); world];
            table[0] = cfg.rendezvous.to_string();
            for _ in 1..world {
                let Some(s) = accept_before(&listener, deadline).map_err(io_err("rendezvous accept"))? else {
                    let missing: Vec<usize> = (1..world).filter(|r| peers[*r].is_none()).collect();
                    return Err(Error::Unavailable(format!(
                        "ranks {missing:?} never arrived at rendezvous {} within {:?}",
                        cfg.rendezvous, cfg.setup_timeout
                    )));
                };
                // Whoever connected gets until the set-up deadline to say who it is.
                let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
                s.set_read_timeout(Some(left)).map_err(io_err("timeout"))?;
                let hello = read_frame(&mut &s, MAX_HANDSHAKE).map_err(io_err("rendezvous hello"))?;
                let text = String::from_utf8_lossy(&hello).to_string();
                let (r, addr) =
                    text.split_once(' ').ok_or_else(|| Error::Unavailable(format!("bad hello {text:?}")))?;
                let r: usize = r.parse().map_err(|_| Error::Unavailable(format!("bad hello {text:?}")))?;
                if r == 0 || r >= world || peers[r].is_some() {
                    return Err(Error::Unavailable(format!(
                        "rank {r} announced twice or out of range (world {world})"
                    )));
                }
                table[r] = addr.to_string();
                peers[r] = Some(s);
            }
            let table = table.join("\n");
            for s in peers.iter().flatten() {
                write_frame(&mut &*s, table.as_bytes()).map_err(io_err("send address table"))?;
            }
        } else {
            let listener =
                TcpListener::bind((cfg.rendezvous.ip(), 0)).map_err(io_err("bind peer listener"))?;
            let my_addr = listener.local_addr().map_err(io_err("peer listener address"))?;
            let s = connect_before(cfg.rendezvous, deadline)
                .map_err(io_err(format!("rank {rank}: rendezvous {} unreachable", cfg.rendezvous)))?;
            write_frame(&mut &s, format!("{rank} {my_addr}").as_bytes()).map_err(io_err("send hello"))?;
            s.set_read_timeout(Some(
                deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1)),
            ))
            .map_err(io_err("timeout"))?;
            let table = read_frame(&mut &s, MAX_HANDSHAKE)
                .map_err(io_err("waiting for the other ranks (address table)"))?;
            let table: Vec<String> = String::from_utf8_lossy(&table).lines().map(str::to_owned).collect();
            peers[0] = Some(s);
            for (j, addr) in table.iter().enumerate().take(rank).skip(1) {
                let addr: SocketAddr =
                    addr.parse().map_err(|_| Error::Unavailable(format!("bad address {addr:?}")))?;
                let s = connect_before(addr, deadline).map_err(io_err(format!("connect to rank {j}")))?;
                write_frame(&mut &s, rank.to_string().as_bytes()).map_err(io_err("peer hello"))?;
                peers[j] = Some(s);
            }
            for _ in rank + 1..world {
                let Some(s) = accept_before(&listener, deadline).map_err(io_err("peer accept"))? else {
                    let missing: Vec<usize> = (rank + 1..world).filter(|r| peers[*r].is_none()).collect();
                    return Err(Error::Unavailable(format!(
                        "ranks {missing:?} never connected to rank {rank}"
                    )));
                };
                let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
                s.set_read_timeout(Some(left)).map_err(io_err("timeout"))?;
                let hello = read_frame(&mut &s, MAX_HANDSHAKE).map_err(io_err("peer hello"))?;
                let j: usize = String::from_utf8_lossy(&hello)
                    .parse()
                    .map_err(|_| Error::Unavailable("bad peer hello".into()))?;
                if j <= rank || j >= world {
                    return Err(Error::Unavailable(format!("unexpected peer {j}")));
                }
                peers[j] = Some(s);
            }
        }
        for s in peers.iter().flatten() {
            s.set_nodelay(true).map_err(io_err("nodelay"))?;
            s.set_read_timeout(Some(cfg.recv_timeout)).map_err(io_err("timeout"))?;
        }
        Ok(Self::from_peers(cfg, peers))
    }

    fn from_peers(cfg: &TcpCommConfig, peers: Vec<Option<TcpStream>>) -> Self {
        TcpComm {
            rank: cfg.rank,
            world: cfg.world,
            recv_timeout: cfg.recv_timeout,
            peers,
            scratch: Vec::new(),
            stats: CommStats::default(),
        }
    }

    fn peer(&self, r: usize) -> Result<&TcpStream> {
        self.peers
            .get(r)
            .and_then(|p| p.as_ref())
            .ok_or_else(|| Error::Internal(format!("rank {} has no link to rank {r}", self.rank)))
    }

    /// Sends `out` to `to` while receiving one frame from `from`.
    /// Sends `out` to `to` while receiving one frame from `from` into `self.scratch`.
    fn exchange(&mut self, to: usize, out: &[u8], from: usize) -> Result<()> {
        let rank = self.rank;
        self.stats.bytes_sent += out.len() as u64;
        let mut got = std::mem::take(&mut self.scratch);
        let mut tx = self.peer(to)?;
        let mut rx = self.peer(from)?;
        let send_err = io_err(format!("rank {rank} → {to}"));
        let recv_err = io_err(format!("rank {rank} ← {from}"));
        // Lengths first (tiny), then both directions at once on non-blocking sockets:
        // write what the kernel takes, read what has arrived, until both are done. No
        // helper thread, and two ranks sending to each other cannot deadlock.
        if let Err(e) = tx.write_all(&(out.len() as u64).to_le_bytes()) {
            return Err(send_err(e));
        }
        let mut len = [0u8; 8];
        if let Err(e) = rx.read_exact(&mut len) {
            return Err(recv_err(e));
        }
        got.resize(frame_len(len, MAX_FRAME).map_err(io_err(format!("rank {rank} ← {from}")))?, 0);
        let set = |nb: bool| -> std::io::Result<()> {
            tx.set_nonblocking(nb)?;
            rx.set_nonblocking(nb)
        };
        set(true).map_err(io_err("non-blocking mode"))?;
        let deadline = Instant::now() + self.recv_timeout;
        let (mut sent, mut recvd) = (0, 0);
        let result = loop {
            if sent == out.len() && recvd == got.len() {
                break Ok(());
            }
            let mut progress = false;
            if sent < out.len() {
                match tx.write(&out[sent..]) {
                    Ok(n) => {
                        sent += n;
                        progress |= n > 0;
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                    Err(e) => break Err(send_err(e)),
                }
            }
            if recvd < got.len() {
                match rx.read(&mut got[recvd..]) {
                    Ok(0) => break Err(recv_err(std::io::ErrorKind::UnexpectedEof.into())),
                    Ok(n) => {
                        recvd += n;
                        progress = true;
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                    Err(e) => break Err(recv_err(e)),
                }
            }
            if !progress {
                if Instant::now() > deadline {
                    break Err(recv_err(std::io::ErrorKind::TimedOut.into()));
                }
                std::thread::yield_now();
            }
        };
        set(false).map_err(io_err("blocking mode"))?;
        self.scratch = got;
        result
    }

    fn position(&self, group: &[usize]) -> Result<usize> {
        group
            .iter()
            .position(|&r| r == self.rank)
            .ok_or_else(|| Error::Internal(format!("rank {} is not in group {group:?}", self.rank)))
    }

    fn timed<T>(&mut self, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        let t = Instant::now();
        let r = f(self);
        self.stats.busy_ns += t.elapsed().as_nanos() as u64;
        r
    }
}

/// Chunk `i` of `n` of a buffer of `len` elements.
fn chunk(len: usize, n: usize, i: usize) -> std::ops::Range<usize> {
    let base = len / n;
    let extra = len % n;
    let start = i * base + i.min(extra);
    start..start + base + usize::from(i < extra)
}

impl Collectives for TcpComm {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world(&self) -> usize {
        self.world
    }
    fn all_reduce_sum(&mut self, group: &[usize], data: &mut [f32]) -> Result<()> {
        let g = group.len();
        if g <= 1 {
            return Ok(());
        }
        self.timed(|c| {
            let me = c.position(group)?;
            let next = group[(me + 1) % g];
            let prev = group[(me + g - 1) % g];
            let len = data.len();
            // Reduce-scatter: after g-1 steps, chunk (me+1)%g holds the full sum.
            for step in 0..g - 1 {
                let send_c = chunk(len, g, (me + g - step) % g);
                let recv_c = chunk(len, g, (me + g - step - 1) % g);
                c.exchange(next, f32_bytes(&data[send_c]), prev)?;
                for (d, v) in data[recv_c].iter_mut().zip(c.scratch.chunks_exact(4)) {
                    *d += f32::from_le_bytes([v[0], v[1], v[2], v[3]]);
                }
            }
            // All-gather the summed chunks around the ring.
            for step in 0..g - 1 {
                let send_c = chunk(len, g, (me + 1 + g - step) % g);
                let recv_c = chunk(len, g, (me + g - step) % g);
                c.exchange(next, f32_bytes(&data[send_c]), prev)?;
                for (d, v) in data[recv_c].iter_mut().zip(c.scratch.chunks_exact(4)) {
                    *d = f32::from_le_bytes([v[0], v[1], v[2], v[3]]);
                }
            }
            Ok(())
        })
    }
    fn all_gather(&mut self, group: &[usize], local: &[f32]) -> Result<Vec<f32>> {
        let g = group.len();
        if g <= 1 {
            return Ok(local.to_vec());
        }
        self.timed(|c| {
            let me = c.position(group)?;
            let next = group[(me + 1) % g];
            let prev = group[(me + g - 1) % g];
            let mut parts: Vec<Vec<f32>> = vec![Vec::new(); g];
            parts[me] = local.to_vec();
            for step in 0..g - 1 {
                let send_i = (me + g - step) % g;
                let recv_i = (me + g - step - 1) % g;
                let out = f32_bytes(&parts[send_i]).to_vec();
                c.exchange(next, &out, prev)?;
                parts[recv_i] = bytes_f32(&c.scratch);
            }
            Ok(parts.concat())
        })
    }
    fn barrier(&mut self, group: &[usize]) -> Result<()> {
        let mut token = [1f32];
        self.all_reduce_sum(group, &mut token)
    }
    fn stats(&self) -> CommStats {
        self.stats
    }
}

impl StepChannel for TcpComm {
    fn broadcast(&mut self, group: &[usize], root: usize, data: &mut Vec<u8>) -> Result<()> {
        self.timed(|c| {
            if c.rank == root {
                for &r in group.iter().filter(|&&r| r != root) {
                    c.stats.bytes_sent += data.len() as u64;
                    write_frame(&mut c.peer(r)?, data).map_err(io_err(format!("broadcast to rank {r}")))?;
                }
            } else {
                *data = read_frame(&mut c.peer(root)?, MAX_FRAME)
                    .map_err(io_err(format!("broadcast from rank {root}")))?;
            }
            Ok(())
        })
    }
    fn send(&mut self, to: usize, data: &[u8]) -> Result<()> {
        self.timed(|c| {
            c.stats.bytes_sent += data.len() as u64;
            write_frame(&mut c.peer(to)?, data).map_err(io_err(format!("send to rank {to}")))
        })
    }
    fn recv(&mut self, from: usize) -> Result<Vec<u8>> {
        self.timed(|c| {
            read_frame(&mut c.peer(from)?, MAX_FRAME).map_err(io_err(format!("receive from rank {from}")))
        })
    }
    fn recv_idle(&mut self, from: usize) -> Result<Vec<u8>> {
        let err = io_err(format!("waiting for rank {from}"));
        let mut s = self.peer(from)?;
        // No timeout until the frame's first byte; then the usual one for the rest.
        s.set_read_timeout(None).map_err(io_err("timeout"))?;
        let mut first = [0u8; 1];
        let got = (&mut s).read_exact(&mut first);
        s.set_read_timeout(Some(self.recv_timeout)).map_err(io_err("timeout"))?;
        got.map_err(err)?;
        self.timed(|c| {
            let mut s = c.peer(from)?;
            let mut rest = [0u8; 7];
            let e = io_err(format!("receive from rank {from}"));
            (&mut s).read_exact(&mut rest).map_err(e)?;
            let mut len = [0u8; 8];
            len[0] = first[0];
            len[1..].copy_from_slice(&rest);
            let mut buf =
                vec![0u8; frame_len(len, MAX_FRAME).map_err(io_err(format!("receive from rank {from}")))?];
            (&mut s).read_exact(&mut buf).map_err(io_err(format!("receive from rank {from}")))?;
            Ok(buf)
        })
    }
}

/// Starts `world` ranks of a TCP group inside this process (threads) on loopback.
pub fn local_group(world: usize, timeout: Duration) -> Result<Vec<TcpComm>> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(io_err("bind loopback rendezvous"))?;
    let rendezvous = listener.local_addr().map_err(io_err("rendezvous address"))?;
    let mut listener = Some(listener);
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            let cfg = TcpCommConfig {
                rank,
                world,
                rendezvous,
                setup_timeout: timeout,
                recv_timeout: Duration::from_secs(300),
            };
            let l = if rank == 0 { listener.take() } else { None };
            std::thread::spawn(move || TcpComm::connect(&cfg, l))
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().map_err(|_| Error::Internal("rank set-up panicked".into()))?)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::comm::contract::boxed;
    use crate::comm::Communicator;

    fn loopback(world: usize) -> Result<Vec<Box<dyn Communicator>>> {
        Ok(boxed(local_group(world, Duration::from_secs(10))?))
    }

    /// Rank 0 of a two-rank group waiting at a rendezvous that a stranger reaches first
    /// with `bytes`: set-up fails with an error, never a panic or an allocation the bytes
    /// asked for.
    fn stranger_sends(bytes: &'static [u8]) -> Error {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let cfg = TcpCommConfig {
            rank: 0,
            world: 2,
            rendezvous: addr,
            setup_timeout: Duration::from_secs(2),
            recv_timeout: Duration::from_secs(2),
        };
        let rank0 = std::thread::spawn(move || TcpComm::connect(&cfg, Some(listener)).map(|_| ()));
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(bytes).unwrap();
        let err = rank0.join().expect("rank 0 did not panic").unwrap_err();
        drop(s);
        err
    }

    #[test]
    fn hostile_rendezvous_bytes_are_errors() {
        for bytes in [&[0xffu8; 8][..], &[0, 0, 0, 0, 0, 0, 0, 0x40], &[0, 0, 0, 0, 0, 0, 1, 0]] {
            let e = stranger_sends(bytes).to_string();
            assert!(e.contains("exceeds") && e.contains("rendezvous hello"), "{bytes:?}: {e}");
        }
        let e = stranger_sends(b"\x05\0\0\0\0\0\0\0hello").to_string();
        assert!(e.contains("bad hello"), "{e}");
        // A stranger that connects and says nothing holds set-up only until its deadline.
        let e = stranger_sends(b"").to_string();
        assert!(e.contains("rendezvous hello"), "{e}");
    }

    #[test]
    fn frame_lengths_are_bounded_before_allocation() {
        assert_eq!(frame_len(16u64.to_le_bytes(), 16).unwrap(), 16);
        assert!(frame_len(17u64.to_le_bytes(), 16).is_err());
        assert!(frame_len(u64::MAX.to_le_bytes(), MAX_FRAME).is_err());
    }

    #[test]
    fn keeps_the_communicator_contract() {
        // The same checks `strata gpu-check comm` runs over NCCL.
        for world in [1usize, 2, 3, 4] {
            for (check, result) in crate::comm::contract::run_all(world, loopback) {
                result.unwrap_or_else(|e| panic!("world {world}, {check}: {e}"));
            }
        }
    }

    #[test]
    fn a_wrong_sum_is_caught_by_the_contract() {
        // The contract's checks can fail: a communicator that skips the reduction.
        struct Lazy(TcpComm);
        impl Collectives for Lazy {
            fn rank(&self) -> usize {
                self.0.rank()
            }
            fn world(&self) -> usize {
                self.0.world()
            }
            fn all_reduce_sum(&mut self, _group: &[usize], _data: &mut [f32]) -> Result<()> {
                Ok(())
            }
            fn all_gather(&mut self, group: &[usize], local: &[f32]) -> Result<Vec<f32>> {
                self.0.all_gather(group, local)
            }
            fn barrier(&mut self, group: &[usize]) -> Result<()> {
                self.0.barrier(group)
            }
            fn stats(&self) -> CommStats {
                self.0.stats()
            }
        }

        impl StepChannel for Lazy {
            fn broadcast(&mut self, group: &[usize], root: usize, data: &mut Vec<u8>) -> Result<()> {
                self.0.broadcast(group, root, data)
            }
            fn send(&mut self, to: usize, data: &[u8]) -> Result<()> {
                self.0.send(to, data)
            }
            fn recv(&mut self, from: usize) -> Result<Vec<u8>> {
                self.0.recv(from)
            }
        }
        let lazy = |world| -> Result<Vec<Box<dyn Communicator>>> {
            Ok(boxed(local_group(world, Duration::from_secs(10))?.into_iter().map(Lazy).collect()))
        };
        let e = crate::comm::contract::all_reduce_sums(lazy(2).unwrap(), 7).unwrap_err();
        assert!(e.to_string().contains("rank 0"), "{e}");
        let e = crate::comm::contract::subgroups_gathers_broadcasts_and_sends(lazy(4).unwrap()).unwrap_err();
        assert!(e.to_string().contains("all_reduce_sum over [0, 1]"), "{e}");
    }

    #[test]
    fn a_missing_rank_fails_setup_with_its_number() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let rendezvous = listener.local_addr().unwrap();
        let cfg = move |rank| TcpCommConfig {
            rank,
            world: 3,
            rendezvous,
            setup_timeout: Duration::from_millis(300),
            recv_timeout: Duration::from_secs(1),
        };
        let one = std::thread::spawn(move || TcpComm::connect(&cfg(1), None).map(|_| ()));
        let e = TcpComm::connect(&cfg(0), Some(listener)).err().expect("rank 2 never comes");
        assert!(e.to_string().contains("[2]"), "{e}");
        assert!(one.join().unwrap().is_err());
    }

    #[test]
    fn an_idle_wait_outlasts_the_receive_timeout_and_ends_when_the_peer_goes() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let rendezvous = listener.local_addr().unwrap();
        let cfg = move |rank| TcpCommConfig {
            rank,
            world: 2,
            rendezvous,
            setup_timeout: Duration::from_secs(10),
            recv_timeout: Duration::from_millis(100),
        };
        let leader = std::thread::spawn(move || {
            let mut c = TcpComm::connect(&cfg(0), Some(listener)).unwrap();
            std::thread::sleep(Duration::from_millis(400)); // idle for 4 receive timeouts
            c.send(1, b"step").unwrap();
            std::thread::sleep(Duration::from_millis(200));
            drop(c); // the leader goes away
        });
        let mut f = TcpComm::connect(&cfg(1), None).unwrap();
        assert_eq!(f.recv_idle(0).unwrap(), b"step");
        let t = Instant::now();
        let e = f.recv_idle(0).unwrap_err();
        assert!(matches!(e, Error::Unavailable(_)), "{e}");
        assert!(t.elapsed() < Duration::from_secs(2));
        leader.join().unwrap();
    }

    #[test]
    fn a_dead_peer_fails_the_collective() {
        let mut comms = local_group(2, Duration::from_secs(10)).unwrap();
        drop(comms.pop());
        let mut c = comms.pop().unwrap();
        let t = Instant::now();
        let e = c.all_reduce_sum(&[0, 1], &mut [1.0; 4]).unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(2));
        assert!(matches!(e, Error::Unavailable(_)), "{e}");
    }
}
