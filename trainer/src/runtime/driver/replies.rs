//! What the workers report about one step, gathered: the per-parameter sums of squared gradients
//! (in canonical order, checked to agree bit for bit between the replicas of a stage), the
//! replicas' loss sums (added in the summation tree's order), the stages' costs, and — with data
//! parallelism — which reduction round is complete. Pure bookkeeping, no I/O: the driver reads the
//! messages and hands them here.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use ops::sum_tree::SumTree;

use super::super::control::StepCost;
use super::super::error::LaunchError;
use super::super::pipeline::Replacement;

/// What the stages reported for one step's forward and backward.
pub(super) struct StepReplies {
    /// Per-parameter sums of squared gradients, in canonical order.
    pub(super) sums: Vec<Option<f64>>,
    /// Per replica: its last stage's sum of token losses.
    pub(super) loss_sums: Vec<Option<f64>>,
    pub(super) retained_bytes: u64,
    pub(super) reduce_bytes: u64,
    pub(super) reduce_s: f64,
    /// The most full-gradient buffers any worker held at once.
    pub(super) gradient_buffers: usize,
    pub(super) units: usize,
    pub(super) compute_s: f64,
    pub(super) compute_cpu_s: f64,
    /// What the worker processes used since their previous reports, summed.
    pub(super) page_faults: u64,
    pub(super) cpu_user_s: f64,
    pub(super) cpu_system_s: f64,
    /// Per stage.
    pub(super) peak_activation_bytes: Vec<u64>,
    /// Per stage.
    pub(super) state_bytes: Vec<u64>,
    /// Some worker's previous peer snapshot was still in flight when it reported the step.
    pub(super) peer_copy_in_flight: bool,
    /// Stages replaced in the middle of the step, with the replacement's cost once it reported.
    pub(super) replaced: Vec<(Replacement, Option<StepCost>)>,
    /// Data parallelism: the replica lost in the middle of the step, whose share was re-routed,
    /// and the failure that took it out.
    pub(super) rerouted: Option<(usize, LaunchError)>,
    /// Units computed again because of the re-routing, and their seconds.
    pub(super) redone: (usize, f64),
}

impl StepReplies {
    pub(super) fn new(stages: usize, replicas: usize, params: usize) -> Self {
        Self {
            sums: vec![None; params],
            loss_sums: vec![None; replicas],
            retained_bytes: 0,
            reduce_bytes: 0,
            reduce_s: 0.0,
            gradient_buffers: 0,
            units: 0,
            compute_s: 0.0,
            compute_cpu_s: 0.0,
            page_faults: 0,
            cpu_user_s: 0.0,
            cpu_system_s: 0.0,
            peak_activation_bytes: vec![0; stages],
            state_bytes: vec![0; stages],
            peer_copy_in_flight: false,
            replaced: Vec::new(),
            rerouted: None,
            redone: (0, 0.0),
        }
    }

    /// Adds the `StepDone` of worker `slot` (stage `slot % stages` of replica `slot / stages`).
    /// The replicas of a stage hold the same reduced gradients: their sums of squares must agree
    /// bit for bit.
    pub(super) fn add(
        &mut self,
        slot: usize,
        sums_of_squares: Vec<(String, f64)>,
        loss_sum: Option<f64>,
        cost: StepCost,
        canonical: &HashMap<String, usize>,
    ) -> Result<(), LaunchError> {
        let stages = self.peak_activation_bytes.len();
        let (replica, stage) = (slot / stages, slot % stages);
        for (name, value) in sums_of_squares {
            let index = *canonical
                .get(&name)
                .ok_or_else(|| LaunchError::Protocol(format!("unknown parameter {name}")))?;
            match self.sums[index] {
                Some(seen) if seen.to_bits() != value.to_bits() => {
                    return Err(LaunchError::Protocol(format!(
                        "the replicas of stage {stage} disagree on the gradient of {name} \
                         (sum of squares {seen} vs {value} from replica {replica}): the \
                         reduction is not deterministic"
                    )));
                }
                _ => self.sums[index] = Some(value),
            }
        }
        if let Some(l) = loss_sum {
            self.loss_sums[replica] = Some(l);
        }
        self.retained_bytes += cost.retained_bytes;
        self.reduce_bytes += cost.reduce_bytes;
        self.reduce_s = self.reduce_s.max(cost.reduce_s);
        self.gradient_buffers = self.gradient_buffers.max(cost.gradient_buffers);
        self.units += cost.units;
        self.compute_s += cost.compute_s;
        self.compute_cpu_s += cost.compute_cpu_s;
        self.page_faults += cost.page_faults;
        self.cpu_user_s += cost.cpu_user_s;
        self.cpu_system_s += cost.cpu_system_s;
        self.peer_copy_in_flight |= cost.peer_copy_in_flight;
        self.redone.0 += cost.redone_units;
        self.redone.1 += cost.redone_s;
        if let Some(peak) = self.peak_activation_bytes.get_mut(stage) {
            *peak = (*peak).max(cost.peak_activation_bytes);
            self.state_bytes[stage] = cost.state_bytes;
        }
        if let Some((_, redone)) = self.replaced.iter_mut().find(|(r, _)| r.stage == slot) {
            *redone = Some(cost);
        }
        Ok(())
    }

    /// The sum of the step's token losses: the replicas' sums added in the summation tree's
    /// order over the step's micro-batches, the same number whatever the replica count and the
    /// order the replicas reported in; `None` until every replica's last stage reported.
    pub(super) fn loss_sum(&self, micro_batches: usize) -> Option<f64> {
        let d = self.loss_sums.len();
        let c = micro_batches / d;
        let mut tree = SumTree::new(micro_batches);
        let mut add = |a: f64, b: f64| Ok::<f64, std::convert::Infallible>(a + b);
        for (r, l) in self.loss_sums.iter().enumerate() {
            tree.push(r * c, (r + 1) * c, (*l)?, &mut add).ok()?;
        }
        tree.finish::<std::convert::Infallible>().ok()
    }
}

impl StepReplies {
    /// The per-parameter sums of squares in canonical order, once every parameter's came in.
    pub(super) fn take_sums(&mut self) -> Result<Vec<f64>, LaunchError> {
        std::mem::take(&mut self.sums)
            .into_iter()
            .enumerate()
            .map(|(i, s)| {
                s.ok_or_else(|| {
                    LaunchError::Protocol(format!("no gradient norm for parameter #{i}"))
                })
            })
            .collect()
    }
}

/// Where a reduction round of a data-parallel step stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Round {
    /// Some active worker has not answered the round yet.
    Waiting,
    /// Every active worker finished it.
    Complete,
    /// Every active worker answered and some failed to reduce, none lost: the slots that failed
    /// and the first one's error.
    Failed { slots: Vec<usize>, error: String },
}

/// Where the current round stands, from the `active` workers (not retired), those that
/// `finished` it and those whose reduction `failed` (slot → error).
pub(super) fn round(
    active: &[usize],
    finished: &BTreeSet<usize>,
    failed: &BTreeMap<usize, String>,
) -> Round {
    if !active
        .iter()
        .all(|w| finished.contains(w) || failed.contains_key(w))
    {
        return Round::Waiting;
    }
    match failed.values().next() {
        None => Round::Complete,
        Some(error) => Round::Failed {
            slots: failed.keys().copied().collect(),
            error: error.clone(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn canonical(names: &[&str]) -> HashMap<String, usize> {
        names
            .iter()
            .enumerate()
            .map(|(i, n)| (n.to_string(), i))
            .collect()
    }

    fn cost(units: usize, peak: u64) -> StepCost {
        StepCost {
            units,
            peak_activation_bytes: peak,
            ..StepCost::default()
        }
    }

    /// Two replicas of two stages: the replicas of a stage report the same sums; the costs add
    /// up, the peaks are per stage, and the sums come out in canonical order.
    #[test]
    fn replies_of_every_stage_and_replica_add_up_in_canonical_order() {
        let names = canonical(&["wte", "h.0.w", "h.1.w"]);
        let mut r = StepReplies::new(2, 2, names.len());
        let stage0 = vec![("h.0.w".to_string(), 2.0), ("wte".to_string(), 1.0)];
        let stage1 = vec![("h.1.w".to_string(), 3.0)];
        r.add(0, stage0.clone(), None, cost(4, 10), &names).unwrap();
        r.add(1, stage1.clone(), Some(5.0), cost(4, 20), &names)
            .unwrap();
        assert_eq!(r.loss_sum(4), None, "replica 1 has not reported its loss");
        r.add(2, stage0, None, cost(4, 30), &names).unwrap();
        r.add(3, stage1, Some(7.0), cost(4, 5), &names).unwrap();
        assert_eq!(r.units, 16);
        assert_eq!(r.peak_activation_bytes, [30, 20]);
        assert_eq!(r.loss_sum(4), Some(12.0));
        assert_eq!(r.take_sums().unwrap(), [1.0, 2.0, 3.0]);
    }

    #[test]
    fn replicas_that_disagree_or_unknown_names_are_protocol_errors() {
        let names = canonical(&["wte"]);
        let mut r = StepReplies::new(1, 2, 1);
        r.add(0, vec![("wte".into(), 1.0)], None, cost(1, 0), &names)
            .unwrap();
        let e = r
            .add(
                1,
                vec![("wte".into(), 1.0 + 1e-15)],
                None,
                cost(1, 0),
                &names,
            )
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("disagree on the gradient of wte") && e.contains("replica 1"),
            "{e}"
        );
        let e = r
            .add(0, vec![("nope".into(), 1.0)], None, cost(1, 0), &names)
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown parameter nope"), "{e}");
        let mut missing = StepReplies::new(1, 1, 2);
        missing.sums[0] = Some(1.0);
        let e = missing.take_sums().unwrap_err().to_string();
        assert!(e.contains("parameter #1"), "{e}");
    }

    /// The loss of a step is the same number whatever the order the replicas reported in: the
    /// summation tree fixes the order of the additions.
    #[test]
    fn the_loss_sum_does_not_depend_on_the_reporting_order() {
        let losses = [0.1, 1e16, -1e16, 0.3];
        let sum = |order: &[usize]| {
            let mut r = StepReplies::new(1, 4, 0);
            for &i in order {
                r.add(i, vec![], Some(losses[i]), cost(0, 0), &HashMap::new())
                    .unwrap();
            }
            r.loss_sum(8).unwrap()
        };
        let forward = sum(&[0, 1, 2, 3]);
        assert_eq!(forward.to_bits(), sum(&[3, 1, 0, 2]).to_bits());
        assert_eq!(forward.to_bits(), sum(&[2, 3, 1, 0]).to_bits());
    }

    #[test]
    fn a_round_completes_when_every_active_worker_answered() {
        let active = [0, 1, 3];
        let mut finished = BTreeSet::from([0, 1]);
        let mut failed = BTreeMap::new();
        assert_eq!(round(&active, &finished, &failed), Round::Waiting);
        finished.insert(3);
        assert_eq!(round(&active, &finished, &failed), Round::Complete);
        finished.remove(&1);
        failed.insert(1, "peer 3 closed".to_string());
        assert_eq!(
            round(&active, &finished, &failed),
            Round::Failed {
                slots: vec![1],
                error: "peer 3 closed".into()
            }
        );
        // A retired worker (slot 2) is not waited for.
        assert_eq!(
            round(&[0, 3], &BTreeSet::from([0, 3]), &BTreeMap::new()),
            Round::Complete
        );
    }
}
