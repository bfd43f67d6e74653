//! Mid-step recovery as data with virtual stages: `resume_after_loss` and `validate_resumed`
//! over progress states that executions of the interleaved schedules (`1f1b-i`, `seq1f1b-i`)
//! actually reach, for every lost worker — including worker 0 and worker p−1, which are
//! neighbours round the ring, and two workers, where the one survivor is on both sides.
//!
//! Each case runs a schedule in a seeded random interleaving of its workers (FIFO channels round
//! the ring, sends never block, a receive waits for its message), stops somewhere, loses one
//! worker and resumes. The resumed step must validate (every (chunk, unit) forwarded and
//! backwarded once per virtual stage, each message received exactly once, no deadlock), the
//! survivors must re-send exactly what they sent the lost worker's chunks, and the replacement
//! must run the lost worker's whole list minus the sends its neighbours already have.

use std::collections::VecDeque;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use trainer::schedule::{
    Action, Op, Schedule, ScheduleKind, generate_virtual, neighbours_of, render_text,
    resume_after_loss, validate_resumed,
};

/// Random stop points per schedule, besides the start and the end.
const RANDOM_STOPS: usize = 12;

/// Workers running action lists over the ring's FIFO channels, one action at a time.
#[derive(Clone)]
struct Run {
    lists: Vec<Vec<Action>>,
    pc: Vec<usize>,
    /// `act[r]`: activations from worker r to worker r+1 mod p; `grad[r]`: gradients from
    /// worker r+1 mod p to worker r.
    act: Vec<VecDeque<Action>>,
    grad: Vec<VecDeque<Action>>,
}

impl Run {
    fn new(s: &Schedule) -> Self {
        let p = s.stages;
        Run {
            lists: s.actions.clone(),
            pc: vec![0; p],
            act: vec![VecDeque::new(); p],
            grad: vec![VecDeque::new(); p],
        }
    }

    fn before(&self, r: usize) -> usize {
        (r + self.lists.len() - 1) % self.lists.len()
    }

    fn ready(&self, r: usize) -> bool {
        match self.lists[r].get(self.pc[r]) {
            None => false,
            Some(a) if a.op() == Op::RecvActivation => !self.act[self.before(r)].is_empty(),
            Some(a) if a.op() == Op::RecvGrad => !self.grad[r].is_empty(),
            Some(_) => true,
        }
    }

    fn step(&mut self, r: usize) {
        let a = self.lists[r][self.pc[r]];
        let before = self.before(r);
        match a.op() {
            Op::RecvActivation => {
                self.act[before].pop_front();
            }
            Op::RecvGrad => {
                self.grad[r].pop_front();
            }
            Op::SendActivation => self.act[r].push_back(a),
            Op::SendGrad => self.grad[before].push_back(a),
            _ => {}
        }
        self.pc[r] += 1;
    }

    fn random_step(&mut self, rng: &mut ChaCha8Rng, frozen: Option<usize>) -> Option<usize> {
        let ready: Vec<usize> = (0..self.lists.len())
            .filter(|&r| Some(r) != frozen && self.ready(r))
            .collect();
        let r = *ready.get(rng.random_range(0..ready.len().max(1)))?;
        self.step(r);
        Some(r)
    }
}

#[test]
fn resumed_interleaved_steps_validate_and_resend_exactly_what_the_lost_chunks_were_sent() {
    let mut cases = 0;
    let mut replayed_somewhere = false;
    for kind in [
        ScheduleKind::Seq1F1BInterleaved,
        ScheduleKind::OneFOneBInterleaved,
    ] {
        for (p, v, m, k) in [
            (2, 2, 2, 1),
            (2, 2, 4, 2),
            (2, 3, 2, 2),
            (3, 2, 3, 3),
            (3, 2, 6, 1),
            (4, 2, 4, 2),
            (4, 2, 8, 1),
        ] {
            let s = generate_virtual(kind, p, v, m, k).unwrap();
            let mut rng = ChaCha8Rng::seed_from_u64((p * 1000 + v * 100 + m * 10 + k) as u64);
            let mut run = Run::new(&s);
            let mut trajectory = vec![run.clone()];
            while run.random_step(&mut rng, None).is_some() {
                trajectory.push(run.clone());
            }
            let n = trajectory.len() - 1;
            assert!(
                (0..p).all(|r| run.pc[r] == s.actions[r].len()),
                "{kind} p={p} v={v} m={m} k={k}: the original stalls"
            );
            let mut stops: Vec<usize> = vec![0, n / 2, n];
            stops.extend((0..RANDOM_STOPS).map(|_| rng.random_range(0..=n)));
            stops.sort_unstable();
            stops.dedup();
            for &t in &stops {
                for lost in 0..p {
                    let mut drained = trajectory[t].clone();
                    while drained.random_step(&mut rng, Some(lost)).is_some() {}
                    for (how, at_loss) in [("stopped", &trajectory[t]), ("drained", &drained)] {
                        let label = format!(
                            "{kind} p={p} v={v} m={m} k={k}, step {t}/{n} ({how}), lost worker \
                             {lost}, progress {:?}",
                            at_loss.pc
                        );
                        let res = resume_after_loss(&s, lost, &at_loss.pc)
                            .unwrap_or_else(|e| panic!("{label}: {e}"));
                        if let Err(e) = validate_resumed(&s, &res) {
                            panic!("{label}: {e}\nrest:\n{}", render_text(&res.rest));
                        }
                        let neighbours = neighbours_of(&s, lost);
                        assert_eq!(neighbours.len(), if p == 2 { 1 } else { 2 }, "{label}");
                        for r in (0..p).filter(|&r| r != lost) {
                            let done = &s.actions[r][..at_loss.pc[r]];
                            // What r sent the lost worker's chunks: activations when the lost
                            // worker comes after it in the ring, gradients when before.
                            let to_lost: Vec<Action> = done
                                .iter()
                                .copied()
                                .filter(|a| match a.op() {
                                    Op::SendActivation => (r + 1) % p == lost,
                                    Op::SendGrad => (lost + 1) % p == r,
                                    _ => false,
                                })
                                .collect();
                            assert_eq!(
                                res.rest.actions[r][..res.resent[r]],
                                to_lost[..],
                                "{label}: worker {r}'s re-sends"
                            );
                            assert_eq!(
                                res.rest.actions[r][res.resent[r]..],
                                s.actions[r][at_loss.pc[r]..],
                                "{label}: worker {r} goes on where it stood"
                            );
                        }
                        // The replacement runs the lost list minus one send per message its
                        // neighbours received from it: every receive of activations on the
                        // worker after it, every receive of gradients on the worker before it.
                        let received = |r: usize, op: Op| {
                            s.actions[r][..at_loss.pc[r]]
                                .iter()
                                .filter(|a| a.op() == op)
                                .count()
                        };
                        let have = received((lost + 1) % p, Op::RecvActivation)
                            + received((lost + p - 1) % p, Op::RecvGrad);
                        let rest = &res.rest.actions[lost];
                        assert_eq!(s.actions[lost].len() - rest.len(), have, "{label}");
                        let mut left = rest.iter().peekable();
                        for a in &s.actions[lost] {
                            if left.peek() == Some(&a) {
                                left.next();
                            } else {
                                assert!(
                                    matches!(a.op(), Op::SendActivation | Op::SendGrad),
                                    "{label}: the replacement drops {a}, not a send"
                                );
                            }
                        }
                        assert!(left.next().is_none(), "{label}: not the lost list in order");
                        replayed_somewhere |= !res.replayed.is_empty();
                        cases += 1;
                    }
                }
            }
        }
    }
    assert!(
        replayed_somewhere,
        "no case replays anything: the stops are all trivial"
    );
    eprintln!("{cases} cases");
}
