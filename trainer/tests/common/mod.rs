//! Helpers shared by trainer's integration tests: a schedule run in one process.

use std::collections::HashMap;

use anyhow::{Result, bail, ensure};
use candle_core::Tensor;
use trainer::model::{Stage, StageOutput};
use trainer::schedule::{Action, Schedule, Unit};

/// Runs the forwards and backwards of `schedule` on `stages` in one process, each stage following
/// its own action list (a stage waits until its input is available; messages are buffered without
/// bound). `forward(stage, r, unit, hidden)` runs a unit's forward on stage `r`: `hidden` is the
/// previous stage's output, `None` on the first stage (which reads its tokens). Returns the last
/// stage's loss sums in the order it computed them; every message was delivered.
pub fn run_in_process(
    stages: &mut [Stage],
    schedule: &Schedule,
    mut forward: impl FnMut(&mut Stage, usize, Unit, Option<Tensor>) -> Result<StageOutput>,
) -> Result<Vec<f64>> {
    let p = stages.len();
    let compute: Vec<Vec<Action>> = schedule
        .actions
        .iter()
        .map(|acts| {
            acts.iter()
                .copied()
                .filter(|a| matches!(a, Action::Forward(_) | Action::Backward(_)))
                .collect()
        })
        .collect();
    let mut next = vec![0; p];
    let mut activations: HashMap<(usize, Unit), Tensor> = HashMap::new();
    let mut gradients: HashMap<(usize, Unit), Tensor> = HashMap::new();
    let mut losses = Vec::new();
    loop {
        let mut progressed = false;
        for r in 0..p {
            while let Some(&action) = compute[r].get(next[r]) {
                match action {
                    Action::Forward(unit) => {
                        let hidden = if r == 0 {
                            None
                        } else {
                            match activations.remove(&(r, unit)) {
                                Some(h) => Some(h),
                                None => break,
                            }
                        };
                        match forward(&mut stages[r], r, unit, hidden)? {
                            StageOutput::Hidden(h) => {
                                activations.insert((r + 1, unit), h);
                            }
                            StageOutput::LossSum(l) => losses.push(l),
                        }
                    }
                    Action::Backward(unit) => {
                        let d = if r + 1 == p {
                            None
                        } else {
                            match gradients.remove(&(r, unit)) {
                                Some(g) => Some(g),
                                None => break,
                            }
                        };
                        if let Some(g) = stages[r].backward(unit, d)? {
                            gradients.insert((r - 1, unit), g);
                        }
                    }
                    other => bail!("unexpected action {other:?}"),
                }
                next[r] += 1;
                progressed = true;
            }
        }
        if (0..p).all(|r| next[r] == compute[r].len()) {
            break;
        }
        ensure!(
            progressed,
            "schedule {:?} deadlocked at {next:?}",
            schedule.kind
        );
    }
    ensure!(
        activations.is_empty() && gradients.is_empty(),
        "undelivered messages"
    );
    Ok(losses)
}
