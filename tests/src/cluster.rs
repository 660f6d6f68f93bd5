//! Real cluster processes for tests: `strata coordinator` and `strata worker --etcd`
//! against a real etcd, each on free loopback ports, logs captured, killed when dropped.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::etcd::Etcd;
use crate::strata_bin;

/// A `strata` process whose stderr is captured line by line.
pub struct Proc {
    pub name: String,
    pub child: Child,
    log: Arc<Mutex<String>>,
    lines: Mutex<Receiver<String>>,
    /// The address from its "listening on" line.
    pub addr: String,
}

impl Proc {
    /// Starts `strata ARGS…` and waits for its "ready, listening on" line.
    pub fn start(name: &str, args: &[String], cwd: Option<&std::path::Path>) -> Proc {
        let mut cmd = Command::new(strata_bin());
        cmd.args(args)
            .env("RUST_LOG", "info,strata_engine::runner=debug")
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        if let Some(d) = cwd {
            cmd.current_dir(d);
        }
        let mut child = cmd.spawn().unwrap_or_else(|e| panic!("start {name}: {e}"));
        let stderr = child.stderr.take().expect("piped stderr");
        let log = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let log2 = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                let _ = tx.send(line.clone());
                let mut l = log2.lock().unwrap();
                l.push_str(&line);
                l.push('\n');
            }
        });
        let mut p = Proc { name: name.to_string(), child, log, lines: Mutex::new(rx), addr: String::new() };
        p.addr = p.wait_for("ready, listening on ", Duration::from_secs(60));
        p
    }

    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// Waits for a new log line containing `marker`; returns the word after it.
    pub fn wait_for(&self, marker: &str, limit: Duration) -> String {
        let deadline = Instant::now() + limit;
        let rx = self.lines.lock().unwrap();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(line) => {
                    if let Some(i) = line.find(marker) {
                        return line[i + marker.len()..].split_whitespace().next().unwrap_or("").to_string();
                    }
                }
                Err(_) => panic!("{}: no line with {marker:?} within {limit:?}:\n{}", self.name, self.log()),
            }
        }
    }

    /// Whether any log line so far contains `marker`.
    pub fn logged(&self, marker: &str) -> bool {
        self.log().contains(marker)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL, and reap.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Sends a signal by name (STOP, CONT, TERM).
    pub fn signal(&self, sig: &str) {
        let ok = Command::new("kill").arg(format!("-{sig}")).arg(self.pid().to_string()).status().unwrap();
        assert!(ok.success(), "kill -{sig} {}", self.pid());
    }

    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("--- {} log ---\n{}", self.name, self.log());
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Timings of a test cluster: short, so failures show within seconds.
#[derive(Debug, Clone)]
pub struct Timing {
    pub lease_ttl: f64,
    pub canary_interval: f64,
    pub canary_timeout: f64,
}

impl Default for Timing {
    fn default() -> Self {
        Timing { lease_ttl: 2.0, canary_interval: 0.5, canary_timeout: 3.0 }
    }
}

/// etcd, coordinators and workers of one test.
pub struct Cluster {
    pub etcd: Etcd,
    pub coordinators: Vec<Proc>,
    pub workers: Vec<Proc>,
    pub timing: Timing,
    pub prefix: String,
}

impl Cluster {
    pub fn start(coordinators: usize, workers: usize, timing: Timing) -> Cluster {
        let etcd = Etcd::start();
        let mut c =
            Cluster { etcd, coordinators: Vec::new(), workers: Vec::new(), timing, prefix: "/strata".into() };
        for _ in 0..coordinators {
            c.add_coordinator(&[]);
        }
        for _ in 0..workers {
            c.add_worker(&[], None);
        }
        c
    }

    fn common(&self) -> Vec<String> {
        vec![
            "--etcd".into(),
            self.etcd.endpoint(),
            "--prefix".into(),
            self.prefix.clone(),
            "--lease-ttl".into(),
            self.timing.lease_ttl.to_string(),
        ]
    }

    pub fn add_coordinator(&mut self, extra: &[&str]) -> &Proc {
        let n = self.coordinators.len();
        let mut args = vec!["coordinator".to_string(), "--listen".into(), "127.0.0.1:0".into()];
        args.extend(self.common());
        args.extend(["--id".into(), format!("c{n}")]);
        args.extend(["--canary-interval".into(), self.timing.canary_interval.to_string()]);
        args.extend(["--canary-timeout".into(), self.timing.canary_timeout.to_string()]);
        args.extend(["--failed-retention".into(), "3".into(), "--route-wait".into(), "30".into()]);
        args.extend(extra.iter().map(|s| s.to_string()));
        self.coordinators.push(Proc::start(&format!("coordinator c{n}"), &args, None));
        self.coordinators.last().unwrap()
    }

    /// Starts worker `w<N>`; `cwd` sets its working directory (relative model paths).
    pub fn add_worker(&mut self, extra: &[&str], cwd: Option<&std::path::Path>) -> &Proc {
        let n = self.workers.len();
        let mut args = vec!["worker".to_string(), "--listen".into(), "127.0.0.1:0".into()];
        args.extend(self.common());
        args.extend(["--id".into(), format!("w{n}"), "--kv-cache-memory".into(), "64MiB".into()]);
        args.extend(extra.iter().map(|s| s.to_string()));
        self.workers.push(Proc::start(&format!("worker w{n}"), &args, cwd));
        self.workers.last().unwrap()
    }

    pub fn worker(&self, id: &str) -> &Proc {
        self.workers
            .iter()
            .find(|w| w.name == format!("worker {id}"))
            .unwrap_or_else(|| panic!("no worker {id}"))
    }

    pub fn worker_mut(&mut self, id: &str) -> &mut Proc {
        self.workers
            .iter_mut()
            .find(|w| w.name == format!("worker {id}"))
            .unwrap_or_else(|| panic!("no worker {id}"))
    }

    /// Index of the coordinator that logged its election last (the current leader).
    pub fn leader(&self, limit: Duration) -> usize {
        let deadline = Instant::now() + limit;
        loop {
            let leaders: Vec<usize> = self
                .coordinators
                .iter()
                .enumerate()
                .filter(|(_, c)| {
                    let log = c.log();
                    let won = log.rfind("elected leader");
                    let lost = log.rfind("no longer the leader");
                    won.is_some() && (lost.is_none() || lost < won)
                })
                .map(|(i, _)| i)
                .collect();
            if leaders.len() == 1 {
                return leaders[0];
            }
            assert!(Instant::now() < deadline, "no single leader among coordinators: {leaders:?}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// Polls `f` until it returns Some, up to `limit`.
pub async fn eventually<T, F, Fut>(what: &str, limit: Duration, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + limit;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out after {limit:?} waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
