//! `strata serve`: every role in one process — the command line and its wiring.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Args;
use strata_common::config::{Config, ServedModel};
use strata_common::model_roots::ModelRoots;

use crate::security_args::{
    caller_tls, client_keys, http_options, reload_keys_on_sighup, CallerArgs, TelemetryArgs,
};
use strata_common::ready::Announcement;
use strata_common::Parallelism;
use strata_coordinator::api::auth::{AdminAuth, ClientAuth};
use strata_coordinator::api::server::{Role, ServeOptions};
use strata_worker::agent::AgentConfig;

use crate::config_args::{engine_config, set, ConfigArg, EngineArgs};
use crate::embedded::{EmbeddedModel, EmbeddedOptions};

#[derive(Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub config: ConfigArg,
    /// Model directories to serve, as `vllm serve DIR` takes one (before any --model).
    #[arg(value_name = "MODEL_DIR")]
    pub model_dirs: Vec<PathBuf>,
    /// Model directory to serve (repeatable; replaces the config's serve.models).
    #[arg(long)]
    pub model: Vec<PathBuf>,
    /// Name clients use for each model, in the same order (default: the directory name);
    /// also --served-model-name, as vLLM calls it.
    #[arg(long, alias = "served-model-name")]
    pub name: Vec<String>,
    /// Address to listen on; port 0 picks a free port (the log says which)
    /// [default: 127.0.0.1:50051].
    #[arg(long, env = "STRATA_LISTEN")]
    pub listen: Option<std::net::SocketAddr>,
    /// Tensor-parallel ranks per replica (also --tensor-parallel-size) [default: 1].
    #[arg(long, alias = "tensor-parallel-size", env = "STRATA_TP")]
    pub tp: Option<usize>,
    /// Pipeline stages per replica (also --pipeline-parallel-size) [default: 1].
    #[arg(long, alias = "pipeline-parallel-size", env = "STRATA_PP")]
    pub pp: Option<usize>,
    /// Expert parallelism: each MoE layer's experts split across this many ranks (a stage's
    /// TP ranks; alone, it sets --tp) [default: 1].
    #[arg(long, env = "STRATA_EP")]
    pub ep: Option<usize>,
    /// Replicas of each model [default: 1].
    #[arg(long, env = "STRATA_REPLICAS")]
    pub replicas: Option<usize>,
    #[command(flatten)]
    pub engine: EngineArgs,
    #[command(flatten)]
    pub callers: CallerArgs,
    #[command(flatten)]
    pub telemetry: TelemetryArgs,
    /// Deprecated (static mode; use cluster mode): wait at this address for the replica's
    /// other ranks to join as `strata worker` processes, instead of running them as
    /// threads (one model, one replica).
    #[arg(long)]
    pub worker_rendezvous: Option<std::net::SocketAddr>,
    /// The secret every rank proves at --worker-rendezvous (the same on each `strata
    /// worker --rank`); required unless the rendezvous is on loopback.
    #[arg(long, env = "STRATA_RENDEZVOUS_SECRET", hide_env_values = true)]
    pub rendezvous_secret: Option<String>,
    /// A directory admin deployments may load models from (repeatable; absolute); the
    /// --model directories are always allowed (security.model_roots).
    #[arg(long = "model-root", env = "STRATA_MODEL_ROOTS", value_delimiter = ',')]
    pub model_roots: Vec<std::path::PathBuf>,
    /// A Jinja chat template file used instead of each model's own (vLLM's
    /// `--chat-template`).
    #[arg(long, value_name = "FILE")]
    pub chat_template: Option<PathBuf>,
    /// The format tool calls are read in when a request's tool_choice is auto (vLLM's
    /// names: hermes, llama3_json, mistral, deepseek_v3, openai) [default: judged from the
    /// chat template].
    #[arg(long, value_name = "NAME")]
    pub tool_call_parser: Option<String>,
    /// Accepted so that a vLLM command line carries over: tool_choice auto is always
    /// served when a request sends tools (no flag needed).
    #[arg(long)]
    pub enable_auto_tool_choice: bool,
    /// Seconds in-flight calls get to finish after SIGTERM [default: 30].
    #[arg(long, env = "STRATA_DRAIN_TIMEOUT")]
    pub drain_timeout: Option<f64>,
    /// Seconds between canaries of each ready replica [default: 5]
    /// (coordinator.canary_interval_s).
    #[arg(long, env = "STRATA_CANARY_INTERVAL")]
    pub canary_interval: Option<f64>,
    /// Seconds a canary may take before its replica is failed, unless the replica is still
    /// completing steps [default: 10] (coordinator.canary_timeout_s).
    #[arg(long, env = "STRATA_CANARY_TIMEOUT")]
    pub canary_timeout: Option<f64>,
    /// Seconds a request waits for a ready replica (at start or after one failed)
    /// [default: 60] (coordinator.route_wait_s).
    #[arg(long, env = "STRATA_ROUTE_WAIT")]
    pub route_wait: Option<f64>,
    /// Token admin calls must bear; without one, admin calls are accepted from loopback only
    /// (coordinator.admin_token).
    #[arg(long, env = "STRATA_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    /// Client API keys inference calls must bear (repeatable); none: inference is open
    /// (coordinator.api_keys).
    #[arg(long = "api-key", env = "STRATA_API_KEYS", value_delimiter = ',', hide_env_values = true)]
    pub api_keys: Vec<String>,
    /// In-process workers beyond what the --model flags need, for models deployed at run
    /// time through the admin API [default: 0].
    #[arg(long, env = "STRATA_SPARE_WORKERS")]
    pub spare_workers: Option<usize>,
}

impl ServeArgs {
    pub(crate) fn overlay(&self, cfg: &mut Config) -> anyhow::Result<()> {
        let s = &mut cfg.serve;
        let models: Vec<&PathBuf> = self.model_dirs.iter().chain(&self.model).collect();
        if !models.is_empty() {
            if !self.name.is_empty() && self.name.len() != models.len() {
                bail!(
                    "--name is given {} times for {} models; give one name per model or none",
                    self.name.len(),
                    models.len()
                );
            }
            s.models = models
                .into_iter()
                .enumerate()
                .map(|(i, path)| ServedModel { path: path.clone(), name: self.name.get(i).cloned() })
                .collect();
        } else if !self.name.is_empty() {
            bail!("--name needs a --model to name");
        }
        set(&mut s.listen, &self.listen);
        set(&mut s.tp, &self.tp);
        set(&mut s.pp, &self.pp);
        set(&mut s.ep, &self.ep);
        set(&mut s.replicas, &self.replicas);
        set(&mut s.drain_timeout_s, &self.drain_timeout);
        set(&mut cfg.coordinator.route_wait_s, &self.route_wait);
        set(&mut cfg.coordinator.canary_interval_s, &self.canary_interval);
        set(&mut cfg.coordinator.canary_timeout_s, &self.canary_timeout);
        set(&mut s.spare_workers, &self.spare_workers);
        self.engine.apply(&mut cfg.engine);
        // serve's coordinator checks credentials as `strata coordinator` does.
        if self.admin_token.is_some() {
            cfg.coordinator.admin_token = self.admin_token.clone();
        }
        if !self.api_keys.is_empty() {
            cfg.coordinator.api_keys = self.api_keys.clone();
        }
        if !self.model_roots.is_empty() {
            cfg.security.model_roots = self.model_roots.clone();
        }
        self.callers.check()?;
        self.callers.apply(&mut cfg.coordinator);
        // One process serving models speaks HTTP too, as `vllm serve` does.
        if cfg.coordinator.http_listen.is_none() && !self.callers.http_off() {
            cfg.coordinator.http_listen = Some(crate::security_args::DEFAULT_HTTP_LISTEN);
        }
        self.telemetry.apply(&mut cfg.telemetry);
        Ok(())
    }
}

/// Why `path` is no model directory, with what to do when it reads as a Hugging Face hub
/// id (`org/name`): Strata loads directories, it downloads nothing.
pub(crate) fn not_a_model_dir(path: &std::path::Path) -> String {
    let text = path.to_string_lossy();
    let parts: Vec<&str> = text.split('/').collect();
    let hub_like = !path.exists()
        && parts.len() == 2
        && parts
            .iter()
            .all(|p| !p.is_empty() && p.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)));
    if hub_like {
        format!(
            "not a directory; it reads as a Hugging Face hub id: download it first (`huggingface-cli download {text} --local-dir DIR`, or `hf download`) and serve DIR"
        )
    } else {
        "not a directory".into()
    }
}

/// Each model's name: given, or its directory's; names must differ.
fn model_names(models: &[ServedModel]) -> anyhow::Result<Vec<String>> {
    let mut names: Vec<String> = Vec::with_capacity(models.len());
    for m in models {
        let name = match &m.name {
            Some(n) => n.clone(),
            None => m
                .path
                .canonicalize()
                .ok()
                .and_then(|d| d.file_name().map(|n| n.to_string_lossy().to_string()))
                .with_context(|| format!("--model {}: {}", m.path.display(), not_a_model_dir(&m.path)))?,
        };
        if names.contains(&name) {
            bail!("model name {name:?} is used twice: give each --model its own --name");
        }
        names.push(name);
    }
    Ok(names)
}

pub fn serve(args: ServeArgs, rt: tokio::runtime::Runtime) -> anyhow::Result<()> {
    let cfg = args.config.resolve(|cfg| args.overlay(cfg))?;
    if args.enable_auto_tool_choice {
        tracing::debug!("--enable-auto-tool-choice: tool_choice auto is always served; nothing to turn on");
    }
    let s = &cfg.serve;
    if s.models.is_empty() {
        bail!("give at least one --model DIR (or serve.models in --config)");
    }
    let par = Parallelism::with_ep(s.tp, s.pp, s.ep).context("serve.ep")?;
    let names = model_names(&s.models)?;
    let (engine, limits) = engine_config(&cfg.engine)?;
    let front = crate::security_args::front_options(&cfg.coordinator)?;
    let routing_policy = crate::security_args::routing_policy(&cfg.coordinator)?;
    let client_auth =
        ClientAuth::with_tenants(client_keys(&cfg.coordinator)?, cfg.coordinator.tenants.clone())
            .context("--api-key, coordinator.tenants")?;
    let client_auth_for_reload = client_auth.clone();
    let admin_auth =
        AdminAuth::new(cfg.coordinator.admin_token.clone(), &client_auth).context("--admin-token")?;
    let mut opts = ServeOptions {
        listen: s.listen,
        drain_timeout: Duration::from_secs_f64(s.drain_timeout_s),
        client_auth,
        role: Role::Serve,
        id: "serve".into(),
        tls: caller_tls(&cfg.coordinator)?,
        http: http_options(&cfg.coordinator)?,
        bound: None,
    };
    let _runtime = rt.enter();
    // Before anything loads: a port in use fails now, not after the models are up.
    opts.bind_early()?;
    reload_keys_on_sighup(cfg.coordinator.clone(), client_auth_for_reload, admin_auth.clone(), "serve")?;
    if let Some(addr) = crate::metrics_http::parse_listen(&cfg.telemetry.metrics_listen)? {
        rt.block_on(crate::metrics_http::serve(addr, "serve"))?;
    }
    if let Some(addr) = args.worker_rendezvous {
        // Static mode: rank 0 here, the other ranks are `strata worker --rendezvous` processes.
        crate::rendezvous::warn_deprecated("strata serve --worker-rendezvous");
        if s.models.len() != 1 || s.replicas != 1 || par.world() == 1 {
            bail!("--worker-rendezvous needs one --model, --replicas 1 and --tp × --pp > 1");
        }
        let secret = crate::rendezvous::secret(args.rendezvous_secret.as_deref(), addr)?;
        let listener =
            std::net::TcpListener::bind(addr).with_context(|| format!("--worker-rendezvous {addr}"))?;
        let address = listener.local_addr()?.to_string();
        tracing::info!("worker rendezvous listening on {address}");
        let rendezvous = Announcement { event: "rendezvous", role: "serve", address: &address, id: "serve" };
        strata_common::ready::announce(&rendezvous);
        let replica = crate::rendezvous::StaticReplica {
            name: &names[0],
            dir: &s.models[0].path,
            par,
            listener,
            secret,
            engine: &engine,
            limits: &limits,
        };
        return crate::rendezvous::run(replica, front, opts, rt);
    }
    // Absolute, so every worker reads the same directory whatever its working directory.
    let mut roots = ModelRoots::new(cfg.security.model_roots.clone());
    let mut models = Vec::with_capacity(names.len());
    for (name, m) in names.into_iter().zip(&s.models) {
        let dir = m.path.canonicalize().with_context(|| format!("--model {}", m.path.display()))?;
        roots = roots.with(dir.clone());
        models.push(EmbeddedModel { name, dir, par, replicas: s.replicas });
    }
    let embedded = EmbeddedOptions {
        chat: chat_settings(args.chat_template.as_deref(), args.tool_call_parser.as_deref())?,
        models,
        spare_workers: s.spare_workers,
        agent: AgentConfig {
            id: String::new(),
            bind_ip: std::net::Ipv4Addr::LOCALHOST.into(),
            advertise_host: "127.0.0.1".into(),
            backend: engine.backend.clone(),
            engine,
            runner: limits,
            model_roots: roots.clone(),
            // Every in-process worker's ranks share this process's threads.
            rank_threads: strata_engine::replica::RankThreads::Own,
        },
        // The deployments say how many sequences a replica runs: the coordinator's
        // fair-admission gate has that many slots per replica.
        limits: strata_common::cluster::EngineLimits {
            max_num_seqs: cfg.engine.max_num_seqs as u32,
            max_waiting: cfg.engine.max_waiting as u32,
            ..Default::default()
        },
        serve: opts,
        front,
        routing_policy,
        admin_auth,
        model_roots: roots,
        // The canary and replica timings of the config, as a coordinator's.
        timings: crate::cluster_cli::timings(&cfg.coordinator),
    };
    rt.block_on(crate::embedded::run_embedded(embedded))
}

/// Most bytes of a `--chat-template` file.
const MAX_TEMPLATE_FILE: u64 = 1 << 20;

/// `--chat-template` and `--tool-call-parser`, checked before anything starts.
pub(crate) fn chat_settings(
    template: Option<&std::path::Path>,
    parser: Option<&str>,
) -> anyhow::Result<strata_coordinator::request::chat::ChatSettings> {
    use strata_coordinator::request::tools::ToolFormat;
    let template = match template {
        None => None,
        Some(path) => {
            // A regular file, bounded, opened without blocking (/dev/zero, a FIFO: refused).
            let source = strata_common::files::read_text(path, MAX_TEMPLATE_FILE)
                .with_context(|| format!("--chat-template {}", path.display()))?;
            strata_coordinator::request::chat::ChatTemplate::new(
                vec![("default".into(), source.clone())],
                Default::default(),
            )
            .with_context(|| format!("--chat-template {}", path.display()))?;
            Some(source)
        }
    };
    let tool_format = match parser {
        None => None,
        Some(name) => Some(
            ToolFormat::parse(name)
                .with_context(|| format!("--tool-call-parser {name:?}: one of {}", ToolFormat::NAMES))?,
        ),
    };
    Ok(strata_coordinator::request::chat::ChatSettings { template, tool_format })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The settings `strata serve ARGS` runs with (no environment in the way: the test
    /// runner's own STRATA_* variables would be read).
    fn overlaid(args: &[&str]) -> anyhow::Result<Config> {
        use clap::Parser;
        let cli = crate::cli::Cli::try_parse_from([&["strata", "serve", "m"], args].concat())?;
        let crate::cli::Command::Serve(serve) = cli.command else { panic!("serve") };
        let mut cfg = Config::default();
        serve.overlay(&mut cfg)?;
        Ok(cfg)
    }

    fn http(args: &[&str]) -> Option<std::net::SocketAddr> {
        overlaid(args).unwrap().coordinator.http_listen
    }

    #[test]
    fn serve_speaks_http_on_loopback_8000_unless_told_otherwise() {
        if std::env::var_os("STRATA_HTTP_LISTEN").is_some() {
            return; // the environment decides; the flags' meaning is tested below
        }
        assert_eq!(http(&[]), Some("127.0.0.1:8000".parse().unwrap()));
        assert_eq!(http(&["--http-listen", "off"]), None);
        assert_eq!(http(&["--http-listen", "0.0.0.0:9000"]), Some("0.0.0.0:9000".parse().unwrap()));
        // vLLM's --host and --port, alone or together.
        assert_eq!(http(&["--port", "8080"]), Some("127.0.0.1:8080".parse().unwrap()));
        assert_eq!(http(&["--host", "0.0.0.0"]), Some("0.0.0.0:8000".parse().unwrap()));
        assert_eq!(http(&["--host", "::1", "--port", "0"]), Some("[::1]:0".parse().unwrap()));
        assert_eq!(http(&["--host", "localhost"]), Some("127.0.0.1:8000".parse().unwrap()));
        let e = overlaid(&["--host", "example.com"]).unwrap_err().to_string();
        assert!(e.contains("--host") && e.contains("IP address"), "{e}");
        let e = overlaid(&["--port", "1", "--http-listen", "off"]).unwrap_err().to_string();
        assert!(e.contains("--http-listen") && e.contains("--port"), "{e}");
        let e = overlaid(&["--http-listen", "nowhere"]).unwrap_err().to_string();
        assert!(e.contains("HOST:PORT") && e.contains("off"), "{e}");
    }

    #[test]
    fn vllms_memory_utilization_is_a_fraction_that_replaces_the_kv_size() {
        let cfg = overlaid(&["--gpu-memory-utilization", "0.85"]).unwrap();
        assert_eq!(cfg.engine.gpu_memory_utilization, Some(0.85));
        let (engine, _) = engine_config(&cfg.engine).unwrap();
        assert_eq!(engine.memory_utilization, Some(0.85));
        let e = overlaid(&["--gpu-memory-utilization", "0.5", "--kv-cache-memory", "1GiB"]).unwrap_err();
        assert!(e.to_string().contains("--kv-cache-memory"), "{e}");
        let mut cfg = overlaid(&["--gpu-memory-utilization", "1.2"]).unwrap();
        cfg.serve.models.clear();
        let e = cfg.validate().unwrap_err().to_string();
        assert!(e.contains("gpu_memory_utilization"), "{e}");
    }

    #[test]
    fn chat_flags_are_checked_before_anything_starts() {
        let e = chat_settings(None, Some("pythonic")).unwrap_err().to_string();
        assert!(e.contains("--tool-call-parser") && e.contains("hermes"), "{e}");
        let bad = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(bad.path(), "{% for %}").unwrap();
        let e = format!("{:#}", chat_settings(Some(bad.path()), None).unwrap_err());
        assert!(e.contains("--chat-template"), "{e}");
        let e =
            chat_settings(Some(std::path::Path::new("/nonexistent/t.jinja")), None).unwrap_err().to_string();
        assert!(e.contains("--chat-template"), "{e}");
        let good = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(good.path(), "{{ messages[0]['content'] }}").unwrap();
        let s = chat_settings(Some(good.path()), Some("llama3_json")).unwrap();
        assert!(s.template.is_some() && s.tool_format.is_some());
    }
}
