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

/// Serves the files of `root` over HTTP/1.1 GET on a loopback port; counts requests by path.
struct FileServer {
    address: String,
    requests: Arc<Mutex<HashMap<String, usize>>>,
}

impl FileServer {
    fn start(root: PathBuf) -> FileServer {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let requests: Arc<Mutex<HashMap<String, usize>>> = Default::default();
        let counted = requests.clone();
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
                let path = line.split_whitespace().nth(1).unwrap_or("/").trim_start_matches('/').to_string();
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
        FileServer { address, requests }
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
        .output()
        .unwrap()
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
