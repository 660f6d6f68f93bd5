//! Flags that feed the config tree (`strata_common::config`): each overrides its key when
//! given, and clap reads the flag's `STRATA_*` variable when the flag is absent — so the
//! layers are defaults, then `--config FILE`, then the environment, then flags.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Args;
use strata_common::config::{parse_memory, seconds, Config, EngineSettings, RegistrySettings};
use strata_common::registry::etcd::EtcdRegistry;
use strata_common::registry::keys::Keys;
use strata_common::registry::Registry;
use strata_common::Device;
use strata_engine::backend::{BackendOptions, Quantization};
use strata_engine::scheduler::SchedulerConfig;
use strata_engine::{EngineConfig, RunnerLimits};

/// `--config FILE`: the TOML layer.
#[derive(Args, Debug, Clone, Default)]
pub struct ConfigArg {
    /// A TOML config file (keys and defaults: deploy/strata.example.toml); flags and
    /// STRATA_* variables override it.
    #[arg(long = "config", env = "STRATA_CONFIG", value_name = "FILE")]
    pub file: Option<PathBuf>,
}

impl ConfigArg {
    /// The defaults overlaid with the file, then `overlay` (the flags), validated.
    pub fn resolve(&self, overlay: impl FnOnce(&mut Config) -> anyhow::Result<()>) -> anyhow::Result<Config> {
        let mut cfg = Config::load(self.file.as_deref()).map_err(with_flag)?;
        overlay(&mut cfg)?;
        cfg.validate().map_err(with_flag)?;
        Ok(cfg)
    }
}

/// `strata config check`: the file's configuration, validated as a coordinator would
/// (tenant keys parsed, none shared), printed as TOML with every secret replaced by its
/// `sha256:` form (which the same keys accept) or removed.
pub fn check(file: &ConfigArg) -> anyhow::Result<()> {
    let mut cfg = file.resolve(|_| Ok(()))?;
    let c = &mut cfg.coordinator;
    strata_coordinator::api::auth::ClientAuth::with_tenants(c.api_keys.clone(), c.tenants.clone())
        .map_err(with_flag)?;
    let hashed = |k: &String| match k.starts_with("sha256:") {
        true => k.clone(),
        false => {
            format!("sha256:{}", strata_coordinator::tenant::hex(&strata_coordinator::tenant::digest(k)))
        }
    };
    c.api_keys = c.api_keys.iter().map(hashed).collect();
    c.admin_token = c.admin_token.as_ref().map(hashed);
    for t in &mut c.tenants {
        t.keys = t.keys.iter().map(hashed).collect();
    }
    if cfg.registry.etcd_password.is_some() {
        cfg.registry.etcd_password = Some("(set)".into());
    }
    print!("{}", toml::to_string(&cfg).context("printing the configuration")?);
    Ok(())
}

/// A config error naming the key and the flag that sets it ("engine.block_size" is set by
/// `--block-size`; durations drop their `_s`).
fn with_flag(e: strata_common::Error) -> anyhow::Error {
    match e {
        strata_common::Error::InvalidArgument { field, reason } if field.contains('.') => {
            let key = field.rsplit('.').next().unwrap_or(&field);
            let flag = key.strip_suffix("_s").unwrap_or(key).replace('_', "-");
            anyhow::anyhow!("invalid {field} (--{flag}): {reason}")
        }
        other => other.into(),
    }
}

/// Engine flags shared by `strata serve`, `strata worker`, `generate`, `model bench`,
/// `model latency` and `model compare` ([engine] in the config): the device, then every
/// other engine flag.
#[derive(Args, Debug, Clone, Default)]
pub struct EngineArgs {
    /// cpu, cuda or cuda:N (in-process ranks and replicas take consecutive GPUs) [default: cpu].
    #[arg(long, env = "STRATA_DEVICE")]
    pub device: Option<String>,
    #[command(flatten)]
    pub flags: EngineFlags,
}

/// The engine's flags other than where it runs: `gpu-check` takes these for the device
/// under test, whose `--device` it names once for all of its checks.
#[derive(Args, Debug, Clone, Default)]
pub struct EngineFlags {
    /// Memory for each replica's (or shard's) KV cache: a size (512MiB, 2GiB) or a fraction
    /// of the machine's available memory (0.2) [default: 512MiB].
    #[arg(long, env = "STRATA_KV_CACHE_MEMORY")]
    pub kv_cache_memory: Option<String>,
    /// The fraction (0, 1] of the device's memory (the host's on the CPU) this process may
    /// use, weights and activations included: the KV cache gets what is left (vLLM's
    /// meaning; replaces --kv-cache-memory).
    #[arg(
        long,
        env = "STRATA_GPU_MEMORY_UTILIZATION",
        value_name = "FRACTION",
        conflicts_with = "kv_cache_memory"
    )]
    pub gpu_memory_utilization: Option<f64>,
    /// Positions per KV cache block [default: 16].
    #[arg(long, env = "STRATA_BLOCK_SIZE")]
    pub block_size: Option<usize>,
    /// Most sequences running at once per replica [default: 64].
    #[arg(long, env = "STRATA_MAX_NUM_SEQS")]
    pub max_num_seqs: Option<usize>,
    /// Most tokens (prefill chunks + decodes) in one engine step (also
    /// --max-num-batched-tokens) [default: 512].
    #[arg(long, alias = "max-num-batched-tokens", env = "STRATA_MAX_BATCHED_TOKENS")]
    pub max_batched_tokens: Option<usize>,
    /// Most requests waiting per replica; beyond it calls get RESOURCE_EXHAUSTED [default: 256].
    #[arg(long, env = "STRATA_MAX_WAITING")]
    pub max_waiting: Option<usize>,
    /// Do not reuse KV blocks of shared prompt prefixes.
    #[arg(long)]
    pub no_prefix_caching: bool,
    /// The model's dtype: auto (the checkpoint's; a bf16 model computes in bf16 with f32
    /// accumulation), bf16, f16, or f32 (exact f32 compute, for comparison with an f32
    /// reference; about half the speed when compute-bound) [default: auto]. A
    /// deployment's dtype overrides a worker's.
    #[arg(long, env = "STRATA_DTYPE")]
    pub dtype: Option<String>,
    /// Quantize weight matrices at load: int8 (symmetric, one scale per output channel;
    /// half the bytes of bf16 per decode step) or none [default: none].
    #[arg(long, env = "STRATA_QUANTIZE")]
    pub quantize: Option<String>,
    /// GPU: run decode steps op by op instead of replaying them from CUDA graphs (for
    /// debugging, and to measure what the graphs save).
    #[arg(long, env = "STRATA_ENFORCE_EAGER")]
    pub enforce_eager: bool,
    /// The longest prompt + output a sequence may have, at most the model's context
    /// [default: the model's context]; a KV cache too small for it limits it further.
    #[arg(long, env = "STRATA_MAX_MODEL_LEN")]
    pub max_model_len: Option<usize>,
    /// How /v1/embeddings pools a prompt's final hidden states unless the request says:
    /// last, mean or cls [default: the model's sentence-transformers config, else last].
    #[arg(long, env = "STRATA_POOLING")]
    pub pooling: Option<String>,
}

impl EngineArgs {
    pub fn apply(&self, e: &mut EngineSettings) {
        set(&mut e.device, &self.device);
        self.flags.apply(e);
    }

    /// The engine of an in-process command (`generate`, `model bench`): the settings'
    /// defaults with these flags applied; `kv_cache_mib` is the older spelling of
    /// `--kv-cache-memory`.
    pub fn in_process(&self, kv_cache_mib: Option<usize>) -> anyhow::Result<EngineConfig> {
        let mut settings = EngineSettings::default();
        self.apply(&mut settings);
        if let Some(mib) = kv_cache_mib {
            settings.kv_cache_memory = format!("{mib}MiB");
        }
        in_process_config(settings)
    }
}

impl EngineFlags {
    pub fn apply(&self, e: &mut EngineSettings) {
        set(&mut e.kv_cache_memory, &self.kv_cache_memory);
        if self.gpu_memory_utilization.is_some() {
            e.gpu_memory_utilization = self.gpu_memory_utilization;
        }
        set(&mut e.block_size, &self.block_size);
        set(&mut e.max_num_seqs, &self.max_num_seqs);
        set(&mut e.max_batched_tokens, &self.max_batched_tokens);
        set(&mut e.max_waiting, &self.max_waiting);
        if self.no_prefix_caching {
            e.prefix_caching = false;
        }
        set(&mut e.dtype, &self.dtype);
        set(&mut e.quantize, &self.quantize);
        if self.enforce_eager {
            e.enforce_eager = true;
        }
        if self.max_model_len.is_some() {
            e.max_model_len = self.max_model_len;
        }
        if self.pooling.is_some() {
            e.pooling = self.pooling.clone();
        }
    }
}

/// The engine config of validated in-process settings; a bad value names its flag.
pub fn in_process_config(settings: EngineSettings) -> anyhow::Result<EngineConfig> {
    let config = Config { engine: settings, ..Config::default() };
    config.validate().map_err(with_flag)?;
    Ok(engine_config(&config.engine)?.0)
}

/// `slot = value` when the flag (or its variable) was given.
pub fn set<T: Clone>(slot: &mut T, value: &Option<T>) {
    if let Some(v) = value {
        *slot = v.clone();
    }
}

/// The engine's settings from validated config.
pub fn engine_config(e: &EngineSettings) -> anyhow::Result<(EngineConfig, RunnerLimits)> {
    let engine = EngineConfig {
        kv_cache_bytes: parse_memory(&e.kv_cache_memory).context("engine.kv_cache_memory")?,
        memory_utilization: e.gpu_memory_utilization,
        block_size: e.block_size,
        scheduler: SchedulerConfig { max_num_seqs: e.max_num_seqs, max_batched_tokens: e.max_batched_tokens },
        prefix_caching: e.prefix_caching,
        backend: BackendOptions {
            device: Device::parse(&e.device).context("engine.device")?,
            dtype: model_dtype(&e.dtype).context("engine.dtype (--dtype)")?,
            quantize: Quantization::parse(&e.quantize).context("engine.quantize (--quantize)")?,
            enforce_eager: e.enforce_eager,
        },
        labels: Default::default(),
        max_model_len: e.max_model_len,
        pooling: e
            .pooling
            .as_deref()
            .map(strata_common::Pooling::parse)
            .transpose()
            .context("engine.pooling (--pooling)")?,
    };
    Ok((engine, RunnerLimits { max_waiting: e.max_waiting, ..Default::default() }))
}

/// Where the cluster's state lives ([registry] in the config).
#[derive(Args, Debug, Clone, Default)]
pub struct RegistryArgs {
    /// etcd endpoints, comma-separated (http://127.0.0.1:2379).
    #[arg(long, env = "STRATA_ETCD", value_delimiter = ',')]
    pub etcd: Vec<String>,
    /// Key prefix of this cluster (two clusters can share one etcd) [default: /strata].
    #[arg(long, env = "STRATA_PREFIX")]
    pub prefix: Option<String>,
    /// Seconds a lease lives without a refresh (liveness of workers and of the leader)
    /// [default: 5].
    #[arg(long, env = "STRATA_LEASE_TTL")]
    pub lease_ttl: Option<f64>,
    /// Seconds between lease refreshes (default: a third of --lease-ttl).
    #[arg(long, env = "STRATA_LEASE_KEEPALIVE")]
    pub lease_keepalive: Option<f64>,
    /// etcd over TLS (https:// endpoints): the CA that signed etcd's certificate.
    #[arg(long, env = "STRATA_ETCD_CA", value_name = "FILE")]
    pub etcd_ca: Option<PathBuf>,
    /// A client certificate for etcd's --client-cert-auth (with --etcd-key).
    #[arg(long, env = "STRATA_ETCD_CERT", value_name = "FILE")]
    pub etcd_cert: Option<PathBuf>,
    /// The client certificate's private key (with --etcd-cert).
    #[arg(long, env = "STRATA_ETCD_KEY", value_name = "FILE")]
    pub etcd_key: Option<PathBuf>,
    /// etcd user (etcd's authentication; with --etcd-password).
    #[arg(long, env = "STRATA_ETCD_USER")]
    pub etcd_user: Option<String>,
    /// etcd password (with --etcd-user).
    #[arg(long, env = "STRATA_ETCD_PASSWORD", hide_env_values = true)]
    pub etcd_password: Option<String>,
}

impl RegistryArgs {
    pub fn apply(&self, r: &mut RegistrySettings) {
        if !self.etcd.is_empty() {
            r.etcd = self.etcd.clone();
        }
        set(&mut r.prefix, &self.prefix);
        set(&mut r.lease_ttl_s, &self.lease_ttl);
        if self.lease_keepalive.is_some() {
            r.lease_keepalive_s = self.lease_keepalive;
        }
        for (slot, v) in [
            (&mut r.etcd_ca, &self.etcd_ca),
            (&mut r.etcd_cert, &self.etcd_cert),
            (&mut r.etcd_key, &self.etcd_key),
        ] {
            if v.is_some() {
                *slot = v.clone();
            }
        }
        for (slot, v) in [(&mut r.etcd_user, &self.etcd_user), (&mut r.etcd_password, &self.etcd_password)] {
            if v.is_some() {
                *slot = v.clone();
            }
        }
    }
}

/// Connects to the configured etcd.
pub async fn connect(r: &RegistrySettings) -> anyhow::Result<(Arc<dyn Registry>, Keys)> {
    if r.etcd.is_empty() {
        bail!("--etcd is required: the etcd endpoints (e.g. http://127.0.0.1:2379), or set STRATA_ETCD or registry.etcd");
    }
    let reg = EtcdRegistry::connect_with(&r.etcd, &r.etcd_security()?).await.context("registry.etcd")?;
    Ok((Arc::new(reg), Keys::new(&r.prefix)))
}

/// (lease TTL, keep-alive interval) of validated settings.
pub fn lease_timings(r: &RegistrySettings) -> anyhow::Result<(Duration, Duration)> {
    let ttl = seconds("registry.lease_ttl_s", r.lease_ttl_s, 1.0)?;
    let keepalive = match r.lease_keepalive_s {
        Some(k) => seconds("registry.lease_keepalive_s", k, 0.05)?,
        None => ttl / 3,
    };
    Ok((ttl, keepalive))
}

/// `--dtype`: None for "auto" (the checkpoint's).
pub fn model_dtype(text: &str) -> strata_common::Result<Option<strata_common::DType>> {
    match text {
        "" | "auto" => Ok(None),
        other => strata_common::DType::parse(other).map(Some).map_err(|_| {
            strata_common::Error::invalid("dtype", format!("{other:?}: give auto, bf16, f16 or f32"))
        }),
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use crate::cli::{Cli, Command, ModelCommand};

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from([&["strata"], args].concat())
    }

    #[test]
    fn in_process_commands_take_serves_engine_flags_and_defaults() {
        let Command::Generate(g) = parse(&["generate", "--model", "m", "--prompt", "x"]).unwrap().command
        else {
            panic!("generate")
        };
        let (got, want) =
            (g.engine.in_process(g.kv_cache_mib).unwrap(), strata_engine::EngineConfig::default());
        assert_eq!(
            (got.kv_cache_bytes, got.block_size, got.prefix_caching),
            (want.kv_cache_bytes, want.block_size, want.prefix_caching)
        );
        assert_eq!(got.scheduler.max_num_seqs, want.scheduler.max_num_seqs);
        let Command::Model { command: ModelCommand::Bench(b) } =
            parse(&["model", "bench", "--model", "m", "--kv-cache-memory", "16MiB", "--max-num-seqs", "3"])
                .unwrap()
                .command
        else {
            panic!("model bench")
        };
        let c = b.engine.in_process(b.kv_cache_mib).unwrap();
        assert_eq!((c.kv_cache_bytes, c.scheduler.max_num_seqs), (16 << 20, 3));
        let Command::Generate(old) =
            parse(&["generate", "--model", "m", "--prompt", "x", "--kv-cache-mib", "16"]).unwrap().command
        else {
            panic!("generate")
        };
        assert_eq!(
            old.engine.in_process(old.kv_cache_mib).unwrap().kv_cache_bytes,
            16 << 20,
            "the older spelling"
        );
        let both = [
            "generate",
            "--model",
            "m",
            "--prompt",
            "x",
            "--kv-cache-mib",
            "16",
            "--kv-cache-memory",
            "1GiB",
        ];
        assert!(parse(&both).is_err(), "one spelling at a time");
        let Command::Generate(bad) =
            parse(&["generate", "--model", "m", "--prompt", "x", "--dtype", "int4"]).unwrap().command
        else {
            panic!("generate")
        };
        let e = bad.engine.in_process(None).unwrap_err().to_string();
        assert!(e.contains("--dtype"), "{e}");
    }

    #[test]
    fn serve_takes_vllms_spellings_and_a_positional_model_dir() {
        let vllm = [
            "serve",
            "/models/a",
            "--model",
            "/models/b",
            "--tensor-parallel-size",
            "2",
            "--pipeline-parallel-size",
            "3",
            "--served-model-name",
            "x",
            "--served-model-name",
            "y",
            "--max-num-batched-tokens",
            "64",
        ];
        let Command::Serve(s) = parse(&vllm).unwrap().command else { panic!("serve") };
        let mut cfg = strata_common::config::Config::default();
        s.overlay(&mut cfg).unwrap();
        let served: Vec<_> =
            cfg.serve.models.iter().map(|m| (m.path.display().to_string(), m.name.clone())).collect();
        assert_eq!(served, [("/models/a".into(), Some("x".into())), ("/models/b".into(), Some("y".into()))]);
        assert_eq!((cfg.serve.tp, cfg.serve.pp, cfg.engine.max_batched_tokens), (2, 3, 64));
        let Command::Admin(a) = parse(&["admin", "--admin-token", "t", "models"]).unwrap().command else {
            panic!("admin")
        };
        assert_eq!(a.token.as_deref(), Some("t"));
        assert_eq!(crate::client::endpoint_url("127.0.0.1:50051"), "http://127.0.0.1:50051");
        assert_eq!(crate::client::endpoint_url("https://h:1"), "https://h:1");
        let hint = crate::serve_cli::not_a_model_dir(std::path::Path::new("meta-llama/Llama-3.2-1B"));
        assert!(hint.contains("hub id") && hint.contains("download"), "{hint}");
        assert_eq!(
            crate::serve_cli::not_a_model_dir(std::path::Path::new("/no/such/dir")),
            "not a directory"
        );
    }
}
