//! Length-prefixed frames: a small JSON header and an optional binary payload.
//!
//! Layout: `b"SQP1"`, header length (u32 LE), payload length (u64 LE), header bytes, payload bytes.

use std::io::{self, Read, Write};

use serde::Serialize;
use serde::de::DeserializeOwned;

const MAGIC: &[u8; 4] = b"SQP1";
/// Largest header accepted (headers are small JSON objects).
const MAX_HEADER: usize = 16 << 20;
/// Largest payload accepted (one activation or gradient tensor).
const MAX_PAYLOAD: u64 = 8 << 30;

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
    let mut prefix = [0u8; 16];
    prefix[..4].copy_from_slice(MAGIC);
    prefix[4..8].copy_from_slice(&(frame.header.len() as u32).to_le_bytes());
    prefix[8..].copy_from_slice(&(frame.payload.len() as u64).to_le_bytes());
    w.write_all(&prefix)?;
    w.write_all(&frame.header)?;
    w.write_all(&frame.payload)?;
    w.flush()
}

/// Reads one frame; `UnexpectedEof` when the peer closed the stream.
pub fn read_frame(r: &mut impl Read) -> io::Result<Frame> {
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
    if header_len > MAX_HEADER || payload_len > MAX_PAYLOAD {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("frame too large (header {header_len} B, payload {payload_len} B)"),
        ));
    }
    let mut header = vec![0u8; header_len];
    r.read_exact(&mut header)?;
    let mut payload = vec![0u8; payload_len as usize];
    r.read_exact(&mut payload)?;
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
        let f = read_frame(&mut buf.as_slice()).unwrap();
        assert_eq!(f.header::<serde_json::Value>().unwrap()["a"], 1);
        assert_eq!(f.payload, vec![1, 2, 3]);
        assert!(read_frame(&mut &b"GET / HTTP/1.1\r\n\r\n"[..]).is_err());
        assert_eq!(
            read_frame(&mut &buf[..5]).unwrap_err().kind(),
            io::ErrorKind::UnexpectedEof
        );
    }
}
