//! The pipeline's decisions, pure: when the reports of a failure are all in, which node hosts the
//! replacement of a stage lost mid-step, and what the replacement and its neighbours are told to
//! link up again. Which stage was lost is [`super::super::recovery::mid_step_stage`]'s decision;
//! the pipeline's shells carry these out.

use std::time::Duration;

use super::super::control::{Side, ToWorker};

/// How long the launcher keeps gathering the reports of a failure whose signs do not settle what
/// was lost (a worker's own error, a timeout, a silent node): until no report came for this long.
pub(in crate::runtime) const GATHER_QUIET: Duration = Duration::from_millis(300);

/// How long the launcher keeps gathering the reports of a failure once they settle what was lost:
/// losses at the same moment (a rack, a node and its buddy) show up within it, and are recovered
/// from together.
pub(super) const SETTLED_QUIET: Duration = Duration::from_millis(50);

/// Whether the reports of a failure are all in, `quiet` after the last one: [`SETTLED_QUIET`]
/// once they settle what was lost (`settled`: [`super::super::recovery::signs_settled`]), else
/// [`GATHER_QUIET`].
pub(super) fn gathered(quiet: Duration, settled: bool) -> bool {
    quiet >= GATHER_QUIET || (quiet >= SETTLED_QUIET && settled)
}

/// The stages whose nodes may host the replacement of `stage` (of `stages`), in order of
/// preference: its own node (when its agent lives), then its neighbours' (the previous first).
pub(super) fn replacement_hosts(stage: usize, stages: usize) -> Vec<usize> {
    std::iter::once(stage)
        .chain(stage.checked_sub(1))
        .chain((stage + 1 < stages).then_some(stage + 1))
        .collect()
}

/// The stages before and after stage `s` of `p` in one replica's pipeline: a line without
/// virtual stages (none before the first, none after the last), a ring with them (`ring`: the last
/// stage's chunk c feeds the first stage's chunk c+1, so their workers are linked too).
pub(super) fn neighbour_slots(s: usize, p: usize, ring: bool) -> (Option<usize>, Option<usize>) {
    if ring {
        (Some((s + p - 1) % p), Some((s + 1) % p))
    } else {
        (s.checked_sub(1), (s + 1 < p).then_some(s + 1))
    }
}

/// What a mid-step replacement of `stage` and its neighbours are told, as link generation
/// `generation`: the previous stage links to the replacement's data address (it connects, as
/// `Next`), the next stage waits for the replacement (as `Prev`), and the replacement gets its
/// topology (`data_addrs`: every stage's data address, the replacement's included). With virtual
/// stages (`ring`) the stages form a ring (see [`neighbour_slots`]); with two stages the one
/// survivor gets both orders, `Next` first. Returns the neighbours' `Relink`s, then the
/// replacement's `Topology`.
pub(super) fn relinks(
    stage: usize,
    generation: u64,
    data_addrs: &[String],
    ring: bool,
) -> (Vec<(usize, ToWorker)>, ToWorker) {
    let (prev, next) = neighbour_slots(stage, data_addrs.len(), ring);
    let mut neighbours = Vec::new();
    if let Some(before) = prev.filter(|&b| b != stage) {
        neighbours.push((
            before,
            ToWorker::Relink {
                generation,
                side: Side::Next,
                addr: Some(data_addrs[stage].clone()),
            },
        ));
    }
    if let Some(after) = next.filter(|&a| a != stage) {
        neighbours.push((
            after,
            ToWorker::Relink {
                generation,
                side: Side::Prev,
                addr: None,
            },
        ));
    }
    let topology = ToWorker::Topology {
        generation,
        prev: prev.map(|b| data_addrs[b].clone()),
        next: next.map(|a| data_addrs[a].clone()),
        replacement: true,
        replicas: Vec::new(),
    };
    (neighbours, topology)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_are_in_after_a_short_quiet_once_settled_else_a_longer_one() {
        let ms = Duration::from_millis;
        assert!(!gathered(ms(10), true));
        assert!(gathered(ms(50), true));
        assert!(!gathered(ms(299), false));
        assert!(gathered(ms(300), false));
    }

    #[test]
    fn stages_are_linked_in_a_line_or_with_virtual_stages_in_a_ring() {
        assert_eq!(neighbour_slots(0, 4, false), (None, Some(1)));
        assert_eq!(neighbour_slots(2, 4, false), (Some(1), Some(3)));
        assert_eq!(neighbour_slots(3, 4, false), (Some(2), None));
        assert_eq!(neighbour_slots(0, 1, false), (None, None));
        assert_eq!(neighbour_slots(0, 4, true), (Some(3), Some(1)));
        assert_eq!(neighbour_slots(3, 4, true), (Some(2), Some(0)));
        // Two workers in a ring: each is the other's previous and next (two links).
        assert_eq!(neighbour_slots(0, 2, true), (Some(1), Some(1)));
        assert_eq!(neighbour_slots(1, 2, true), (Some(0), Some(0)));
    }

    #[test]
    fn a_replacement_runs_on_its_own_node_or_a_neighbours() {
        assert_eq!(replacement_hosts(0, 4), [0, 1]);
        assert_eq!(replacement_hosts(2, 4), [2, 1, 3]);
        assert_eq!(replacement_hosts(3, 4), [3, 2]);
        assert_eq!(replacement_hosts(0, 1), [0]);
    }

    fn addrs(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("10.0.0.{i}:7000")).collect()
    }

    #[test]
    fn a_middle_replacement_relinks_both_neighbours() {
        let (neighbours, topology) = relinks(1, 5, &addrs(3), false);
        assert_eq!(neighbours.len(), 2);
        assert!(matches!(
            &neighbours[0],
            (0, ToWorker::Relink { generation: 5, side: Side::Next, addr: Some(a) }) if a == "10.0.0.1:7000"
        ));
        assert!(matches!(
            &neighbours[1],
            (
                2,
                ToWorker::Relink {
                    generation: 5,
                    side: Side::Prev,
                    addr: None
                }
            )
        ));
        let ToWorker::Topology {
            generation,
            prev,
            next,
            replacement,
            replicas,
        } = topology
        else {
            panic!("{topology:?}");
        };
        assert_eq!(generation, 5);
        assert_eq!(prev.as_deref(), Some("10.0.0.0:7000"));
        assert_eq!(next.as_deref(), Some("10.0.0.2:7000"));
        assert!(replacement && replicas.is_empty());
    }

    #[test]
    fn an_end_replacement_relinks_its_one_neighbour() {
        let (first, topology) = relinks(0, 2, &addrs(3), false);
        assert!(matches!(
            first.as_slice(),
            [(
                1,
                ToWorker::Relink {
                    side: Side::Prev,
                    ..
                }
            )]
        ));
        assert!(matches!(
            topology,
            ToWorker::Topology {
                prev: None,
                next: Some(_),
                ..
            }
        ));
        let (last, topology) = relinks(2, 2, &addrs(3), false);
        assert!(matches!(
            last.as_slice(),
            [(
                1,
                ToWorker::Relink {
                    side: Side::Next,
                    ..
                }
            )]
        ));
        assert!(matches!(
            topology,
            ToWorker::Topology {
                prev: Some(_),
                next: None,
                ..
            }
        ));
    }

    /// With virtual stages the first and the last worker are neighbours: their replacements
    /// relink both sides, and with two workers the survivor gets both orders (`Next` first, so
    /// it connects before it accepts).
    #[test]
    fn a_replacement_in_a_ring_relinks_round_the_ends() {
        let (neighbours, topology) = relinks(0, 3, &addrs(4), true);
        assert!(matches!(
            neighbours.as_slice(),
            [
                (3, ToWorker::Relink { side: Side::Next, addr: Some(a), .. }),
                (1, ToWorker::Relink { side: Side::Prev, addr: None, .. }),
            ] if a == "10.0.0.0:7000"
        ));
        assert!(matches!(
            topology,
            ToWorker::Topology { prev: Some(p), next: Some(n), replacement: true, .. }
                if p == "10.0.0.3:7000" && n == "10.0.0.1:7000"
        ));
        let (neighbours, topology) = relinks(1, 3, &addrs(2), true);
        assert!(matches!(
            neighbours.as_slice(),
            [
                (
                    0,
                    ToWorker::Relink {
                        side: Side::Next,
                        addr: Some(_),
                        ..
                    }
                ),
                (
                    0,
                    ToWorker::Relink {
                        side: Side::Prev,
                        addr: None,
                        ..
                    }
                ),
            ]
        ));
        assert!(matches!(
            topology,
            ToWorker::Topology { prev: Some(p), next: Some(n), .. }
                if p == "10.0.0.0:7000" && n == "10.0.0.0:7000"
        ));
    }
}
