//! Real cluster processes for tests: `strata coordinator` and `strata worker --etcd`
//! against a real etcd, each on free loopback ports, logs captured, killed when dropped.
//!
//! Clusters run with mutual TLS, as production does: each test cluster gets its own CA
//! and per-role certificates from `strata cert dev`.

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
    /// Where it serves GET /metrics, as it announced before ready.
    pub metrics: Option<String>,
}

impl Proc {
    /// Starts `strata ARGS…` (with `env` added to its environment) and waits for its
    /// ready announcement.
    pub fn start(
        name: &str,
        args: &[String],
        cwd: Option<&std::path::Path>,
        env: &[(String, String)],
    ) -> Proc {
        let mut cmd = Command::new(strata_bin());
        cmd.args(args).env("RUST_LOG", "info,strata_engine::runner=debug");
        cmd.envs(env.iter().map(|(k, v)| (k, v)));
        if let Some(d) = cwd {
            cmd.current_dir(d);
        }
        let (child, out) = spawn_captured(&mut cmd);
        let ready = out.wait_event("ready", Duration::from_secs(60), name);
        let addr = ready["address"].as_str().expect("ready announcement names its address").to_string();
        let metrics = out.passed("metrics").and_then(|m| m["address"].as_str().map(str::to_string));
        Proc { name: name.to_string(), child, out, addr, metrics }
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

/// A CA and one certificate per role, made by `strata cert dev`.
pub struct Certs {
    pub dir: tempfile::TempDir,
}

impl Certs {
    pub fn new() -> Certs {
        let dir = tempfile::tempdir().expect("temp dir");
        let out = Command::new(strata_bin())
            .args(["cert", "dev", "--out"])
            .arg(dir.path())
            .output()
            .expect("run strata cert dev");
        assert!(out.status.success(), "strata cert dev: {}", String::from_utf8_lossy(&out.stderr));
        Certs { dir }
    }

    pub fn path(&self, file: &str) -> String {
        self.dir.path().join(file).to_string_lossy().to_string()
    }

    /// The flags giving a process of `role` ("coordinator" or "worker") its credentials.
    pub fn flags(&self, role: &str) -> Vec<String> {
        vec![
            "--cluster-cert".into(),
            self.path(&format!("{role}.crt")),
            "--cluster-key".into(),
            self.path(&format!("{role}.key")),
            "--cluster-ca".into(),
            self.path("ca.crt"),
        ]
    }

    /// A worker.v1 channel to `address` presenting the certificate of `role` and
    /// expecting a worker.
    pub async fn channel(&self, address: &str, role: &str) -> Result<tonic::transport::Channel, String> {
        use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};
        let read = |f: &str| std::fs::read(self.path(f)).expect("read a certificate file");
        let tls = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(read("ca.crt")))
            .identity(Identity::from_pem(read(&format!("{role}.crt")), read(&format!("{role}.key"))))
            .domain_name("strata-worker");
        let endpoint = Endpoint::from_shared(format!("https://{address}"))
            .map_err(|e| e.to_string())?
            .tls_config(tls)
            .map_err(|e| e.to_string())?;
        endpoint.connect().await.map_err(|e| format!("{e:?}"))
    }
}

impl Default for Certs {
    fn default() -> Self {
        Self::new()
    }
}

/// etcd, coordinators and workers of one test.
pub struct Cluster {
    pub etcd: Etcd,
    pub certs: Certs,
    /// Whether processes get their cluster credentials (true unless started plain).
    pub tls: bool,
    /// Extra flags of every coordinator, and of every worker, started from now on.
    pub coordinator_flags: Vec<String>,
    pub worker_flags: Vec<String>,
    /// Environment variables of every process started from now on.
    pub env: Vec<(String, String)>,
    pub coordinators: Vec<Proc>,
    pub workers: Vec<Proc>,
    pub timing: Timing,
    pub prefix: String,
}

impl Cluster {
    pub fn start(coordinators: usize, workers: usize, timing: Timing) -> Cluster {
        Cluster::start_on(Etcd::start(), coordinators, workers, timing)
    }

    /// A cluster whose processes have `env` added to their environment.
    pub fn start_with_env(
        coordinators: usize,
        workers: usize,
        timing: Timing,
        env: &[(&str, &str)],
    ) -> Cluster {
        let mut c = Cluster::start_on(Etcd::start(), 0, 0, timing);
        c.env = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        for _ in 0..coordinators {
            c.add_coordinator(&[]);
        }
        for _ in 0..workers {
            c.add_worker(&[], None);
        }
        c
    }

    /// A cluster on an etcd the test started (a secured one, say).
    pub fn start_on(etcd: Etcd, coordinators: usize, workers: usize, timing: Timing) -> Cluster {
        let mut c = Cluster {
            etcd,
            coordinator_flags: Vec::new(),
            worker_flags: Vec::new(),
            env: Vec::new(),
            certs: Certs::new(),
            tls: std::env::var("STRATA_TEST_PLAIN_CLUSTER").is_err(),
            coordinators: Vec::new(),
            workers: Vec::new(),
            timing,
            prefix: "/strata".into(),
        };
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
        if self.tls {
            args.extend(self.certs.flags("coordinator"));
        }
        args.extend(self.coordinator_flags.iter().cloned());
        args.extend(extra.iter().map(|s| s.to_string()));
        self.coordinators.push(Proc::start(&format!("coordinator c{n}"), &args, None, &self.env));
        self.coordinators.last().unwrap()
    }

    /// Starts worker `w<N>`; `cwd` sets its working directory (relative model paths).
    pub fn add_worker(&mut self, extra: &[&str], cwd: Option<&std::path::Path>) -> &Proc {
        let n = self.workers.len();
        let mut args = vec!["worker".to_string(), "--listen".into(), "127.0.0.1:0".into()];
        args.extend(self.common());
        args.extend(["--id".into(), format!("w{n}"), "--kv-cache-memory".into(), "64MiB".into()]);
        if self.tls {
            args.extend(self.certs.flags("worker"));
        }
        args.extend(self.worker_flags.iter().cloned());
        args.extend(extra.iter().map(|s| s.to_string()));
        self.workers.push(Proc::start(&format!("worker w{n}"), &args, cwd, &self.env));
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

    /// Deploys `name` from `dir` as `replicas` replicas of `tp` ranks through the first
    /// coordinator, and waits until every replica is ready and the coordinator routes to
    /// the model.
    pub async fn deploy_ready(&self, name: &str, dir: &str, tp: u32, replicas: u32, limit: Duration) {
        use strata_proto::admin::v1 as apb;
        use strata_proto::admin::v1::admin_client::AdminClient;
        use strata_proto::inference::v1 as ipb;
        use strata_proto::inference::v1::inference_client::InferenceClient;
        let endpoint = self.coordinators[0].endpoint();
        let mut admin = AdminClient::connect(endpoint.clone()).await.expect("connect admin");
        let req = apb::DeployModelRequest {
            name: name.into(),
            model_dir: dir.into(),
            tp,
            pp: 1,
            replicas,
            ..Default::default()
        };
        admin.deploy_model(req).await.expect("deploy");
        eventually(&format!("{replicas} ready replicas of {name}"), limit, || {
            let (mut admin, endpoint) = (admin.clone(), endpoint.clone());
            async move {
                let rs = admin.list_replicas(apb::ListReplicasRequest { name: name.into() }).await.ok()?;
                let ready = rs
                    .into_inner()
                    .replicas
                    .iter()
                    .filter(|r| r.state == apb::ReplicaState::Ready as i32)
                    .count();
                let mut c = InferenceClient::connect(endpoint).await.ok()?;
                let models = c.list_models(ipb::ListModelsRequest {}).await.ok()?.into_inner().models;
                (ready == replicas as usize && models.iter().any(|m| m.name == name)).then_some(())
            }
        })
        .await;
    }

    /// A worker.v1 channel to worker `id`, as a coordinator.
    pub async fn worker_channel(&self, id: &str) -> tonic::transport::Channel {
        self.channel(&self.worker(id).addr).await
    }

    /// A worker.v1 channel to the worker at `address`, as a coordinator.
    pub async fn channel(&self, address: &str) -> tonic::transport::Channel {
        if !self.tls {
            let endpoint = format!("http://{address}");
            return tonic::transport::Endpoint::from_shared(endpoint)
                .unwrap()
                .connect()
                .await
                .expect("connect");
        }
        self.certs.channel(address, "coordinator").await.expect("connect to the worker")
    }

    /// A worker's own status over worker.v1 (shard loads, sequences served).
    pub async fn worker_status(&self, id: &str) -> strata_proto::worker::v1::StatusResponse {
        use strata_proto::worker::v1::worker_client::WorkerClient;
        let mut c = WorkerClient::new(self.worker_channel(id).await);
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
