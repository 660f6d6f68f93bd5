//! Credentials on the command line: the cluster's ([security] in the config) with the safe
//! default that a cluster role reachable from other machines needs them, and the callers'
//! (API key file with reload on SIGHUP, TLS for inference and admin calls).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use clap::Args;
use strata_common::config::{CoordinatorSettings, SecuritySettings};
use strata_common::ready::{announce, Announcement};
use strata_common::tls::{ClusterCredentials, ClusterTls, Role};
use strata_coordinator::api::auth::{AdminAuth, ClientAuth};
use strata_coordinator::frontend::texts::{TextBudgetOptions, SMALL_TEXT};
use strata_coordinator::frontend::FrontEndOptions;
use strata_coordinator::request::generation::RouteLimits;
use strata_coordinator::routing::policy::PolicyKind;
use tonic::transport::{Certificate, Identity, ServerTlsConfig};

#[derive(Args, Debug, Clone, Default)]
pub struct SecurityArgs {
    /// This process's certificate from the cluster CA (PEM); it must name its role
    /// (`strata cert dev --out DIR` makes a development set).
    #[arg(long, env = "STRATA_CLUSTER_CERT", value_name = "FILE")]
    pub cluster_cert: Option<PathBuf>,
    /// The certificate's private key (PEM).
    #[arg(long, env = "STRATA_CLUSTER_KEY", value_name = "FILE")]
    pub cluster_key: Option<PathBuf>,
    /// The cluster CA (PEM): peers must present a certificate it signed.
    #[arg(long, env = "STRATA_CLUSTER_CA", value_name = "FILE")]
    pub cluster_ca: Option<PathBuf>,
    /// Listen beyond loopback without cluster credentials: anyone who can reach this
    /// process is trusted as a cluster member.
    #[arg(long, env = "STRATA_INSECURE")]
    pub insecure: bool,
    /// A directory deployments may load models from (repeatable; absolute).
    #[arg(long = "model-root", alias = "model-roots", env = "STRATA_MODEL_ROOTS", value_delimiter = ',')]
    pub model_roots: Vec<PathBuf>,
}

impl SecurityArgs {
    pub fn apply(&self, s: &mut SecuritySettings) {
        for (slot, v) in [
            (&mut s.cluster_cert, &self.cluster_cert),
            (&mut s.cluster_key, &self.cluster_key),
            (&mut s.cluster_ca, &self.cluster_ca),
        ] {
            if v.is_some() {
                *slot = v.clone();
            }
        }
        if self.insecure {
            s.insecure = true;
        }
        if !self.model_roots.is_empty() {
            s.model_roots = self.model_roots.clone();
        }
    }
}

/// The cluster credentials of a process of `role` listening on `listen`. Without
/// credentials, only a loopback address (or an explicit `--insecure`) is allowed.
pub fn cluster_tls(
    s: &SecuritySettings,
    listen: SocketAddr,
    role: Role,
) -> anyhow::Result<Option<ClusterTls>> {
    if let Some((cert, key, ca)) = s.credentials()? {
        return Ok(Some(ClusterTls::load(&ClusterCredentials { cert, key, ca }, role)?));
    }
    if listen.ip().is_loopback() {
        return Ok(None);
    }
    if s.insecure {
        tracing::warn!(
            "--insecure: listening on {listen} without cluster credentials; anyone who can reach this {role} is trusted as a cluster member"
        );
        return Ok(None);
    }
    bail!(
        "--listen {listen} is reachable from other machines, and without cluster credentials anyone who can reach it would be trusted: \
         give --cluster-cert, --cluster-key and --cluster-ca (`strata cert dev --out DIR` makes a development set), \
         or --insecure to accept that"
    )
}

/// Callers' credentials and transport ([coordinator] keys of the config): for
/// `strata coordinator` and `strata serve`.
#[derive(Args, Debug, Clone, Default)]
pub struct CallerArgs {
    /// A file of client API keys (one key or `sha256:<hex>` per line, `#` comments), read
    /// again on SIGHUP so keys rotate without a restart.
    #[arg(long, env = "STRATA_API_KEY_FILE", value_name = "FILE")]
    pub api_key_file: Option<PathBuf>,
    /// TLS for inference and admin calls: this server's certificate (PEM).
    #[arg(long, env = "STRATA_TLS_CERT", value_name = "FILE")]
    pub tls_cert: Option<PathBuf>,
    /// The certificate's private key (PEM).
    #[arg(long, env = "STRATA_TLS_KEY", value_name = "FILE")]
    pub tls_key: Option<PathBuf>,
    /// Callers must present a certificate this CA signed (PEM).
    #[arg(long, env = "STRATA_TLS_CLIENT_CA", value_name = "FILE")]
    pub tls_client_ca: Option<PathBuf>,
    /// Serve the OpenAI-style HTTP API (/v1/completions, /v1/chat/completions, batches)
    /// here, or `off`; port 0 picks a free port (announced on stdout) [default: serve:
    /// 127.0.0.1:8000; coordinator: off] (coordinator.http_listen).
    #[arg(long, env = "STRATA_HTTP_LISTEN", value_name = "HOST:PORT|off", value_parser = parse_http_listen)]
    pub http_listen: Option<HttpListen>,
    /// The HTTP API's address, as vLLM's --host names it (with --port; default port 8000).
    // No STRATA_HOST/STRATA_PORT variables: Kubernetes sets <SERVICE>_PORT in every pod.
    #[arg(long, value_name = "IP", conflicts_with = "http_listen")]
    pub host: Option<String>,
    /// The HTTP API's port, as vLLM's --port names it (with --host; default host 127.0.0.1).
    #[arg(long, conflicts_with = "http_listen")]
    pub port: Option<u16>,
    /// Keep batch jobs and their files here; unfinished jobs resume after a restart
    /// (coordinator.data_dir). Without it the batch API is off.
    #[arg(long, env = "STRATA_DATA_DIR", value_name = "DIR")]
    pub data_dir: Option<PathBuf>,
    /// Most batch requests in flight at once, all batches together [default: 32]
    /// (coordinator.batch_concurrency).
    #[arg(long, env = "STRATA_BATCH_CONCURRENCY")]
    pub batch_concurrency: Option<usize>,
    /// Memory for responses to deterministic requests (greedy, or seeded sampling), replayed
    /// for identical requests: a size, or 0 to turn it off [default: 64MiB]
    /// (coordinator.response_cache_memory).
    #[arg(long, env = "STRATA_RESPONSE_CACHE_MEMORY", value_name = "SIZE")]
    pub response_cache_memory: Option<String>,
    /// Bytes of caller text parsed, rendered and tokenized at once, across gRPC, HTTP and
    /// batch jobs (tokenizing costs ~220× the text in memory; texts of 64 KiB and less
    /// have a lane of their own) [default: 16MiB] (coordinator.text_in_flight).
    #[arg(long, env = "STRATA_TEXT_IN_FLIGHT", value_name = "SIZE")]
    pub text_in_flight: Option<String>,
    /// How a model's router picks among its ready replicas: prefix-affinity (where the
    /// prompt's prefix went before, unless that replica is much busier) or
    /// least-outstanding [default: prefix-affinity] (coordinator.routing_policy).
    #[arg(long, env = "STRATA_ROUTING_POLICY", value_name = "POLICY")]
    pub routing_policy: Option<String>,
    /// Log one info line per finished request: request id, model, tenant, tokens, outcome,
    /// duration (with --log-format json, its trace_id too).
    #[arg(long, env = "STRATA_ACCESS_LOG")]
    pub access_log: bool,
}

impl CallerArgs {
    pub fn apply(&self, c: &mut CoordinatorSettings) {
        for (slot, v) in [
            (&mut c.api_key_file, &self.api_key_file),
            (&mut c.tls_cert, &self.tls_cert),
            (&mut c.tls_key, &self.tls_key),
            (&mut c.tls_client_ca, &self.tls_client_ca),
            (&mut c.data_dir, &self.data_dir),
        ] {
            if v.is_some() {
                *slot = v.clone();
            }
        }
        match self.http_listen {
            Some(HttpListen::Off) => c.http_listen = None,
            Some(HttpListen::At(addr)) => c.http_listen = Some(addr),
            None => {}
        }
        if let Some(ip) = self.host_ip() {
            c.http_listen = Some(SocketAddr::new(ip, self.port.unwrap_or(DEFAULT_HTTP_LISTEN.port())));
        } else if let Some(port) = self.port {
            c.http_listen = Some(SocketAddr::new(DEFAULT_HTTP_LISTEN.ip(), port));
        }
        if let Some(n) = self.batch_concurrency {
            c.batch_concurrency = n;
        }
        if let Some(m) = &self.response_cache_memory {
            c.response_cache_memory = m.clone();
        }
        if let Some(m) = &self.text_in_flight {
            c.text_in_flight = m.clone();
        }
        if let Some(p) = &self.routing_policy {
            c.routing_policy = p.clone();
        }
        if self.access_log {
            c.access_log = true;
        }
    }
}

/// Where `strata serve` serves the HTTP API unless told otherwise.
pub const DEFAULT_HTTP_LISTEN: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 8000);

/// `--http-listen`: an address, or `off`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HttpListen {
    Off,
    At(SocketAddr),
}

fn parse_http_listen(text: &str) -> Result<HttpListen, String> {
    if text.eq_ignore_ascii_case("off") {
        return Ok(HttpListen::Off);
    }
    text.parse().map(HttpListen::At).map_err(|_| format!("{text:?}: give HOST:PORT (127.0.0.1:8000) or off"))
}

impl CallerArgs {
    /// `--http-listen off` was given: no HTTP API, whatever the default.
    pub fn http_off(&self) -> bool {
        self.http_listen == Some(HttpListen::Off)
    }

    /// `--host` as an address (`localhost` is loopback); None when not given. A bad value
    /// was refused by [`CallerArgs::check`].
    fn host_ip(&self) -> Option<std::net::IpAddr> {
        self.host.as_deref().and_then(|h| parse_host(h).ok())
    }

    /// Values clap cannot check alone.
    pub fn check(&self) -> anyhow::Result<()> {
        if let Some(h) = &self.host {
            parse_host(h).map_err(|e| anyhow::anyhow!("--host {e}"))?;
        }
        Ok(())
    }
}

fn parse_host(text: &str) -> Result<std::net::IpAddr, String> {
    if text.eq_ignore_ascii_case("localhost") {
        return Ok(DEFAULT_HTTP_LISTEN.ip());
    }
    let bare = text.strip_prefix('[').and_then(|t| t.strip_suffix(']')).unwrap_or(text);
    bare.parse().map_err(|_| format!("{text:?}: give an IP address (127.0.0.1, 0.0.0.0, ::) or localhost"))
}

/// The routing policy `coordinator.routing_policy` names.
pub fn routing_policy(c: &CoordinatorSettings) -> anyhow::Result<PolicyKind> {
    PolicyKind::parse(&c.routing_policy).context("--routing-policy (coordinator.routing_policy)")
}

/// The front end's settings: how long a request waits for a replica
/// (`coordinator.route_wait_s`) and the response cache's size
/// (`coordinator.response_cache_memory`).
pub fn front_options(c: &CoordinatorSettings) -> anyhow::Result<FrontEndOptions> {
    let bytes = strata_common::config::parse_memory_or_zero(&c.response_cache_memory)
        .context("--response-cache-memory (coordinator.response_cache_memory)")?;
    if bytes > 0 {
        // Said at start: a benchmark or a test that repeats a greedy request would
        // otherwise measure the cache without knowing it.
        tracing::info!(
            response_cache_bytes = bytes,
            "response cache on: a repeated deterministic request may be answered from it (--response-cache-memory 0 turns it off; requests may send cache: false)"
        );
    }
    let text = strata_common::config::parse_memory(&c.text_in_flight)
        .context("--text-in-flight (coordinator.text_in_flight)")?;
    // `route_wait_s` is finite and not negative: the settings were validated.
    let wait = std::time::Duration::from_secs_f64(c.route_wait_s);
    let defaults = RouteLimits::default();
    Ok(FrontEndOptions {
        // Replicas pending for workers hold a request no longer than the route wait.
        route: RouteLimits { wait, pending_grace: defaults.pending_grace.min(wait), ..defaults },
        response_cache_bytes: bytes,
        texts: TextBudgetOptions { total_bytes: text, small_bytes: (text / 4).max(SMALL_TEXT * 4) },
        access_log: c.access_log,
    })
}

/// Largest key file read.
const MAX_KEY_FILE: u64 = 1 << 20;

/// The keys of a key file: one per line, blank lines and `#` comments skipped.
pub fn read_key_file(path: &Path) -> anyhow::Result<Vec<String>> {
    let meta = std::fs::metadata(path).with_context(|| format!("--api-key-file {}", path.display()))?;
    if meta.len() > MAX_KEY_FILE {
        bail!("--api-key-file {}: larger than {MAX_KEY_FILE} bytes", path.display());
    }
    let text = std::fs::read_to_string(path).with_context(|| format!("--api-key-file {}", path.display()))?;
    Ok(text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_owned)
        .collect())
}

/// The HTTP API's settings (None when `http_listen` is not set).
pub fn http_options(
    c: &CoordinatorSettings,
) -> anyhow::Result<Option<strata_coordinator::api::http::HttpOptions>> {
    let Some(listen) = c.http_listen else {
        if c.data_dir.is_some() {
            bail!("--data-dir keeps batch jobs for the HTTP API, which is off: give --http-listen");
        }
        return Ok(None);
    };
    if c.batch_concurrency == 0 {
        bail!("--batch-concurrency must be at least 1");
    }
    Ok(Some(strata_coordinator::api::http::HttpOptions {
        listen,
        data_dir: c.data_dir.clone(),
        batch_concurrency: c.batch_concurrency,
    }))
}

/// The configured client keys: `api_keys` and the key file's.
pub fn client_keys(c: &CoordinatorSettings) -> anyhow::Result<Vec<String>> {
    let mut keys = c.api_keys.clone();
    if let Some(f) = &c.api_key_file {
        keys.extend(read_key_file(f)?);
    }
    Ok(keys)
}

/// The server TLS for callers, when configured.
pub fn caller_tls(c: &CoordinatorSettings) -> anyhow::Result<Option<ServerTlsConfig>> {
    let (Some(cert), Some(key)) = (&c.tls_cert, &c.tls_key) else { return Ok(None) };
    let read = |p: &PathBuf, flag: &str| std::fs::read(p).with_context(|| format!("{flag} {}", p.display()));
    let mut tls = ServerTlsConfig::new()
        .identity(Identity::from_pem(read(cert, "--tls-cert")?, read(key, "--tls-key")?));
    if let Some(ca) = &c.tls_client_ca {
        tls = tls.client_ca_root(Certificate::from_pem(read(ca, "--tls-client-ca")?));
    }
    Ok(Some(tls))
}

/// Re-reads the key file on every SIGHUP and swaps the keys in; a file that cannot be
/// read or parsed keeps the old keys (and says why). Each reload is announced on stdout
/// (`{"event":"keys_reloaded",…}`) for supervisors and tests.
pub fn reload_keys_on_sighup(
    settings: CoordinatorSettings,
    clients: ClientAuth,
    admin: AdminAuth,
    role: &'static str,
) -> anyhow::Result<()> {
    let Some(file) = settings.api_key_file.clone() else { return Ok(()) };
    let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
        .context("listening for SIGHUP (key reload)")?;
    tokio::spawn(async move {
        while hup.recv().await.is_some() {
            let reloaded = client_keys(&settings)
                .and_then(|keys| clients.reload(keys, &admin).map_err(anyhow::Error::from));
            match reloaded {
                Ok(n) => {
                    tracing::info!(keys = n, file = %file.display(), "SIGHUP: API keys reloaded");
                    announce(&Announcement { event: "keys_reloaded", role, address: "", id: "" });
                }
                Err(e) => tracing::error!("SIGHUP: keeping the previous API keys: {e:#}"),
            }
        }
    });
    Ok(())
}

/// `--metrics-listen` ([telemetry] in the config).
#[derive(Args, Debug, Clone, Default)]
pub struct TelemetryArgs {
    /// Where GET /metrics is served: HOST:PORT (port 0: a free one, announced on stdout),
    /// or off [default: 127.0.0.1:0].
    #[arg(long, env = "STRATA_METRICS_LISTEN")]
    pub metrics_listen: Option<String>,
}

impl TelemetryArgs {
    pub fn apply(&self, t: &mut strata_common::config::TelemetrySettings) {
        if let Some(m) = &self.metrics_listen {
            t.metrics_listen = m.clone();
        }
    }
}
