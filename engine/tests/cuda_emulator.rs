//! The CUDA backend on the CPU emulator (feature `cuda-emulator`) as the engine uses it:
//! device reductions and draws against the host sampler, whole models against the CPU
//! backend, decode graphs against eager steps, tensor- and pipeline-parallel replicas
//! whose ranks each drive an emulated device, and the emulated NCCL's device-collectives
//! contract.
#![cfg(feature = "cuda-emulator")]

use std::sync::Arc;

use strata_common::{Architecture, SamplingParams};
use strata_engine::backend::cpu::CpuBackend;
use strata_engine::backend::cuda::emulator::EmulatedGpu;
use strata_engine::backend::cuda::CudaBackend;
use strata_engine::backend::prelude::*;
use strata_engine::comm::nccl::emulated::EmulatedDeviceComm;
use strata_engine::comm::{DeviceCollectives, HostStaged};
use strata_engine::model::random::RandomModelSpec;
use strata_engine::model::Model;
use strata_engine::tensor::DType;
use strata_engine::{Engine, EngineConfig};

fn backend() -> CudaBackend<EmulatedGpu> {
    CudaBackend::new(Arc::new(EmulatedGpu::new()))
}

/// A communicator of host memory (TCP) is not handed device buffers: the all-reduce goes
/// through the host and still sums across ranks. (NCCL on device buffers needs a GPU per
/// rank: `strata gpu-check comm` runs it.)
#[test]
fn all_reduce_through_a_host_communicator_sums_across_ranks() {
    let comms = strata_engine::comm::tcp::local_group(2, std::time::Duration::from_secs(20)).unwrap();
    let sums: Vec<Vec<f32>> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| {
                s.spawn(move || {
                    let b = backend();
                    let mut comm = HostStaged::new(Box::new(comm));
                    let data: Vec<f32> = (0..12).map(|i| (i * (rank + 1)) as f32).collect();
                    let mut x = b.upload(data, 3, 4).unwrap();
                    comm.all_reduce(&b, &mut x, &[0, 1]).unwrap();
                    b.to_host(&x).unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let want: Vec<f32> = (0..12).map(|i| (i * 3) as f32).collect();
    assert_eq!(sums, vec![want.clone(), want]);
}

/// One decode event: sequence, token and logprobs.
type Event = (strata_engine::SeqId, u32, Option<strata_common::TokenLogprobs>);

/// Every event of `e`'s steps until its sequences finish.
fn events(e: &mut Engine) -> Vec<Event> {
    let mut out = Vec::new();
    while e.has_work() {
        out.extend(e.step().unwrap().into_iter().map(|ev| (ev.seq, ev.token, ev.logprobs)));
    }
    out
}

fn greedy(e: &mut Engine, prompt: &[u32], n: u32) -> Vec<u32> {
    e.add(
        strata_engine::SeqId(0),
        prompt.to_vec(),
        SamplingParams { max_new_tokens: n, ignore_eos: true, ..Default::default() },
    )
    .unwrap();
    let mut out = Vec::new();
    while e.has_work() {
        out.extend(e.step().unwrap().into_iter().map(|ev| ev.token));
    }
    out
}

/// A tiny random Llama with bf16 weights and `layers` layers, in a temporary directory.
/// Seeded top-p and min-p sampling of 8 tokens: drawn on the device.
fn nucleus_sampling() -> SamplingParams {
    SamplingParams {
        temperature: 0.9,
        top_p: 0.8,
        min_p: 0.01,
        seed: Some(11),
        max_new_tokens: 8,
        ignore_eos: true,
        ..Default::default()
    }
}

fn tiny_bf16_model(layers: usize) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let mut spec = RandomModelSpec::tiny(Architecture::Llama);
    spec.dtype = DType::BF16;
    spec.layers = layers;
    spec.write(dir.path(), |_, _| {}).unwrap();
    dir
}

#[test]
fn a_whole_model_matches_the_cpu_backend() {
    // bf16 weights on both sides; the device also rounds matmul inputs to bf16.
    let dir = tiny_bf16_model(2);
    let config = EngineConfig { kv_cache_bytes: 1 << 20, block_size: 4, ..Default::default() };
    let mut cpu = Engine::new(Model::load(dir.path(), CpuBackend::new()).unwrap(), &config).unwrap();
    let mut gpu = Engine::new(Model::load(dir.path(), backend()).unwrap(), &config).unwrap();
    // The device's KV cache is bf16: the same budget holds twice the blocks.
    assert_eq!(gpu.total_blocks(), 2 * cpu.total_blocks());
    let prompt: Vec<u32> = vec![1, 17, 300, 42, 9, 511, 3];
    let want = cpu.prompt_logits(&prompt).unwrap();
    let got = gpu.prompt_logits(&prompt).unwrap();
    let scale = want.iter().fold(0f32, |a, b| a.max(b.abs()));
    let diff = got.iter().zip(&want).fold(0f32, |a, (x, y)| a.max((x - y).abs()));
    eprintln!("prompt logits: max |Δ| {diff:.4} at scale {scale:.3}");
    assert!(diff <= 0.03 * scale, "logits differ by {diff} (scale {scale})");
    // Greedy decoding over the paged (bf16) cache: prefill, then decode steps across blocks.
    let a = greedy(&mut cpu, &prompt, 6);
    let b = greedy(&mut gpu, &prompt, 6);
    assert_eq!(a, b, "greedy tokens");
}

/// Qwen3's per-head RMSNorm of queries and keys (one norm over `[tokens · heads, head_dim]`)
/// on the device: HF's tiny bf16 Qwen3 fixture gives the CPU backend's logits and tokens.
#[test]
fn a_qwen3_model_with_per_head_norms_matches_the_cpu_backend() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/models/qwen3_bf16");
    let config = EngineConfig { kv_cache_bytes: 1 << 20, block_size: 4, ..Default::default() };
    let mut cpu = Engine::new(Model::load(&dir, CpuBackend::new()).unwrap(), &config).unwrap();
    let mut gpu = Engine::new(Model::load(&dir, backend()).unwrap(), &config).unwrap();
    let prompt: Vec<u32> = vec![1, 17, 300, 42, 9, 211, 3];
    let want = cpu.prompt_logits(&prompt).unwrap();
    let got = gpu.prompt_logits(&prompt).unwrap();
    let scale = want.iter().fold(0f32, |a, b| a.max(b.abs()));
    let diff = got.iter().zip(&want).fold(0f32, |a, (x, y)| a.max((x - y).abs()));
    eprintln!("qwen3 prompt logits: max |Δ| {diff:.4} at scale {scale:.3}");
    assert!(diff <= 0.03 * scale, "logits differ by {diff} (scale {scale})");
    assert_eq!(greedy(&mut cpu, &prompt, 6), greedy(&mut gpu, &prompt, 6), "greedy tokens");
}

/// Gemma 3 on the device: local layers with their own rope base and an 8-token window, a
/// global layer with scaled rope, GELU (tanh), sandwich norms, embeddings scaled by
/// √hidden and soft-capped logits — within bf16 of the CPU backend (bf16 weights on both
/// sides), and decode steps replayed from graphs (which find both rope tables on the
/// device) give the tokens of eager ones, past the window.
#[test]
fn gemma3_runs_on_the_device_and_its_graphs_replay_eager_steps() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/models/gemma3_window");
    let config = EngineConfig { kv_cache_bytes: 1 << 20, block_size: 4, ..Default::default() };
    let bf16 = CpuBackend::new().with_weight_dtype(Some(DType::BF16));
    let mut cpu = Engine::new(Model::load(&dir, bf16).unwrap(), &config).unwrap();
    let prompt: Vec<u32> = (0..14).map(|i| 3 + i * 23 % 380).collect();
    let want = cpu.prompt_logits(&prompt).unwrap();
    let run = |graphs: bool| {
        let gpu = Arc::new(EmulatedGpu::new());
        let backend = CudaBackend::with_graphs(gpu.clone(), graphs);
        let mut e = Engine::new(Model::load(&dir, backend).unwrap(), &config).unwrap();
        let logits = e.prompt_logits(&prompt).unwrap();
        (logits, greedy(&mut e, &prompt, 10), gpu.captures(), gpu.replays())
    };
    let (got, eager, ..) = run(false);
    let scale = want.iter().fold(0f32, |a, b| a.max(b.abs()));
    let diff = got.iter().zip(&want).fold(0f32, |a, (x, y)| a.max((x - y).abs()));
    eprintln!("gemma3 prompt logits: max |Δ| {diff:.4} at scale {scale:.3}");
    assert!(diff <= 0.03 * scale, "logits differ by {diff} (scale {scale})");
    let (_, replayed, captures, replays) = run(true);
    assert_eq!(replayed, eager, "tokens with graphs");
    assert!(captures >= 1 && replays > captures, "({captures} captures, {replays} replays)");
}

/// A mixture of experts on the device (Mixtral: 4 experts, 2 a token): within bf16 of the
/// CPU backend; routed on the device, so its decode steps are captured and replayed like
/// a dense model's, with the tokens of eager steps.
#[test]
fn mixtral_runs_on_the_device() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/models/mixtral_moe");
    let config = EngineConfig { kv_cache_bytes: 1 << 20, block_size: 4, ..Default::default() };
    let bf16 = CpuBackend::new().with_weight_dtype(Some(DType::BF16));
    let mut cpu = Engine::new(Model::load(&dir, bf16).unwrap(), &config).unwrap();
    let prompt: Vec<u32> = vec![1, 17, 300, 42, 9, 211, 3, 77];
    let want = cpu.prompt_logits(&prompt).unwrap();
    let run = |graphs: bool| {
        let gpu = Arc::new(EmulatedGpu::new());
        let backend = CudaBackend::with_graphs(gpu.clone(), graphs);
        let mut e = Engine::new(Model::load(&dir, backend).unwrap(), &config).unwrap();
        (e.prompt_logits(&prompt).unwrap(), greedy(&mut e, &prompt, 6), gpu)
    };
    let (got, eager, _) = run(false);
    let scale = want.iter().fold(0f32, |a, b| a.max(b.abs()));
    let diff = got.iter().zip(&want).fold(0f32, |a, (x, y)| a.max((x - y).abs()));
    eprintln!("mixtral prompt logits: max |Δ| {diff:.4} at scale {scale:.3}");
    assert!(diff <= 0.03 * scale, "logits differ by {diff} (scale {scale})");
    let (_, graphed, gpu) = run(true);
    assert_eq!(graphed, eager, "tokens with graphs");
    assert!(gpu.captures() > 0 && gpu.replays() > 0, "decode steps with experts are captured and replayed");
    // Expert parallelism on two emulated devices: the all-to-alls and the gather are the
    // emulated NCCL's device work; one device's tokens.
    let par = strata_common::Parallelism { tp: 2, pp: 1, ep: 2 };
    let gpus: Vec<Arc<EmulatedGpu>> = (0..2).map(|_| Arc::new(EmulatedGpu::new())).collect();
    let backend = move |rank: usize| Ok(CudaBackend::with_graphs(gpus[rank].clone(), false));
    let comm = move |mesh: strata_engine::comm::tcp::TcpComm, _| Ok(collectives(mesh, true));
    let mut ep = strata_engine::replica::local_replica_on(&dir, par, &config, backend, comm).unwrap();
    assert_eq!(greedy(&mut ep, &prompt, 6), eager, "tokens with experts on two devices");
}

/// Gemma 2 (soft-capped attention scores, the windows of alternate layers), gpt-oss
/// (per-head sinks, biased attention, YaRN, a window, biased experts with the clamped
/// SwiGLU) and DeepSeek-V3 (latent attention over a cache of latents, grouped routing,
/// a shared expert) on the device: within bf16 of the CPU backend, and their decode steps,
/// experts and all, replayed from graphs with the tokens of eager steps.
#[test]
fn gemma2_gpt_oss_and_deepseek_run_on_the_device() {
    for case in ["gemma2_softcap", "gpt_oss_moe", "deepseek_v3_mla"] {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/models").join(case);
        let config = EngineConfig { kv_cache_bytes: 1 << 20, block_size: 4, ..Default::default() };
        let bf16 = CpuBackend::new().with_weight_dtype(Some(DType::BF16));
        let mut cpu = Engine::new(Model::load(&dir, bf16).unwrap(), &config).unwrap();
        let prompt: Vec<u32> = (0..14).map(|i| 3 + i * 29 % 380).collect();
        let want = cpu.prompt_logits(&prompt).unwrap();
        let run = |graphs: bool| {
            let gpu = Arc::new(EmulatedGpu::new());
            let backend = CudaBackend::with_graphs(gpu.clone(), graphs);
            let mut e = Engine::new(Model::load(&dir, backend).unwrap(), &config).unwrap();
            (e.prompt_logits(&prompt).unwrap(), greedy(&mut e, &prompt, 8), gpu)
        };
        let (got, eager, _) = run(false);
        let scale = want.iter().fold(0f32, |a, b| a.max(b.abs()));
        let diff = got.iter().zip(&want).fold(0f32, |a, (x, y)| a.max((x - y).abs()));
        eprintln!("{case} prompt logits: max |Δ| {diff:.4} at scale {scale:.3}");
        assert!(diff <= 0.03 * scale, "{case}: logits differ by {diff} (scale {scale})");
        let (_, graphed, gpu) = run(true);
        assert_eq!(graphed, eager, "{case}: tokens with graphs");
        assert!(gpu.replays() > 0, "{case}: decode steps are replayed from graphs");
    }
}

/// Seeded top-k sampling from the device's candidates (2k + 1 floats per row cross to the
/// host) draws the tokens, and reports the logprobs, that sampling the same rows whole
/// does.
#[test]
fn sampling_from_device_candidates_equals_sampling_whole_rows() {
    use strata_engine::sampler::Sampler;
    let b = backend();
    let (rows, vocab) = (24, 300);
    let logits: Vec<f32> =
        (0..rows * vocab).map(|i| ((i as u64 * 2654435761) % 1000) as f32 / 90.0 - 5.0).collect();
    let on_device = b.upload(logits.clone(), rows, vocab).unwrap();
    for (top_k, top_p, min_p) in [(20, 1.0, 0.0), (50, 0.8, 0.0), (5, 1.0, 0.2), (1, 1.0, 0.0)] {
        let params = SamplingParams {
            temperature: 0.7,
            top_k,
            top_p,
            min_p,
            seed: Some(5),
            logprobs: Some(4),
            ..Default::default()
        };
        let (mut whole, mut cands) = (Sampler::new(params.clone(), &[]), Sampler::new(params, &[]));
        let k = cands.candidates_needed().expect("top-k sampling needs candidates only");
        let top = b.top_logits(&on_device, rows, k, 0).unwrap();
        for (r, c) in top.iter().enumerate() {
            let want = whole.sample(&logits[r * vocab..(r + 1) * vocab], None);
            let got = cands.take(c);
            assert_eq!(got.0, want.0, "top_k {top_k}: row {r}");
            let (g, w) = (got.1.unwrap(), want.1.unwrap());
            assert_eq!(
                g.top.iter().map(|t| t.0).collect::<Vec<_>>(),
                w.top.iter().map(|t| t.0).collect::<Vec<_>>()
            );
            assert!((g.logprob - w.logprob).abs() < 1e-4, "row {r}: {g:?} vs {w:?}");
        }
    }
}

/// Decode steps replayed from captured graphs give exactly the tokens and logprobs that
/// running every op gives: three sequences padded to a graph of four rows (seeded top-k
/// sampling), then one alone (greedy: another graph) whose one-position blocks outgrow the
/// graph's block-table stride, so that it is captured again.
#[test]
fn decode_graphs_replay_what_eager_steps_compute() {
    let dir = tiny_bf16_model(1);
    let config = EngineConfig { kv_cache_bytes: 1 << 20, block_size: 1, ..Default::default() };
    let run = |graphs: bool| {
        let gpu = Arc::new(EmulatedGpu::new());
        let backend = CudaBackend::with_graphs(gpu.clone(), graphs);
        let mut e = Engine::new(Model::load(dir.path(), backend).unwrap(), &config).unwrap();
        let greedy = |n| SamplingParams { max_new_tokens: n, ignore_eos: true, ..Default::default() };
        let sampled =
            SamplingParams { temperature: 0.8, top_k: 5, seed: Some(3), logprobs: Some(2), ..greedy(5) };
        e.add(strata_engine::SeqId(0), vec![1, 17, 300], greedy(19)).unwrap();
        e.add(strata_engine::SeqId(1), vec![5, 6, 7, 8], sampled.clone()).unwrap();
        e.add(strata_engine::SeqId(2), vec![400, 2], sampled).unwrap();
        let out = events(&mut e);
        // Operators see the replays while the engine lives (its series go with it; other
        // tests of this process may add their own).
        let counted: u64 = strata_common::metrics::encode()
            .lines()
            .filter(|l| l.starts_with("strata_graph_steps_total"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .sum();
        (out, gpu.captures(), gpu.replays(), counted)
    };
    let (eager, no_captures, no_replays, _) = run(false);
    let (replayed, captures, replays, counted) = run(true);
    eprintln!("{} tokens; {captures} graphs captured, {replays} replays", replayed.len());
    assert_eq!((no_captures, no_replays), (0, 0), "--enforce-eager captures nothing");
    assert_eq!(eager.len(), 19 + 5 + 5);
    assert_eq!(replayed, eager, "tokens and logprobs with graphs");
    // Four rows, top-k (4 decode steps): warm-up, then a capture and 3 replays (a capture
    // runs by replaying). One row, greedy (14 steps): warm-up at 9 blocks, capture at 10
    // (stride 16), capture again at 17 blocks (stride 32): 13 replays.
    assert_eq!(captures, 3, "captures");
    assert_eq!(replays, 3 + 13, "replays");
    assert!(counted >= replays, "strata_graph_steps_total {counted}, {replays} replays");
}

/// The device draws the token the host reference draws — top-p, min-p, both, neither,
/// and a nucleus that cuts a run of equal logits (ties go by id) — and, over a grid of
/// uniform numbers, each kept token in proportion to its probability and nothing else.
#[test]
fn device_draws_follow_the_samplers_kept_distribution() {
    use strata_engine::logits::draw::{host_draw, kept};
    use strata_engine::logits::Draw;
    use strata_engine::sampler::Sampler;
    let b = backend();
    let (rows, vocab) = (16, 300);
    let mut logits: Vec<f32> =
        (0..rows * vocab).map(|i| ((i as u64 * 2654435761) % 1000) as f32 / 150.0 - 3.0).collect();
    logits[..vocab].iter_mut().enumerate().for_each(|(c, l)| *l = if c % 7 == 3 { 4.0 } else { -4.0 });
    let on_device = b.upload(logits.clone(), rows, vocab).unwrap();
    for (temperature, top_p, min_p) in [(0.8, 0.9, 0.0), (1.0, 1.0, 0.1), (0.6, 0.5, 0.05), (1.2, 1.0, 0.0)] {
        let draws: Vec<Draw> = (0..rows)
            .map(|r| Draw { temperature, top_p, min_p, u: ((r * 37 + 11) % 100) as f32 / 100.0 })
            .collect();
        let picks = b.draw_tokens(&on_device, &draws, 0).unwrap();
        for (r, (p, d)) in picks.iter().zip(&draws).enumerate() {
            assert_eq!(p.token as usize, host_draw(&logits[r * vocab..(r + 1) * vocab], d), "row {r}, {d:?}");
        }
    }
    // The host sampler draws such a request the same way: the same tokens, seed for seed.
    let params =
        SamplingParams { temperature: 0.8, top_p: 0.9, min_p: 0.02, seed: Some(4), ..Default::default() };
    let (mut host, mut dev) = (Sampler::new(params.clone(), &[]), Sampler::new(params, &[]));
    assert!(dev.drawable());
    let draws: Vec<Draw> = (0..rows).map(|_| dev.next_draw()).collect();
    let picks = b.draw_tokens(&on_device, &draws, 0).unwrap();
    for (r, p) in picks.iter().enumerate() {
        assert_eq!(
            p.token,
            host.sample(&logits[r * vocab..(r + 1) * vocab], None).0,
            "row {r}: the host sampler"
        );
    }
    let row = &logits[vocab..2 * vocab];
    let d = Draw { temperature: 0.9, top_p: 0.7, min_p: 0.02, u: 0.0 };
    // A stratified grid: each kept token is drawn p·n ± 1 times (200 draws keep CI inside
    // its time; the emulator synchronises the draw kernel's 256 threads at every bisection step).
    let n = 200;
    let grid: Vec<Draw> = (0..n).map(|i| Draw { u: (i as f32 + 0.5) / n as f32, ..d }).collect();
    let picks = b.draw_tokens(&b.upload(row.repeat(n), n, vocab).unwrap(), &grid, 0).unwrap();
    let keep: Vec<usize> = kept(row, &d).into_iter().map(|k| k.0).collect();
    let top = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let weight = |c: usize| ((row[c] / d.temperature - top / d.temperature) as f64).exp();
    let total: f64 = keep.iter().map(|&c| weight(c)).sum();
    let mut counts = vec![0usize; vocab];
    picks.iter().for_each(|p| counts[p.token as usize] += 1);
    for (c, &count) in counts.iter().enumerate() {
        let want = if keep.contains(&c) { weight(c) / total * n as f64 } else { 0.0 };
        assert!((count as f64 - want).abs() <= 2.0, "token {c}: drawn {count} times, {want:.1} expected");
    }
}

/// A top-p sequence's tokens are drawn on the device — not one row of logits crosses to
/// the host — and are the same whether it decodes alone or beside a sequence whose
/// penalties need whole rows and a greedy one, with graphs or without: whether a token is
/// drawn on the device depends on its request only, so a seed reproduces a generation.
#[test]
fn drawn_tokens_do_not_depend_on_what_shares_the_batch() {
    let dir = tiny_bf16_model(1);
    let vocab = RandomModelSpec::tiny(Architecture::Llama).vocab;
    let config = EngineConfig { kv_cache_bytes: 1 << 20, block_size: 4, ..Default::default() };
    let nucleus = nucleus_sampling();
    let run = |graphs: bool, companions: bool| {
        let gpu = Arc::new(EmulatedGpu::new());
        let backend = CudaBackend::with_graphs(gpu.clone(), graphs);
        let mut e = Engine::new(Model::load(dir.path(), backend).unwrap(), &config).unwrap();
        e.add(strata_engine::SeqId(0), vec![1, 17, 300], nucleus.clone()).unwrap();
        if companions {
            let penalised = SamplingParams { repetition_penalty: 1.3, seed: Some(2), ..nucleus.clone() };
            e.add(strata_engine::SeqId(1), vec![5, 6], penalised).unwrap();
            e.add(strata_engine::SeqId(2), vec![9], SamplingParams { temperature: 0.0, ..nucleus.clone() })
                .unwrap();
        }
        let mut out = Vec::new();
        while e.has_work() {
            let events = e.step().unwrap();
            out.extend(events.into_iter().filter(|ev| ev.seq == strata_engine::SeqId(0)).map(|ev| ev.token));
        }
        (out, gpu.downloaded_bytes())
    };
    let (alone, bytes) = run(true, false);
    eprintln!("drawn alone: {alone:?}, {bytes} bytes downloaded");
    assert_eq!(alone.len(), 8);
    assert!(bytes < (vocab * 4) as u64, "{bytes} bytes reached the host: a row of logits is {}", vocab * 4);
    assert_eq!(run(false, false).0, alone, "eager steps");
    assert_eq!(run(true, true).0, alone, "beside whole-row and greedy sequences, with graphs");
    assert_eq!(run(false, true).0, alone, "beside whole-row and greedy sequences, eager");
}

/// A tensor-parallel rank replays its decode steps from graphs when its collectives are
/// device work (NCCL on GPUs; here the emulator's stand-in, [`EmulatedDeviceComm`]), and
/// draws top-p tokens from the vocabulary gathered on the device: two ranks, each its own
/// emulated device, give exactly the tokens and logprobs of eager steps — greedy, seeded
/// top-k with logprobs, and seeded top-p — and capture the same graphs. With a
/// communicator of host memory nothing is captured (the collectives could not be), the
/// top-p rows are gathered and drawn on the host, and the tokens are the same.
#[test]
fn tensor_parallel_decode_graphs_replay_what_eager_steps_compute() {
    let dir = tiny_bf16_model(2);
    let config = EngineConfig { kv_cache_bytes: 1 << 20, block_size: 4, ..Default::default() };
    let par = strata_common::Parallelism::new(2, 1);
    let run = |graphs: bool, on_device: bool| {
        let gpus: Vec<Arc<EmulatedGpu>> = (0..2).map(|_| Arc::new(EmulatedGpu::new())).collect();
        let ranks = gpus.clone();
        let backend = move |rank: usize| Ok(CudaBackend::with_graphs(ranks[rank].clone(), graphs));
        let comm =
            move |mesh: strata_engine::comm::tcp::TcpComm, _rank: usize| Ok(collectives(mesh, on_device));
        let mut e =
            strata_engine::replica::local_replica_on(dir.path(), par, &config, backend, comm).unwrap();
        let greedy = |n| SamplingParams { max_new_tokens: n, ignore_eos: true, ..Default::default() };
        let top_k =
            SamplingParams { temperature: 0.8, top_k: 5, seed: Some(3), logprobs: Some(2), ..greedy(6) };
        let top_p = SamplingParams { temperature: 0.9, top_p: 0.8, seed: Some(5), ..greedy(6) };
        e.add(strata_engine::SeqId(0), vec![1, 17, 300], greedy(9)).unwrap();
        e.add(strata_engine::SeqId(1), vec![5, 6, 7, 8], top_k).unwrap();
        e.add(strata_engine::SeqId(2), vec![400, 2], top_p).unwrap();
        let out = events(&mut e);
        drop(e); // stops the other rank before its device is read
        let counts: Vec<(u64, u64)> = gpus.iter().map(|g| (g.captures(), g.replays())).collect();
        (out, counts, gpus.iter().map(|g| g.downloaded_bytes()).collect::<Vec<_>>())
    };
    let (eager, none, eager_bytes) = run(false, true);
    let (replayed, counts, bytes) = run(true, true);
    let (host, host_counts, host_bytes) = run(true, false);
    eprintln!("{} tokens; (captures, replays) per rank: {counts:?}", replayed.len());
    eprintln!("bytes to each rank's host: {bytes:?} with graphs, {eager_bytes:?} eager, {host_bytes:?} through the host");
    // Device collectives: the top-p rows are drawn from the vocabulary gathered on the
    // device, so only picks and candidates reach the host, and only rank 0's (rank 1's
    // part of a drawing step ends at the gather); a host communicator gathers every
    // step's logit rows there and draws on the host (the same walk: same tokens).
    for b in [&bytes, &eager_bytes] {
        assert!(b[0] * 10 < host_bytes[0], "rows of logits reached the host: {b:?}");
        assert!(b[1] * 10 < b[0], "rank 1 downloaded a drawing step's output: {b:?}");
    }
    assert_eq!(none, vec![(0, 0); 2], "--enforce-eager captures nothing");
    assert_eq!(eager.len(), 9 + 6 + 6);
    assert_eq!(replayed, eager, "tokens and logprobs with graphs");
    // Through the host, the whole rows' log-softmax is the CPU's (`sampler::logprobs`),
    // whose normaliser sums in the CPU kernels' lane order, not the device's: the same
    // tokens, logprobs equal to f32 rounding.
    assert_same_tokens(&host, &eager, 1e-5, "through a host communicator");
    assert_eq!(host_counts, vec![(0, 0); 2], "host all-reduces are not captured");
    assert_eq!(counts[0], counts[1], "every rank captures and replays the same steps");
    // Greedy, top-k and whole rows are three graph keys of three rows, then one and two
    // rows as sequences finish: at least one capture, and replays after it.
    assert!(counts[0].0 >= 1 && counts[0].1 > counts[0].0, "(captures, replays) {:?}", counts[0]);
}

/// A rank's collectives over its TCP mesh endpoint: the emulator's stand-in for NCCL
/// (device work, captured in graphs) or tensors staged through host memory.
fn collectives(
    mesh: strata_engine::comm::tcp::TcpComm,
    on_device: bool,
) -> Box<dyn DeviceCollectives<Emulated>> {
    match on_device {
        true => Box::new(EmulatedDeviceComm::new(Box::new(mesh))),
        false => Box::new(HostStaged::new(Box::new(mesh))),
    }
}

type Emulated = CudaBackend<EmulatedGpu>;

/// `got` has `want`'s tokens exactly, and its logprobs (the chosen token's and the top
/// alternatives', same tokens in the same order) within `tol` of `want`'s.
fn assert_same_tokens(got: &[Event], want: &[Event], tol: f32, what: &str) {
    let tokens = |v: &[Event]| v.iter().map(|e| (e.0, e.1)).collect::<Vec<_>>();
    assert_eq!(tokens(got), tokens(want), "tokens {what}");
    for ((_, _, g), (_, _, w)) in got.iter().zip(want) {
        let close = match (g, w) {
            (None, None) => true,
            (Some(g), Some(w)) => {
                (g.logprob - w.logprob).abs() <= tol
                    && g.top.len() == w.top.len()
                    && g.top.iter().zip(&w.top).all(|(a, b)| a.0 == b.0 && (a.1 - b.1).abs() <= tol)
            }
            _ => false,
        };
        assert!(close, "logprobs {what}: {g:?} against {w:?}");
    }
}

/// A pipeline-parallel replica draws on its last stage's device — the picks travel to the
/// leader with the step's logits, never a row of them — and, where its stages hand hidden
/// states over on the device (NCCL; here the emulator's stand-in), every stage replays its
/// decode steps from graphs that receive from the previous stage and send to the next.
/// Two stages on two emulated devices give one rank's top-p tokens every way; so do two
/// stages of two TP ranks each, with graphs and without.
#[test]
fn pipeline_stages_replay_graphs_and_draw_on_the_last_stages_device() {
    use strata_common::Parallelism;
    let dir = tiny_bf16_model(2);
    let vocab = RandomModelSpec::tiny(Architecture::Llama).vocab;
    let config = EngineConfig { kv_cache_bytes: 1 << 20, block_size: 4, ..Default::default() };
    let nucleus = nucleus_sampling();
    let run = |par: Parallelism, on_device: bool, graphs: bool| {
        let gpus: Vec<Arc<EmulatedGpu>> = (0..par.world()).map(|_| Arc::new(EmulatedGpu::new())).collect();
        let ranks = gpus.clone();
        let backend = move |rank: usize| Ok(CudaBackend::with_graphs(ranks[rank].clone(), graphs));
        let comm = move |mesh: strata_engine::comm::tcp::TcpComm, _| Ok(collectives(mesh, on_device));
        let mut e =
            strata_engine::replica::local_replica_on(dir.path(), par, &config, backend, comm).unwrap();
        e.add(strata_engine::SeqId(0), vec![1, 17, 300], nucleus.clone()).unwrap();
        e.add(strata_engine::SeqId(1), vec![5, 6], SamplingParams { seed: Some(4), ..nucleus.clone() })
            .unwrap();
        let mut out = Vec::new();
        while e.has_work() {
            out.extend(e.step().unwrap().into_iter().map(|ev| (ev.seq, ev.token)));
        }
        drop(e); // stops the other ranks before their devices are read
        let counts: Vec<(u64, u64)> = gpus.iter().map(|g| (g.captures(), g.replays())).collect();
        (out, counts, gpus.iter().map(|g| g.downloaded_bytes()).collect::<Vec<_>>())
    };
    let two = Parallelism::new(1, 2);
    let (one, ..) = run(Parallelism::NONE, false, true);
    let (host, host_counts, host_bytes) = run(two, false, true);
    let (device, counts, bytes) = run(two, true, true);
    let (eager, ..) = run(two, true, false);
    eprintln!(
        "bytes to each stage's host: {host_bytes:?} handing over through the host, {bytes:?} on the device"
    );
    eprintln!("(captures, replays) per stage: {counts:?}");
    assert_eq!(one.len(), 16);
    assert_eq!(host, one, "two stages through the host draw the tokens one rank draws");
    assert_eq!(device, one, "two stages handing over on the device, with graphs");
    assert_eq!(eager, one, "two stages handing over on the device, without graphs");
    assert!(host_bytes[1] < (vocab * 4) as u64, "{} bytes reached the last stage's host", host_bytes[1]);
    assert_eq!(host_counts, vec![(0, 0); 2], "a hand-off through the host is not captured");
    assert_eq!(counts[0], counts[1], "both stages capture and replay the same steps");
    assert!(counts[0].0 >= 1 && counts[0].1 > counts[0].0, "(captures, replays) {:?}", counts[0]);
    assert!(bytes[0] * 4 < host_bytes[0], "the first stage's hidden states went through its host");
    let grid = Parallelism::new(2, 2);
    let (grid_graphs, grid_counts, _) = run(grid, true, true);
    let (grid_eager, ..) = run(grid, true, false);
    assert_eq!(grid_graphs, grid_eager, "2 × 2 ranks with graphs and without");
    assert!(grid_counts.iter().all(|&c| c == grid_counts[0] && c.0 >= 1), "{grid_counts:?}");
}

/// The emulator's stand-in for NCCL keeps the device-collectives contract (the checks
/// `strata gpu-check comm` runs over NCCL), and so does staging its tensors through the
/// host, for groups of one to three ranks, each with an emulated device of its own.
#[test]
fn emulated_collectives_keep_the_device_collectives_contract() {
    use strata_engine::comm::device_contract::{run_all, Rank};
    for on_device in [true, false] {
        for world in 1..=3 {
            let make = |w: usize| -> strata_common::Result<Vec<Rank<Emulated>>> {
                let meshes = strata_engine::comm::tcp::local_group(w, std::time::Duration::from_secs(20))?;
                Ok(meshes.into_iter().map(|m| (backend(), collectives(m, on_device))).collect())
            };
            for (check, result) in run_all(world, make) {
                result.unwrap_or_else(|e| panic!("on device {on_device}, world {world}, {check}: {e}"));
            }
        }
    }
}

/// The device's mask kernel leaves exactly what the host's masking leaves, rows without a
/// mask untouched.
#[test]
fn the_mask_kernel_masks_as_the_host_does() {
    use strata_engine::logits::late::mask_row;
    let b = backend();
    let (rows, vocab) = (3usize, 100usize);
    let logits: Vec<f32> = (0..rows * vocab).map(|i| (i % 37) as f32 - 9.0).collect();
    let words = vocab.div_ceil(32);
    let mask: Vec<u32> = (0..words as u32).map(|w| 0x9249_2492u32.rotate_left(w)).collect();
    let masks = vec![Some(Arc::new(mask.clone())), None, Some(Arc::new(vec![1u32]))];
    let got =
        b.to_host(&b.mask_logits(b.upload(logits.clone(), rows, vocab).unwrap(), &masks).unwrap()).unwrap();
    let mut want = logits.clone();
    mask_row(&mut want[..vocab], &mask);
    mask_row(&mut want[2 * vocab..], &[1]);
    assert_eq!(got, want);
    assert_eq!(
        got[2 * vocab..].iter().filter(|x| x.is_finite()).count(),
        1,
        "a short mask allows only its tokens"
    );
}

/// Constrained sequences on a replica of one emulated GPU: their masks go to the device
/// (applied before the reductions and draws), and greedy decoding gives the tokens host
/// masking gives; seeded sampling stays inside the constraint (a token outside it would
/// fail its sequence) and repeats itself.
#[test]
fn constrained_rows_are_masked_on_the_device_as_on_the_host() {
    use strata_common::Constraint;
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/models/llama_gqa");
    let make = |device: bool| {
        let model = Model::load(&dir, backend()).unwrap();
        Engine::new(model, &EngineConfig::default())
            .unwrap()
            .with_grammars_from(&dir)
            .with_device_masks(device)
    };
    let (mut on, mut off) = (make(true), make(false));
    assert!(on.masks_on_device() && !off.masks_on_device());
    let schema = r#"{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}"#;
    let constraints = [
        Constraint::Regex("[a-z]{3,8}( [a-z]{2,5}){0,2}".into()),
        Constraint::Choice(vec!["yes".into(), "no".into(), "perhaps".into()]),
        Constraint::JsonSchema(schema.into()),
    ];
    let run = |e: &mut Engine, sampled: bool| -> Vec<Vec<u32>> {
        for (i, c) in constraints.iter().enumerate() {
            let mut p =
                SamplingParams { max_new_tokens: 20, constraint: Some(c.clone()), ..Default::default() };
            if sampled {
                (p.temperature, p.top_p, p.seed) = (0.9, 0.95, Some(i as u64));
            }
            e.add(strata_engine::SeqId(i as u64), vec![1, 300 + i as u32, 17, 45], p).unwrap();
        }
        let free = SamplingParams { max_new_tokens: 6, ignore_eos: true, ..Default::default() };
        e.add(strata_engine::SeqId(9), vec![1, 5, 6], free).unwrap();
        let mut out = vec![Vec::new(); constraints.len() + 1];
        while e.has_work() {
            for ev in e.step().unwrap() {
                out[(ev.seq.0 as usize).min(constraints.len())].push(ev.token);
            }
            let aborted = e.take_aborted();
            assert!(
                aborted.is_empty(),
                "{:?}",
                aborted.iter().map(|a| a.error.to_string()).collect::<Vec<_>>()
            );
        }
        out
    };
    assert_eq!(run(&mut on, false), run(&mut off, false), "greedy: the same tokens either way");
    let sampled = run(&mut on, true);
    assert!(sampled[..constraints.len()].iter().all(|t| !t.is_empty() && t.len() < 20), "{sampled:?}");
    assert_eq!(run(&mut on, true), sampled, "seeded: the same draws again");
}
