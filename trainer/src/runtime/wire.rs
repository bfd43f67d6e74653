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
    read_frame_into(r, limits, |_| Vec::new())
}

/// [`read_frame`], receiving the payload into the buffer `buffer_for(claimed length)` gives (once
/// the claim is within `limits`): a reused buffer whose capacity holds the payload is written in
/// place, with no allocation.
pub fn read_frame_into(
    r: &mut impl Read,
    limits: Limits,
    buffer_for: impl FnOnce(u64) -> Vec<u8>,
) -> io::Result<Frame> {
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
    let payload = read_payload(r, payload_len, buffer_for(payload_len))?;
    Ok(Frame { header, payload })
}

/// Reads a payload of `len` bytes as they arrive into `payload` (emptied first): the buffer grows
/// beyond its capacity by at most what was received so far (and [`RESERVE_AHEAD`] at first), never
/// beyond `len`, so a peer that claims a large payload and sends part of it costs about what it
/// sent, not the claim nor twice the claim.
fn read_payload(r: &mut impl Read, len: u64, mut payload: Vec<u8>) -> io::Result<Vec<u8>> {
    payload.clear();
    while (payload.len() as u64) < len {
        let remaining = len - payload.len() as u64;
        let chunk = remaining.min((payload.len() as u64).max(RESERVE_AHEAD));
        payload.try_reserve_exact(chunk as usize).map_err(|e| {
            io::Error::new(
                io::ErrorKind::OutOfMemory,
                format!("payload of {len} B: {e}"),
            )
        })?;
        let got = (&mut *r).take(chunk).read_to_end(&mut payload)?;
        if (got as u64) < chunk {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "the peer closed the stream {} B into a {len} B payload",
                    payload.len()
                ),
            ));
        }
    }
    Ok(payload)
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

    /// A payload claimed within the limit but cut short costs about what was sent: the buffer
    /// never holds more than twice the bytes received (and the first read-ahead), whatever the
    /// claim, and never more than the claim.
    #[test]
    fn a_payload_buffer_grows_with_the_bytes_received() {
        let sent = 20 << 20;
        let mut data = vec![7u8; sent];
        let err = read_payload(&mut data.as_slice(), 1 << 36, Vec::new()).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof, "{err}");
        data.truncate(3 << 20);
        let got = read_payload(&mut data.as_slice(), 3 << 20, Vec::new()).unwrap();
        assert_eq!(got.len(), 3 << 20);
        assert_eq!(got.capacity(), 3 << 20, "reserved beyond the claim");
        let mut long = vec![1u8; 20 << 20];
        long.push(2);
        let got = read_payload(&mut long.as_slice(), 20 << 20, Vec::new()).unwrap();
        assert_eq!(got.capacity(), 20 << 20, "reserved beyond the claim");
    }

    /// A buffer whose capacity holds the payload is filled in place: the same allocation comes
    /// back (an agent's reused snapshot buffers page-fault nothing).
    #[test]
    fn a_reused_buffer_is_filled_in_place() {
        let mut buf = Vec::new();
        write_frame(
            &mut buf,
            &Frame::new(&serde_json::json!({}), vec![5u8; 3 << 20]),
        )
        .unwrap();
        let reused = vec![9u8; 4 << 20];
        let at = reused.as_ptr();
        let frame = read_frame_into(&mut buf.as_slice(), Limits::SNAPSHOT, move |len| {
            assert_eq!(len, 3 << 20);
            reused
        })
        .unwrap();
        assert_eq!(frame.payload.as_ptr(), at, "the payload was reallocated");
        assert_eq!(frame.payload, vec![5u8; 3 << 20]);
    }
}
