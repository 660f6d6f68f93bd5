//! Tests of the TCP communicator: set-up under hostile peers, the contract, failures.

use super::*;

use crate::comm::contract::boxed;
use crate::comm::Communicator;

fn loopback(world: usize) -> Result<Vec<Box<dyn Communicator>>> {
    Ok(boxed(local_group(world, Duration::from_secs(10))?))
}

fn config(
    rank: usize,
    world: usize,
    rendezvous: SocketAddr,
    secret: &[u8],
    setup: Duration,
) -> TcpCommConfig {
    TcpCommConfig {
        rank,
        world,
        rendezvous,
        setup_timeout: setup,
        recv_timeout: Duration::from_secs(2),
        secret: secret.to_vec(),
    }
}

/// A stranger that connects to `addr`, sends `bytes` and hangs up.
fn stranger(addr: SocketAddr, bytes: &[u8]) {
    let mut s = TcpStream::connect(addr).unwrap();
    let _ = s.write_all(bytes);
}

#[test]
fn strangers_at_the_rendezvous_are_refused_and_the_group_still_forms() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let secret = b"replica-secret".to_vec();
    let cfg0 = config(0, 2, addr, &secret, Duration::from_secs(20));
    let rank0 = std::thread::spawn(move || TcpComm::connect(&cfg0, Some(listener)));
    // Hostile lengths (a frame of 2^64-1, 2^62, 2^48 bytes), a hello of the old protocol
    // without a proof, nothing at all: each is dropped, none allocates what it announced.
    for bytes in [
        &[0xffu8; 8][..],
        &[0, 0, 0, 0, 0, 0, 0, 0x40],
        &[0, 0, 0, 0, 0, 0, 1, 0],
        b"\x05\0\0\0\0\0\0\x001 1.2",
        b"",
    ] {
        stranger(addr, bytes);
    }
    // A well-formed join by someone who does not know the secret is refused, and learns so.
    let s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let e = handshake::join(&s, b"a guess", b"1 127.0.0.1:1").unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied, "{e}");
    drop(s);
    // The real rank still joins, and the pair works.
    let mut one = TcpComm::connect(&config(1, 2, addr, &secret, Duration::from_secs(20)), None).unwrap();
    let mut zero = rank0.join().expect("rank 0 did not panic").expect("rank 0 formed the group");
    zero.send(1, b"plan").unwrap();
    assert_eq!(one.recv(0).unwrap(), b"plan");
}

#[test]
fn a_rank_without_the_group_secret_cannot_join() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let cfg0 = config(0, 2, addr, b"right", Duration::from_millis(1500));
    let rank0 = std::thread::spawn(move || TcpComm::connect(&cfg0, Some(listener)).map(|_| ()));
    let e = TcpComm::connect(&config(1, 2, addr, b"wrong", Duration::from_secs(5)), None).err().unwrap();
    assert!(e.to_string().contains("group secret"), "{e}");
    let e = rank0.join().unwrap().unwrap_err();
    assert!(e.to_string().contains("[1]"), "{e}");
}

#[test]
fn random_bytes_never_panic_the_handshake() {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    for _ in 0..200 {
        let len = rng.random_range(0..96);
        let mut bytes: Vec<u8> = (0..len).map(|_| rng.random()).collect();
        if rng.random_bool(0.5) && bytes.len() >= 8 {
            // A plausible small length prefix, so the body is read and checked too.
            bytes[..8].copy_from_slice(&((len - 8) as u64).to_le_bytes());
        }
        let writer = std::thread::spawn(move || stranger(addr, &bytes));
        let (s, _) = listener.accept().unwrap();
        s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        assert!(handshake::accept(&s, b"secret").is_err());
        writer.join().unwrap();
    }
}

#[test]
fn frame_lengths_are_bounded_before_allocation() {
    assert_eq!(frame_len(16u64.to_le_bytes(), 16).unwrap(), 16);
    assert!(frame_len(17u64.to_le_bytes(), 16).is_err());
    assert!(frame_len(u64::MAX.to_le_bytes(), MAX_FRAME).is_err());
}

#[test]
fn keeps_the_communicator_contract() {
    // The same checks `strata gpu-check comm` runs over NCCL.
    for world in [1usize, 2, 3, 4] {
        for (check, result) in crate::comm::contract::run_all(world, loopback) {
            result.unwrap_or_else(|e| panic!("world {world}, {check}: {e}"));
        }
    }
}

#[test]
fn a_wrong_sum_is_caught_by_the_contract() {
    // The contract's checks can fail: a communicator that skips the reduction.
    struct Lazy(TcpComm);
    impl Collectives for Lazy {
        fn rank(&self) -> usize {
            self.0.rank()
        }
        fn world(&self) -> usize {
            self.0.world()
        }
        fn all_reduce_sum(&mut self, _group: &[usize], _data: &mut [f32]) -> Result<()> {
            Ok(())
        }
        fn all_gather(&mut self, group: &[usize], local: &[f32]) -> Result<Vec<f32>> {
            self.0.all_gather(group, local)
        }
        fn all_to_all(&mut self, group: &[usize], parts: &[&[f32]]) -> Result<Vec<Vec<f32>>> {
            self.0.all_to_all(group, parts)
        }
        fn barrier(&mut self, group: &[usize]) -> Result<()> {
            self.0.barrier(group)
        }
        fn stats(&self) -> CommStats {
            self.0.stats()
        }
    }

    impl StepChannel for Lazy {
        fn broadcast(&mut self, group: &[usize], root: usize, data: &mut Vec<u8>) -> Result<()> {
            self.0.broadcast(group, root, data)
        }
        fn send(&mut self, to: usize, data: &[u8]) -> Result<()> {
            self.0.send(to, data)
        }
        fn recv(&mut self, from: usize) -> Result<Vec<u8>> {
            self.0.recv(from)
        }
    }
    let lazy = |world| -> Result<Vec<Box<dyn Communicator>>> {
        Ok(boxed(local_group(world, Duration::from_secs(10))?.into_iter().map(Lazy).collect()))
    };
    let e = crate::comm::contract::all_reduce_sums(lazy(2).unwrap(), 7).unwrap_err();
    assert!(e.to_string().contains("rank 0"), "{e}");
    let e = crate::comm::contract::subgroups_gathers_broadcasts_and_sends(lazy(4).unwrap()).unwrap_err();
    assert!(e.to_string().contains("all_reduce_sum over [0, 1]"), "{e}");
}

#[test]
fn a_missing_rank_fails_setup_with_its_number() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let rendezvous = listener.local_addr().unwrap();
    let cfg = move |rank| TcpCommConfig {
        rank,
        world: 3,
        rendezvous,
        setup_timeout: Duration::from_millis(300),
        recv_timeout: Duration::from_secs(1),
        secret: Vec::new(),
    };
    let one = std::thread::spawn(move || TcpComm::connect(&cfg(1), None).map(|_| ()));
    let e = TcpComm::connect(&cfg(0), Some(listener)).err().expect("rank 2 never comes");
    assert!(e.to_string().contains("[2]"), "{e}");
    assert!(one.join().unwrap().is_err());
}

#[test]
fn an_idle_wait_outlasts_the_receive_timeout_and_ends_when_the_peer_goes() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let rendezvous = listener.local_addr().unwrap();
    let cfg = move |rank| TcpCommConfig {
        rank,
        world: 2,
        rendezvous,
        setup_timeout: Duration::from_secs(10),
        recv_timeout: Duration::from_millis(100),
        secret: Vec::new(),
    };
    let leader = std::thread::spawn(move || {
        let mut c = TcpComm::connect(&cfg(0), Some(listener)).unwrap();
        std::thread::sleep(Duration::from_millis(400)); // idle for 4 receive timeouts
        c.send(1, b"step").unwrap();
        std::thread::sleep(Duration::from_millis(200));
        drop(c); // the leader goes away
    });
    let mut f = TcpComm::connect(&cfg(1), None).unwrap();
    assert_eq!(f.recv_idle(0).unwrap(), b"step");
    let t = Instant::now();
    let e = f.recv_idle(0).unwrap_err();
    assert!(matches!(e, Error::Unavailable(_)), "{e}");
    assert!(t.elapsed() < Duration::from_secs(2));
    leader.join().unwrap();
}

#[test]
fn a_dead_peer_fails_the_collective() {
    let mut comms = local_group(2, Duration::from_secs(10)).unwrap();
    drop(comms.pop());
    let mut c = comms.pop().unwrap();
    let t = Instant::now();
    let e = c.all_reduce_sum(&[0, 1], &mut [1.0; 4]).unwrap_err();
    assert!(t.elapsed() < Duration::from_secs(2));
    assert!(matches!(e, Error::Unavailable(_)), "{e}");
}
