//! Helpers shared by the end-to-end tests in `tests/`.

pub mod cluster;
pub mod etcd;
pub mod http;
pub mod otlp;
pub mod prometheus;

use std::path::{Path, PathBuf};

/// `tests/fixtures/models`, the HF-made models with reference outputs.
pub fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures").join("models")
}

/// Every fixture model directory (those holding a reference.json), sorted by name.
pub fn fixture_models() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(fixtures_dir())
        .expect("tests/fixtures/models exists (run tests/fixtures/make_fixtures.py)")
        .map(|e| e.expect("readable fixtures dir").path())
        .filter(|p| p.join("reference.json").exists())
        .collect();
    dirs.sort();
    assert!(!dirs.is_empty(), "no fixture models found");
    dirs
}

/// The `strata` binary built by `cargo build` into the same target directory as the test.
pub fn strata_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("STRATA_BIN") {
        return PathBuf::from(p);
    }
    // target/<profile>/deps/<test-binary> → target/<profile>/strata
    let exe = std::env::current_exe().expect("test executable path");
    let bin = exe
        .parent()
        .and_then(Path::parent)
        .map(|d| d.join(format!("strata{}", std::env::consts::EXE_SUFFIX)))
        .expect("target directory");
    assert!(bin.exists(), "{} not found: run `cargo build --bin strata` before the tests", bin.display());
    bin
}

/// Reads a fixture's reference.json.
pub fn reference(dir: &Path) -> serde_json::Value {
    json_file(&dir.join("reference.json"))
}

/// A JSON file of the fixtures.
pub fn json_file(path: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().expect("array of ids").iter().map(|x| x.as_u64().expect("id") as u32).collect()
}

pub fn floats(v: &serde_json::Value) -> Vec<f32> {
    v.as_array().expect("array of numbers").iter().map(|x| x.as_f64().expect("number") as f32).collect()
}

/// A started `strata` process's outputs: its stderr log (for people: printed when a test
/// fails, never asserted on) and the JSON announcements it writes on stdout (what tests
/// act on; see `strata_common::ready`).
pub struct Outputs {
    pub log: std::sync::Arc<std::sync::Mutex<String>>,
    pub events: std::sync::mpsc::Receiver<serde_json::Value>,
    /// Announcements `wait_event` passed over while waiting for another.
    passed: std::sync::Mutex<Vec<serde_json::Value>>,
}

/// Spawns `cmd` with stdout and stderr captured as [`Outputs`].
pub fn spawn_captured(cmd: &mut std::process::Command) -> (std::process::Child, Outputs) {
    use std::io::{BufRead, BufReader};
    use std::process::Stdio;
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("start strata");
    let stderr = child.stderr.take().expect("piped stderr");
    let stdout = child.stdout.take().expect("piped stdout");
    let log = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let log2 = log.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            let mut l = log2.lock().unwrap();
            l.push_str(&line);
            l.push('\n');
        }
    });
    let (tx, events) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            let v: serde_json::Value = serde_json::from_str(&line)
                .unwrap_or_else(|e| panic!("stdout line is not JSON ({e}): {line:?}"));
            let _ = tx.send(v);
        }
    });
    (child, Outputs { log, events, passed: Default::default() })
}

impl Outputs {
    /// Waits (up to `limit`) for the next announcement of `event`; returns it.
    pub fn wait_event(&self, event: &str, limit: std::time::Duration, who: &str) -> serde_json::Value {
        let deadline = std::time::Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match self.events.recv_timeout(left) {
                Ok(v) if v["event"] == event => return v,
                Ok(v) => self.passed.lock().unwrap().push(v),
                Err(_) => panic!("{who}: no {event:?} announcement within {limit:?}:\n{}", self.log()),
            }
        }
    }

    pub fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// The last announcement of `event` that `wait_event` passed over, if any.
    pub fn passed(&self, event: &str) -> Option<serde_json::Value> {
        self.passed.lock().unwrap().iter().rev().find(|v| v["event"] == event).cloned()
    }
}

/// A `strata serve` process on a free loopback port, killed when dropped.
pub struct Server {
    pub child: std::process::Child,
    pub addr: String,
    pub out: Outputs,
}

impl Server {
    /// Starts `strata serve --listen 127.0.0.1:0 ARGS…` and waits until it announces it
    /// is ready.
    pub fn start(args: &[&str]) -> Server {
        Server::start_with_env(args, &[])
    }

    /// [`Server::start`] with extra environment variables.
    pub fn start_with_env(args: &[&str], env: &[(&str, &str)]) -> Server {
        let mut server = Server::spawn_with_env(args, env);
        server.addr = server.wait_ready();
        server
    }

    /// Starts `strata serve` without waiting.
    pub fn spawn(args: &[&str]) -> Server {
        Server::spawn_with_env(args, &[])
    }

    fn spawn_with_env(args: &[&str], env: &[(&str, &str)]) -> Server {
        let mut cmd = std::process::Command::new(strata_bin());
        cmd.arg("serve")
            .args(["--listen", "127.0.0.1:0"])
            .args(args)
            // Tests run side by side: no HTTP API on the default port unless a test asks
            // for one (its flag overrides this).
            .env("STRATA_HTTP_LISTEN", "off")
            .env("RUST_LOG", "info,strata_engine::runner=debug")
            .envs(env.iter().copied());
        let (child, out) = spawn_captured(&mut cmd);
        Server { child, addr: String::new(), out }
    }

    /// Waits for the ready announcement; returns the address it serves at.
    pub fn wait_ready(&self) -> String {
        let v = self.out.wait_event("ready", std::time::Duration::from_secs(60), "strata serve");
        v["address"].as_str().expect("ready announcement names its address").to_string()
    }

    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn log(&self) -> String {
        self.out.log()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("--- strata serve log ---\n{}", self.log());
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Writes a random model bigger than the fixtures (so generations take a while) into `dir`.
pub fn write_slow_model(dir: &Path) {
    let out = std::process::Command::new(strata_bin())
        .args(["model", "random", "--arch", "llama", "--hidden", "512", "--layers", "6", "--heads", "8"])
        .args(["--kv-heads", "4", "--intermediate", "1536", "--vocab", "2048", "--out"])
        .arg(dir)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run strata model random");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

/// A greedy `Generate` request for token ids, ignoring EOS (so it yields exactly
/// `max_tokens` tokens). It opts out of the response cache: the tests that send it load
/// replicas, kill them mid-stream or fill their queues, and a repeated request must reach
/// a replica (the cache's own tests set `cache` back).
pub fn token_request(
    model: &str,
    prompt: Vec<u32>,
    max_tokens: u32,
) -> strata_proto::inference::v1::GenerateRequest {
    use strata_proto::inference::v1 as pb;
    pb::GenerateRequest {
        model: model.into(),
        prompt: Some(pb::generate_request::Prompt::TokenIds(pb::TokenIds { ids: prompt })),
        max_tokens: Some(max_tokens),
        ignore_eos: true,
        cache: Some(false),
        ..Default::default()
    }
}
