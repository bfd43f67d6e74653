//! A raw etcd v3 client over the JSON gateway: key-values, leases and transactions.
//!
//! Every call is one blocking `POST /v3/<service>/<method>` (keys and values base64-encoded,
//! int64 fields as JSON strings) that ends within the client's timeout, all of it, and buffers
//! at most a bounded answer. The client holds no connection, so it is cheap to clone and safe
//! to share between threads.

use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use serde_json::{Map, Value, json};

use super::error::EtcdError;
use super::lease::LeaseId;
use crate::http::{self, HttpError};

/// How long a whole call (connect, request and the complete answer) may take unless
/// [`EtcdClient::with_timeout`] says otherwise.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);

/// The message etcd gives for a lease that does not exist (expired, revoked or never granted).
const LEASE_NOT_FOUND: &str = "requested lease not found";

/// A granted lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lease {
    /// Its id.
    pub id: LeaseId,
    /// The TTL etcd granted, whole seconds; etcd raises short TTLs to its minimum (2 s with
    /// the default election timeout). Keep the lease alive every third of it.
    pub ttl: Duration,
}

/// A key and its value, with etcd's bookkeeping.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyValue {
    /// The key.
    pub key: Vec<u8>,
    /// The value.
    pub value: Vec<u8>,
    /// The revision that created the key (it changes when a deleted key is created again).
    pub create_revision: i64,
    /// The revision of the last write to the key.
    pub mod_revision: i64,
    /// The lease the key is attached to, if any.
    pub lease: Option<LeaseId>,
}

/// A condition of a transaction ([`EtcdClient::txn`]).
#[derive(Clone, Debug)]
pub enum Compare {
    /// The key does not exist (its create revision is 0).
    Absent(Vec<u8>),
    /// The key exists and holds exactly this value.
    Value(Vec<u8>, Vec<u8>),
    /// The key exists and is attached to this lease.
    Lease(Vec<u8>, LeaseId),
}

/// An operation of a transaction's branch ([`EtcdClient::txn`]).
#[derive(Clone, Debug)]
pub enum TxnOp {
    /// Writes `value` at `key`, attached to `lease` if given.
    Put {
        /// The key.
        key: Vec<u8>,
        /// The value.
        value: Vec<u8>,
        /// The lease to attach the key to.
        lease: Option<LeaseId>,
    },
    /// Reads `key`.
    Get(Vec<u8>),
    /// Deletes `key`.
    Delete(Vec<u8>),
}

/// What a transaction did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TxnResponse {
    /// Whether every comparison held, so that the success branch ran (else the failure branch).
    pub succeeded: bool,
    /// The key-values read by the branch that ran, from its [`TxnOp::Get`]s, in order (a
    /// missing key adds nothing).
    pub fetched: Vec<KeyValue>,
}

/// A client of one etcd endpoint (`host:port`).
#[derive(Clone, Debug)]
pub struct EtcdClient {
    endpoint: String,
    timeout: Duration,
    /// The HTTP agent enforcing `timeout` and the size limits (shared by clones).
    agent: ureq::Agent,
}

impl EtcdClient {
    /// A client of `endpoint` (`host:port`), with [`DEFAULT_TIMEOUT`]. Opens nothing yet.
    pub fn new(endpoint: impl Into<String>) -> Self {
        Self {
            endpoint: endpoint.into(),
            timeout: DEFAULT_TIMEOUT,
            agent: http::agent(DEFAULT_TIMEOUT),
        }
    }

    /// The same client with another deadline for each whole call: connecting, sending the
    /// request and receiving all of the answer. A call past it is [`EtcdError::Timeout`] (or
    /// [`EtcdError::Unreachable`] if no connection was made in time).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self.agent = http::agent(timeout);
        self
    }

    /// The endpoint, `host:port`.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Writes `value` at `key`, attached to `lease` if given (the key goes when the lease
    /// does). A lease that is gone is [`EtcdError::LeaseExpired`].
    pub fn put(&self, key: &[u8], value: &[u8], lease: Option<LeaseId>) -> Result<(), EtcdError> {
        let request = format!("kv/put `{}`", show(key));
        self.call("kv/put", &request, put_json(key, value, lease))
            .map_err(|e| self.lease_gone(e, lease, &request))?;
        Ok(())
    }

    /// The value at `key`, if any.
    pub fn get(&self, key: &[u8]) -> Result<Option<KeyValue>, EtcdError> {
        let request = format!("kv/range `{}`", show(key));
        let answer = self.call("kv/range", &request, json!({ "key": BASE64.encode(key) }))?;
        Ok(self.kvs(&answer, &request)?.into_iter().next())
    }

    /// Every key starting with `prefix`, sorted by key.
    pub fn get_prefix(&self, prefix: &[u8]) -> Result<Vec<KeyValue>, EtcdError> {
        let request = format!("kv/range `{}*`", show(prefix));
        let body = json!({
            "key": BASE64.encode(prefix),
            "range_end": BASE64.encode(prefix_end(prefix)),
        });
        let answer = self.call("kv/range", &request, body)?;
        self.kvs(&answer, &request)
    }

    /// Deletes `key`; returns whether it existed.
    pub fn delete(&self, key: &[u8]) -> Result<bool, EtcdError> {
        let request = format!("kv/deleterange `{}`", show(key));
        let body = json!({ "key": BASE64.encode(key) });
        let answer = self.call("kv/deleterange", &request, body)?;
        Ok(self.int(&answer, "deleted", &request)? > 0)
    }

    /// Atomically: if every comparison in `compare` holds, runs `success`, else `failure`.
    /// A [`TxnOp::Put`] on a lease that is gone is [`EtcdError::LeaseExpired`].
    pub fn txn(
        &self,
        compare: &[Compare],
        success: &[TxnOp],
        failure: &[TxnOp],
    ) -> Result<TxnResponse, EtcdError> {
        let keys: Vec<String> = compare
            .iter()
            .map(|c| match c {
                Compare::Absent(key) | Compare::Value(key, _) | Compare::Lease(key, _) => {
                    format!("`{}`", show(key))
                }
            })
            .collect();
        let request = format!("kv/txn on {}", keys.join(", "));
        let body = json!({
            "compare": compare.iter().map(compare_json).collect::<Vec<_>>(),
            "success": success.iter().map(op_json).collect::<Vec<_>>(),
            "failure": failure.iter().map(op_json).collect::<Vec<_>>(),
        });
        let lease = success.iter().chain(failure).find_map(|op| match op {
            TxnOp::Put { lease, .. } => *lease,
            _ => None,
        });
        let answer = self
            .call("kv/txn", &request, body)
            .map_err(|e| self.lease_gone(e, lease, &request))?;
        let mut fetched = Vec::new();
        for response in answer["responses"].as_array().into_iter().flatten() {
            if let Some(range) = response.get("response_range") {
                fetched.extend(self.kvs(range, &request)?);
            }
        }
        Ok(TxnResponse {
            succeeded: answer["succeeded"].as_bool().unwrap_or(false),
            fetched,
        })
    }

    /// Grants a lease of `ttl`, rounded up to whole seconds (at least 1; etcd may raise it to
    /// its minimum, see [`Lease::ttl`]).
    pub fn grant(&self, ttl: Duration) -> Result<Lease, EtcdError> {
        let seconds = (ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0)).max(1);
        let request = format!("lease/grant of {seconds} s");
        let answer = self.call(
            "lease/grant",
            &request,
            json!({ "TTL": seconds.to_string() }),
        )?;
        if let Some(message) = answer["error"].as_str().filter(|m| !m.is_empty()) {
            return Err(self.server_error(&request, 200, 0, message.to_string()));
        }
        Ok(Lease {
            id: LeaseId(self.int(&answer, "ID", &request)?),
            ttl: Duration::from_secs(self.int(&answer, "TTL", &request)?.max(0) as u64),
        })
    }

    /// Renews `lease` to its full TTL and returns that TTL; [`EtcdError::LeaseExpired`] if the
    /// lease is gone.
    pub fn keep_alive(&self, lease: LeaseId) -> Result<Duration, EtcdError> {
        let request = format!("lease/keepalive of {lease}");
        let answer = self.call(
            "lease/keepalive",
            &request,
            json!({ "ID": lease.0.to_string() }),
        )?;
        // A streaming call: the gateway wraps each message as {"result": ...} or {"error": ...}.
        if let Some(error) = answer.get("error") {
            let message = error["message"].as_str().unwrap_or_default().to_string();
            let code = error["grpc_code"].as_i64().unwrap_or_default();
            return Err(self.server_error(&request, 200, code, message));
        }
        // An expired lease is no error to etcd: it answers with no TTL.
        let ttl = self.int(&answer["result"], "TTL", &request)?;
        if ttl <= 0 {
            return Err(self.lease_expired(lease, &request));
        }
        Ok(Duration::from_secs(ttl as u64))
    }

    /// Revokes `lease`, deleting the keys attached to it. A lease that is already gone is fine.
    pub fn revoke(&self, lease: LeaseId) -> Result<(), EtcdError> {
        let request = format!("lease/revoke of {lease}");
        match self.call(
            "lease/revoke",
            &request,
            json!({ "ID": lease.0.to_string() }),
        ) {
            Err(EtcdError::Server { message, .. }) if message.contains(LEASE_NOT_FOUND) => Ok(()),
            Err(e) => Err(e),
            Ok(_) => Ok(()),
        }
    }

    /// One gateway call: `POST /v3/<rpc>` with `body`; the answer's JSON, or the error etcd
    /// gave. `request` names the call in errors.
    fn call(&self, rpc: &str, request: &str, body: Value) -> Result<Value, EtcdError> {
        let response = http::post(
            &self.agent,
            &self.endpoint,
            &format!("/v3/{rpc}"),
            body.to_string().as_bytes(),
            self.timeout,
        )
        .map_err(|e| match e {
            HttpError::Connect(source) => EtcdError::Unreachable {
                endpoint: self.endpoint.clone(),
                request: request.to_string(),
                source,
            },
            HttpError::Timeout(timeout) => EtcdError::Timeout {
                endpoint: self.endpoint.clone(),
                request: request.to_string(),
                timeout,
            },
            HttpError::Io(source) => EtcdError::Io {
                endpoint: self.endpoint.clone(),
                request: request.to_string(),
                source,
            },
            HttpError::Malformed(reason) => self.bad_response(request, reason),
        })?;
        let answer: Result<Value, _> = serde_json::from_slice(&response.body);
        match (response.status, answer) {
            (200, Ok(answer)) => Ok(answer),
            (status, Ok(error)) if error.get("code").is_some() => {
                let message = error["message"]
                    .as_str()
                    .or(error["error"].as_str())
                    .unwrap_or_default()
                    .to_string();
                let code = error["code"].as_i64().unwrap_or_default();
                Err(self.server_error(request, status, code, message))
            }
            (status, _) => {
                let text = String::from_utf8_lossy(&response.body);
                let text: String = text.trim().chars().take(200).collect();
                Err(self.bad_response(request, format!("HTTP {status} with body {text:?}")))
            }
        }
    }

    /// `kvs` of a range answer.
    fn kvs(&self, answer: &Value, request: &str) -> Result<Vec<KeyValue>, EtcdError> {
        let mut out = Vec::new();
        for kv in answer["kvs"].as_array().into_iter().flatten() {
            let lease = self.int(kv, "lease", request)?;
            out.push(KeyValue {
                key: self.bytes(kv, "key", request)?,
                value: self.bytes(kv, "value", request)?,
                create_revision: self.int(kv, "create_revision", request)?,
                mod_revision: self.int(kv, "mod_revision", request)?,
                lease: (lease != 0).then_some(LeaseId(lease)),
            });
        }
        Ok(out)
    }

    /// An int64 field: a JSON string (as the gateway sends them) or number; absent means 0
    /// (proto3 leaves out zero values).
    fn int(&self, object: &Value, field: &str, request: &str) -> Result<i64, EtcdError> {
        match &object[field] {
            Value::Null => Some(0),
            Value::String(s) => s.parse().ok(),
            Value::Number(n) => n.as_i64(),
            _ => None,
        }
        .ok_or_else(|| {
            self.bad_response(
                request,
                format!("`{field}` is not an integer: {}", object[field]),
            )
        })
    }

    /// A base64 bytes field; absent means empty.
    fn bytes(&self, object: &Value, field: &str, request: &str) -> Result<Vec<u8>, EtcdError> {
        let text = object[field].as_str().unwrap_or_default();
        BASE64
            .decode(text)
            .map_err(|e| self.bad_response(request, format!("`{field}` is not base64: {e}")))
    }

    /// Turns etcd's "lease not found" into [`EtcdError::LeaseExpired`] when `lease` was used.
    fn lease_gone(&self, e: EtcdError, lease: Option<LeaseId>, request: &str) -> EtcdError {
        match (e, lease) {
            (EtcdError::Server { message, .. }, Some(lease))
                if message.contains(LEASE_NOT_FOUND) =>
            {
                self.lease_expired(lease, request)
            }
            (e, _) => e,
        }
    }

    fn lease_expired(&self, lease: LeaseId, request: &str) -> EtcdError {
        EtcdError::LeaseExpired {
            endpoint: self.endpoint.clone(),
            request: request.to_string(),
            lease,
        }
    }

    fn server_error(&self, request: &str, status: u16, code: i64, message: String) -> EtcdError {
        EtcdError::Server {
            endpoint: self.endpoint.clone(),
            request: request.to_string(),
            status,
            code,
            message,
        }
    }

    fn bad_response(&self, request: &str, reason: String) -> EtcdError {
        EtcdError::BadResponse {
            endpoint: self.endpoint.clone(),
            request: request.to_string(),
            reason,
        }
    }
}

/// The body of a put request.
fn put_json(key: &[u8], value: &[u8], lease: Option<LeaseId>) -> Value {
    let mut put = Map::new();
    put.insert("key".into(), BASE64.encode(key).into());
    put.insert("value".into(), BASE64.encode(value).into());
    if let Some(lease) = lease {
        put.insert("lease".into(), lease.0.to_string().into());
    }
    Value::Object(put)
}

fn compare_json(compare: &Compare) -> Value {
    match compare {
        Compare::Absent(key) => json!({
            "key": BASE64.encode(key), "target": "CREATE", "result": "EQUAL",
            "create_revision": "0",
        }),
        Compare::Value(key, value) => json!({
            "key": BASE64.encode(key), "target": "VALUE", "result": "EQUAL",
            "value": BASE64.encode(value),
        }),
        Compare::Lease(key, lease) => json!({
            "key": BASE64.encode(key), "target": "LEASE", "result": "EQUAL",
            "lease": lease.0.to_string(),
        }),
    }
}

fn op_json(op: &TxnOp) -> Value {
    match op {
        TxnOp::Put { key, value, lease } => json!({ "request_put": put_json(key, value, *lease) }),
        TxnOp::Get(key) => json!({ "request_range": { "key": BASE64.encode(key) } }),
        TxnOp::Delete(key) => json!({ "request_delete_range": { "key": BASE64.encode(key) } }),
    }
}

/// The end of the range of keys starting with `prefix`: the prefix with its last byte below
/// 0xff incremented (and what follows dropped); `[0]` (every key) if there is none.
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

/// A key for messages: UTF-8 where it is, escaped elsewhere.
fn show(key: &[u8]) -> String {
    match std::str::from_utf8(key) {
        Ok(s) => s.to_string(),
        Err(_) => key.escape_ascii().to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_end_increments_the_last_byte_below_0xff() {
        assert_eq!(prefix_end(b"/a/"), b"/a0");
        assert_eq!(prefix_end(&[b'a', 0xff, 0xff]), b"b");
        assert_eq!(prefix_end(&[0xff]), [0]);
    }
}
