//! Length-prefixed frames: a small JSON header and an optional binary payload.
//!
//! Layout: `b"SQP1"`, header length (u32 LE), payload length (u64 LE), header bytes, payload bytes.

use std::io::{self, Read, Write};

use serde::Serialize;
use serde::de::DeserializeOwned;

const MAGIC: &[u8; 4] = b"SQP1";

/// Memory a claimed payload length may make the reader reserve before the bytes arrive; beyond it
/// the buffer grows only as data comes in.
const RESERVE_AHEAD: u64 = 8 << 20;

/// The largest frame a channel accepts: every peer is untrusted, even after authentication, so a
/// frame over its channel's limit is that peer's failure, and nothing is allocated for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Largest JSON header, bytes.
    pub header: usize,
    /// Largest binary payload, bytes.
    pub payload: u64,
}

impl Limits {
    /// Control messages: JSON only (the largest is a worker's config or a step's per-parameter
    /// gradient norms).
    pub const CONTROL: Limits = Limits {
        header: 4 << 20,
        payload: 0,
    };
    /// Peer snapshots: a stage's parameters and AdamW moments. The payload bound is generous (a
    /// 1.5B-parameter stage is 18 GiB); memory follows the bytes actually received.
    pub const SNAPSHOT: Limits = Limits {
        header: 16 << 20,
        payload: 64 << 30,
    };

    /// Stage data links: one activation or gradient of at most `max_tensor_bytes`.
    pub fn data(max_tensor_bytes: u64) -> Limits {
        Limits {
            header: 64 << 10,
            payload: max_tensor_bytes,
        }
    }
}

/// One message on a stream.
#[derive(Debug)]
pub struct Frame {
    /// JSON header.
    pub header: Vec<u8>,
    /// Binary payload (may be empty).
    pub payload: Vec<u8>,
}

impl Frame {
    /// A frame whose header is `header` serialized as JSON.
    pub fn new(header: &impl Serialize, payload: Vec<u8>) -> Self {
        Self {
            header: serde_json::to_vec(header).expect("headers always serialize"),
            payload,
        }
    }

    /// Parses the header.
    pub fn header<T: DeserializeOwned>(&self) -> io::Result<T> {
        serde_json::from_slice(&self.header).map_err(|e| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("malformed message header: {e}"),
            )
        })
    }
}

/// Writes one frame.
pub fn write_frame(w: &mut impl Write, frame: &Frame) -> io::Result<()> {
    write_frame_parts(w, &frame.header, &[&frame.payload])
}

/// Writes one frame whose payload is `parts` one after the other, without gathering them into
/// one buffer first (a peer snapshot's tensors).
pub fn write_frame_parts(w: &mut impl Write, header: &[u8], parts: &[&[u8]]) -> io::Result<()> {
    let payload_len: usize = parts.iter().map(|p| p.len()).sum();
    let mut prefix = [0u8; 16];
    prefix[..4].copy_from_slice(MAGIC);
    prefix[4..8].copy_from_slice(&(header.len() as u32).to_le_bytes());
    prefix[8..].copy_from_slice(&(payload_len as u64).to_le_bytes());
    w.write_all(&prefix)?;
    w.write_all(header)?;
    for part in parts {
        w.write_all(part)?;
    }
    w.flush()
}

/// Reads one frame within `limits`; `UnexpectedEof` when the peer closed the stream.
pub fn read_frame(r: &mut impl Read, limits: Limits) -> io::Result<Frame> {
    let mut prefix = [0u8; 16];
    r.read_exact(&mut prefix)?;
    if &prefix[..4] != MAGIC {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "not a seqpipe peer (bad magic)",
        ));
    }
    let header_len = u32::from_le_bytes(prefix[4..8].try_into().expect("4 bytes")) as usize;
    let payload_len = u64::from_le_bytes(prefix[8..].try_into().expect("8 bytes"));
    if header_len > limits.header || payload_len > limits.payload {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "frame too large: header {header_len} B, payload {payload_len} B; this channel accepts at most {} B and {} B",
                limits.header, limits.payload
            ),
        ));
    }
    let mut header = vec![0u8; header_len];
    r.read_exact(&mut header)?;
    let mut payload = Vec::new();
    payload
        .try_reserve_exact(payload_len.min(RESERVE_AHEAD) as usize)
        .map_err(|e| {
            io::Error::new(
                io::ErrorKind::OutOfMemory,
                format!("payload of {payload_len} B: {e}"),
            )
        })?;
    let got = r.take(payload_len).read_to_end(&mut payload)?;
    if got as u64 != payload_len {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!("the peer closed the stream {got} B into a {payload_len} B payload"),
        ));
    }
    Ok(Frame { header, payload })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_garbage() {
        let mut buf = Vec::new();
        write_frame(
            &mut buf,
            &Frame::new(&serde_json::json!({"a": 1}), vec![1, 2, 3]),
        )
        .unwrap();
        let limits = Limits::data(3);
        let f = read_frame(&mut buf.as_slice(), limits).unwrap();
        assert_eq!(f.header::<serde_json::Value>().unwrap()["a"], 1);
        assert_eq!(f.payload, vec![1, 2, 3]);
        assert!(read_frame(&mut &b"GET / HTTP/1.1\r\n\r\n"[..], limits).is_err());
        assert_eq!(
            read_frame(&mut &buf[..5], limits).unwrap_err().kind(),
            io::ErrorKind::UnexpectedEof
        );
        // One byte over the channel's payload limit.
        let err = read_frame(&mut buf.as_slice(), Limits::data(2)).unwrap_err();
        assert!(err.to_string().contains("at most"), "{err}");
        // A payload cut short.
        let err = read_frame(&mut &buf[..buf.len() - 1], limits).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
    }

    /// A frame that claims an 8 GiB payload (within the limit) and sends 10 bytes: the reader
    /// reserves at most `RESERVE_AHEAD`, fails on the short payload, and never panics.
    #[test]
    fn a_claimed_length_reserves_nothing_beyond_the_read_ahead() {
        let mut buf = Vec::new();
        buf.extend_from_slice(MAGIC);
        buf.extend_from_slice(&2u32.to_le_bytes());
        buf.extend_from_slice(&(8u64 << 30).to_le_bytes());
        buf.extend_from_slice(b"{}");
        buf.extend_from_slice(&[0u8; 10]);
        let err = read_frame(&mut buf.as_slice(), Limits::SNAPSHOT).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof, "{err}");
        // Over the control channel's limits: refused before reading anything else.
        let err = read_frame(&mut buf.as_slice(), Limits::CONTROL).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData, "{err}");
        buf[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(read_frame(&mut buf.as_slice(), Limits::SNAPSHOT).is_err());
    }
}
