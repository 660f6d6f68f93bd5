//! A real Prometheus server for tests (Debian's `prometheus` package, which `make
//! prerequisites` installs): its own free loopback port and data directory, scraping the
//! targets a test names every second; stopped when dropped. Queries go through its HTTP
//! API (`/api/v1/query`).

use std::io::{Read, Write};
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct Prometheus {
    child: Child,
    pub address: String,
    dir: tempfile::TempDir,
}

/// The prometheus binary: `$PROMETHEUS_BIN`, or `prometheus` on the PATH.
pub fn prometheus_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("PROMETHEUS_BIN") {
        return PathBuf::from(p);
    }
    for dir in
        std::env::var_os("PATH").map(|p| std::env::split_paths(&p).collect::<Vec<_>>()).unwrap_or_default()
    {
        let c = dir.join("prometheus");
        if c.is_file() {
            return c;
        }
    }
    panic!("prometheus not found on PATH: run `make prerequisites` (installs Debian's prometheus) or set PROMETHEUS_BIN");
}

/// `GET path` over HTTP/1.0 (no chunked encoding to undo): the status code and the body.
pub fn http_get(address: &str, path: &str) -> std::io::Result<(u16, String)> {
    let mut s = std::net::TcpStream::connect(address)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {address}\r\n\r\n")?;
    let mut raw = String::new();
    s.read_to_string(&mut raw)?;
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    let status = head.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    Ok((status, body.to_string()))
}

/// `s` percent-encoded for a URL query value.
pub fn url_encode(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => out.push(b as char),
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

impl Prometheus {
    /// Starts Prometheus scraping `jobs` (job name, targets) every second.
    pub fn start(jobs: &[(&str, Vec<String>)]) -> Prometheus {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut config =
            String::from("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n");
        for (job, targets) in jobs {
            let targets: Vec<String> = targets.iter().map(|t| format!("\"{t}\"")).collect();
            config.push_str(&format!(
                "  - job_name: {job}\n    static_configs:\n      - targets: [{}]\n",
                targets.join(", ")
            ));
        }
        let config_path = dir.path().join("prometheus.yml");
        std::fs::write(&config_path, config).expect("write prometheus.yml");
        // Prometheus cannot take a listener handed over: find a free port, then start; a
        // start that loses the port to another process is retried on a new one.
        for _ in 0..5 {
            let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
            let address = format!("127.0.0.1:{port}");
            let mut child = Command::new(prometheus_bin())
                .arg(format!("--config.file={}", config_path.display()))
                .arg(format!("--storage.tsdb.path={}", dir.path().join("data").display()))
                .arg(format!("--web.listen-address={address}"))
                .arg("--log.level=warn")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("start prometheus");
            let deadline = Instant::now() + Duration::from_secs(30);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    break; // exited: most likely the port was taken
                }
                if matches!(http_get(&address, "/-/ready"), Ok((200, _))) {
                    return Prometheus { child, address, dir };
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        panic!("prometheus did not become ready (data in {})", dir.path().display());
    }

    /// An instant query's result: Err with Prometheus's message when it refuses the
    /// expression, else the result vector (possibly empty).
    pub fn query(&self, expr: &str) -> Result<Vec<serde_json::Value>, String> {
        let (status, body) = http_get(&self.address, &format!("/api/v1/query?query={}", url_encode(expr)))
            .map_err(|e| format!("querying prometheus: {e}"))?;
        let v: serde_json::Value =
            serde_json::from_str(&body).map_err(|e| format!("HTTP {status}, not JSON ({e}): {body}"))?;
        if v["status"] != "success" {
            return Err(format!("{expr}: {}", v["error"]));
        }
        Ok(v["data"]["result"].as_array().cloned().unwrap_or_default())
    }

    /// The single value an expression that yields one sample evaluates to, if it does.
    pub fn scalar(&self, expr: &str) -> Option<f64> {
        let r = self.query(expr).ok()?;
        let [one] = r.as_slice() else { return None };
        one["value"][1].as_str()?.parse().ok()
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = &self.dir;
    }
}
