//! Checks on what a peer sends before it is used: names that become paths, numbers that become
//! durations, counts and indices, addresses to connect to. Every peer is untrusted input, even an
//! authenticated one; a value that fails a check is that peer's failure (an error naming the field
//! and the value), never a panic and never a file outside the directory it belongs in.

use std::fmt;
use std::time::Duration;

/// A value a peer sent that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadInput(pub String);

impl fmt::Display for BadInput {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for BadInput {}

/// The longest name accepted as a path component.
const MAX_NAME: usize = 128;

/// `value` as one path component: ASCII letters, digits, `-`, `_` and `.`, not starting with a
/// `.` (no `..`, no hidden files), at most 128 bytes.
pub fn path_component<'a>(field: &str, value: &'a str) -> Result<&'a str, BadInput> {
    let ok_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
    if value.is_empty()
        || value.len() > MAX_NAME
        || value.starts_with('.')
        || !value.chars().all(ok_char)
    {
        return Err(BadInput(format!(
            "{field} {value:?} is not a plain name (1-{MAX_NAME} of A-Z a-z 0-9 - _ ., not starting with '.')"
        )));
    }
    Ok(value)
}

/// `seconds` as a duration above zero, within the config's rule ([`elastic::checked_seconds`]).
pub fn seconds(field: &str, seconds: f64) -> Result<Duration, BadInput> {
    elastic::checked_seconds(seconds, elastic::Zero::Refused)
        .map_err(|e| BadInput(format!("{field}: {e}")))
}

/// `value` as an index below `bound`.
pub fn index(field: &str, value: usize, bound: usize) -> Result<usize, BadInput> {
    if value >= bound {
        return Err(BadInput(format!("{field} = {value} is not below {bound}")));
    }
    Ok(value)
}

/// `value` as a `host:port` address to connect to (a name or an IP, and a non-zero port).
pub fn address<'a>(field: &str, value: &'a str) -> Result<&'a str, BadInput> {
    let bad = || BadInput(format!("{field} {value:?} is not a host:port address"));
    let (host, port) = value.rsplit_once(':').ok_or_else(bad)?;
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    let host_ok = !host.is_empty()
        && host.len() <= 253
        && host
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | ':'));
    match port.parse::<u16>() {
        Ok(p) if p != 0 && host_ok => Ok(value),
        _ => Err(bad()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_that_escape_a_directory_are_refused() {
        for bad in [
            "",
            "..",
            ".",
            "../../../../elsewhere",
            "a/b",
            "a\\b",
            ".hidden",
            "a\0b",
            "é",
            &"x".repeat(129),
        ] {
            assert!(path_component("session", bad).is_err(), "{bad:?}");
        }
        for good in ["session-1732", "node_a.2", "local-000"] {
            assert_eq!(path_component("session", good), Ok(good));
        }
    }

    #[test]
    fn durations_are_finite_positive_and_bounded() {
        for bad in [0.0, -1.0, 1e300, f64::INFINITY, f64::NAN, 1e8] {
            let err = seconds("heartbeat_s", bad).unwrap_err();
            assert!(err.0.contains("heartbeat_s"), "{err}");
        }
        assert_eq!(seconds("x", 0.5), Ok(Duration::from_millis(500)));
    }

    #[test]
    fn addresses_need_a_host_and_a_port() {
        for good in ["127.0.0.1:4000", "node-a.example:1", "[::1]:80"] {
            assert!(address("a", good).is_ok(), "{good}");
        }
        for bad in [
            "",
            "host",
            "host:0",
            "host:99999",
            ":80",
            "a b:80",
            "h/x:80",
        ] {
            assert!(address("a", bad).is_err(), "{bad}");
        }
        assert!(index("stage", 3, 3).is_err());
        assert_eq!(index("stage", 2, 3), Ok(2));
    }
}
