//! One config tree for every role: defaults, then a TOML file (`--config FILE`), then the
//! environment (`STRATA_*`), then flags — each layer overriding the one before.
//!
//! The tree is plain data. The command line fills the last two layers (clap reads each
//! flag's `STRATA_*` variable when the flag is absent, so a flag beats its variable, and a
//! value from either beats the file); [`Config::validate`] runs once at start-up and names
//! the bad key as the file spells it (`engine.block_size`). `deploy/strata.example.toml`
//! lists every key with its default, and a test parses it.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::device::Device;
use crate::error::{Error, Result};

/// Everything a Strata process can be configured with.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// How each replica's engine runs (`strata serve` and `strata worker`).
    pub engine: EngineSettings,
    /// Where cluster state lives (`strata coordinator` and `strata worker --etcd`).
    pub registry: RegistrySettings,
    pub serve: ServeSettings,
    pub coordinator: CoordinatorSettings,
    pub worker: WorkerSettings,
    /// Who is inside the cluster, and which model files a deployment may name.
    pub security: SecuritySettings,
    pub telemetry: TelemetrySettings,
}

/// What a process exposes for watching it (`[telemetry]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TelemetrySettings {
    /// Where `GET /metrics` (Prometheus) is served: HOST:PORT, port 0 for a free one
    /// (announced on stdout), or "off".
    pub metrics_listen: String,
}

impl Default for TelemetrySettings {
    fn default() -> Self {
        TelemetrySettings { metrics_listen: "127.0.0.1:0".into() }
    }
}

/// Cluster credentials and the model roots (`[security]`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SecuritySettings {
    /// This process's certificate (PEM) from the cluster CA; its DNS names carry its role
    /// (`strata-coordinator` or `strata-worker`).
    pub cluster_cert: Option<PathBuf>,
    /// The certificate's private key (PEM).
    pub cluster_key: Option<PathBuf>,
    /// The cluster CA certificate (PEM): peers must present a certificate it signed.
    pub cluster_ca: Option<PathBuf>,
    /// Run a cluster role on a non-loopback address without cluster credentials
    /// (anyone who can reach it is trusted). Logged as a warning at every start.
    pub insecure: bool,
    /// Directories deployments may load models from (absolute). Empty: any absolute path
    /// (logged as a warning in cluster mode).
    pub model_roots: Vec<PathBuf>,
}

impl SecuritySettings {
    /// The cluster credentials: all three files, or none.
    pub fn credentials(&self) -> Result<Option<(PathBuf, PathBuf, PathBuf)>> {
        match (&self.cluster_cert, &self.cluster_key, &self.cluster_ca) {
            (Some(c), Some(k), Some(a)) => Ok(Some((c.clone(), k.clone(), a.clone()))),
            (None, None, None) => Ok(None),
            _ => Err(Error::invalid(
                "security.cluster_cert",
                "give the cluster certificate, its key and the cluster CA together (or none of them)",
            )),
        }
    }
}

/// Engine settings shared by `serve` and `worker` (a deployment may override the limits).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EngineSettings {
    /// cpu, cuda or cuda:N.
    pub device: String,
    /// KV cache per replica (serve) or per shard (worker): a size ("512MiB", "2GiB") or a
    /// fraction of the machine's available memory ("0.2").
    pub kv_cache_memory: String,
    /// vLLM's `--gpu-memory-utilization`: the fraction (0, 1] of the device's memory this
    /// process may use, weights and activations included; the KV cache gets what is left
    /// and `kv_cache_memory` is not used. Unset: `kv_cache_memory`.
    pub gpu_memory_utilization: Option<f64>,
    /// Positions per KV cache block.
    pub block_size: usize,
    /// Most sequences running at once.
    pub max_num_seqs: usize,
    /// Most tokens (prefill chunks + decodes) in one step.
    pub max_batched_tokens: usize,
    /// Most requests waiting; beyond it calls get RESOURCE_EXHAUSTED.
    pub max_waiting: usize,
    /// Reuse KV blocks of shared prompt prefixes.
    pub prefix_caching: bool,
    /// The model's dtype: "auto" (the checkpoint's: a bf16 model computes in bf16),
    /// "bf16", "f16" or "f32" (exact f32 compute, for comparison with an f32 reference).
    pub dtype: String,
    /// CPU: quantize weight matrices at load: "none" or "int8" (per-channel scales).
    pub quantize: String,
    /// GPU: run decode steps op by op instead of replaying them from CUDA graphs.
    pub enforce_eager: bool,
    /// The longest prompt + output a sequence may have (at most the model's context);
    /// unset: the model's context. A KV cache too small for it limits it further.
    pub max_model_len: Option<usize>,
    /// How embedding requests pool hidden states unless they say: "last", "mean" or
    /// "cls"; unset: the model's (its sentence-transformers config, else the last token).
    pub pooling: Option<String>,
}

/// The engine's defaults: the one place they are stated. The engine's own config types,
/// every command's flags and the coordinator's view of a replica's capacity take theirs
/// from here.
impl EngineSettings {
    /// KV cache bytes per replica (serve) or shard (worker).
    pub const KV_CACHE_BYTES: usize = 512 << 20;
    pub const MAX_NUM_SEQS: usize = 64;
    pub const MAX_BATCHED_TOKENS: usize = 512;
    pub const MAX_WAITING: usize = 256;
}

impl Default for EngineSettings {
    fn default() -> Self {
        EngineSettings {
            device: "cpu".into(),
            kv_cache_memory: format!("{}MiB", Self::KV_CACHE_BYTES >> 20),
            gpu_memory_utilization: None,
            block_size: crate::prefix::DEFAULT_BLOCK_SIZE,
            max_num_seqs: Self::MAX_NUM_SEQS,
            max_batched_tokens: Self::MAX_BATCHED_TOKENS,
            max_waiting: Self::MAX_WAITING,
            prefix_caching: true,
            dtype: "auto".into(),
            quantize: "none".into(),
            enforce_eager: false,
            max_model_len: None,
            pooling: None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RegistrySettings {
    /// etcd endpoints ("http://127.0.0.1:2379").
    pub etcd: Vec<String>,
    /// Key prefix of this cluster (two clusters can share one etcd).
    pub prefix: String,
    /// Seconds a lease lives without a refresh.
    pub lease_ttl_s: f64,
    /// Seconds between lease refreshes; absent: a third of the TTL.
    pub lease_keepalive_s: Option<f64>,
    /// etcd over TLS (`https://` endpoints): the CA that signed etcd's certificate (PEM).
    pub etcd_ca: Option<PathBuf>,
    /// A client certificate and key for etcd's `--client-cert-auth` (PEM).
    pub etcd_cert: Option<PathBuf>,
    pub etcd_key: Option<PathBuf>,
    /// etcd's own authentication: user name and password (tokens refresh by themselves).
    pub etcd_user: Option<String>,
    pub etcd_password: Option<String>,
}

impl Default for RegistrySettings {
    fn default() -> Self {
        RegistrySettings {
            etcd: Vec::new(),
            prefix: "/strata".into(),
            lease_ttl_s: 5.0,
            lease_keepalive_s: None,
            etcd_ca: None,
            etcd_cert: None,
            etcd_key: None,
            etcd_user: None,
            etcd_password: None,
        }
    }
}

/// How to reach etcd securely, from [`RegistrySettings`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EtcdSecurity {
    pub ca: Option<PathBuf>,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    pub user: Option<(String, String)>,
}

impl RegistrySettings {
    pub fn etcd_security(&self) -> Result<EtcdSecurity> {
        if self.etcd_cert.is_some() != self.etcd_key.is_some() {
            return Err(Error::invalid(
                "registry.etcd_cert",
                "give the etcd client certificate and its key together",
            ));
        }
        let user = match (&self.etcd_user, &self.etcd_password) {
            (Some(u), Some(p)) => Some((u.clone(), p.clone())),
            (None, None) => None,
            _ => {
                return Err(Error::invalid("registry.etcd_user", "give the etcd user and password together"))
            }
        };
        Ok(EtcdSecurity {
            ca: self.etcd_ca.clone(),
            cert: self.etcd_cert.clone(),
            key: self.etcd_key.clone(),
            user,
        })
    }
}

/// One model `strata serve` loads at start-up.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServedModel {
    pub path: PathBuf,
    /// The name clients use (default: the directory's name).
    #[serde(default)]
    pub name: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServeSettings {
    pub listen: SocketAddr,
    pub models: Vec<ServedModel>,
    /// Tensor-parallel ranks per replica.
    pub tp: usize,
    /// Pipeline stages per replica.
    pub pp: usize,
    /// Expert parallelism: 1 (every TP rank holds a slice of every expert), or `tp` (each
    /// holds whole experts); `ep` alone sets `tp` to it.
    pub ep: usize,
    /// Replicas of each model.
    pub replicas: usize,
    /// In-process workers beyond what the models need (for deployments at run time).
    pub spare_workers: usize,
    /// Seconds in-flight calls get to finish after SIGTERM.
    pub drain_timeout_s: f64,
}

impl Default for ServeSettings {
    fn default() -> Self {
        ServeSettings {
            listen: ([127, 0, 0, 1], 50051).into(),
            models: Vec::new(),
            tp: 1,
            pp: 1,
            ep: 1,
            replicas: 1,
            spare_workers: 0,
            drain_timeout_s: 30.0,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CoordinatorSettings {
    pub listen: SocketAddr,
    /// This coordinator's id (default: made from the port and a random suffix).
    pub id: Option<String>,
    /// Token admin calls must bear; absent: admin calls only from loopback.
    pub admin_token: Option<String>,
    /// Client API keys inference calls must bear; empty: inference is open. An entry
    /// `sha256:<64 hex digits>` is the SHA-256 of a key, so the file need not hold it.
    pub api_keys: Vec<String>,
    /// A file of more API keys (one key or `sha256:` hash per line, `#` comments),
    /// read again on SIGHUP: keys rotate without a restart.
    pub api_key_file: Option<PathBuf>,
    /// TLS for callers: this server's certificate and key (PEM). Absent: plaintext.
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    /// With TLS: callers must also present a certificate this CA signed.
    pub tls_client_ca: Option<PathBuf>,
    /// Where the OpenAI-style HTTP API listens; absent: not served.
    pub http_listen: Option<SocketAddr>,
    /// Where batch jobs and their files are kept (absent: the batch API is off); a
    /// coordinator restarted on the same directory resumes its unfinished jobs.
    pub data_dir: Option<PathBuf>,
    /// Most batch requests in flight at once (online traffic first: see docs/HTTP_API.md).
    pub batch_concurrency: usize,
    pub canary_interval_s: f64,
    pub canary_timeout_s: f64,
    pub load_timeout_s: f64,
    pub replica_drain_timeout_s: f64,
    pub failed_retention_s: f64,
    /// Seconds a request waits for a ready replica.
    pub route_wait_s: f64,
    pub drain_timeout_s: f64,
    /// The device kind a deployment runs on when it names none: "cpu" or "cuda".
    pub default_device: String,
    /// Memory for responses to deterministic requests, replayed when an identical
    /// request comes again (a size: "64MiB"; "0": off).
    pub response_cache_memory: String,
    /// Bytes of caller text parsed, rendered and tokenized at once across every API (a
    /// size: "16MiB"; tokenizing costs ~220× the text in memory). A quarter more is kept
    /// for texts of 64 KiB and less, so they never wait behind large ones.
    pub text_in_flight: String,
    /// How a model's router picks among its ready replicas: "prefix-affinity" (where the
    /// prompt's prefix went before, unless much busier) or "least-outstanding".
    pub routing_policy: String,
    /// One info log line per finished request (`--access-log`).
    pub access_log: bool,
    /// Tenants: their API keys and limits (`[[coordinator.tenants]]`; more can be made
    /// through the admin API). See docs/TENANTS.md.
    pub tenants: Vec<crate::tenant::TenantConfig>,
}

impl Default for CoordinatorSettings {
    fn default() -> Self {
        CoordinatorSettings {
            listen: ([127, 0, 0, 1], 50051).into(),
            id: None,
            admin_token: None,
            api_keys: Vec::new(),
            api_key_file: None,
            tls_cert: None,
            tls_key: None,
            tls_client_ca: None,
            http_listen: None,
            data_dir: None,
            batch_concurrency: 32,
            canary_interval_s: 5.0,
            canary_timeout_s: 10.0,
            load_timeout_s: 600.0,
            replica_drain_timeout_s: 30.0,
            failed_retention_s: 30.0,
            route_wait_s: 60.0,
            drain_timeout_s: 30.0,
            default_device: "cpu".into(),
            response_cache_memory: "64MiB".into(),
            text_in_flight: "16MiB".into(),
            routing_policy: "prefix-affinity".into(),
            access_log: false,
            tenants: Vec::new(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WorkerSettings {
    pub listen: SocketAddr,
    /// Address coordinators and other ranks reach this worker at (default: the bound one).
    pub advertise: Option<String>,
    /// This worker's id (default: host name and port).
    pub id: Option<String>,
    pub drain_timeout_s: f64,
    /// Where plaintext `grpc.health.v1` is served for probes that cannot present a
    /// cluster certificate (the kubelet's); None: only on the worker.v1 port.
    pub health_listen: Option<SocketAddr>,
    /// The machine this worker runs on, as placement groups workers (Kubernetes: the
    /// node's name); default: the host name.
    pub node: Option<String>,
}

impl Default for WorkerSettings {
    fn default() -> Self {
        WorkerSettings {
            listen: ([127, 0, 0, 1], 0).into(),
            advertise: None,
            id: None,
            drain_timeout_s: 30.0,
            health_listen: None,
            node: None,
        }
    }
}

impl Config {
    /// The defaults, overlaid with `file` when given.
    pub fn load(file: Option<&Path>) -> Result<Config> {
        let Some(path) = file else { return Ok(Config::default()) };
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::invalid("--config", format!("{}: {e}", path.display())))?;
        Config::from_toml(&text).map_err(|e| match e {
            Error::InvalidArgument { field, reason } => {
                Error::invalid(field, format!("{reason} (in {})", path.display()))
            }
            other => other,
        })
    }

    /// The defaults overlaid with a TOML document; an unknown or mistyped key is an error
    /// naming it.
    pub fn from_toml(text: &str) -> Result<Config> {
        toml::from_str(text).map_err(|e| {
            let reason = e.message().to_string();
            Error::invalid("config", reason)
        })
    }

    /// Checks every value once, naming the key at fault.
    pub fn validate(&self) -> Result<()> {
        let e = &self.engine;
        Device::parse(&e.device).map_err(|err| rename(err, "engine.device"))?;
        if e.dtype != "auto" && crate::DType::parse(&e.dtype).is_err() {
            return Err(Error::invalid(
                "engine.dtype",
                format!("{:?}: give auto, bf16, f16 or f32", e.dtype),
            ));
        }
        if !matches!(e.quantize.as_str(), "none" | "int8") {
            return Err(Error::invalid("engine.quantize", format!("{:?}: give int8 or none", e.quantize)));
        }
        if e.max_model_len == Some(0) {
            return Err(Error::invalid("engine.max_model_len", "must be at least 1"));
        }
        if e.gpu_memory_utilization.is_some_and(|u| !(u > 0.0 && u <= 1.0)) {
            let u = e.gpu_memory_utilization.unwrap_or_default();
            return Err(Error::invalid(
                "engine.gpu_memory_utilization",
                format!("{u}: a fraction in (0, 1]"),
            ));
        }
        if let Some(p) = &e.pooling {
            crate::sampling::Pooling::parse(p).map_err(|err| rename(err, "engine.pooling"))?;
        }
        let kv = parse_memory(&e.kv_cache_memory).map_err(|err| rename(err, "engine.kv_cache_memory"))?;
        if let Some(avail) = crate::host::available_memory() {
            if kv as u64 > avail {
                return Err(Error::invalid(
                    "engine.kv_cache_memory",
                    format!("{kv} bytes exceed the {avail} bytes of memory this machine has available"),
                ));
            }
        }
        for (key, v) in [
            ("engine.block_size", e.block_size),
            ("engine.max_num_seqs", e.max_num_seqs),
            ("engine.max_batched_tokens", e.max_batched_tokens),
            ("engine.max_waiting", e.max_waiting),
            ("serve.tp", self.serve.tp),
            ("serve.pp", self.serve.pp),
            ("serve.ep", self.serve.ep),
            ("serve.replicas", self.serve.replicas),
        ] {
            if v == 0 {
                return Err(Error::invalid(key, "must be at least 1"));
            }
        }
        let r = &self.registry;
        r.etcd_security()?;
        seconds("registry.lease_ttl_s", r.lease_ttl_s, 1.0)?;
        if let Some(k) = r.lease_keepalive_s {
            seconds("registry.lease_keepalive_s", k, 0.05)?;
            if k >= r.lease_ttl_s {
                return Err(Error::invalid(
                    "registry.lease_keepalive_s",
                    "must be shorter than registry.lease_ttl_s, or leases lapse between refreshes",
                ));
            }
        }
        let c = &self.coordinator;
        for (i, t) in c.tenants.iter().enumerate() {
            t.validate(i)?;
            if c.tenants[..i].iter().any(|o| o.name == t.name) {
                return Err(Error::invalid(
                    format!("coordinator.tenants[{i}].name"),
                    format!("tenant {:?} is declared twice", t.name),
                ));
            }
        }
        parse_memory_or_zero(&c.response_cache_memory)
            .map_err(|err| rename(err, "coordinator.response_cache_memory"))?;
        parse_memory(&c.text_in_flight).map_err(|err| rename(err, "coordinator.text_in_flight"))?;
        if !matches!(c.default_device.as_str(), "cpu" | "cuda") {
            return Err(Error::invalid(
                "coordinator.default_device",
                format!("{:?}: give cpu or cuda", c.default_device),
            ));
        }
        self.check_durations()?;
        self.security.credentials()?;
        let m = &self.telemetry.metrics_listen;
        if m != "off" && m.parse::<SocketAddr>().is_err() {
            return Err(Error::invalid("telemetry.metrics_listen", format!("{m:?}: give HOST:PORT or off")));
        }
        let c = &self.coordinator;
        if c.tls_cert.is_some() != c.tls_key.is_some() || (c.tls_client_ca.is_some() && c.tls_cert.is_none())
        {
            return Err(Error::invalid(
                "coordinator.tls_cert",
                "give the certificate and its key together (a client CA needs them too)",
            ));
        }
        for root in &self.security.model_roots {
            if !root.is_absolute() {
                return Err(Error::invalid(
                    "security.model_roots",
                    format!("{}: a model root must be an absolute path", root.display()),
                ));
            }
        }
        Ok(())
    }

    /// Every duration setting within its bounds (see [`seconds`]).
    fn check_durations(&self) -> Result<()> {
        let c = &self.coordinator;
        for (key, v, min) in [
            ("coordinator.canary_interval_s", c.canary_interval_s, 0.05),
            ("coordinator.canary_timeout_s", c.canary_timeout_s, 0.05),
            ("coordinator.load_timeout_s", c.load_timeout_s, 1.0),
            ("coordinator.replica_drain_timeout_s", c.replica_drain_timeout_s, 0.0),
            ("coordinator.failed_retention_s", c.failed_retention_s, 0.0),
            ("coordinator.route_wait_s", c.route_wait_s, 0.0),
            ("coordinator.drain_timeout_s", c.drain_timeout_s, 0.0),
            ("serve.drain_timeout_s", self.serve.drain_timeout_s, 0.0),
            ("worker.drain_timeout_s", self.worker.drain_timeout_s, 0.0),
        ] {
            seconds(key, v, min)?;
        }
        Ok(())
    }
}

fn rename(e: Error, key: &str) -> Error {
    match e {
        Error::InvalidArgument { reason, .. } => Error::invalid(key, reason),
        other => other,
    }
}

/// Longest duration a setting may name: a year.
pub const MAX_SECONDS: f64 = 365.0 * 86_400.0;

/// A duration of at least `min` seconds and at most [`MAX_SECONDS`], or an error naming
/// `key`.
pub fn seconds(key: &str, v: f64, min: f64) -> Result<std::time::Duration> {
    if !(v.is_finite() && v >= min && v <= MAX_SECONDS) {
        return Err(Error::invalid(
            key,
            format!("must be a number of seconds from {min} to {MAX_SECONDS}, got {v}"),
        ));
    }
    Ok(std::time::Duration::from_secs_f64(v))
}

/// Parses "512MiB", "2GiB", "1000000" (bytes) or a fraction of available memory ("0.2").
/// [`parse_memory`], or 0 for "0" (a cache turned off).
pub fn parse_memory_or_zero(text: &str) -> Result<usize> {
    if text.trim() == "0" {
        return Ok(0);
    }
    parse_memory(text)
}

pub fn parse_memory(text: &str) -> Result<usize> {
    let bad = |reason: String| Error::invalid("memory", format!("{text:?}: {reason}"));
    let t = text.trim();
    let units = [
        ("KiB", 1usize << 10),
        ("MiB", 1 << 20),
        ("GiB", 1 << 30),
        ("KB", 1000),
        ("MB", 1_000_000),
        ("GB", 1_000_000_000),
    ];
    for (suffix, mul) in units {
        if let Some(n) = t.strip_suffix(suffix) {
            let v: f64 = n.trim().parse().map_err(|_| bad(format!("expected a number before {suffix}")))?;
            if !(v > 0.0 && v.is_finite()) {
                return Err(bad("must be positive".into()));
            }
            return Ok((v * mul as f64) as usize);
        }
    }
    let v: f64 = t.parse().map_err(|_| bad("expected a size like 512MiB or a fraction like 0.2".into()))?;
    if v > 0.0 && v < 1.0 {
        let avail = crate::host::available_memory()
            .ok_or_else(|| bad("a fraction needs MemAvailable from /proc/meminfo".into()))?;
        return Ok((avail as f64 * v) as usize);
    }
    if v >= 1.0 && v.fract() == 0.0 {
        return Ok(v as usize);
    }
    Err(bad("a fraction must be in (0, 1)".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_example_config_parses_validates_and_states_the_defaults() {
        let text = include_str!("../../deploy/strata.example.toml");
        let cfg = Config::from_toml(text).unwrap();
        cfg.validate().unwrap();
        // Every value in the example is the default, so the file documents them truly
        // (models aside, which have none).
        let mut defaults = Config::default();
        defaults.serve.models = cfg.serve.models.clone();
        defaults.registry.etcd = cfg.registry.etcd.clone();
        assert_eq!(cfg, defaults);
    }

    #[test]
    fn unknown_keys_and_bad_values_are_named() {
        let e = Config::from_toml("[engine]\nblok_size = 4\n").unwrap_err().to_string();
        assert!(e.contains("blok_size"), "{e}");
        let e = Config::from_toml("[engine]\nblock_size = \"big\"\n").unwrap_err().to_string();
        assert!(e.contains("block_size") || e.contains("invalid type"), "{e}");
        let cfg = Config::from_toml("[engine]\nblock_size = 0\n").unwrap();
        assert!(cfg.validate().unwrap_err().to_string().contains("engine.block_size"));
        let cfg = Config::from_toml("[registry]\nlease_ttl_s = 3\nlease_keepalive_s = 3\n").unwrap();
        assert!(cfg.validate().unwrap_err().to_string().contains("registry.lease_keepalive_s"));
        let cfg = Config::from_toml("[engine]\ngpu_memory_utilization = 1.5\n").unwrap();
        assert!(cfg.validate().unwrap_err().to_string().contains("engine.gpu_memory_utilization"));
        let cfg = Config::from_toml("[engine]\ndevice = \"tpu\"\n").unwrap();
        assert!(cfg.validate().unwrap_err().to_string().contains("engine.device"));
        // Durations are bounded above too: 1e20 seconds was a panic, not an error.
        let cfg = Config::from_toml("[coordinator]\nroute_wait_s = 1e20\n").unwrap();
        assert!(cfg.validate().unwrap_err().to_string().contains("coordinator.route_wait_s"));
        let cfg = Config::from_toml("[engine]\nkv_cache_memory = \"lots\"\n").unwrap();
        assert!(cfg.validate().unwrap_err().to_string().contains("engine.kv_cache_memory"));
        let cfg = Config::from_toml("[coordinator]\nresponse_cache_memory = \"lots\"\n").unwrap();
        assert!(cfg.validate().unwrap_err().to_string().contains("coordinator.response_cache_memory"));
        let cfg = Config::from_toml("[coordinator]\nresponse_cache_memory = \"0\"\n").unwrap();
        assert!(cfg.validate().is_ok(), "0 turns the response cache off");
        let cfg = Config::from_toml("[engine]\npooling = \"max\"\n").unwrap();
        assert!(cfg.validate().unwrap_err().to_string().contains("engine.pooling"));
        assert!(Config::from_toml("[engine]\npooling = \"mean\"\n").unwrap().validate().is_ok());
    }

    #[test]
    fn memory_sizes_parse() {
        assert_eq!(parse_memory("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_memory("1.5GiB").unwrap(), 3 << 29);
        assert_eq!(parse_memory("4096").unwrap(), 4096);
        assert!(parse_memory("-1MiB").is_err());
        assert!(parse_memory("2.5").is_err());
        // A cache may be turned off; a KV cache may not.
        assert_eq!(parse_memory_or_zero("0").unwrap(), 0);
        assert_eq!(parse_memory_or_zero("64MiB").unwrap(), 64 << 20);
        assert!(parse_memory("0").is_err() && parse_memory_or_zero("lots").is_err());
    }
}
