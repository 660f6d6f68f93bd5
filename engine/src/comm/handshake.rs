//! How a rank proves it belongs to a replica before it joins the TCP mesh.
//!
//! Every set-up connection (to the rendezvous and between ranks) opens with a mutual
//! challenge-response over the replica's **group secret**, which the leader coordinator
//! hands each rank with its shard assignment over the authenticated control channel:
//!
//! 1. the accepting side sends `MAGIC ‖ VERSION ‖ nonce_a`;
//! 2. the joining side answers `hello ‖ nonce_j ‖ HMAC(secret, "join" ‖ nonce_a ‖ nonce_j ‖ hello)`;
//! 3. the accepting side checks the MAC and answers `HMAC(secret, "welcome" ‖ nonce_j ‖ nonce_a)`,
//!    which the joining side checks in turn.
//!
//! Fresh nonces on both sides make a recorded exchange useless for another connection,
//! and the secret never crosses the wire. A peer that speaks another protocol or version,
//! or cannot prove the secret, is refused before its hello is read as a rank. Frames here
//! are bounded by the set-up limit, so a stranger's bytes buy nothing.

use std::io::{Error, ErrorKind, Result};
use std::net::TcpStream;

use hmac::{Hmac, Mac};
use rand::TryRngCore;
use sha2::Sha256;

use super::tcp::{read_frame, write_frame};

fn write(mut s: &TcpStream, data: &[u8]) -> Result<()> {
    write_frame(&mut s, data)
}

fn read(mut s: &TcpStream, max: usize) -> Result<Vec<u8>> {
    read_frame(&mut s, max)
}

/// The set-up protocol's magic and version.
pub const MAGIC: &[u8; 8] = b"STRATArv";
pub const VERSION: u32 = 1;
const NONCE: usize = 32;
/// What the accepting side answers a join whose proof is wrong (never 32 bytes long).
const REFUSAL: &[u8] = b"refused: wrong group secret";
const TAG: usize = 32;
/// Longest hello a joining rank may send ("rank address").
const MAX_HELLO: usize = 1024;

fn nonce() -> Result<[u8; NONCE]> {
    let mut n = [0u8; NONCE];
    rand::rngs::OsRng.try_fill_bytes(&mut n).map_err(|e| Error::other(format!("no randomness: {e}")))?;
    Ok(n)
}

/// A fresh group secret for a replica.
pub fn new_secret() -> Result<Vec<u8>> {
    Ok(nonce()?.to_vec())
}

fn mac(secret: &[u8], parts: &[&[u8]]) -> Hmac<Sha256> {
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(secret).expect("HMAC takes a key of any length");
    for p in parts {
        m.update(p);
    }
    m
}

fn refused(what: &str) -> Error {
    Error::new(ErrorKind::PermissionDenied, what.to_string())
}

/// The accepting side: returns the joining peer's hello once it has proved the secret.
pub fn accept(s: &TcpStream, secret: &[u8]) -> Result<Vec<u8>> {
    let mine = nonce()?;
    write(s, &[MAGIC.as_slice(), &VERSION.to_le_bytes(), &mine].concat())?;
    let msg = read(s, MAX_HELLO + NONCE + TAG)?;
    if msg.len() < NONCE + TAG {
        return Err(refused("a join message too short to carry a proof"));
    }
    let (hello, rest) = msg.split_at(msg.len() - NONCE - TAG);
    let (theirs, tag) = rest.split_at(NONCE);
    if mac(secret, &[b"join", &mine, theirs, hello]).verify_slice(tag).is_err() {
        // Tell an honest rank with the wrong secret why, then hang up.
        let _ = write(s, REFUSAL);
        return Err(refused("the peer does not know this replica's group secret"));
    }
    write(s, &mac(secret, &[b"welcome", theirs, &mine]).finalize().into_bytes())?;
    Ok(hello.to_vec())
}

/// The joining side: sends `hello` and checks that the other side knows the secret too.
pub fn join(s: &TcpStream, secret: &[u8], hello: &[u8]) -> Result<()> {
    if hello.len() > MAX_HELLO {
        return Err(Error::new(ErrorKind::InvalidInput, "hello too long"));
    }
    let challenge = read(s, MAGIC.len() + 4 + NONCE)?;
    if challenge.len() != MAGIC.len() + 4 + NONCE || &challenge[..MAGIC.len()] != MAGIC {
        return Err(refused("the rendezvous does not speak Strata's set-up protocol"));
    }
    let version = u32::from_le_bytes(challenge[8..12].try_into().expect("4 bytes"));
    if version != VERSION {
        return Err(refused(&format!("set-up protocol version {version}, this rank speaks {VERSION}")));
    }
    let theirs = &challenge[12..];
    let mine = nonce()?;
    let tag = mac(secret, &[b"join", theirs, &mine, hello]).finalize().into_bytes();
    write(s, &[hello, &mine, &tag].concat())?;
    let welcome = read(s, REFUSAL.len().max(TAG))?;
    if welcome == REFUSAL {
        return Err(refused("the rendezvous refused this rank: it does not know the replica's group secret"));
    }
    mac(secret, &[b"welcome", &mine, theirs])
        .verify_slice(&welcome)
        .map_err(|_| refused("the rendezvous does not know this replica's group secret"))
}
