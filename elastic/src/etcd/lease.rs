//! An etcd lease's id: the leaf the client, its errors and the rendezvous all name leases by.

use std::fmt;

/// An etcd lease. Shown in hex, as `etcdctl` shows leases.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LeaseId(pub i64);

impl fmt::Display for LeaseId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn lease_ids_show_in_hex_like_etcdctl() {
        assert_eq!(LeaseId(0x694d77aa9e38260f).to_string(), "694d77aa9e38260f");
        assert_eq!(LeaseId(77).to_string(), "000000000000004d");
    }
}
