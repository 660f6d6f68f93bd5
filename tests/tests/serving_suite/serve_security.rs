//! The front door: API keys (also as SHA-256 hashes) rotated from a key file on SIGHUP
//! without a restart, and TLS for callers, with client certificates when asked.

use std::time::Duration;

use strata_proto::inference::v1 as pb;
use strata_proto::inference::v1::inference_client::InferenceClient;
use strata_tests::cluster::Certs;
use strata_tests::{fixtures_dir, token_request, Server};
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};
use tonic::Code;

fn gqa() -> String {
    fixtures_dir().join("llama_gqa").to_string_lossy().to_string()
}

fn sha256_hex(text: &str) -> String {
    let out = std::process::Command::new("sha256sum")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            use std::io::Write;
            c.stdin.take().unwrap().write_all(text.as_bytes())?;
            c.wait_with_output()
        })
        .expect("sha256sum");
    String::from_utf8(out.stdout).unwrap().split_whitespace().next().unwrap().to_string()
}

async fn generate_with(endpoint: &str, key: &str) -> Result<(), Code> {
    let mut c = InferenceClient::connect(endpoint.to_string()).await.unwrap();
    let mut req = tonic::Request::new(token_request("m", vec![1, 2, 3], 2));
    req.metadata_mut().insert("authorization", format!("Bearer {key}").parse().unwrap());
    c.generate(req).await.map(|_| ()).map_err(|s| s.code())
}

#[tokio::test(flavor = "multi_thread")]
async fn api_keys_rotate_from_a_key_file_on_sighup() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("keys");
    std::fs::write(&file, "# the first key\nkey-one\n").unwrap();
    let server =
        Server::start(&["--model", &gqa(), "--name", "m", "--api-key-file", &file.to_string_lossy()]);
    let ep = server.endpoint();
    assert_eq!(generate_with(&ep, "key-one").await, Ok(()));
    assert_eq!(generate_with(&ep, "key-two").await, Err(Code::Unauthenticated));
    // Rotate: the file now holds only the hash of the second key.
    std::fs::write(&file, format!("sha256:{}\n", sha256_hex("key-two"))).unwrap();
    let hup =
        std::process::Command::new("kill").args(["-HUP", &server.child.id().to_string()]).status().unwrap();
    assert!(hup.success());
    server.out.wait_event("keys_reloaded", Duration::from_secs(10), "strata serve");
    assert_eq!(generate_with(&ep, "key-two").await, Ok(()));
    assert_eq!(generate_with(&ep, "key-one").await, Err(Code::Unauthenticated), "rotated out");
    // A broken file keeps the keys that work.
    std::fs::write(&file, "sha256:not-hex\n").unwrap();
    let _ = std::process::Command::new("kill").args(["-HUP", &server.child.id().to_string()]).status();
    assert_eq!(generate_with(&ep, "key-two").await, Ok(()));
}

/// A generation over TLS trusting `certs`' CA, presenting `present` (a role's certificate
/// from `issued`) if given.
async fn tls_call(addr: &str, certs: &Certs, present: Option<(&Certs, &str)>) -> Result<usize, String> {
    let ca = std::fs::read(certs.path("ca.crt")).unwrap();
    let mut tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca)).domain_name("localhost");
    if let Some((issued, role)) = present {
        let read = |f: String| std::fs::read(issued.path(&f)).unwrap();
        tls = tls.identity(Identity::from_pem(read(format!("{role}.crt")), read(format!("{role}.key"))));
    }
    let channel = Endpoint::from_shared(format!("https://{addr}"))
        .unwrap()
        .tls_config(tls)
        .unwrap()
        .connect()
        .await
        .map_err(|e| format!("{e:?}"))?;
    let mut c = InferenceClient::new(channel);
    let r = c.generate(token_request("m", vec![1, 2, 3], 3)).await.map_err(|s| format!("{s:?}"))?;
    Ok(r.into_inner().token_ids.len())
}

#[tokio::test(flavor = "multi_thread")]
async fn callers_can_be_required_to_use_tls_and_client_certificates() {
    let certs = Certs::new();
    let (crt, key, ca) = (certs.path("coordinator.crt"), certs.path("coordinator.key"), certs.path("ca.crt"));
    let tls_only = Server::start(&["--model", &gqa(), "--name", "m", "--tls-cert", &crt, "--tls-key", &key]);
    assert_eq!(tls_call(&tls_only.addr, &certs, None).await, Ok(3));
    let mut plain = InferenceClient::connect(tls_only.endpoint()).await.unwrap();
    let plaintext = plain.list_models(pb::ListModelsRequest {}).await;
    assert!(plaintext.is_err(), "a plaintext call to a TLS server: {plaintext:?}");

    let mutual = Server::start(&[
        "--model",
        &gqa(),
        "--name",
        "m",
        "--tls-cert",
        &crt,
        "--tls-key",
        &key,
        "--tls-client-ca",
        &ca,
    ]);
    assert!(tls_call(&mutual.addr, &certs, None).await.is_err(), "no client certificate");
    assert_eq!(tls_call(&mutual.addr, &certs, Some((&certs, "worker"))).await, Ok(3));
    let strangers = Certs::new();
    let other = tls_call(&mutual.addr, &certs, Some((&strangers, "coordinator"))).await;
    assert!(other.is_err(), "a client certificate from another CA: {other:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn the_server_advertises_a_bound_on_concurrent_streams() {
    let server = Server::start(&["--model", &gqa(), "--name", "m"]);
    let tcp = tokio::net::TcpStream::connect(&server.addr).await.unwrap();
    let (client, connection) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(connection);
    let mut client = client.ready().await.unwrap();
    // One request round trip, so the server's SETTINGS have been read.
    let req =
        tonic::codegen::http::Request::post(format!("http://{}/grpc.health.v1.Health/Check", server.addr))
            .header("content-type", "application/grpc")
            .body(())
            .unwrap();
    let (response, _) = client.send_request(req, true).unwrap();
    let _ = response.await;
    assert_eq!(client.current_max_send_streams(), 1024, "SETTINGS_MAX_CONCURRENT_STREAMS");
}

/// `strata serve`'s workers are called in-process: their addresses serve nothing, so a
/// local user cannot reach worker.v1 (Generate without an API key, Drain without the admin
/// token, LoadShard dialling an address of their choice) around the front door.
#[tokio::test(flavor = "multi_thread")]
async fn serves_in_process_workers_have_no_worker_api_on_loopback() {
    use strata_proto::admin::v1::admin_client::AdminClient;
    use strata_proto::admin::v1::ListWorkersRequest;
    use strata_proto::worker::v1::worker_client::WorkerClient;
    use strata_proto::worker::v1::StatusRequest;
    let server = Server::start(&["--model", &gqa(), "--name", "m", "--api-key", "k"]);
    let mut admin = AdminClient::connect(server.endpoint()).await.unwrap();
    let workers = admin.list_workers(ListWorkersRequest::default()).await.unwrap().into_inner().workers;
    assert!(!workers.is_empty());
    for w in workers {
        let call = async {
            let channel = Endpoint::from_shared(format!("http://{}", w.address)).unwrap().connect().await?;
            WorkerClient::new(channel).status(StatusRequest {}).await.map_err(|e| e.into())
        };
        let reached: Result<_, Box<dyn std::error::Error + Send + Sync>> =
            match tokio::time::timeout(Duration::from_secs(3), call).await {
                Ok(r) => r,
                Err(_) => Err("no answer".into()),
            };
        assert!(reached.is_err(), "worker.v1 answered at {}", w.address);
    }
}

/// Idle connections cannot use up the server: one peer's connections past its cap are
/// closed at once, connections that send nothing are closed after the first-bytes
/// deadline, and other peers are answered throughout (21,000 idle connections once took
/// every descriptor and every listener stopped answering).
#[test]
fn idle_connections_are_capped_per_peer_and_closed() {
    use std::io::{Read, Write};
    use std::net::{SocketAddr, TcpStream};
    let server = Server::start(&["--model", &gqa(), "--name", "m", "--http-listen", "127.0.0.1:0"]);
    let http: SocketAddr = server.out.passed("http").unwrap()["address"].as_str().unwrap().parse().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    // A connection from `ip` (any 127.x address is this machine).
    let from = |ip: &str| -> TcpStream {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind(format!("{ip}:0").parse().unwrap()).unwrap();
        let stream = rt.block_on(socket.connect(http)).unwrap().into_std().unwrap();
        stream.set_nonblocking(false).unwrap();
        stream
    };
    let idle: Vec<TcpStream> = (0..600).map(|_| from("127.0.0.1")).collect();
    // Another peer is answered while the first holds its whole allowance.
    let mut other = from("127.0.0.2");
    write!(other, "GET /health HTTP/1.0\r\n\r\n").unwrap();
    let mut reply = String::new();
    other.read_to_string(&mut reply).unwrap();
    assert!(reply.starts_with("HTTP/1.0 200"), "{reply}");
    // Past the peer's cap, connections are closed at once; the silent ones within 10 s.
    let started = std::time::Instant::now();
    for mut s in idle {
        s.set_read_timeout(Some(std::time::Duration::from_secs(30))).unwrap();
        let mut buf = [0u8; 1];
        let n = s.read(&mut buf);
        assert!(matches!(n, Ok(0) | Err(_)), "an idle connection got {n:?}");
    }
    assert!(started.elapsed() < std::time::Duration::from_secs(25), "closed after {:?}", started.elapsed());
}

/// A connection that starts a request and stops — half a request head, a kept-alive
/// connection gone quiet, half an HTTP/2 preface on the gRPC port — is closed by the
/// header-read and opening deadlines (10 s each), not held for as long as the peer likes.
#[test]
fn half_sent_requests_are_closed_at_their_deadlines() {
    use std::io::{Read, Write};
    use std::net::TcpStream;
    let server = Server::start(&["--model", &gqa(), "--name", "m", "--http-listen", "127.0.0.1:0"]);
    let http = server.out.passed("http").unwrap()["address"].as_str().unwrap().to_string();
    let connect = |addr: &str| {
        let s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        s
    };
    // Reads to the end; Err if the server still held the connection after 30 s.
    let read_to_close = |mut s: TcpStream| -> std::io::Result<Vec<u8>> {
        let mut got = Vec::new();
        s.read_to_end(&mut got).map(|_| got)
    };
    let started = std::time::Instant::now();
    let mut half_head = connect(&http);
    half_head.write_all(b"GET /health HTTP/1.1\r\nHost: strata\r\nX-Slow: ").unwrap();
    let mut kept_alive = connect(&http);
    kept_alive.write_all(b"GET /health HTTP/1.1\r\nHost: strata\r\n\r\n").unwrap();
    let mut half_preface = connect(&server.addr);
    half_preface.write_all(b"PRI * HTTP/2.0\r\n").unwrap();

    assert!(read_to_close(half_head).is_ok(), "half a request head was held open");
    let answered = read_to_close(kept_alive).expect("a quiet kept-alive connection was held open");
    assert!(answered.starts_with(b"HTTP/1.1 200"), "{}", String::from_utf8_lossy(&answered));
    assert!(read_to_close(half_preface).is_ok(), "half an HTTP/2 preface was held open");
    assert!(started.elapsed() < Duration::from_secs(25), "closed after {:?}", started.elapsed());
}
