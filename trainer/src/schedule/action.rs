//! The vocabulary of schedules: which schedule ([`ScheduleKind`]), what is scheduled ([`Unit`]),
//! and what a worker does with it ([`Action`], built from an [`Op`], a unit and a chunk).
//!
//! Every type here prints and parses (in `parse`) in a compact text form (PyTorch `_Action` style), and
//! serializes to JSON as that same string, so that a schedule can be written to a file, read
//! back, and diffed by eye:
//!
//! | text     | meaning                                            |
//! |----------|----------------------------------------------------|
//! | `F0.1`   | forward of micro-batch 0, segment 1                |
//! | `B0.1`   | backward of micro-batch 0, segment 1 (whole: input and weight gradients) |
//! | `I0.1`   | the input-gradient half of the backward (zero-bubble schedules) |
//! | `W0.1`   | the weight-gradient half of the backward (after `I0.1`) |
//! | `RF0.1`  | receive the unit's input activation (from the previous stage) |
//! | `SF0.1`  | send the unit's output activation (to the next stage) |
//! | `RB0.1`  | receive the gradient of the unit's output (from the next stage) |
//! | `SB0.1`  | send the gradient of the unit's input (to the previous stage) |
//! | `F0.1@1` | any of the above on the worker's chunk 1 (virtual stages) |
//!
//! **Chunks.** With `v` virtual stages a worker r of p holds v chunks of layers: its local chunk
//! c is virtual stage `c·p + r` of the `v·p`. An action without `@` is on local chunk 0, which is
//! the whole stage when `v = 1`, so the schedules without virtual stages print exactly as before.
//! "Previous" and "next" stage are the neighbouring *virtual* stages: worker `r−1 mod p` and
//! `r+1 mod p`.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Which pipeline schedule.
///
/// Text and JSON forms are `"gpipe"`, `"1f1b"`, `"seq1f1b"`, `"1f1b-i"`, `"seq1f1b-i"` and
/// `"seq1f1b-zb"`; parsing ignores ASCII case and a wrong name is an error that lists the allowed
/// values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum ScheduleKind {
    /// All forwards of the step, then all backwards (`"gpipe"`).
    GPipe,
    /// Classic 1F1B over whole micro-batches; a micro-batch's forward is its k segment forwards in
    /// order, its backward the k segment backwards in reverse (`"1f1b"`).
    OneFOneB,
    /// Seq1F1B: 1F1B over (micro-batch, segment) units (`"seq1f1b"`).
    Seq1F1B,
    /// Megatron's interleaved 1F1B over whole micro-batches, v ≥ 2 chunks per worker
    /// (`"1f1b-i"`).
    OneFOneBInterleaved,
    /// Seq1F1B-I: the reference's interleaved Seq1F1B over units, v ≥ 2 chunks per worker
    /// (`"seq1f1b-i"`).
    Seq1F1BInterleaved,
    /// Zero-bubble Seq1F1B: every backward split into its input half (`I`) and weight half
    /// (`W`), the weight halves moved into the bubbles at Seq1F1B's peak memory
    /// (`"seq1f1b-zb"`).
    Seq1F1BZeroBubble,
}

impl ScheduleKind {
    /// All kinds, in the order they are listed in error messages.
    pub const ALL: [ScheduleKind; 6] = [
        ScheduleKind::GPipe,
        ScheduleKind::OneFOneB,
        ScheduleKind::Seq1F1B,
        ScheduleKind::OneFOneBInterleaved,
        ScheduleKind::Seq1F1BInterleaved,
        ScheduleKind::Seq1F1BZeroBubble,
    ];

    /// The canonical name (`"gpipe"`, `"1f1b"`, `"seq1f1b"`, `"1f1b-i"`, `"seq1f1b-i"`,
    /// `"seq1f1b-zb"`).
    pub fn as_str(self) -> &'static str {
        match self {
            ScheduleKind::GPipe => "gpipe",
            ScheduleKind::OneFOneB => "1f1b",
            ScheduleKind::Seq1F1B => "seq1f1b",
            ScheduleKind::OneFOneBInterleaved => "1f1b-i",
            ScheduleKind::Seq1F1BInterleaved => "seq1f1b-i",
            ScheduleKind::Seq1F1BZeroBubble => "seq1f1b-zb",
        }
    }

    /// True for the interleaved kinds, which need `virtual_stages ≥ 2` (all others need 1).
    pub fn is_interleaved(self) -> bool {
        matches!(
            self,
            ScheduleKind::OneFOneBInterleaved | ScheduleKind::Seq1F1BInterleaved
        )
    }

    /// True for the zero-bubble kind, whose backwards run split into an input half (`I`) and a
    /// weight half (`W`): the stage runtime runs it on CPU stages over TCP, mid-step recovery
    /// included (see `Config::validate` for what it refuses).
    pub fn splits_backward(self) -> bool {
        self == ScheduleKind::Seq1F1BZeroBubble
    }

    /// The kinds the stage runtime runs with one layer chunk per worker, with whole or split
    /// backwards: those whose mid-step recovery `trainer/tests/schedule_resume.rs` covers (the
    /// interleaved ones have their own tests).
    pub fn runtime_kinds() -> impl Iterator<Item = ScheduleKind> {
        Self::ALL.into_iter().filter(|k| !k.is_interleaved())
    }
}

impl fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl From<ScheduleKind> for String {
    fn from(k: ScheduleKind) -> String {
        k.as_str().to_string()
    }
}

/// One schedulable unit (micro-batch, segment), text form `"i.j"`: defined with the model, which
/// names units in its errors; read back from text by [`super::parse`].
pub use ::model::Unit;

/// What an action does, whatever its unit and chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Op {
    /// Run the chunk's layers forward (text `F`).
    Forward,
    /// The whole backward: input and weight gradients (text `B`).
    Backward,
    /// The input-gradient half of the backward (text `I`): the gradient sent to the previous
    /// stage and the dK/dV carried to the micro-batch's earlier segments. Critical path.
    BackwardInput,
    /// The weight-gradient half of the backward (text `W`), after the unit's `I`: accumulates
    /// the parameter gradients. Off the critical path.
    BackwardWeight,
    /// Receive the unit's input activation from the previous stage (text `RF`).
    RecvActivation,
    /// Send the unit's output activation to the next stage (text `SF`).
    SendActivation,
    /// Receive the gradient of the unit's output from the next stage (text `RB`).
    RecvGrad,
    /// Send the gradient of the unit's input to the previous stage (text `SB`).
    SendGrad,
}

impl Op {
    /// Every op, two-letter prefixes first (the order the parser tries them in).
    pub const ALL: [Op; 8] = [
        Op::RecvActivation,
        Op::SendActivation,
        Op::RecvGrad,
        Op::SendGrad,
        Op::Forward,
        Op::Backward,
        Op::BackwardInput,
        Op::BackwardWeight,
    ];

    /// The text prefix (`"F"`, `"B"`, `"I"`, `"W"`, `"RF"`, `"SF"`, `"RB"`, `"SB"`).
    pub fn prefix(self) -> &'static str {
        match self {
            Op::Forward => "F",
            Op::Backward => "B",
            Op::BackwardInput => "I",
            Op::BackwardWeight => "W",
            Op::RecvActivation => "RF",
            Op::SendActivation => "SF",
            Op::RecvGrad => "RB",
            Op::SendGrad => "SB",
        }
    }

    /// True for the ops that take compute time: `F`, `B`, `I`, `W`.
    pub fn is_compute(self) -> bool {
        matches!(
            self,
            Op::Forward | Op::Backward | Op::BackwardInput | Op::BackwardWeight
        )
    }

    /// True for the ops that produce the gradient of the unit's input (`B` and `I`): what a
    /// `SendGrad` sends and what the earlier segments' dK/dV wait for.
    pub fn is_input_backward(self) -> bool {
        matches!(self, Op::Backward | Op::BackwardInput)
    }
}

/// A worker's action on one unit.
///
/// Text form (see the module docs): `F0.1`, `B0.1`, `I0.1`, `W0.1`, `RF0.1`, `SF0.1`, `RB0.1`,
/// `SB0.1`, with `@c` appended for local chunk c ≥ 1. JSON form is the same string.
///
/// The six plain variants are the actions of schedules without virtual stages or split
/// backwards (and what the stage runtime executes today). [`Action::Extended`] says everything
/// else. Build actions with [`Action::new`], which picks the plain variant whenever one can say
/// it, so that every action has exactly one form; [`super::validate`] refuses an `Extended` that
/// a plain variant could say.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum Action {
    /// Run the stage's layers forward on the unit (text `F`).
    Forward(Unit),
    /// Run the stage's layers backward on the unit (text `B`).
    Backward(Unit),
    /// Receive the unit's input activation from stage r−1 (text `RF`).
    RecvActivation(Unit),
    /// Send the unit's output activation to stage r+1 (text `SF`).
    SendActivation(Unit),
    /// Receive the gradient of the unit's output from stage r+1 (text `RB`).
    RecvGrad(Unit),
    /// Send the gradient of the unit's input to stage r−1 (text `SB`).
    SendGrad(Unit),
    /// Any op on any local chunk: for a split backward half (`I`, `W`) or a chunk ≥ 1.
    Extended {
        /// What is done.
        op: Op,
        /// On which unit.
        unit: Unit,
        /// On which of the worker's chunks (0..v; virtual stage `chunk·p + worker`).
        chunk: usize,
    },
}

impl Action {
    /// The action `op` on `unit` on local chunk `chunk`, in its one canonical form.
    pub fn new(op: Op, unit: Unit, chunk: usize) -> Action {
        if chunk == 0 {
            match op {
                Op::Forward => return Action::Forward(unit),
                Op::Backward => return Action::Backward(unit),
                Op::RecvActivation => return Action::RecvActivation(unit),
                Op::SendActivation => return Action::SendActivation(unit),
                Op::RecvGrad => return Action::RecvGrad(unit),
                Op::SendGrad => return Action::SendGrad(unit),
                Op::BackwardInput | Op::BackwardWeight => {}
            }
        }
        Action::Extended { op, unit, chunk }
    }

    /// The same action with another op (same unit and chunk).
    pub fn with_op(self, op: Op) -> Action {
        Action::new(op, self.unit(), self.chunk())
    }

    /// The unit this action is about.
    pub fn unit(self) -> Unit {
        match self {
            Action::Forward(u)
            | Action::Backward(u)
            | Action::RecvActivation(u)
            | Action::SendActivation(u)
            | Action::RecvGrad(u)
            | Action::SendGrad(u) => u,
            Action::Extended { unit, .. } => unit,
        }
    }

    /// What this action does.
    pub fn op(self) -> Op {
        match self {
            Action::Forward(_) => Op::Forward,
            Action::Backward(_) => Op::Backward,
            Action::RecvActivation(_) => Op::RecvActivation,
            Action::SendActivation(_) => Op::SendActivation,
            Action::RecvGrad(_) => Op::RecvGrad,
            Action::SendGrad(_) => Op::SendGrad,
            Action::Extended { op, .. } => op,
        }
    }

    /// The worker's local chunk this action is on (0 for the plain variants).
    pub fn chunk(self) -> usize {
        match self {
            Action::Extended { chunk, .. } => chunk,
            _ => 0,
        }
    }

    /// True when this is the one canonical form of the action (see [`Action::new`]).
    pub fn is_canonical(self) -> bool {
        Action::new(self.op(), self.unit(), self.chunk()) == self
    }

    /// True for the actions that take time: `F`, `B`, `I`, `W`.
    pub fn is_compute(self) -> bool {
        self.op().is_compute()
    }

    /// True for the backward-pass actions: `B`, `I`, `W`, `RB`, `SB`.
    pub fn is_backward_pass(self) -> bool {
        matches!(
            self.op(),
            Op::Backward | Op::BackwardInput | Op::BackwardWeight | Op::RecvGrad | Op::SendGrad
        )
    }

    /// The text prefix of this action's op (`"F"`, `"B"`, `"I"`, `"W"`, `"RF"`, `"SF"`, `"RB"`,
    /// `"SB"`).
    pub fn prefix(self) -> &'static str {
        self.op().prefix()
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.prefix(), self.unit())?;
        match self.chunk() {
            0 => Ok(()),
            c => write!(f, "@{c}"),
        }
    }
}

impl From<Action> for String {
    fn from(a: Action) -> String {
        a.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kind_round_trips_and_lists_allowed_values() {
        for k in ScheduleKind::ALL {
            assert_eq!(k.to_string().parse::<ScheduleKind>().unwrap(), k);
            let json = serde_json::to_string(&k).unwrap();
            assert_eq!(json, format!("\"{k}\""));
            assert_eq!(serde_json::from_str::<ScheduleKind>(&json).unwrap(), k);
        }
        assert_eq!(
            "Seq1F1B".parse::<ScheduleKind>().unwrap(),
            ScheduleKind::Seq1F1B
        );
        let e = "zb-v".parse::<ScheduleKind>().unwrap_err().to_string();
        assert!(
            e.contains("zb-v")
                && ScheduleKind::ALL
                    .iter()
                    .all(|k| e.contains(&format!("{:?}", k.as_str()))),
            "{e}"
        );
        let e = serde_json::from_str::<ScheduleKind>("\"pipedream\"")
            .unwrap_err()
            .to_string();
        assert!(e.contains("seq1f1b"), "{e}");
    }

    #[test]
    fn action_round_trips() {
        let u = Unit::new(12, 3);
        for a in [
            Action::Forward(u),
            Action::Backward(u),
            Action::RecvActivation(u),
            Action::SendActivation(u),
            Action::RecvGrad(u),
            Action::SendGrad(u),
        ] {
            let s = a.to_string();
            assert_eq!(s.parse::<Action>().unwrap(), a, "{s}");
            let json = serde_json::to_string(&a).unwrap();
            assert_eq!(json, format!("\"{s}\""));
            assert_eq!(serde_json::from_str::<Action>(&json).unwrap(), a);
        }
        assert_eq!(Action::Forward(Unit::new(0, 1)).to_string(), "F0.1");
        assert_eq!(Action::RecvGrad(Unit::new(2, 0)).to_string(), "RB2.0");
        assert_eq!(
            "SB1.2".parse::<Action>().unwrap(),
            Action::SendGrad(Unit::new(1, 2))
        );
    }

    #[test]
    fn extended_actions_round_trip_in_one_form() {
        let u = Unit::new(3, 1);
        for op in Op::ALL {
            for chunk in [0, 1, 7] {
                let a = Action::new(op, u, chunk);
                assert!(a.is_canonical(), "{a:?}");
                assert_eq!((a.op(), a.unit(), a.chunk()), (op, u, chunk));
                let s = a.to_string();
                assert_eq!(s.parse::<Action>().unwrap(), a, "{s}");
                let json = serde_json::to_string(&a).unwrap();
                assert_eq!(serde_json::from_str::<Action>(&json).unwrap(), a);
                assert_eq!(s.ends_with("@1") || s.ends_with("@7"), chunk != 0, "{s}");
            }
        }
        // Chunk 0 of a plain op is the plain variant: old schedules print as before.
        assert_eq!(Action::new(Op::Forward, u, 0), Action::Forward(u));
        assert_eq!(Action::new(Op::Forward, u, 0).to_string(), "F3.1");
        assert_eq!(Action::new(Op::RecvGrad, u, 1).to_string(), "RB3.1@1");
        assert_eq!(Action::new(Op::BackwardInput, u, 0).to_string(), "I3.1");
        assert_eq!(Action::new(Op::BackwardWeight, u, 2).to_string(), "W3.1@2");
        let odd = Action::Extended {
            op: Op::Forward,
            unit: u,
            chunk: 0,
        };
        assert!(!odd.is_canonical());
        assert_eq!(
            odd.to_string().parse::<Action>().unwrap(),
            Action::Forward(u)
        );
    }

    #[test]
    fn bad_actions_are_rejected_with_the_input() {
        for bad in [
            "", "F", "X0.1", "F0", "F0.", "F.1", "F-1.0", "F+1.0", "RX0.0", "F0.1.2", "f0.1",
            "F0.1@", "F0.1@x", "F0.1@+1", "F0.1@0", "F0.1@1@1", "I0", "W@1",
        ] {
            let e = bad.parse::<Action>().unwrap_err().to_string();
            assert!(e.contains(&format!("{bad:?}")), "{bad}: {e}");
        }
    }

    #[test]
    fn units_order_forward_first() {
        let mut v = vec![Unit::new(1, 0), Unit::new(0, 1), Unit::new(0, 0)];
        v.sort();
        assert_eq!(v, vec![Unit::new(0, 0), Unit::new(0, 1), Unit::new(1, 0)]);
    }
}
