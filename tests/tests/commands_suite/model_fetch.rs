//! `strata model fetch` against a local HTTP server (a few lines of std here, serving a
//! directory as any web server or S3-compatible store would): the fixture model arrives
//! whole and loads; a second run fetches nothing it has; a file whose bytes do not match
//! the manifest fails the fetch, naming it, and leaves nothing under its name; a manifest
//! naming a path outside the directory is refused.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use sha2::{Digest, Sha256};
use strata_tests::{fixtures_dir, strata_bin};

/// Serves the files of `root` over HTTP/1.1 GET on a loopback port; counts requests by path
/// and keeps their query strings.
struct FileServer {
    address: String,
    requests: Arc<Mutex<HashMap<String, usize>>>,
    queries: Arc<Mutex<Vec<String>>>,
}

impl FileServer {
    fn start(root: PathBuf) -> FileServer {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let requests: Arc<Mutex<HashMap<String, usize>>> = Default::default();
        let queries: Arc<Mutex<Vec<String>>> = Default::default();
        let (counted, queried) = (requests.clone(), queries.clone());
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { continue };
                let mut line = String::new();
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                if reader.read_line(&mut line).is_err() {
                    continue;
                }
                // Skip the headers.
                let mut header = String::new();
                while reader.read_line(&mut header).is_ok_and(|n| n > 2) {
                    header.clear();
                }
                let target = line.split_whitespace().nth(1).unwrap_or("/");
                let (path, query) = target.split_once('?').unwrap_or((target, ""));
                let path = path.trim_start_matches('/').to_string();
                queried.lock().unwrap().push(query.to_string());
                *counted.lock().unwrap().entry(path.clone()).or_default() += 1;
                let reply = match std::fs::read(root.join(&path)) {
                    Ok(body) => {
                        let head = format!(
                            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                            body.len()
                        );
                        [head.into_bytes(), body].concat()
                    }
                    Err(_) => {
                        b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".to_vec()
                    }
                };
                let _ = stream.write_all(&reply);
            }
        });
        FileServer { address, requests, queries }
    }

    fn count(&self, path: &str) -> usize {
        self.requests.lock().unwrap().get(path).copied().unwrap_or(0)
    }
}

/// The fixture model under `root/name`, with its SHA256SUMS.
fn publish(root: &Path, name: &str) -> Vec<String> {
    let dir = root.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    let mut files = Vec::new();
    let mut sums = String::new();
    for f in ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"] {
        let bytes = std::fs::read(fixtures_dir().join("llama_gqa").join(f)).unwrap();
        let sum: String = Sha256::digest(&bytes).iter().map(|b| format!("{b:02x}")).collect();
        sums.push_str(&format!("{sum}  {f}\n"));
        std::fs::write(dir.join(f), bytes).unwrap();
        files.push(f.to_string());
    }
    std::fs::write(dir.join("SHA256SUMS"), sums).unwrap();
    files
}

fn fetch(url: &str, out: &Path) -> std::process::Output {
    std::process::Command::new(strata_bin())
        .args(["model", "fetch", "--url", url, "--out", out.to_str().unwrap()])
        .env("RUST_LOG", "warn")
        .env_remove("AWS_ENDPOINT_URL")
        .env_remove("AWS_ENDPOINT_URL_S3")
        .output()
        .unwrap()
}

/// `s3://BUCKET/PREFIX` from an S3-compatible endpoint (buckets by path): every request is
/// a SigV4-signed URL for the AWS_* credentials and region, and the files arrive whole.
#[test]
fn an_s3_bucket_is_fetched_with_signed_requests() {
    let served = tempfile::tempdir().unwrap();
    let files = publish(&served.path().join("models-bucket"), "llama");
    let server = FileServer::start(served.path().to_path_buf());
    let out = tempfile::tempdir().unwrap();
    let run = std::process::Command::new(strata_bin())
        .args(["model", "fetch", "--url", "s3://models-bucket/llama", "--out", out.path().to_str().unwrap()])
        .env("AWS_ENDPOINT_URL", format!("http://{}", server.address))
        .env("AWS_ACCESS_KEY_ID", "AKIDSTRATATEST")
        .env("AWS_SECRET_ACCESS_KEY", "not-a-real-secret")
        .env("AWS_REGION", "eu-west-1")
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    for f in &files {
        let want = std::fs::read(served.path().join("models-bucket/llama").join(f)).unwrap();
        assert_eq!(std::fs::read(out.path().join(f)).unwrap(), want, "{f}");
    }
    let queries = server.queries.lock().unwrap().clone();
    assert_eq!(queries.len(), files.len() + 1, "the manifest and each file: {queries:?}");
    for q in &queries {
        assert!(q.contains("X-Amz-Algorithm=AWS4-HMAC-SHA256"), "{q}");
        assert!(
            q.contains("X-Amz-Credential=AKIDSTRATATEST%2F")
                && q.contains("%2Feu-west-1%2Fs3%2Faws4_request"),
            "{q}"
        );
        assert!(q.contains("X-Amz-Signature="), "{q}");
    }
    // A missing object names the object, not the signed URL (a credential while it lasts).
    let missing = std::process::Command::new(strata_bin())
        .args([
            "model",
            "fetch",
            "--url",
            "s3://models-bucket/nothing",
            "--out",
            out.path().join("n").to_str().unwrap(),
        ])
        .env("AWS_ENDPOINT_URL", format!("http://{}", server.address))
        .env("AWS_ACCESS_KEY_ID", "AKIDSTRATATEST")
        .env("AWS_SECRET_ACCESS_KEY", "not-a-real-secret")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&missing.stderr);
    assert!(
        !missing.status.success() && stderr.contains("s3://models-bucket/nothing/SHA256SUMS"),
        "{stderr}"
    );
    assert!(!stderr.contains("X-Amz-Signature"), "{stderr}");
}

#[test]
fn a_model_directory_is_fetched_checked_and_loads() {
    let served = tempfile::tempdir().unwrap();
    let files = publish(served.path(), "llama");
    let server = FileServer::start(served.path().to_path_buf());
    let out = tempfile::tempdir().unwrap();
    let dir = out.path().join("llama");
    let url = format!("http://{}/llama", server.address);
    let run = fetch(&url, &dir);
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    for f in &files {
        assert_eq!(
            std::fs::read(dir.join(f)).unwrap(),
            std::fs::read(served.path().join("llama").join(f)).unwrap(),
            "{f}"
        );
    }
    // What arrived is a model: it generates.
    let generated = std::process::Command::new(strata_bin())
        .args(["generate", "--model", dir.to_str().unwrap(), "--prompt-ids", "1,2,3", "--max-tokens", "2"])
        .output()
        .unwrap();
    assert!(generated.status.success(), "{}", String::from_utf8_lossy(&generated.stderr));
    // Again: only the manifest is fetched.
    let again = fetch(&url, &dir);
    assert!(again.status.success());
    assert_eq!(server.count("llama/SHA256SUMS"), 2);
    for f in &files {
        assert_eq!(server.count(&format!("llama/{f}")), 1, "{f} fetched again");
    }
}

#[test]
fn a_file_that_does_not_match_its_sum_fails_the_fetch_and_leaves_nothing() {
    let served = tempfile::tempdir().unwrap();
    publish(served.path(), "llama");
    // The weights change after the manifest was written.
    let weights = served.path().join("llama/model.safetensors");
    let mut bytes = std::fs::read(&weights).unwrap();
    bytes[100] ^= 1;
    std::fs::write(&weights, bytes).unwrap();
    let server = FileServer::start(served.path().to_path_buf());
    let out = tempfile::tempdir().unwrap();
    let run = fetch(&format!("http://{}/llama", server.address), out.path());
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success());
    assert!(stderr.contains("model.safetensors") && stderr.contains("sha256"), "{stderr}");
    let left: Vec<String> = std::fs::read_dir(out.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(!left.iter().any(|n| n.contains("model.safetensors")), "{left:?}");

    // A manifest naming a file outside the directory is refused before anything is fetched.
    std::fs::write(
        served.path().join("llama/SHA256SUMS"),
        "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855  ../escape\n",
    )
    .unwrap();
    let run = fetch(&format!("http://{}/llama", server.address), &out.path().join("x"));
    assert!(!run.status.success());
    assert!(String::from_utf8_lossy(&run.stderr).contains("leaves the directory"));
    assert_eq!(server.count("escape"), 0);
}

/// A server that accepts and then sends nothing (or stops mid-file) fails the fetch after
/// `--read-timeout`, instead of hanging it for as long as the server likes.
#[test]
fn a_stalled_server_fails_the_fetch_in_time() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let held = std::thread::spawn(move || {
        // Read the request, answer nothing; hold the connection until the client leaves.
        let (mut s, _) = listener.accept().unwrap();
        let mut buf = [0u8; 4096];
        while matches!(std::io::Read::read(&mut s, &mut buf), Ok(n) if n > 0) {}
    });
    let out = tempfile::tempdir().unwrap();
    let started = std::time::Instant::now();
    let run = std::process::Command::new(strata_bin())
        .args(["model", "fetch", "--url", &format!("http://{addr}/m/"), "--read-timeout", "1"])
        .args(["--out", out.path().join("m").to_str().unwrap()])
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    let e = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success(), "{e}");
    assert!(e.to_lowercase().contains("timeout") || e.to_lowercase().contains("timed out"), "{e}");
    assert!(started.elapsed() < std::time::Duration::from_secs(20), "took {:?}", started.elapsed());
    held.join().unwrap();
}
