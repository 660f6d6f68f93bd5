//! `strata gpu-check`: what `scripts/gpu-check.sh` runs on a machine with a GPU.
//!
//! - `ops`: every backend op on the device against the CPU backend, fresh random inputs;
//! - `tokens`: greedy tokens of model directories on the device against the CPU backend
//!   (and HF transformers' reference.json when the directory has one); a difference is
//!   classified as a bf16 near-tie (the CPU's two candidates are closer than bf16 rounding
//!   moves logits) or a real mismatch;
//! - `decode`: batch-1 decode tokens/s beside the roofline from the device's copy bandwidth,
//!   decode tokens/s of batches (8, 32, 128 sequences) and prefill tokens/s;
//! - `bandwidth`: the device-to-device copy bandwidth alone;
//! - `comm`: the host communicator's contract (`strata_engine::comm::contract`, the checks
//!   the TCP communicator's tests run) over loopback TCP, the step channel every replica's
//!   ranks share whatever their device;
//! - `collectives`: the device-collectives contract (`strata_engine::comm::device_contract`,
//!   which the CPU and emulator suites run) over NCCL, one rank per GPU, for every group
//!   size up to the number of GPUs (one GPU: groups of one rank, NCCL's own path still),
//!   then NCCL's all-reduce of device buffers with its bus bandwidth. With `--device cpu`,
//!   over tensors staged through the host and TCP.
//!
//! Every subcommand prints JSON objects, one per line. `--device cpu` runs the same code
//! with the CPU backend as the "device" (a self-check, used by the tests).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context};
use clap::{Args, Subcommand};
use serde_json::json;
use strata_common::config::EngineSettings;
use strata_common::{Parallelism, SamplingParams};
use strata_engine::backend::check::{check_ops, CheckSizes};
use strata_engine::backend::cpu::CpuBackend;
use strata_engine::backend::cuda::driver::CudaGpu;
use strata_engine::backend::cuda::CudaBackend;
use strata_engine::backend::{BackendOptions, Device, Tensors};
use strata_engine::comm::contract::boxed;
use strata_engine::comm::device_contract::{self, Rank};
use strata_engine::comm::{nccl, tcp, DeviceCollectives, HostStaged};
use strata_engine::replica::local_replica;
use strata_engine::{Engine, EngineConfig};
use tracing::info;

use crate::config_args::{in_process_config, EngineFlags};

#[derive(Args, Debug)]
pub struct GpuCheckArgs {
    /// cuda, cuda:N, or cpu (a self-check of this command).
    #[arg(long, default_value = "cuda:0", global = true)]
    pub device: String,
    #[command(subcommand)]
    pub command: GpuCheckCommand,
}

#[derive(Subcommand, Debug)]
pub enum GpuCheckCommand {
    /// Every op on the device against the CPU backend.
    Ops {
        /// Llama-8B-sized shapes and a 3000-position context instead of small ones.
        #[arg(long)]
        large: bool,
        /// Seed of the random inputs.
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
    /// Greedy tokens on the device against the CPU backend (and HF's reference.json).
    Tokens {
        /// Model directories to generate with (repeatable).
        #[arg(long, required = true)]
        model: Vec<PathBuf>,
        /// Greedy tokens generated per model.
        #[arg(long, default_value_t = 24)]
        tokens: u32,
        /// The device's engine (the CPU reference computes in f32) [KV cache default: 64MiB].
        #[command(flatten)]
        engine: EngineFlags,
    },
    /// Batch-1 decode speed against the copy-bandwidth roofline, decode of larger
    /// batches, and prefill speed.
    Decode {
        /// Model directory.
        #[arg(long)]
        model: PathBuf,
        /// Tokens decoded at batch 1.
        #[arg(long, default_value_t = 64)]
        tokens: usize,
        /// The engine under test [KV cache default: 1GiB].
        #[command(flatten)]
        engine: EngineFlags,
        /// KV cache, MiB (the older spelling of --kv-cache-memory).
        #[arg(long, hide = true, conflicts_with = "kv_cache_memory")]
        kv_cache_mib: Option<usize>,
        /// Batched decode: how many sequences decode together, each size in turn.
        #[arg(long, value_delimiter = ',', default_value = "8,32,128")]
        batches: Vec<usize>,
        /// Prefill: the prompt's length in tokens (0: skip).
        #[arg(long, default_value_t = 512)]
        prefill_len: usize,
    },
    /// The host communicator's contract over loopback TCP, groups of 2 up to `--max-world`.
    Comm {
        /// Largest group to check (at most 4).
        #[arg(long, default_value_t = 8)]
        max_world: usize,
    },
    /// The device-collectives contract over NCCL, one rank per GPU (over TCP with
    /// `--device cpu`), then NCCL's all-reduce of device buffers.
    Collectives {
        /// Largest group to check (default: every GPU, at most 8).
        #[arg(long, default_value_t = 8)]
        max_world: usize,
    },
    /// Device-to-device copy bandwidth (reads + writes ÷ time), GB/s.
    Bandwidth {
        /// Bytes copied, in MiB.
        #[arg(long, default_value_t = 1024)]
        mib: usize,
    },
}

/// The CPU reference: exact f32 compute.
fn reference_config(kv_mib: usize) -> EngineConfig {
    EngineConfig {
        kv_cache_bytes: kv_mib << 20,
        backend: BackendOptions {
            device: Device::Cpu,
            dtype: Some(strata_engine::tensor::DType::F32),
            ..Default::default()
        },
        ..Default::default()
    }
}

/// The engine under test: `flags` over the engine's defaults, on `device`, with
/// `kv_cache` unless `--kv-cache-memory` (or `kv_cache_mib`, its older spelling) says.
fn device_config(
    device: Device,
    flags: &EngineFlags,
    kv_cache: &str,
    kv_cache_mib: Option<usize>,
) -> anyhow::Result<EngineConfig> {
    let mut settings = EngineSettings { kv_cache_memory: kv_cache.into(), ..EngineSettings::default() };
    if device == Device::Cpu {
        settings.dtype = "f32".into(); // the self-check: both sides exact unless --dtype says
    }
    flags.apply(&mut settings);
    if let Some(mib) = kv_cache_mib {
        settings.kv_cache_memory = format!("{mib}MiB");
    }
    let mut config = in_process_config(settings)?;
    config.backend.device = device;
    Ok(config)
}

/// `n` greedy tokens after `prompt` (EOS ignored), run to completion.
pub(crate) fn greedy(e: &mut Engine, prompt: &[u32], n: u32) -> anyhow::Result<Vec<u32>> {
    e.add(
        strata_engine::SeqId(1),
        prompt.to_vec(),
        SamplingParams { max_new_tokens: n, ignore_eos: true, ..Default::default() },
    )?;
    let mut out = Vec::new();
    while e.has_work() {
        out.extend(e.step()?.into_iter().map(|ev| ev.token));
    }
    Ok(out)
}

use strata_common::stats::median;

/// Copy bandwidth of `device` in bytes/s (reads + writes).
fn bandwidth(device: Device, mib: usize) -> anyhow::Result<f64> {
    match device {
        Device::Cpu => Ok(strata_engine::backend::cpu::roofline::read_bandwidth(5)),
        Device::Cuda(n) => Ok(CudaGpu::open(n)?.copy_bandwidth(mib << 20, 20)?),
    }
}

pub fn run(args: GpuCheckArgs) -> anyhow::Result<()> {
    let device = Device::parse(&args.device).context("--device")?;
    strata_engine::replica::check_device(device)?;
    match args.command {
        GpuCheckCommand::Ops { large, seed } => ops(device, large, seed),
        GpuCheckCommand::Tokens { model, tokens: n, engine } => {
            tokens(device_config(device, &engine, "64MiB", None)?, model, n)
        }
        GpuCheckCommand::Decode { model, tokens, engine, kv_cache_mib, batches, prefill_len } => {
            let config = device_config(device, &engine, "1GiB", kv_cache_mib)?;
            decode(config, &model, &DecodeSizes { tokens, batches, prefill_len })
        }
        GpuCheckCommand::Comm { max_world } => comm(max_world),
        GpuCheckCommand::Collectives { max_world } => collectives(device, max_world),
        GpuCheckCommand::Bandwidth { mib } => {
            let bw = bandwidth(device, mib)?;
            println!(
                "{}",
                json!({"device": device.to_string(), "copy_bandwidth_gb_per_s": bw / 1e9, "mib": mib})
            );
            Ok(())
        }
    }
}

fn ops(device: Device, large: bool, seed: u64) -> anyhow::Result<()> {
    let sizes = if large { CheckSizes::large() } else { CheckSizes::tiny() };
    let report = match device {
        // The self-check keeps weights in bf16 like a GPU does.
        Device::Cpu => check_ops(
            &CpuBackend::new().with_weight_dtype(Some(strata_engine::tensor::DType::BF16)),
            &sizes,
            seed,
        )?,
        Device::Cuda(n) => check_ops(&CudaBackend::new(CudaGpu::open(n)?), &sizes, seed)?,
    };
    let mut failed = 0;
    for r in &report {
        failed += usize::from(!r.ok);
        println!("{}", serde_json::to_string(r)?);
    }
    if failed > 0 {
        bail!("{failed} of {} ops beyond tolerance", report.len());
    }
    Ok(())
}

fn tokens(config: EngineConfig, models: Vec<std::path::PathBuf>, tokens: u32) -> anyhow::Result<()> {
    let device = config.backend.device;
    let mut mismatches = 0;
    for dir in models {
        let name = dir.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
        let reference: Option<serde_json::Value> = std::fs::read_to_string(dir.join("reference.json"))
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok());
        let ids = |v: &serde_json::Value| -> Vec<u32> {
            v.as_array()
                .map(|a| a.iter().filter_map(|x| x.as_u64()).map(|x| x as u32).collect())
                .unwrap_or_default()
        };
        let prompt = reference
            .as_ref()
            .map(|r| ids(&r["prompt_ids"]))
            .filter(|p| !p.is_empty())
            .unwrap_or_else(|| vec![1, 2, 3, 4]);
        let hf = reference.as_ref().map(|r| ids(&r["greedy_ids"]));
        let n = hf.as_ref().map_or(tokens, |h| (h.len() as u32).min(tokens).max(1));
        let mut cpu = local_replica(&dir, Parallelism::NONE, &reference_config(64))?;
        let mut dev = local_replica(&dir, Parallelism::NONE, &config)?;
        let want = greedy(&mut cpu, &prompt, n)?;
        let got = greedy(&mut dev, &prompt, n)?;
        let hf_match = hf.as_ref().map(|h| h[..n as usize] == got[..]);
        let verdict = match got.iter().zip(&want).position(|(a, b)| a != b) {
            None => json!({"verdict": "identical"}),
            Some(i) => {
                // The CPU's logits where they part: how far apart were the two choices?
                let mut context = prompt.clone();
                context.extend(&want[..i]);
                let logits = cpu.prompt_logits(&context)?;
                let scale = logits.iter().fold(0f32, |a, b| a.max(b.abs()));
                let margin = logits[want[i] as usize] - logits[got[i] as usize];
                let near_tie = margin <= 0.02 * scale;
                if !near_tie {
                    mismatches += 1;
                }
                json!({
                    "verdict": if near_tie { "bf16 near-tie" } else { "MISMATCH" },
                    "first_difference": i, "cpu_token": want[i], "device_token": got[i],
                    "cpu_logit_margin": margin, "logit_scale": scale,
                })
            }
        };
        println!(
            "{}",
            json!({"model": name, "tokens": n, "device": device.to_string(), "matches_hf_reference": hf_match,
                   "device_tokens": got, "cpu_tokens": want, "result": verdict})
        );
    }
    if mismatches > 0 {
        bail!("{mismatches} model(s) differ from the CPU backend beyond a bf16 near-tie");
    }
    Ok(())
}

/// What `decode` measures.
struct DecodeSizes {
    tokens: usize,
    batches: Vec<usize>,
    prefill_len: usize,
}

fn decode(mut config: EngineConfig, model: &std::path::Path, sizes: &DecodeSizes) -> anyhow::Result<()> {
    let device = config.backend.device;
    let tokens = sizes.tokens;
    if tokens < 2 {
        bail!("--tokens must be at least 2");
    }
    let t = Instant::now();
    let most = sizes.batches.iter().copied().max().unwrap_or(1);
    config.scheduler.max_num_seqs = config.scheduler.max_num_seqs.max(most);
    let mut e = local_replica(model, Parallelism::NONE, &config)?;
    let load_s = t.elapsed().as_secs_f64();
    let bytes = e.executor().decode_bytes_per_token();
    let step = median(&decode_steps(&mut e, 1, tokens)?);
    let mut batched = Vec::new();
    for &b in &sizes.batches {
        info!(batch = b, "batched decode");
        let step = median(&decode_steps(&mut e, b, tokens)?);
        batched.push(json!({"batch": b, "step_ms_median": step * 1e3, "tokens_per_s": b as f64 / step}));
    }
    let prefill = if sizes.prefill_len > 0 { Some(prefill_speed(&mut e, sizes.prefill_len)?) } else { None };
    info!("measuring the copy bandwidth");
    let bw = bandwidth(device, 1024)?;
    let roofline = bw / bytes as f64;
    println!(
        "{}",
        json!({
            "model": model.display().to_string(), "device": device.to_string(), "load_s": load_s,
            "cuda_graphs": !config.backend.enforce_eager, "graph_steps": graph_steps(),
            "decode_tokens": tokens, "decode_step_ms_median": step * 1e3,
            "decode_tokens_per_s": 1.0 / step, "weight_bytes_per_token": bytes,
            "copy_bandwidth_gb_per_s": bw / 1e9, "roofline_tokens_per_s": roofline,
            "share_of_roofline": 1.0 / step / roofline,
            "batched_decode": batched,
            "prefill_len": sizes.prefill_len, "prefill_tokens_per_s": prefill,
        })
    );
    Ok(())
}

/// Steps replayed from CUDA graphs so far in this process (`strata_graph_steps_total`).
fn graph_steps() -> u64 {
    strata_common::metrics::encode()
        .lines()
        .filter(|l| l.starts_with("strata_graph_steps_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

/// Seconds of each step in which all `batch` sequences (8-token prompts) decoded a token
/// and nothing prefilled, over `tokens` tokens each.
fn decode_steps(e: &mut Engine, batch: usize, tokens: usize) -> anyhow::Result<Vec<f64>> {
    let vocab = e.executor().config().vocab_size as u32;
    for s in 0..batch {
        let prompt: Vec<u32> = (0..8).map(|i| 1 + (s as u32 * 8 + i) % (vocab - 1)).collect();
        let params =
            SamplingParams { max_new_tokens: tokens as u32 + 1, ignore_eos: true, ..Default::default() };
        e.add(strata_engine::SeqId(1_000 + s as u64), prompt, params)?;
    }
    let mut steps = Vec::new();
    while e.has_work() {
        let t = Instant::now();
        let events = e.step()?;
        let seconds = t.elapsed().as_secs_f64();
        if events.len() == batch && e.last_step_tokens() == batch {
            steps.push(seconds);
        }
    }
    if steps.is_empty() {
        bail!("no step decoded all {batch} sequences at once (max_num_seqs, KV cache?)");
    }
    Ok(steps)
}

/// Prefill tokens/s of a `len`-token prompt: the median of three prompts that share no
/// prefix (so the prefix cache cannot help).
fn prefill_speed(e: &mut Engine, len: usize) -> anyhow::Result<f64> {
    let vocab = e.executor().config().vocab_size as u32;
    let mut speeds = Vec::new();
    for r in 0..3u32 {
        let prompt: Vec<u32> = (0..len as u32).map(|i| 1 + (i * 7 + r * 13) % (vocab - 1)).collect();
        let params = SamplingParams { max_new_tokens: 1, ignore_eos: true, ..Default::default() };
        e.add(strata_engine::SeqId(9_000 + r as u64), prompt, params)?;
        let t = Instant::now();
        while e.has_work() {
            e.step()?;
        }
        speeds.push(len as f64 / t.elapsed().as_secs_f64());
    }
    Ok(median(&speeds))
}

fn comm(max_world: usize) -> anyhow::Result<()> {
    let make = |world: usize| Ok(boxed(tcp::local_group(world, std::time::Duration::from_secs(30))?));
    let mut failed = 0;
    for world in 2..=max_world.min(4) {
        for (check, result) in strata_engine::comm::contract::run_all(world, make) {
            failed += usize::from(result.is_err());
            println!(
                "{}",
                json!({"communicator": "tcp", "world": world, "check": check, "ok": result.is_ok(),
                       "error": result.err().map(|e| e.to_string())})
            );
        }
    }
    if failed > 0 {
        bail!("{failed} communicator check(s) failed");
    }
    Ok(())
}

/// Runs the device-collectives contract for groups of 1 to `max_world` ranks made by
/// `make`, one JSON line a check; the number that failed.
fn device_contract_lines<B: Tensors>(
    name: &str,
    max_world: usize,
    mut make: impl FnMut(usize) -> strata_common::Result<Vec<Rank<B>>>,
) -> usize {
    let mut failed = 0;
    for world in 1..=max_world {
        for (check, result) in device_contract::run_all(world, &mut make) {
            failed += usize::from(result.is_err());
            println!(
                "{}",
                json!({"collectives": name, "world": world, "check": check, "ok": result.is_ok(),
                       "error": result.err().map(|e| e.to_string())})
            );
        }
    }
    failed
}

fn collectives(device: Device, max_world: usize) -> anyhow::Result<()> {
    let failed = match device {
        Device::Cpu => device_contract_lines("host-staged tcp", max_world.min(4), |world| {
            let meshes = tcp::local_group(world, std::time::Duration::from_secs(30))?;
            Ok(meshes
                .into_iter()
                .map(|m| {
                    (
                        CpuBackend::new(),
                        Box::new(HostStaged::new(Box::new(m))) as Box<dyn DeviceCollectives<_>>,
                    )
                })
                .collect())
        }),
        Device::Cuda(first) => {
            let available = nccl::device_count()?.saturating_sub(first).min(max_world);
            if available == 0 {
                bail!("no GPU from {device} on");
            }
            let failed = device_contract_lines("nccl", available, |world| {
                let comms = nccl::local_group(first, world, &device_contract::groups(world))?;
                comms
                    .into_iter()
                    .enumerate()
                    .map(|(r, c)| {
                        Ok((
                            CudaBackend::new(CudaGpu::open(first + r)?),
                            Box::new(c) as Box<dyn DeviceCollectives<_>>,
                        ))
                    })
                    .collect()
            });
            if failed == 0 {
                device_all_reduce(first, available, if available == 1 { 64 } else { 256 })?;
            }
            failed
        }
    };
    if failed > 0 {
        bail!("{failed} device-collectives check(s) failed");
    }
    Ok(())
}

/// NCCL all-reduce of device buffers (the CUDA backend's path, ordered on a compute
/// stream) across `world` GPUs from `first` on: whether it summed, the median time, and
/// the bus bandwidth as nccl-tests define it (2(n−1)/n × bytes ÷ time; 0 for one rank).
fn device_all_reduce(first: usize, world: usize, mib: usize) -> anyhow::Result<()> {
    let group: Vec<usize> = (0..world).collect();
    let comms = nccl::local_group(first, world, std::slice::from_ref(&group))?;
    let count = (mib << 20) / 4;
    let results = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(r, mut c)| {
                let group = &group;
                s.spawn(move || c.bench_all_reduce(first + r, group, count, 20))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().map_err(|_| anyhow::anyhow!("an NCCL rank panicked"))?.map_err(Into::into))
            .collect::<anyhow::Result<Vec<_>>>()
    })?;
    let seconds = results.iter().map(|r| r.seconds).fold(0f64, f64::max);
    let bytes = (count * 4) as f64;
    let ok = results.iter().all(|r| r.correct);
    println!(
        "{}",
        json!({"collectives": "nccl", "world": world, "check": "all_reduce_device+all_gather_device", "ok": ok,
               "mib": mib, "median_ms": seconds * 1e3, "algbw_gb_per_s": bytes / seconds / 1e9,
               "busbw_gb_per_s": 2.0 * (world - 1) as f64 / world as f64 * bytes / seconds / 1e9})
    );
    if !ok {
        bail!("NCCL's all-reduce of device buffers did not sum, or its all-gather put blocks out of order");
    }
    Ok(())
}
