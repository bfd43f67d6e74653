//! Reading the schedule vocabulary ([`ScheduleKind`], [`Unit`], [`Action`]) back from its text
//! form, with a [`ScheduleError::Parse`] that names what could not be read. Apart from the types
//! themselves (in `action`), so that the error type may name actions without a circle.

use std::str::FromStr;

use super::action::{Action, Op, ScheduleKind, Unit};
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
                reason: format!(
                    "allowed values are {}",
                    ScheduleKind::ALL
                        .iter()
                        .map(|k| format!("{:?}", k.as_str()))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
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
        let err = |reason: String| ScheduleError::Parse {
            what: "action",
            input: s.to_string(),
            reason,
        };
        let t = s.trim();
        // `Op::ALL` lists two-letter prefixes first: "RF0.0" must not be read as "R" + "F0.0".
        let Some((op, rest)) = Op::ALL
            .into_iter()
            .find_map(|op| t.strip_prefix(op.prefix()).map(|rest| (op, rest)))
        else {
            return Err(err(
                "expected F, B, I, W, RF, SF, RB or SB followed by \"<micro_batch>.<segment>\" \
                 and optionally \"@<chunk>\", e.g. \"F0.1\" or \"RB2.0@1\""
                    .to_string(),
            ));
        };
        let (unit, chunk) = match rest.split_once('@') {
            None => (rest, 0),
            Some((unit, chunk)) => {
                if chunk.is_empty() || !chunk.bytes().all(|b| b.is_ascii_digit()) {
                    return Err(err(format!(
                        "the chunk after '@' must be a decimal integer, got {chunk:?}"
                    )));
                }
                let c = chunk
                    .parse::<usize>()
                    .map_err(|_| err(format!("chunk {chunk:?} does not fit in usize")))?;
                if c == 0 {
                    return Err(err(
                        "chunk 0 is written without \"@0\" (one text per action)".to_string(),
                    ));
                }
                (unit, c)
            }
        };
        let prefix = op.prefix();
        let unit = parse_unit(unit).map_err(|e| err(format!("bad unit after {prefix:?}: {e}")))?;
        Ok(Action::new(op, unit, chunk))
    }
}

impl TryFrom<String> for Action {
    type Error = ScheduleError;

    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}
