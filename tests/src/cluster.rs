//! Real cluster processes for tests: `strata coordinator` and `strata worker --etcd`
//! against a real etcd, each on free loopback ports, logs captured, killed when dropped.

use std::process::{Child, Command};
use std::time::{Duration, Instant};

use crate::etcd::Etcd;
use crate::{spawn_captured, strata_bin, Outputs};

/// A `strata` process: its log captured for people, its announcements for the test.
pub struct Proc {
    pub name: String,
    pub child: Child,
    out: Outputs,
    /// The address it announced when ready.
    pub addr: String,
}

impl Proc {
    /// Starts `strata ARGS…` and waits for its ready announcement.
    pub fn start(name: &str, args: &[String], cwd: Option<&std::path::Path>) -> Proc {
        let mut cmd = Command::new(strata_bin());
        cmd.args(args).env("RUST_LOG", "info,strata_engine::runner=debug");
        if let Some(d) = cwd {
            cmd.current_dir(d);
        }
        let (child, out) = spawn_captured(&mut cmd);
        let ready = out.wait_event("ready", Duration::from_secs(60), name);
        let addr = ready["address"].as_str().expect("ready announcement names its address").to_string();
        Proc { name: name.to_string(), child, out, addr }
    }

    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn log(&self) -> String {
        self.out.log()
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

    /// Index of the leader coordinator: the one every live coordinator's admin API names.
    pub async fn leader(&self, limit: Duration) -> usize {
        use strata_proto::admin::v1 as apb;
        use strata_proto::admin::v1::admin_client::AdminClient;
        eventually("one leader every coordinator agrees on", limit, || async {
            let mut named = Vec::new();
            for c in &self.coordinators {
                let Ok(mut admin) = AdminClient::connect(c.endpoint()).await else { continue };
                let Ok(r) = admin.get_leader(apb::GetLeaderRequest {}).await else { continue };
                named.push(r.into_inner().leader_id);
            }
            let first = named.first()?.clone();
            if first.is_empty() || named.iter().any(|n| *n != first) {
                return None;
            }
            let index: usize = first.strip_prefix('c')?.parse().ok()?;
            (index < self.coordinators.len()).then_some(index)
        })
        .await
    }

    /// A worker's own status over worker.v1 (shard loads, sequences served).
    pub async fn worker_status(&self, id: &str) -> strata_proto::worker::v1::StatusResponse {
        use strata_proto::worker::v1::worker_client::WorkerClient;
        let mut c = WorkerClient::connect(self.worker(id).endpoint()).await.expect("connect to the worker");
        c.status(strata_proto::worker::v1::StatusRequest {}).await.expect("worker status").into_inner()
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
