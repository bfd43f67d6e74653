//! seqpipe's rendezvous in etcd: the job, its live nodes, its coordinator leadership, its plan
//! generation and its current plan, under one key prefix.
//!
//! ```text
//! <prefix>/job          hash of the job token, written at first use, never attached to a lease
//! <prefix>/nodes/<id>   a live node's NodeInfo (JSON), attached to that node's lease
//! <prefix>/leader       the coordinator's Leader (JSON), attached to the coordinator's lease
//! <prefix>/generation   the plan generation (decimal), advanced by compare-and-swap only
//! <prefix>/plan         the current Plan (JSON), written only under its own generation
//! ```
//!
//! Liveness is etcd's: a node keeps its lease alive (every third of its TTL); when its process
//! or machine dies the lease expires and its keys go, so its registration disappears and, if it
//! was the coordinator, the leadership is free for the next [`Rendezvous::campaign`].

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::client::{Compare, EtcdClient, KeyValue, Lease, TxnOp};
use super::error::EtcdError;
use super::lease::LeaseId;
use super::url::EtcdUrl;
use crate::node::{NodeId, NodeInfo};
use crate::plan::Plan;

/// Who coordinates the job: the value of `<prefix>/leader`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Leader {
    /// The candidate's name (e.g. its node id).
    pub candidate: String,
    /// Where the coordinator listens (`host:port`).
    pub addr: String,
}

/// One job's rendezvous: an [`EtcdClient`] and the job's key prefix.
#[derive(Clone, Debug)]
pub struct Rendezvous {
    client: EtcdClient,
    prefix: String,
}

impl Rendezvous {
    /// Connects to the rendezvous at `url` as a member of the job whose token hashes to
    /// `job_token_hash`. The first member of a job records the hash; a later one with another
    /// hash is refused with [`EtcdError::WrongJob`], so a node with the wrong token cannot
    /// join.
    pub fn connect(url: &EtcdUrl, job_token_hash: &str) -> Result<Self, EtcdError> {
        let rendezvous = Self {
            client: EtcdClient::new(url.endpoint()),
            prefix: url.prefix().to_string(),
        };
        let key = rendezvous.key("job");
        let answer = rendezvous.client.txn(
            &[Compare::Absent(key.clone().into_bytes())],
            &[TxnOp::Put {
                key: key.clone().into_bytes(),
                value: job_token_hash.as_bytes().to_vec(),
                lease: None,
            }],
            &[TxnOp::Get(key.clone().into_bytes())],
        )?;
        let found = match answer.fetched.first() {
            Some(kv) => String::from_utf8_lossy(&kv.value).into_owned(),
            None => job_token_hash.to_string(),
        };
        if found != job_token_hash {
            return Err(EtcdError::WrongJob {
                endpoint: url.endpoint().to_string(),
                prefix: rendezvous.prefix,
                key,
                found,
                ours: job_token_hash.to_string(),
            });
        }
        Ok(rendezvous)
    }

    /// Grants a lease of `ttl` (see [`EtcdClient::grant`]: etcd may raise a short TTL).
    pub fn grant(&self, ttl: Duration) -> Result<Lease, EtcdError> {
        self.client.grant(ttl)
    }

    /// Renews `lease` and returns its TTL; [`EtcdError::LeaseExpired`] if it is gone, in which
    /// case this node's registration and any leadership are gone too.
    pub fn keep_alive(&self, lease: LeaseId) -> Result<Duration, EtcdError> {
        self.client.keep_alive(lease)
    }

    /// Revokes `lease`: at once deregisters and resigns whatever was attached to it.
    pub fn revoke(&self, lease: LeaseId) -> Result<(), EtcdError> {
        self.client.revoke(lease)
    }

    /// Registers (or updates) `node` as live for as long as `lease` lives.
    pub fn register(&self, node: &NodeInfo, lease: LeaseId) -> Result<(), EtcdError> {
        let value = serde_json::to_vec(node).expect("a NodeInfo always serializes");
        self.client
            .put(self.node_key(&node.id).as_bytes(), &value, Some(lease))
    }

    /// The registered nodes whose leases are alive, sorted by id.
    pub fn nodes(&self) -> Result<Vec<NodeInfo>, EtcdError> {
        let kvs = self.client.get_prefix(self.key("nodes/").as_bytes())?;
        kvs.iter().map(|kv| self.decode_json(kv)).collect()
    }

    /// Removes `id`'s registration; returns whether it was there.
    pub fn deregister(&self, id: &NodeId) -> Result<bool, EtcdError> {
        self.client.delete(self.node_key(id).as_bytes())
    }

    /// Tries to become the coordinator: creates `<prefix>/leader` = `{candidate, addr}` attached
    /// to `lease`, only if no leader exists. Returns whether this candidate leads, which is
    /// also true when the leader key is already held under `lease` (a repeated campaign).
    pub fn campaign(&self, candidate: &str, addr: &str, lease: LeaseId) -> Result<bool, EtcdError> {
        let key = self.key("leader").into_bytes();
        let leader = Leader {
            candidate: candidate.to_string(),
            addr: addr.to_string(),
        };
        let answer = self.client.txn(
            &[Compare::Absent(key.clone())],
            &[TxnOp::Put {
                key: key.clone(),
                value: serde_json::to_vec(&leader).expect("a Leader always serializes"),
                lease: Some(lease),
            }],
            &[TxnOp::Get(key)],
        )?;
        Ok(answer.succeeded
            || answer
                .fetched
                .first()
                .is_some_and(|kv| kv.lease == Some(lease)))
    }

    /// The current coordinator, if any.
    pub fn leader(&self) -> Result<Option<Leader>, EtcdError> {
        match self.client.get(self.key("leader").as_bytes())? {
            Some(kv) => self.decode_json(&kv).map(Some),
            None => Ok(None),
        }
    }

    /// Gives up the leadership held under `lease`; returns whether it was held (another
    /// leader's key is never touched).
    pub fn resign(&self, lease: LeaseId) -> Result<bool, EtcdError> {
        let key = self.key("leader").into_bytes();
        let answer = self.client.txn(
            &[Compare::Lease(key.clone(), lease)],
            &[TxnOp::Delete(key)],
            &[],
        )?;
        Ok(answer.succeeded)
    }

    /// The plan generation; 0 before the first [`Rendezvous::bump_generation`].
    pub fn generation(&self) -> Result<u64, EtcdError> {
        match self.client.get(self.key("generation").as_bytes())? {
            Some(kv) => self.decode_generation(&kv),
            None => Ok(0),
        }
    }

    /// Advances the generation from `expected` to `expected + 1` and returns the new one, as a
    /// compare-and-swap: if another coordinator moved it first, nothing is written and the
    /// answer is [`EtcdError::GenerationRace`] with the generation found.
    pub fn bump_generation(&self, expected: u64) -> Result<u64, EtcdError> {
        let key = self.key("generation");
        let next = expected + 1;
        let answer = self.client.txn(
            &[self.generation_is(expected)],
            &[TxnOp::Put {
                key: key.clone().into_bytes(),
                value: next.to_string().into_bytes(),
                lease: None,
            }],
            &[TxnOp::Get(key.clone().into_bytes())],
        )?;
        if answer.succeeded {
            Ok(next)
        } else {
            Err(self.race(key, expected, answer.fetched.first()))
        }
    }

    /// Publishes `plan` as the current plan, only while the generation is still
    /// `plan.generation` (else [`EtcdError::GenerationRace`]): a coordinator that lost a race
    /// cannot overwrite the winner's plan.
    pub fn publish_plan(&self, plan: &Plan) -> Result<(), EtcdError> {
        let gen_key = self.key("generation");
        let answer = self.client.txn(
            &[self.generation_is(plan.generation)],
            &[TxnOp::Put {
                key: self.key("plan").into_bytes(),
                value: serde_json::to_vec(plan).expect("a Plan always serializes"),
                lease: None,
            }],
            &[TxnOp::Get(gen_key.clone().into_bytes())],
        )?;
        if answer.succeeded {
            Ok(())
        } else {
            Err(self.race(gen_key, plan.generation, answer.fetched.first()))
        }
    }

    /// The current plan, if one was published.
    pub fn plan(&self) -> Result<Option<Plan>, EtcdError> {
        match self.client.get(self.key("plan").as_bytes())? {
            Some(kv) => self.decode_json(&kv).map(Some),
            None => Ok(None),
        }
    }

    /// `<prefix>/<name>`.
    fn key(&self, name: &str) -> String {
        format!("{}/{name}", self.prefix)
    }

    fn node_key(&self, id: &NodeId) -> String {
        self.key(&format!("nodes/{id}"))
    }

    /// The comparison "the generation is `generation`" (no key stands for 0).
    fn generation_is(&self, generation: u64) -> Compare {
        let key = self.key("generation").into_bytes();
        if generation == 0 {
            Compare::Absent(key)
        } else {
            Compare::Value(key, generation.to_string().into_bytes())
        }
    }

    /// The error for a lost generation race, given the generation key as read by the
    /// transaction's failure branch (or the error reading it).
    fn race(&self, key: String, expected: u64, found: Option<&KeyValue>) -> EtcdError {
        match found.map_or(Ok(0), |kv| self.decode_generation(kv)) {
            Ok(found) => EtcdError::GenerationRace {
                endpoint: self.client.endpoint().to_string(),
                key,
                expected,
                found,
            },
            Err(e) => e,
        }
    }

    fn decode_generation(&self, kv: &KeyValue) -> Result<u64, EtcdError> {
        std::str::from_utf8(&kv.value)
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| self.bad_value(kv, "not a decimal generation number".into()))
    }

    fn decode_json<T: serde::de::DeserializeOwned>(&self, kv: &KeyValue) -> Result<T, EtcdError> {
        serde_json::from_slice(&kv.value).map_err(|e| self.bad_value(kv, e.to_string()))
    }

    fn bad_value(&self, kv: &KeyValue, reason: String) -> EtcdError {
        EtcdError::BadValue {
            endpoint: self.client.endpoint().to_string(),
            key: String::from_utf8_lossy(&kv.key).into_owned(),
            reason,
        }
    }
}
