//! Seconds from a config file or a command-line flag, checked once into a [`Duration`].
//!
//! `Duration::from_secs_f64` panics on NaN, negative and huge values, and `Instant + Duration`
//! panics on overflow; every `*_s` key and seconds flag goes through [`checked_seconds`] when it
//! is validated, so that later conversions ([`clamped_seconds`]) cannot fail.

use std::fmt;
use std::time::Duration;

/// The longest duration any key or flag accepts: 30 days.
pub const MAX_SECONDS: f64 = 30.0 * 24.0 * 3600.0;

/// Whether 0 seconds means something for a key (e.g. "no grace") or is refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Zero {
    /// 0 is a valid value.
    Allowed,
    /// The value must be above 0.
    Refused,
}

/// A number of seconds outside the accepted range.
#[derive(Clone, Copy, Debug, PartialEq, thiserror::Error)]
#[error("{value} is not a usable number of seconds; use a finite number {range} (30 days)", range = Range(*zero))]
pub struct SecondsError {
    /// The refused value.
    pub value: f64,
    /// Whether 0 would have been accepted.
    pub zero: Zero,
}

struct Range(Zero);

impl fmt::Display for Range {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Zero::Allowed => write!(f, "of 0 or more, at most {MAX_SECONDS}"),
            Zero::Refused => write!(f, "more than 0, at most {MAX_SECONDS}"),
        }
    }
}

/// `value` seconds as a [`Duration`], or why it is not a usable number of seconds: NaN,
/// infinite, negative, above [`MAX_SECONDS`], or 0 where `zero` refuses it.
pub fn checked_seconds(value: f64, zero: Zero) -> Result<Duration, SecondsError> {
    let usable = value.is_finite()
        && value <= MAX_SECONDS
        && match zero {
            Zero::Allowed => value >= 0.0,
            Zero::Refused => value > 0.0,
        };
    if usable {
        Ok(Duration::from_secs_f64(value))
    } else {
        Err(SecondsError { value, zero })
    }
}

/// `value` seconds as a [`Duration`] for a value already checked by [`checked_seconds`]; never
/// panics: NaN and negative values give zero, values above [`MAX_SECONDS`] give `MAX_SECONDS`.
pub fn clamped_seconds(value: f64) -> Duration {
    if value.is_nan() || value <= 0.0 {
        Duration::ZERO
    } else {
        Duration::from_secs_f64(value.min(MAX_SECONDS))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usable_seconds_convert() {
        assert_eq!(
            checked_seconds(1.5, Zero::Refused),
            Ok(Duration::from_millis(1500))
        );
        assert_eq!(checked_seconds(0.0, Zero::Allowed), Ok(Duration::ZERO));
        assert_eq!(
            checked_seconds(MAX_SECONDS, Zero::Refused),
            Ok(Duration::from_secs(30 * 24 * 3600))
        );
    }

    #[test]
    fn unusable_seconds_say_the_range() {
        for value in [
            f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
            -1.0,
            1e19,
            1e300,
            MAX_SECONDS + 1.0,
        ] {
            for zero in [Zero::Allowed, Zero::Refused] {
                let err = checked_seconds(value, zero).unwrap_err();
                let msg = err.to_string();
                assert!(msg.contains("2592000"), "{msg}");
            }
        }
        let msg = checked_seconds(0.0, Zero::Refused).unwrap_err().to_string();
        assert!(msg.contains("more than 0"), "{msg}");
    }

    #[test]
    fn clamped_never_panics() {
        assert_eq!(clamped_seconds(f64::NAN), Duration::ZERO);
        assert_eq!(clamped_seconds(-3.0), Duration::ZERO);
        assert_eq!(clamped_seconds(1e300), Duration::from_secs_f64(MAX_SECONDS));
        assert_eq!(
            clamped_seconds(f64::INFINITY),
            Duration::from_secs_f64(MAX_SECONDS)
        );
    }
}
