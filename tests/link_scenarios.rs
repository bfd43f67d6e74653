//! Recovery scenarios decided by the order in which the coordinator hears things on different
//! control links, made deterministic by holding one link's messages (see `harness::links`): a
//! message is held until an event (the coordinator has handled a node's death), then delivered
//! or dropped with its connection. Each scenario ends bit-identical to an undisturbed run.

mod common;
mod harness;

use std::sync::{Arc, OnceLock};

use harness::links::{Dir, End, Hold, Msg};
use harness::{Cluster, Pos, Rule, UNITS_PER_STAGE, WorkerId};
use trainer::runtime::control::{FromAgent, ToLauncher};
use trainer::runtime::kill_switch::Verdict;
use trainer::runtime::recovery::Tier;

/// The step the scenarios disturb: a checkpoint step (`checkpoint.every = 2`), so that a step
/// that went on too early meets the checkpoint's wait for the workers' shards.
const STEP: u64 = 4;

/// Whether `msg` on `end`'s link in `dir` is the report of `step` by the first worker of `stage`
/// (not a replacement).
fn step_done_of(stage: usize, step: u64, end: &End, dir: Dir, msg: &Msg) -> bool {
    matches!(end, End::Worker(id) if id.stage == stage && !id.replacement)
        && dir == Dir::ToCoordinator
        && matches!(msg, Msg::FromWorker(ToLauncher::StepDone { step: s, .. }) if *s == step)
}

/// Rules that hold stage 3's `StepDone` of [`STEP`] on its way to the coordinator, and once it
/// is held (and the peer snapshots of the step before are too) run `then` on the worker's node.
fn hold_step_done_then(
    then: impl FnOnce(&Arc<Cluster>, &WorkerId, &Hold) + Send + 'static,
) -> Vec<Rule> {
    let slot: Arc<OnceLock<Arc<Hold>>> = Arc::default();
    let armed = Arc::clone(&slot);
    vec![
        // Armed before the worker's last action of the step, so before its report is sent.
        Rule::at(3, STEP, Pos::LastAction, move |c, _| {
            let hold = c.hold(|end, dir, msg| step_done_of(3, STEP, end, dir, msg));
            assert!(armed.set(hold).is_ok(), "armed twice");
            Verdict::Go
        }),
        // The report is sent (and held by the relay): the worker's node dies now.
        Rule::at(3, STEP, Pos::StepDone, move |c, id| {
            let hold = slot.get().expect("the hold was armed at the last action");
            hold.wait_caught();
            c.wait_held(STEP - 1, 2);
            then(c, id, hold);
            Verdict::Kill
        }),
    ]
}

/// The race of commit 17da276, made deterministic: stage 3's node (agent and worker) dies just
/// after its worker sent `StepDone`, and the coordinator reads the agent's closed connection
/// before that report (held here until the coordinator has handled the death). The stage looks
/// lost mid-step, so a replacement redoes its part of the step on a neighbour's node; the dead
/// worker's report, read while the loss was being gathered, must not count as the
/// replacement's. (It used to: the step went on to its update while the replacement still ran
/// it, and the replacement's late `Updated` ended the run with a protocol error.)
#[test]
fn a_dead_workers_last_report_read_after_its_nodes_death_is_not_its_replacements() {
    let out = harness::run(
        "stale-step-done",
        4,
        &[],
        hold_step_done_then(|c, id, hold| {
            c.kill_node_seen_first(&id.node);
            hold.release();
        }),
    );
    assert_eq!(
        out.result,
        Ok(harness::STEPS),
        "the run failed; events: {:#?}",
        out.events
    );
    let r = out.recoveries();
    assert_eq!(r.len(), 2, "{:#?}", out.events);
    assert_eq!(
        (
            r[0].tier,
            r[0].stage,
            r[0].node.as_ref().map(|n| n.as_str()),
            r[0].host.as_ref().map(|n| n.as_str()),
        ),
        (Tier::MidStep, Some(3), Some("node-3"), Some("node-2")),
        "{:#?}",
        out.events
    );
    // The dead worker had finished every unit, but the coordinator never counted its report:
    // the replacement redoes them all.
    assert_eq!(r[0].redone_units, Some(UNITS_PER_STAGE as usize), "{r:?}");
    assert_eq!(
        (r[1].tier, r[1].stages_before, r[1].stages_after),
        (Tier::Handover, 4, 3),
        "{:#?}",
        out.events
    );
    let lost = out.lost();
    assert_eq!(lost.len(), 1, "{:#?}", out.events);
    assert_eq!(
        (lost[0].node.as_str(), lost[0].agent_alive, lost[0].mid_step),
        ("node-3", false, Some(true))
    );
    out.assert_bit_identical();
}

/// The same death, with the held report dropped with its connection (it never arrives): the
/// replacement's own report is the only one, and the run ends as the one above.
#[test]
fn a_dead_workers_report_lost_with_its_connection_is_redone_by_its_replacement() {
    let out = harness::run(
        "lost-step-done",
        4,
        &[],
        hold_step_done_then(|c, id, hold| {
            c.kill_node_seen_first(&id.node);
            hold.drop_with_connection();
        }),
    );
    let r = out.recoveries();
    assert_eq!(r.len(), 2, "{:#?}", out.events);
    assert_eq!(
        (r[0].tier, r[0].stage, r[0].redone_units),
        (Tier::MidStep, Some(3), Some(UNITS_PER_STAGE as usize)),
        "{:#?}",
        out.events
    );
    assert_eq!(out.lost_nodes(), ["node-3"]);
    out.assert_bit_identical();
}

/// A stall of the whole fleet as the coordinator sees it (issue 35): every agent's heartbeats
/// stop reaching it (held on their links) while the pipeline stands still (stage 0 stops at the
/// start of step 3), so it declares all four nodes dead at once and fences them. Each agent
/// joins again as a new incarnation, as the real agent does, while its old incarnation's held
/// heartbeats reach the coordinator only afterwards (refused). The run must re-plan on the new
/// incarnations — not report "only 0 nodes alive" — and end bit-identical. A fenced agent is the
/// same process joining again: it keeps the peer snapshots it holds and reports them to its new
/// connection, so the interrupted step is redone from the peer snapshots of the step before and
/// no step is lost.
#[test]
fn a_fleet_wide_stall_that_fences_every_node_keeps_the_whole_pipeline() {
    let out = harness::run(
        "fleet-stall",
        4,
        &["elastic.dead_after_s=1"],
        vec![Rule::at(0, 3, Pos::Action(0), |c, _| {
            c.rejoin_when_fenced();
            let holds: Vec<Arc<Hold>> = (0..4)
                .map(|r| {
                    let node = format!("node-{r}");
                    c.hold(move |end, dir, msg| {
                        matches!(end, End::Agent { node: n } if *n == node)
                            && dir == Dir::ToCoordinator
                            && matches!(msg, Msg::FromAgent(FromAgent::Heartbeat))
                    })
                })
                .collect();
            for hold in &holds {
                hold.wait_caught();
            }
            // The coordinator's own clock runs: after `dead_after_s` of silence it fences all.
            c.wait_fenced(4);
            for hold in &holds {
                hold.release();
            }
            Verdict::Kill
        })],
    );
    assert_eq!(
        out.result,
        Ok(harness::STEPS),
        "the run failed; events: {:#?}",
        out.events
    );
    let mut lost = out.lost_nodes();
    lost.sort();
    assert_eq!(
        lost,
        ["node-0", "node-1", "node-2", "node-3"],
        "{:#?}",
        out.events
    );
    let r = out.the_recovery();
    assert_eq!(
        (r.stages_before, r.stages_after),
        (4, 4),
        "{:#?}",
        out.events
    );
    assert_eq!((r.tier, r.lost_steps), (Tier::Peer, 0), "{:#?}", out.events);
    let plans = out.plans();
    assert_eq!(plans.len(), 1, "{:#?}", out.events);
    let mut nodes: Vec<&str> = plans[0].nodes.iter().map(|n| n.as_str()).collect();
    nodes.sort();
    assert_eq!(nodes, ["node-0", "node-1", "node-2", "node-3"], "{plans:?}");
    let mut fenced = out.fenced.clone();
    fenced.sort();
    assert_eq!(fenced, ["node-0", "node-1", "node-2", "node-3"]);
    out.assert_bit_identical();
}

/// A node agent's control link cut in the middle of step 3 (its node otherwise fine): the
/// coordinator sees the agent's connection close, and the agent — its coordinator gone — ends
/// with its workers, as the real agent does. That is the node's loss: its stage is replaced mid-
/// step on a neighbour's node, and the pipeline shrinks at the step's boundary.
#[test]
fn an_agents_cut_link_loses_its_node_mid_step() {
    let out = harness::run(
        "cut-agent-link",
        4,
        &[],
        vec![Rule::at(1, 3, Pos::Action(20), |c, id| {
            c.wait_held(2, 2);
            c.cut_agent_link(&id.node);
            Verdict::Go
        })],
    );
    assert_eq!(
        out.result,
        Ok(harness::STEPS),
        "the run failed; events: {:#?}",
        out.events
    );
    let r = out.recoveries();
    assert_eq!(r.len(), 2, "{:#?}", out.events);
    assert_eq!(
        (
            r[0].tier,
            r[0].stage,
            r[0].node.as_ref().map(|n| n.as_str())
        ),
        (Tier::MidStep, Some(1), Some("node-1")),
        "{:#?}",
        out.events
    );
    assert_eq!(
        (r[1].tier, r[1].stages_before, r[1].stages_after),
        (Tier::Handover, 4, 3),
        "{:#?}",
        out.events
    );
    let lost = out.lost();
    assert_eq!(lost.len(), 1, "{:#?}", out.events);
    assert_eq!(
        (lost[0].node.as_str(), lost[0].agent_alive),
        ("node-1", false)
    );
    assert!(
        lost[0].reason.contains("agent's connection closed"),
        "{:?}",
        lost[0]
    );
    out.assert_bit_identical();
}

/// A worker's control link cut in the middle of step 3 (the worker and its node otherwise
/// fine): the coordinator sees the worker's connection close and replaces its stage mid-step on
/// the same node (its agent lives); nothing is lost.
#[test]
fn a_workers_cut_control_link_is_repaired_mid_step() {
    let out = harness::run(
        "cut-worker-link",
        4,
        &[],
        vec![Rule::at(2, 3, Pos::Action(20), |c, id| {
            c.wait_held(2, 2);
            c.cut_worker_link(id.stage);
            Verdict::Go
        })],
    );
    assert_eq!(
        out.result,
        Ok(harness::STEPS),
        "the run failed; events: {:#?}",
        out.events
    );
    let r = out.the_recovery();
    assert_eq!(
        (
            r.tier,
            r.stage,
            r.host.as_ref().map(|n| n.as_str()),
            r.stages_after
        ),
        (Tier::MidStep, Some(2), Some("node-2"), 4),
        "{:#?}",
        out.events
    );
    assert_eq!(out.lost_nodes(), ["node-2"]);
    assert!(out.lost()[0].agent_alive, "{:?}", out.lost()[0]);
    out.assert_bit_identical();
}
