//! Job-token authentication of every connection (coordinator and stage data ports).
//!
//! The accepting side sends a random nonce; the connecting side answers with BLAKE3 keyed by the
//! job token over (nonce, purpose). The token itself never crosses the wire. A connection that does
//! not answer correctly within [`HANDSHAKE_TIMEOUT`] is closed without effect.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// Environment variable holding the job's shared secret.
pub const TOKEN_ENV: &str = "SEQPIPE_JOB_TOKEN";

/// How long an accepting side waits for the answer to its challenge.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

const MAGIC: &[u8; 8] = b"SQPAUTH1";

/// `SEQPIPE_JOB_TOKEN` is set but empty or blank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "{TOKEN_ENV} is set but empty; an empty job secret is refused rather than replaced: set it to \
     the same secret on the coordinator and every agent (e.g. `openssl rand -hex 16`), or unset it \
     for a single-machine run (a random one is made)"
)]
pub struct EmptyJobToken;

/// The job token set in `SEQPIPE_JOB_TOKEN`: `None` when unset, an error when set but blank.
pub fn token_from_env() -> Result<Option<String>, EmptyJobToken> {
    match std::env::var(TOKEN_ENV) {
        Ok(t) if t.trim().is_empty() => Err(EmptyJobToken),
        Ok(t) => Ok(Some(t)),
        Err(_) => Ok(None),
    }
}

/// The job token: `SEQPIPE_JOB_TOKEN`, or a fresh random one when it is unset (local runs; the
/// launcher passes it to its workers). Set but empty is an error, never silently replaced.
pub fn job_token() -> Result<String, EmptyJobToken> {
    Ok(token_from_env()?.unwrap_or_else(|| format!("{:032x}", rand::random::<u128>())))
}

/// A public fingerprint of the job token (BLAKE3 of a domain-separated token): the etcd
/// rendezvous stores it so that nodes of another job are refused, without storing the token.
pub fn fingerprint(token: &str) -> String {
    blake3::keyed_hash(&key(token), b"seqpipe job fingerprint")
        .to_hex()
        .to_string()
}

fn key(token: &str) -> [u8; 32] {
    *blake3::hash(token.as_bytes()).as_bytes()
}

fn answer(token: &str, nonce: &[u8; 32], purpose: &str) -> [u8; 32] {
    let mut msg = nonce.to_vec();
    msg.extend_from_slice(purpose.as_bytes());
    *blake3::keyed_hash(&key(token), &msg).as_bytes()
}

fn denied(why: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::PermissionDenied,
        format!("connection refused: {why} (does it share this job's {TOKEN_ENV}?)"),
    )
}

/// Accepting side: challenges the peer and checks its answer; the caller drops the stream on error.
pub fn challenge(stream: &mut TcpStream, token: &str, purpose: &str) -> io::Result<()> {
    let nonce: [u8; 32] = rand::random();
    let previous = stream.read_timeout()?;
    stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
    stream.write_all(MAGIC)?;
    stream.write_all(&nonce)?;
    let mut got = [0u8; 32];
    let read = stream.read_exact(&mut got);
    stream.set_read_timeout(previous)?;
    read.map_err(|_| denied("no answer to the authentication challenge"))?;
    // Constant-time comparison.
    let expected = answer(token, &nonce, purpose);
    if got
        .iter()
        .zip(expected.iter())
        .fold(0u8, |acc, (a, b)| acc | (a ^ b))
        != 0
    {
        return Err(denied("wrong job token"));
    }
    Ok(())
}

/// Connecting side: answers the acceptor's challenge.
pub fn respond(stream: &mut TcpStream, token: &str, purpose: &str) -> io::Result<()> {
    let mut hello = [0u8; 40];
    stream.read_exact(&mut hello).map_err(|e| {
        io::Error::new(
            e.kind(),
            format!("no authentication challenge from the peer: {e}"),
        )
    })?;
    if &hello[..8] != MAGIC {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "the peer is not a seqpipe endpoint",
        ));
    }
    let nonce: [u8; 32] = hello[8..].try_into().expect("32 bytes");
    stream.write_all(&answer(token, &nonce, purpose))
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;

    use super::*;

    fn handshake(
        server_token: &'static str,
        client: impl FnOnce(&mut TcpStream) + Send + 'static,
    ) -> io::Result<()> {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let mut s = TcpStream::connect(addr).unwrap();
            client(&mut s);
        });
        let (mut stream, _) = listener.accept().unwrap();
        let result = challenge(&mut stream, server_token, "control");
        t.join().unwrap();
        result
    }

    #[test]
    fn right_token_passes_wrong_token_and_silence_fail() {
        assert!(handshake("secret", |s| respond(s, "secret", "control").unwrap()).is_ok());
        let err = handshake("secret", |s| respond(s, "guess", "control").unwrap()).unwrap_err();
        assert!(err.to_string().contains("wrong job token"), "{err}");
        // Right token, wrong purpose: an answer for another port does not replay here.
        assert!(handshake("secret", |s| respond(s, "secret", "data").unwrap()).is_err());
        // A client that sends something else and hangs up.
        assert!(
            handshake("secret", |s| s
                .write_all(b"GET / HTTP/1.1\r\n\r\n")
                .unwrap())
            .is_err()
        );
    }
}
