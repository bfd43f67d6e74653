//! Reading the schedule vocabulary ([`ScheduleKind`], [`Unit`], [`Action`]) back from its text
//! form, with a [`ScheduleError::Parse`] that names what could not be read. Apart from the types
//! themselves (in `action`), so that the error type may name actions without a circle.

use std::str::FromStr;

use super::action::{Action, ScheduleKind, Unit};
use super::error::ScheduleError;

impl FromStr for ScheduleKind {
    type Err = ScheduleError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim();
        ScheduleKind::ALL
            .into_iter()
            .find(|k| k.as_str().eq_ignore_ascii_case(t))
            .ok_or_else(|| ScheduleError::Parse {
                what: "schedule kind",
                input: s.to_string(),
                reason: "allowed values are \"gpipe\", \"1f1b\", \"seq1f1b\"".to_string(),
            })
    }
}

impl TryFrom<String> for ScheduleKind {
    type Error = ScheduleError;

    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

/// A [`Unit`] from its text form `"i.j"` (the type lives in the `model` crate, so this is a
/// function rather than `FromStr`).
pub fn parse_unit(s: &str) -> Result<Unit, ScheduleError> {
    let err = |reason: &str| ScheduleError::Parse {
        what: "unit",
        input: s.to_string(),
        reason: reason.to_string(),
    };
    let (i, j) = s
        .split_once('.')
        .ok_or_else(|| err("expected \"<micro_batch>.<segment>\", e.g. \"0.1\""))?;
    let parse = |x: &str| {
        // `usize::from_str` accepts a leading '+'; we do not.
        if x.is_empty() || !x.bytes().all(|b| b.is_ascii_digit()) {
            return Err(err("indices must be non-negative decimal integers"));
        }
        x.parse::<usize>()
            .map_err(|_| err("index does not fit in usize"))
    };
    Ok(Unit::new(parse(i)?, parse(j)?))
}

impl FromStr for Action {
    type Err = ScheduleError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        // Two-letter prefixes first: "RF0.0" must not be read as "R" + "F0.0".
        type Ctor = fn(Unit) -> Action;
        const CTORS: [(&str, Ctor); 6] = [
            ("RF", Action::RecvActivation),
            ("SF", Action::SendActivation),
            ("RB", Action::RecvGrad),
            ("SB", Action::SendGrad),
            ("F", Action::Forward),
            ("B", Action::Backward),
        ];
        let t = s.trim();
        for (prefix, ctor) in CTORS {
            if let Some(rest) = t.strip_prefix(prefix) {
                let unit = parse_unit(rest).map_err(|e| ScheduleError::Parse {
                    what: "action",
                    input: s.to_string(),
                    reason: format!("bad unit after {prefix:?}: {e}"),
                })?;
                return Ok(ctor(unit));
            }
        }
        Err(ScheduleError::Parse {
            what: "action",
            input: s.to_string(),
            reason: "expected F, B, RF, SF, RB or SB followed by \"<micro_batch>.<segment>\", \
                     e.g. \"F0.1\""
                .to_string(),
        })
    }
}

impl TryFrom<String> for Action {
    type Error = ScheduleError;

    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}
