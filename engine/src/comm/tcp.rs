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

use super::{bytes_f32, f32_bytes, handshake, Collectives, CommStats, StepChannel};

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

pub(super) fn write_frame(s: &mut &TcpStream, data: &[u8]) -> std::io::Result<()> {
    s.write_all(&(data.len() as u64).to_le_bytes())?;
    s.write_all(data)
}

pub(super) fn read_frame(s: &mut &TcpStream, max: usize) -> std::io::Result<Vec<u8>> {
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
    /// The replica's group secret: every set-up connection proves it ([`handshake`]).
    pub secret: Vec<u8>,
}

/// How long one set-up connection may take to prove itself: a silent stranger delays
/// set-up by at most this, then is dropped.
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);

/// Accepts connections on `listener` until `admit` has taken `count` of them (false: the
/// deadline passed first). Each must pass the handshake; a stranger, a failed proof or a
/// hello `admit` refuses is logged and dropped, and set-up goes on.
fn accept_members(
    listener: &TcpListener,
    deadline: Instant,
    secret: &[u8],
    count: usize,
    mut admit: impl FnMut(&[u8], TcpStream) -> std::result::Result<(), String>,
) -> std::io::Result<bool> {
    let mut admitted = 0;
    while admitted < count {
        let Some(s) = accept_before(listener, deadline)? else { return Ok(false) };
        let left = deadline.saturating_duration_since(Instant::now());
        s.set_read_timeout(Some(left.clamp(Duration::from_millis(1), HELLO_TIMEOUT)))?;
        let peer = s.peer_addr().map(|a| a.to_string()).unwrap_or_default();
        let admitted_now = match handshake::accept(&s, secret) {
            Ok(hello) => admit(&hello, s),
            Err(e) => Err(e.to_string()),
        };
        match admitted_now {
            Ok(()) => admitted += 1,
            Err(why) => tracing::warn!(%peer, "refused a set-up connection: {why}"),
        }
    }
    Ok(true)
}

/// Rank 0: admits every other rank at the rendezvous and sends them the address table.
fn gather(
    cfg: &TcpCommConfig,
    listener: Option<TcpListener>,
    deadline: Instant,
    peers: &mut [Option<TcpStream>],
) -> Result<()> {
    let world = cfg.world;
    let listener = match listener {
        Some(l) => l,
        None => TcpListener::bind(cfg.rendezvous)
            .map_err(io_err(format!("bind rendezvous {}", cfg.rendezvous)))?,
    };
    let mut table = vec![String::new(); world];
    table[0] = cfg.rendezvous.to_string();
    let complete = accept_members(&listener, deadline, &cfg.secret, world - 1, |hello, s| {
        let text = std::str::from_utf8(hello).map_err(|_| "a hello that is not UTF-8".to_string())?;
        let bad = || format!("bad hello {text:?}");
        let (r, addr) = text.split_once(' ').ok_or_else(bad)?;
        let r: usize = r.parse().map_err(|_| bad())?;
        addr.parse::<SocketAddr>().map_err(|_| bad())?;
        if r == 0 || r >= world || peers[r].is_some() {
            return Err(format!("rank {r} announced twice or out of range (world {world})"));
        }
        table[r] = addr.to_string();
        peers[r] = Some(s);
        Ok(())
    })
    .map_err(io_err("rendezvous accept"))?;
    if !complete {
        let missing: Vec<usize> = (1..world).filter(|r| peers[*r].is_none()).collect();
        return Err(Error::Unavailable(format!(
            "ranks {missing:?} never arrived at rendezvous {} within {:?}",
            cfg.rendezvous, cfg.setup_timeout
        )));
    }
    let table = table.join("\n");
    for s in peers.iter().flatten() {
        write_frame(&mut &*s, table.as_bytes()).map_err(io_err("send address table"))?;
    }
    Ok(())
}

/// Rank > 0: joins at the rendezvous, then links to every other rank (dialling lower
/// ranks, admitting higher ones).
fn join_group(cfg: &TcpCommConfig, deadline: Instant, peers: &mut [Option<TcpStream>]) -> Result<()> {
    let (rank, world) = (cfg.rank, cfg.world);
    let listener = TcpListener::bind((cfg.rendezvous.ip(), 0)).map_err(io_err("bind peer listener"))?;
    let my_addr = listener.local_addr().map_err(io_err("peer listener address"))?;
    let s = connect_before(cfg.rendezvous, deadline)
        .map_err(io_err(format!("rank {rank}: rendezvous {} unreachable", cfg.rendezvous)))?;
    let left = || deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
    s.set_read_timeout(Some(left())).map_err(io_err("timeout"))?;
    handshake::join(&s, &cfg.secret, format!("{rank} {my_addr}").as_bytes())
        .map_err(io_err(format!("rank {rank}: joining at rendezvous {}", cfg.rendezvous)))?;
    s.set_read_timeout(Some(left())).map_err(io_err("timeout"))?;
    let table =
        read_frame(&mut &s, MAX_HANDSHAKE).map_err(io_err("waiting for the other ranks (address table)"))?;
    let table: Vec<String> = String::from_utf8_lossy(&table).lines().map(str::to_owned).collect();
    if table.len() != world {
        return Err(Error::Unavailable(format!("an address table of {} ranks (world {world})", table.len())));
    }
    peers[0] = Some(s);
    for (j, addr) in table.iter().enumerate().take(rank).skip(1) {
        let addr: SocketAddr =
            addr.parse().map_err(|_| Error::Unavailable(format!("bad address {addr:?}")))?;
        let s = connect_before(addr, deadline).map_err(io_err(format!("connect to rank {j}")))?;
        s.set_read_timeout(Some(left())).map_err(io_err("timeout"))?;
        handshake::join(&s, &cfg.secret, rank.to_string().as_bytes())
            .map_err(io_err(format!("joining rank {j}")))?;
        peers[j] = Some(s);
    }
    let complete = accept_members(&listener, deadline, &cfg.secret, world - 1 - rank, |hello, s| {
        let j: usize = std::str::from_utf8(hello)
            .ok()
            .and_then(|t| t.parse().ok())
            .ok_or_else(|| "bad peer hello".to_string())?;
        if j <= rank || j >= world || peers[j].is_some() {
            return Err(format!("unexpected peer {j}"));
        }
        peers[j] = Some(s);
        Ok(())
    })
    .map_err(io_err("peer accept"))?;
    if !complete {
        let missing: Vec<usize> = (rank + 1..world).filter(|r| peers[*r].is_none()).collect();
        return Err(Error::Unavailable(format!("ranks {missing:?} never connected to rank {rank}")));
    }
    Ok(())
}

impl TcpComm {
    /// Joins the group. Rank 0 passes the listener already bound to the rendezvous address
    /// (so callers can bind port 0 and hand the address out); other ranks pass None.
    pub fn connect(cfg: &TcpCommConfig, rendezvous_listener: Option<TcpListener>) -> Result<Self> {
        let deadline = Instant::now() + cfg.setup_timeout;
        let mut peers: Vec<Option<TcpStream>> = (0..cfg.world).map(|_| None).collect();
        if cfg.world == 1 {
            return Ok(Self::from_peers(cfg, peers));
        }
        if cfg.rank == 0 {
            gather(cfg, rendezvous_listener, deadline, &mut peers)?;
        } else {
            join_group(cfg, deadline, &mut peers)?;
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
    fn all_to_all(&mut self, group: &[usize], parts: &[&[f32]]) -> Result<Vec<Vec<f32>>> {
        let g = group.len();
        if parts.len() != g {
            return Err(Error::Internal(format!("an all-to-all over {g} ranks with {} parts", parts.len())));
        }
        self.timed(|c| {
            let me = c.position(group)?;
            let mut got: Vec<Vec<f32>> = vec![Vec::new(); g];
            got[me] = parts[me].to_vec();
            // Round `step`: send to the member `step` ahead, receive from the one `step`
            // behind, both at once — every pair meets in one round, none waits on another.
            for step in 1..g {
                let (to, from) = ((me + step) % g, (me + g - step) % g);
                c.exchange(group[to], f32_bytes(parts[to]), group[from])?;
                got[from] = bytes_f32(&c.scratch);
            }
            Ok(got)
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
    let secret = handshake::new_secret().map_err(io_err("group secret"))?;
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            let cfg = TcpCommConfig {
                rank,
                world,
                rendezvous,
                setup_timeout: timeout,
                recv_timeout: Duration::from_secs(300),
                secret: secret.clone(),
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
#[path = "tcp_tests.rs"]
mod tests;
