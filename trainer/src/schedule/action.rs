//! The vocabulary of schedules: which schedule ([`ScheduleKind`]), what is scheduled ([`Unit`]),
//! and what a stage does with it ([`Action`]).
//!
//! Every type here prints and parses (in `parse`) in a compact text form (PyTorch `_Action` style), and
//! serializes to JSON as that same string, so that a schedule can be written to a file, read
//! back, and diffed by eye:
//!
//! | text     | meaning                                            |
//! |----------|----------------------------------------------------|
//! | `F0.1`   | forward of micro-batch 0, segment 1                |
//! | `B0.1`   | backward of micro-batch 0, segment 1               |
//! | `RF0.1`  | receive the unit's input activation (from r−1)     |
//! | `SF0.1`  | send the unit's output activation (to r+1)         |
//! | `RB0.1`  | receive the gradient of the unit's output (from r+1) |
//! | `SB0.1`  | send the gradient of the unit's input (to r−1)     |

use std::fmt;

use serde::{Deserialize, Serialize};

/// Which pipeline schedule.
///
/// Text and JSON forms are `"gpipe"`, `"1f1b"` and `"seq1f1b"`; parsing ignores ASCII case and
/// a wrong name is an error that lists the allowed values.
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
}

impl ScheduleKind {
    /// All kinds, in the order they are listed in error messages.
    pub const ALL: [ScheduleKind; 3] = [
        ScheduleKind::GPipe,
        ScheduleKind::OneFOneB,
        ScheduleKind::Seq1F1B,
    ];

    /// The canonical name (`"gpipe"`, `"1f1b"`, `"seq1f1b"`).
    pub fn as_str(self) -> &'static str {
        match self {
            ScheduleKind::GPipe => "gpipe",
            ScheduleKind::OneFOneB => "1f1b",
            ScheduleKind::Seq1F1B => "seq1f1b",
        }
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

/// A stage's action on one unit.
///
/// Text form (see the module docs): `F0.1`, `B0.1`, `RF0.1`, `SF0.1`, `RB0.1`, `SB0.1`.
/// JSON form is the same string.
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
}

impl Action {
    /// The unit this action is about.
    pub fn unit(self) -> Unit {
        match self {
            Action::Forward(u)
            | Action::Backward(u)
            | Action::RecvActivation(u)
            | Action::SendActivation(u)
            | Action::RecvGrad(u)
            | Action::SendGrad(u) => u,
        }
    }

    /// True for [`Action::Forward`] and [`Action::Backward`] (the actions that take time).
    pub fn is_compute(self) -> bool {
        matches!(self, Action::Forward(_) | Action::Backward(_))
    }

    /// True for the backward-pass actions: [`Action::Backward`], [`Action::RecvGrad`],
    /// [`Action::SendGrad`].
    pub fn is_backward_pass(self) -> bool {
        matches!(
            self,
            Action::Backward(_) | Action::RecvGrad(_) | Action::SendGrad(_)
        )
    }

    /// The text prefix of this action (`"F"`, `"B"`, `"RF"`, `"SF"`, `"RB"`, `"SB"`).
    pub fn prefix(self) -> &'static str {
        match self {
            Action::Forward(_) => "F",
            Action::Backward(_) => "B",
            Action::RecvActivation(_) => "RF",
            Action::SendActivation(_) => "SF",
            Action::RecvGrad(_) => "RB",
            Action::SendGrad(_) => "SB",
        }
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.prefix(), self.unit())
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
                && e.contains("gpipe")
                && e.contains("1f1b")
                && e.contains("seq1f1b"),
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
    fn bad_actions_are_rejected_with_the_input() {
        for bad in [
            "", "F", "X0.1", "F0", "F0.", "F.1", "F-1.0", "F+1.0", "RX0.0", "F0.1.2", "f0.1",
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
