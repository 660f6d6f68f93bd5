//! The `strata` command line.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::{Args, Parser, Subcommand, ValueEnum};
use strata_common::{Architecture, Constraint, SamplingParams};
use strata_engine::model::random::RandomModelSpec;
use strata_engine::tensor::DType;

use crate::config_args::EngineArgs;
use crate::local::{LocalModel, Prompt};
use crate::model_tools::write_random_model;

#[derive(Parser, Debug)]
#[command(name = "strata", version, about = "Distributed LLM inference: serve, generate, benchmark")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
    /// Log lines on stderr as `text` or `json` (one object per line, with the current
    /// span's fields: request spans carry `trace_id`).
    #[arg(long, global = true, env = "STRATA_LOG_FORMAT", default_value = "text")]
    pub log_format: strata_common::telemetry::LogFormat,
}

impl Cli {
    /// The service name spans are exported under (unless OTEL_SERVICE_NAME says).
    pub fn service_name(&self) -> &'static str {
        match self.command {
            Command::Serve(_) => "strata-serve",
            Command::Coordinator(_) => "strata-coordinator",
            Command::Worker(_) => "strata-worker",
            _ => "strata",
        }
    }
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Generate text from a prompt, in-process (or against a server with --endpoint).
    Generate(GenerateArgs),
    /// Serve models over gRPC: coordinator and workers in one process, no etcd.
    Serve(crate::serve_cli::ServeArgs),
    /// Load-test a running server: throughput, TTFT, ITL, TPOT and latency percentiles.
    Bench(crate::bench::BenchArgs),
    /// Offline batches against an OpenAI-style HTTP endpoint.
    Batch {
        #[command(subcommand)]
        command: crate::batch_cli::BatchCommand,
    },
    /// Cluster mode: route requests, serve the admin API, reconcile while elected leader.
    Coordinator(crate::cluster_cli::CoordinatorArgs),
    /// A worker: with --etcd, registers and holds the shards the leader assigns; with
    /// --rank/--rendezvous (deprecated static mode), one rank of a replica led by `strata serve`.
    Worker(crate::cluster_cli::WorkerArgs),
    /// Deploy, scale, list and drain through a coordinator's admin API.
    Admin(crate::admin_cli::AdminArgs),
    /// Checks for a machine with a GPU: ops and tokens against the CPU backend, decode
    /// speed against the bandwidth roofline (see scripts/gpu-check.sh).
    GpuCheck(crate::gpu_check::GpuCheckArgs),
    /// Benchmark the TCP communicator's all-reduce against a raw loopback TCP stream.
    CommBench {
        /// Ranks in the all-reduce group.
        #[arg(long, default_value_t = 2)]
        ranks: usize,
        /// Repetitions of each size (the median is reported).
        #[arg(long, default_value_t = 7)]
        repeats: usize,
    },
    /// Cluster certificates: a development CA and per-role certificates.
    Cert {
        #[command(subcommand)]
        command: crate::cert_cli::CertCommand,
    },
    /// Model tools.
    Model {
        #[command(subcommand)]
        command: ModelCommand,
    },
    /// Check a configuration file (what every command would refuse, it refuses) and print
    /// the effective configuration: defaults, the file, STRATA_* variables.
    Config {
        #[command(subcommand)]
        command: ConfigCommand,
    },
}

#[derive(Subcommand, Debug)]
pub enum ConfigCommand {
    /// Load, validate (tenants and their keys too) and print the effective configuration.
    Check(crate::config_args::ConfigArg),
}

#[derive(Subcommand, Debug)]
pub enum ModelCommand {
    /// Write a random-weight model directory (config, safetensors, tokenizer).
    Random(RandomArgs),
    /// Measure prefill and decode speed in-process, beside the memory-bandwidth roofline.
    Bench(BenchArgs),
    /// Latency of 1-token generations, in-process or through a server (--endpoint).
    Latency(LatencyArgs),
    /// How far a numeric setting (e.g. --quantize int8) moves a model from its checkpoint
    /// dtype: greedy agreement over prompts and the log-likelihood of a text.
    Compare(crate::model_compare::CompareArgs),
    /// Write an int8 copy of a model (every weight matrix, one scale per output row: what
    /// --quantize int8 does at load, from half the bytes of bf16).
    Quantize(crate::model_compare::QuantizeArgs),
    /// Fetch a model directory from an HTTP(S) URL (a web server or an S3-compatible
    /// store), every file checked against the directory's SHA256SUMS.
    Fetch(crate::model_fetch::FetchArgs),
}

#[derive(Args, Debug)]
pub struct LatencyArgs {
    /// Model directory (in-process) or served model name (with --endpoint).
    #[arg(long)]
    pub model: String,
    /// A running server to call instead of running the model in-process.
    #[arg(long)]
    pub endpoint: Option<String>,
    /// Requests sent, one after another.
    #[arg(long, default_value_t = 500)]
    pub requests: usize,
    /// With --endpoint: the same server's HTTP API (http://HOST:PORT); streams the same
    /// request over gRPC and HTTP alternately and reports both.
    #[arg(long, requires = "endpoint")]
    pub http: Option<String>,
    /// Tokens per streamed request (with --http).
    #[arg(long, default_value_t = 16)]
    pub tokens: u32,
    /// In-process: the engine, as `serve` takes it.
    #[command(flatten)]
    pub engine: EngineArgs,
}

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Model directory.
    #[arg(long)]
    pub model: PathBuf,
    /// Prompt length for the prefill measurement.
    #[arg(long, default_value_t = 512)]
    pub prompt_len: usize,
    /// Tokens decoded at batch 1.
    #[arg(long, default_value_t = 32)]
    pub decode_tokens: usize,
    /// Tensor-parallel ranks (threads of this process).
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
    /// Pipeline stages (threads of this process).
    #[arg(long, default_value_t = 1)]
    pub pp: usize,
    /// Expert parallelism: each MoE layer's experts split across this many ranks (the TP
    /// ranks of each stage; with --tp left out, --ep N means N ranks).
    #[arg(long, default_value_t = 1)]
    pub ep: usize,
    /// The engine: device, dtype, quantization, KV cache and scheduler, as `serve` takes them.
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Also measure decode steps with this many sequences running (e.g. 8,32).
    #[arg(long, value_delimiter = ',')]
    pub batch_sizes: Vec<usize>,
    /// Prefill repetitions (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// The KV cache in MiB (the older spelling of --kv-cache-memory).
    #[arg(long, hide = true, conflicts_with = "kv_cache_memory")]
    pub kv_cache_mib: Option<usize>,
    /// Instead of the full report, alternate two CPU kernel levels in this process (e.g.
    /// avx512,amx): --repeats rounds of prefill (and decode at --batch-sizes) under each,
    /// medians and their ratio. Both must read the weights as loaded: bf16 weights packed
    /// for AVX512-BF16 take avx512 or amx.
    #[arg(long, value_delimiter = ',', value_name = "A,B")]
    pub kernels_ab: Vec<String>,
}

#[derive(Args, Debug)]
pub struct GenerateArgs {
    /// Model directory (in-process) or served model name (with --endpoint).
    #[arg(long)]
    pub model: String,
    /// Prompt text (tokenized with the model's tokenizer.json).
    #[arg(long, conflicts_with = "prompt_ids", required_unless_present = "prompt_ids")]
    pub prompt: Option<String>,
    /// Prompt as comma-separated token ids, e.g. 1,2,3.
    #[arg(long, value_delimiter = ',')]
    pub prompt_ids: Option<Vec<u32>>,
    /// Maximum number of tokens to generate.
    #[arg(long, default_value_t = 16)]
    pub max_tokens: u32,
    /// Sampling temperature; 0 or absent is greedy.
    #[arg(long, allow_negative_numbers = true)]
    pub temperature: Option<f32>,
    /// Sample from the K most likely tokens (0: all).
    #[arg(long, default_value_t = 0)]
    pub top_k: u32,
    /// Sample from the smallest set of tokens whose probability reaches P.
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub top_p: f32,
    /// Drop tokens less likely than P × the most likely one's probability.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub min_p: f32,
    /// Divide the logits of tokens already present (> 1 discourages repeats).
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub repetition_penalty: f32,
    /// Subtract from the logits of tokens already generated.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub presence_penalty: f32,
    /// Subtract from the logits of generated tokens, once per occurrence.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub frequency_penalty: f32,
    /// Seed for reproducible sampling.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Stop string (repeatable); the text is cut before it.
    #[arg(long)]
    pub stop: Vec<String>,
    /// Token ids that end generation, comma-separated.
    #[arg(long, value_delimiter = ',')]
    pub stop_token_ids: Vec<u32>,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Report per-token logprobs with this many alternatives.
    #[arg(long)]
    pub logprobs: Option<u32>,
    /// Constrain the output to JSON valid under this JSON schema (the schema's text).
    #[arg(long, value_name = "SCHEMA", group = "constraint")]
    pub json_schema: Option<String>,
    /// Constrain the output to text this regular expression matches whole.
    #[arg(long, value_name = "REGEX", group = "constraint")]
    pub regex: Option<String>,
    /// Constrain the output to exactly one of these strings (repeat the flag).
    #[arg(long, value_name = "TEXT", group = "constraint")]
    pub choice: Vec<String>,
    /// Print one JSON object instead of streaming text.
    #[arg(long)]
    pub json: bool,
    /// In-process: the KV cache in MiB (the older spelling of --kv-cache-memory).
    #[arg(long, hide = true, conflicts_with = "kv_cache_memory")]
    pub kv_cache_mib: Option<usize>,
    /// Call a running server (e.g. http://127.0.0.1:50051); --model is then a served name.
    #[arg(long)]
    pub endpoint: Option<String>,
    /// With --endpoint: stream text as it is generated.
    #[arg(long, requires = "endpoint")]
    pub stream: bool,
    /// With --endpoint: the API key the server expects (sent as "authorization: Bearer").
    #[arg(long, env = "STRATA_API_KEY", hide_env_values = true, requires = "endpoint")]
    pub api_key: Option<String>,
    /// In-process: the engine (device, dtype, quantization, KV cache, scheduler), as
    /// `serve` takes it.
    #[command(flatten)]
    pub engine: EngineArgs,
    /// In-process: tensor-parallel ranks (threads).
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
    /// In-process: pipeline stages (threads).
    #[arg(long, default_value_t = 1)]
    pub pp: usize,
    /// In-process: expert parallelism (see `model bench --ep`).
    #[arg(long, default_value_t = 1)]
    pub ep: usize,
}

impl GenerateArgs {
    pub fn sampling(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature.unwrap_or(0.0),
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            seed: self.seed,
            max_new_tokens: self.max_tokens,
            ignore_eos: self.ignore_eos,
            stop_token_ids: self.stop_token_ids.clone(),
            stop: self.stop.clone(),
            logprobs: self.logprobs,
            prompt_logprobs: None,
            priority: Default::default(),
            constraint: self.constraint(),
            embed: None,
            cache_salt: None,
        }
    }

    fn constraint(&self) -> Option<Constraint> {
        match (&self.json_schema, &self.regex) {
            (Some(schema), _) => Some(Constraint::JsonSchema(schema.clone())),
            (None, Some(rx)) => Some(Constraint::Regex(rx.clone())),
            (None, None) if !self.choice.is_empty() => Some(Constraint::Choice(self.choice.clone())),
            (None, None) => None,
        }
    }

    fn prompt(&self) -> Prompt {
        match (&self.prompt, &self.prompt_ids) {
            (Some(t), _) => Prompt::Text(t.clone()),
            (None, Some(ids)) => Prompt::Ids(ids.clone()),
            (None, None) => Prompt::Ids(Vec::new()),
        }
    }
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum ArchArg {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
    Mixtral,
    #[value(name = "qwen3-moe")]
    Qwen3Moe,
    /// Gemma 3's text model: five local layers to a global one.
    Gemma3,
    /// gpt-oss: attention with sinks, alternating windowed and global layers, stacked
    /// experts with biases.
    #[value(name = "gpt-oss")]
    GptOss,
    /// DeepSeek-V3's architecture: latent attention, grouped routing, a shared expert.
    #[value(name = "deepseek-v3")]
    DeepseekV3,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum PresetArg {
    Tiny,
    #[value(name = "llama-1b")]
    Llama1b,
    #[value(name = "llama-8b")]
    Llama8b,
    /// Qwen3-MoE's shape at about 0.9B parameters, 0.15B active (32 experts, 4 a token).
    #[value(name = "qwen3-moe-1b")]
    Qwen3Moe1b,
    /// Gemma-3-1B's shape: 26 layers, five local (512-position window) to a global one.
    #[value(name = "gemma3-1b")]
    Gemma31b,
    /// gpt-oss's shape at about 1B parameters, 0.2B active (32 experts, 4 a token).
    #[value(name = "gpt-oss-1b")]
    GptOss1b,
    /// DeepSeek-V3's architecture at about 1B parameters, 0.2B active.
    #[value(name = "deepseek-1b")]
    Deepseek1b,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum DTypeArg {
    F32,
    Bf16,
    F16,
}

#[derive(Args, Debug)]
pub struct RandomArgs {
    /// The architecture [default: the preset's; llama for tiny].
    #[arg(long, value_enum)]
    pub arch: Option<ArchArg>,
    /// A named shape; individual flags override it.
    #[arg(long, value_enum, default_value = "tiny")]
    pub preset: PresetArg,
    /// Hidden size.
    #[arg(long)]
    pub hidden: Option<usize>,
    /// Decoder layers.
    #[arg(long)]
    pub layers: Option<usize>,
    /// Attention heads.
    #[arg(long)]
    pub heads: Option<usize>,
    /// Key/value heads (fewer than --heads: grouped-query attention).
    #[arg(long)]
    pub kv_heads: Option<usize>,
    /// MLP intermediate size.
    #[arg(long)]
    pub intermediate: Option<usize>,
    /// Vocabulary size.
    #[arg(long)]
    pub vocab: Option<usize>,
    /// MoE architectures: experts a layer, experts a token, columns an expert.
    #[arg(long)]
    pub experts: Option<usize>,
    /// MoE: experts each token is routed to.
    #[arg(long)]
    pub top_k: Option<usize>,
    /// MoE: intermediate size of one expert.
    #[arg(long)]
    pub expert_intermediate: Option<usize>,
    /// The dtype the weights are written in.
    #[arg(long, value_enum, default_value = "f32")]
    pub dtype: DTypeArg,
    /// Seed of the random weights.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Output directory (created if missing).
    #[arg(long)]
    pub out: PathBuf,
}

pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Generate(args) => match args.endpoint.clone() {
            Some(endpoint) => runtime()?.block_on(crate::client::generate_remote(&args, &endpoint)),
            None => generate(args),
        },
        Command::Serve(args) => crate::serve_cli::serve(args, runtime()?),
        Command::CommBench { ranks, repeats } => {
            if ranks < 2 || repeats == 0 {
                bail!("--ranks must be at least 2 and --repeats at least 1");
            }
            let sizes = [4 << 10, 64 << 10, 1 << 20, 16 << 20];
            let report = crate::comm_bench::run(ranks, &sizes, repeats)?;
            println!("{}", serde_json::to_string(&report)?);
            Ok(())
        }
        Command::Coordinator(args) => crate::cluster_cli::coordinator(args, runtime()?),
        Command::Worker(args) => crate::cluster_cli::worker(args, runtime),
        Command::Admin(args) => runtime()?.block_on(crate::admin_cli::run(args)),
        Command::GpuCheck(args) => crate::gpu_check::run(args),
        Command::Bench(args) => {
            let json = args.json;
            let report = runtime()?.block_on(crate::bench::run(args))?;
            if json {
                println!("{}", serde_json::to_string(&report)?);
            } else {
                crate::bench::print_human(&report);
            }
            Ok(())
        }
        Command::Cert { command } => crate::cert_cli::run(command),
        Command::Config { command: ConfigCommand::Check(file) } => crate::config_args::check(&file),
        Command::Batch { command } => crate::batch_cli::run(command, runtime()?),
        Command::Model { command } => match command {
            ModelCommand::Random(args) => random_model(args),
            ModelCommand::Bench(args) => bench_model(args),
            ModelCommand::Latency(args) => latency(args),
            ModelCommand::Compare(args) => crate::model_compare::run(args),
            ModelCommand::Quantize(args) => crate::model_compare::quantize(args),
            ModelCommand::Fetch(args) => crate::model_fetch::fetch(args),
        },
    }
}

fn generate(args: GenerateArgs) -> anyhow::Result<()> {
    let dir = PathBuf::from(&args.model);
    let config = args.engine.in_process(args.kv_cache_mib)?;
    let par = strata_common::Parallelism::with_ep(args.tp, args.pp, args.ep).context("--ep")?;
    let mut model = LocalModel::load_parallel(&dir, par, &config)?;
    let params = args.sampling();
    let json = args.json;
    let mut stdout = std::io::stdout();
    let out = model.generate(args.prompt(), params, |delta| {
        if !json {
            let _ = stdout.write_all(delta.as_bytes());
            let _ = stdout.flush();
        }
    })?;
    if json {
        println!("{}", serde_json::to_string(&out)?);
    } else {
        println!();
        eprintln!("[{} tokens, finish_reason={}]", out.token_ids.len(), out.finish_reason.as_str());
    }
    Ok(())
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread().enable_all().build().context("cannot start the async runtime")
}

fn latency(args: LatencyArgs) -> anyhow::Result<()> {
    if args.requests == 0 {
        bail!("--requests must be at least 1");
    }
    if let (Some(endpoint), Some(http)) = (&args.endpoint, &args.http) {
        let reports = runtime()?.block_on(crate::latency_bench::streaming_grpc_vs_http(
            endpoint,
            http,
            &args.model,
            args.requests,
            args.tokens,
        ))?;
        for r in reports {
            println!("{}", serde_json::to_string(&r)?);
        }
        return Ok(());
    }
    let report = match &args.endpoint {
        Some(endpoint) => {
            runtime()?.block_on(crate::latency_bench::over_grpc(endpoint, &args.model, args.requests))?
        }
        None => {
            let config = args.engine.in_process(None)?;
            let mut model = LocalModel::load(std::path::Path::new(&args.model), &config)?;
            crate::latency_bench::in_process(&mut model, args.requests)?
        }
    };
    println!("{}", serde_json::to_string(&report)?);
    Ok(())
}

fn bench_model(args: BenchArgs) -> anyhow::Result<()> {
    if args.prompt_len == 0 || args.decode_tokens == 0 || args.repeats == 0 {
        bail!("--prompt-len, --decode-tokens and --repeats must be at least 1");
    }
    let config = args.engine.in_process(args.kv_cache_mib)?;
    let par = strata_common::Parallelism::with_ep(args.tp, args.pp, args.ep).context("--ep")?;
    let ab = kernels_ab_levels(&args.kernels_ab)?;
    if let Some([_, high]) = ab {
        // Loaded under the higher level: the layout it packs is what both must read.
        strata_engine::backend::cpu::CpuBackend::set_kernels(high).context("--kernels-ab")?;
    }
    let mut model = LocalModel::load_parallel(&args.model, par, &config)?;
    let dtype = model.engine.executor().config().dtype.clone();
    use strata_engine::backend::cpu::roofline::{Compute, PrefillWeights};
    let weights = match (config.backend.quantize, config.backend.dtype) {
        (Some(_), _) => PrefillWeights::Int8,
        (None, Some(DType::BF16)) => PrefillWeights::Bf16,
        (None, None) if dtype.as_deref() == Some("bfloat16") => PrefillWeights::Bf16,
        _ => PrefillWeights::Other,
    };
    let cfg = crate::engine_bench::EngineBenchConfig {
        batch_sizes: args.batch_sizes.clone(),
        prompt_len: args.prompt_len,
        decode_tokens: args.decode_tokens,
        repeats: args.repeats,
        weights,
    };
    if let Some([low, _]) = ab {
        let packed = matches!(Compute::for_prefill(weights), Compute::AmxBf16 | Compute::Avx512Bf16);
        if packed && KERNEL_LEVELS.iter().position(|l| *l == low) < Some(2) {
            bail!("--kernels-ab: this model's bf16 weights are packed for AVX512-BF16, which {low} cannot read; compare avx512 with amx, or load with --dtype float32");
        }
        let [a, b] = [args.kernels_ab[0].as_str(), args.kernels_ab[1].as_str()];
        let report = crate::engine_bench::kernels_ab(&mut model.engine, &cfg, [a, b])?;
        println!("{}", serde_json::to_string(&report)?);
        return Ok(());
    }
    let report = crate::engine_bench::run(&mut model.engine, &cfg)?;
    println!("{}", serde_json::to_string(&report)?);
    Ok(())
}

/// CPU kernel levels from lowest to highest, as `STRATA_CPU_KERNELS` names them.
const KERNEL_LEVELS: [&str; 4] = ["portable", "avx2", "avx512", "amx"];

/// The two levels of `--kernels-ab`, lower first; None when not given.
fn kernels_ab_levels(names: &[String]) -> anyhow::Result<Option<[&'static str; 2]>> {
    if names.is_empty() {
        return Ok(None);
    }
    if names.len() != 2 {
        bail!("--kernels-ab takes two levels, A,B (e.g. avx512,amx), not {}", names.join(","));
    }
    let rank = |name: &str| {
        KERNEL_LEVELS
            .iter()
            .position(|l| *l == name)
            .with_context(|| format!("--kernels-ab: {name:?} is not one of {}", KERNEL_LEVELS.join(", ")))
    };
    let (a, b) = (rank(&names[0])?, rank(&names[1])?);
    if a == b {
        bail!("--kernels-ab: two different levels, not {} twice", names[0]);
    }
    Ok(Some([KERNEL_LEVELS[a.min(b)], KERNEL_LEVELS[a.max(b)]]))
}

fn random_model(args: RandomArgs) -> anyhow::Result<()> {
    let arch = args.arch.map(|a| match a {
        ArchArg::Llama => Architecture::Llama,
        ArchArg::Mistral => Architecture::Mistral,
        ArchArg::Qwen2 => Architecture::Qwen2,
        ArchArg::Qwen3 => Architecture::Qwen3,
        ArchArg::Mixtral => Architecture::Mixtral,
        ArchArg::Qwen3Moe => Architecture::Qwen3Moe,
        ArchArg::Gemma3 => Architecture::Gemma3,
        ArchArg::GptOss => Architecture::GptOss,
        ArchArg::DeepseekV3 => Architecture::DeepseekV3,
    });
    // Each preset names its architecture; --arch replaces it.
    let spec = match args.preset {
        PresetArg::Tiny => RandomModelSpec::tiny(arch.unwrap_or(Architecture::Llama)),
        PresetArg::Llama1b => RandomModelSpec::llama_1b(),
        PresetArg::Llama8b => RandomModelSpec::llama_8b(),
        PresetArg::Qwen3Moe1b => RandomModelSpec::qwen3_moe_1b(),
        PresetArg::Gemma31b => RandomModelSpec::gemma3_1b(),
        PresetArg::GptOss1b => RandomModelSpec::gpt_oss_1b(),
        PresetArg::Deepseek1b => RandomModelSpec::deepseek_1b(),
    };
    let mut spec = match arch {
        Some(arch) => RandomModelSpec { arch, ..spec },
        None => spec,
    };
    spec.hidden = args.hidden.unwrap_or(spec.hidden);
    spec.layers = args.layers.unwrap_or(spec.layers);
    spec.heads = args.heads.unwrap_or(spec.heads);
    spec.kv_heads = args.kv_heads.unwrap_or(spec.kv_heads);
    spec.intermediate = args.intermediate.unwrap_or(spec.intermediate);
    spec.vocab = args.vocab.unwrap_or(spec.vocab);
    spec.experts = args.experts.unwrap_or(spec.experts);
    spec.top_k = args.top_k.unwrap_or(spec.top_k);
    spec.expert_intermediate = args.expert_intermediate.unwrap_or(spec.expert_intermediate);
    spec.seed = args.seed;
    spec.dtype = match args.dtype {
        DTypeArg::F32 => DType::F32,
        DTypeArg::Bf16 => DType::BF16,
        DTypeArg::F16 => DType::F16,
    };
    if args.out.exists() && !args.out.is_dir() {
        bail!("--out {}: exists and is not a directory", args.out.display());
    }
    let mut last_pct = usize::MAX;
    write_random_model(&spec, &args.out, |done, total| {
        let pct = done * 100 / total.max(1);
        if pct / 10 != last_pct / 10 {
            tracing::info!("writing weights: {pct}% of {} MiB", total >> 20);
            last_pct = pct;
        }
    })
    .with_context(|| format!("writing a random model to {}", args.out.display()))?;
    eprintln!("wrote {} ({:?}, {} parameters)", args.out.display(), spec.arch, spec_params(&spec));
    Ok(())
}

fn spec_params(spec: &RandomModelSpec) -> String {
    let h = spec.hidden;
    let kv = spec.kv_heads * (h / spec.heads);
    let mlp = match spec.arch {
        Architecture::Mixtral | Architecture::Qwen3Moe => {
            spec.experts * (3 * h * spec.expert_intermediate + h)
        }
        _ => 3 * h * spec.intermediate,
    };
    let per_layer = 2 * h * h + 2 * h * kv + mlp;
    let embed = spec.vocab * h * if spec.tie_word_embeddings { 1 } else { 2 };
    let n = spec.layers * per_layer + embed;
    if n >= 1_000_000_000 {
        format!("{:.2}B", n as f64 / 1e9)
    } else {
        format!("{:.1}M", n as f64 / 1e6)
    }
}
