//! `strata comm-bench`: the TCP communicator's all-reduce against a raw TCP socket.
//!
//! Two (or more) ranks run as threads of this process joined on loopback, exactly as an
//! in-process replica's ranks are. For each message size it reports the median all-reduce
//! time, the algorithm bandwidth (size / time) and the bus bandwidth (NCCL's convention,
//! `algbw × 2(g−1)/g`: the bytes each rank actually moves), beside the throughput of one
//! plain TCP stream over loopback measured in the same run.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use serde::Serialize;
use strata_engine::comm::tcp::local_group;
use strata_engine::comm::Collectives;

#[derive(Debug, Serialize)]
pub struct AllReduceRow {
    pub bytes: usize,
    pub p50_us: f64,
    pub algbw_gb_per_s: f64,
    pub busbw_gb_per_s: f64,
}

#[derive(Debug, Serialize)]
pub struct CommBenchReport {
    pub ranks: usize,
    pub raw_tcp_gb_per_s: f64,
    pub all_reduce: Vec<AllReduceRow>,
}

use strata_common::stats::median;

/// Throughput of one TCP stream over loopback: 16 MiB messages, median of `repeats`.
pub fn raw_tcp(repeats: usize) -> anyhow::Result<f64> {
    const SIZE: usize = 16 << 20;
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let reader = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = listener.accept()?;
        let mut buf = vec![0u8; SIZE];
        for _ in 0..repeats + 1 {
            s.read_exact(&mut buf)?;
            s.write_all(&[1])?;
        }
        Ok(())
    });
    let mut s = TcpStream::connect(addr)?;
    s.set_nodelay(true)?;
    let buf = vec![7u8; SIZE];
    let mut rates = Vec::new();
    for i in 0..repeats + 1 {
        let t = Instant::now();
        s.write_all(&buf)?;
        let mut ack = [0u8];
        s.read_exact(&mut ack)?;
        if i > 0 {
            rates.push(SIZE as f64 / t.elapsed().as_secs_f64());
        }
    }
    reader.join().map_err(|_| anyhow::anyhow!("reader panicked"))??;
    Ok(median(&rates) / 1e9)
}

pub fn run(ranks: usize, sizes: &[usize], repeats: usize) -> anyhow::Result<CommBenchReport> {
    let raw = raw_tcp(repeats)?;
    let comms = local_group(ranks, Duration::from_secs(10))?;
    let sizes = sizes.to_vec();
    let handles: Vec<_> = comms
        .into_iter()
        .map(|mut c| {
            let sizes = sizes.clone();
            std::thread::spawn(move || -> anyhow::Result<Vec<f64>> {
                let group: Vec<usize> = (0..c.world()).collect();
                let mut out = Vec::new();
                for &bytes in &sizes {
                    let mut data = vec![1f32; bytes / 4];
                    let reps = if bytes >= 1 << 20 { repeats } else { repeats * 20 };
                    let mut times = Vec::new();
                    for i in 0..reps + 2 {
                        c.barrier(&group)?;
                        let t = Instant::now();
                        c.all_reduce_sum(&group, &mut data)?;
                        if i >= 2 {
                            times.push(t.elapsed().as_secs_f64());
                        }
                    }
                    out.push(median(&times));
                }
                Ok(out)
            })
        })
        .collect();
    let mut per_rank = Vec::new();
    for h in handles {
        per_rank.push(h.join().map_err(|_| anyhow::anyhow!("rank panicked"))??);
    }
    let g = ranks as f64;
    let all_reduce = sizes
        .iter()
        .enumerate()
        .map(|(i, &bytes)| {
            let secs = per_rank.iter().map(|r| r[i]).fold(0f64, f64::max);
            let algbw = bytes as f64 / secs / 1e9;
            AllReduceRow {
                bytes,
                p50_us: secs * 1e6,
                algbw_gb_per_s: algbw,
                busbw_gb_per_s: algbw * 2.0 * (g - 1.0) / g,
            }
        })
        .collect();
    Ok(CommBenchReport { ranks, raw_tcp_gb_per_s: raw, all_reduce })
}
