//! A real etcd server for tests: its own free loopback ports and a temporary data
//! directory, stopped when dropped. It can be stopped and started again on the same ports
//! and data (an etcd outage).

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct Etcd {
    child: Option<Child>,
    pub client_port: u16,
    peer_port: u16,
    /// Plain-HTTP port of /health and /metrics (the client port may be TLS).
    metrics_port: u16,
    dir: tempfile::TempDir,
    /// Server certificate, key and the CA clients must present certificates from.
    tls: Option<(PathBuf, PathBuf, PathBuf)>,
}

/// The etcd binary: `$ETCD_BIN`, or `etcd` on the PATH (`make prerequisites` installs it).
pub fn etcd_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("ETCD_BIN") {
        return PathBuf::from(p);
    }
    for dir in
        std::env::var_os("PATH").map(|p| std::env::split_paths(&p).collect::<Vec<_>>()).unwrap_or_default()
    {
        let c = dir.join("etcd");
        if c.is_file() {
            return c;
        }
    }
    panic!(
        "etcd not found on PATH: run `make prerequisites` (installs Debian's etcd-server) or set ETCD_BIN"
    );
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").expect("bind a free port").local_addr().unwrap().port()
}

impl Etcd {
    /// Starts etcd on free ports. etcd cannot take a listener handed over, so its ports are
    /// found by binding port 0 and closing it; another process may take one in between, so
    /// a start that fails is retried on new ports.
    pub fn start() -> Etcd {
        Etcd::start_with(None)
    }

    /// etcd serving clients over TLS with `cert`/`key`, and requiring a client certificate
    /// from `ca` (`--client-cert-auth`).
    pub fn start_tls(cert: PathBuf, key: PathBuf, ca: PathBuf) -> Etcd {
        Etcd::start_with(Some((cert, key, ca)))
    }

    fn start_with(tls: Option<(PathBuf, PathBuf, PathBuf)>) -> Etcd {
        let mut last = String::new();
        for _ in 0..3 {
            let mut e = Etcd {
                child: None,
                client_port: free_port(),
                peer_port: free_port(),
                metrics_port: free_port(),
                dir: tempfile::tempdir().expect("temporary etcd data directory"),
                tls: tls.clone(),
            };
            match e.try_resume() {
                Ok(()) => return e,
                Err(why) => last = why,
            }
        }
        panic!("etcd did not start on free ports three times: {last}");
    }

    pub fn endpoint(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.client_port)
    }

    /// Kills the server (SIGKILL): an outage.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts the server again on the same ports and data, and waits until it answers.
    pub fn resume(&mut self) {
        if let Err(why) = self.try_resume() {
            panic!("{why}");
        }
    }

    fn try_resume(&mut self) -> Result<(), String> {
        assert!(self.child.is_none(), "etcd is already running");
        let client = self.endpoint();
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let metrics = format!("http://127.0.0.1:{}", self.metrics_port);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("etcd.log"))
            .expect("etcd log file");
        let mut cmd = Command::new(etcd_bin());
        if let Some((cert, key, ca)) = &self.tls {
            cmd.arg("--cert-file").arg(cert).arg("--key-file").arg(key);
            cmd.arg("--trusted-ca-file").arg(ca).arg("--client-cert-auth");
        }
        let child = cmd
            .args(["--name", "strata-test", "--data-dir"])
            .arg(self.dir.path().join("data"))
            .args(["--listen-client-urls", &client, "--advertise-client-urls", &client])
            .args(["--listen-metrics-urls", &metrics])
            .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("strata-test={peer}")])
            .args(["--log-level", "warn"])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start etcd");
        self.child = Some(child);
        self.wait_healthy(Duration::from_secs(20))
    }

    fn wait_healthy(&mut self, limit: Duration) -> Result<(), String> {
        use std::io::{Read, Write};
        let deadline = Instant::now() + limit;
        loop {
            if let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", self.metrics_port)) {
                let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
                let _ = s.write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
                let mut body = String::new();
                let _ = s.read_to_string(&mut body);
                if body.contains("\"health\":\"true\"") {
                    return Ok(());
                }
            }
            if let Some(Ok(Some(status))) = self.child.as_mut().map(|c| c.try_wait()) {
                self.child = None;
                return Err(format!("etcd exited ({status}): {}", self.log()));
            }
            if Instant::now() >= deadline {
                return Err(format!("etcd did not become healthy: {}", self.log()));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("etcd.log")).unwrap_or_default()
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.stop();
    }
}
