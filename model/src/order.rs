//! The order in which a stage may run a micro-batch's units (Seq1F1B's K/V rule), written once for
//! every device: a segment's forward needs the K/V of exactly the segments before it, and its
//! backward runs only after every later segment's (whose dK/dV it receives). Each device tracks how
//! many positions of the micro-batch are cached and asks these before it computes.

use crate::error::ModelError;
use crate::unit::Unit;

/// The forward of `unit`, a segment starting at position `start`, may run with positions
/// `0..cached` of its micro-batch cached: only when the segments before it (and none after) ran.
pub fn check_forward(unit: Unit, cached: usize, start: usize) -> Result<(), ModelError> {
    if cached != start {
        return Err(ModelError::Order {
            unit,
            reason: format!(
                "forward needs the K/V of positions 0..{start} but {cached} are cached (segments must run in order)"
            ),
        });
    }
    Ok(())
}

/// The backward of `unit`, a segment of positions `start..start + len` whose forward ran, may run
/// with positions `0..cached` still cached: only when every later segment's backward ran (each
/// drops its own positions), so that the dK/dV of this segment's keys and values are complete.
pub fn check_backward(
    unit: Unit,
    cached: usize,
    start: usize,
    len: usize,
) -> Result<(), ModelError> {
    if cached != start + len {
        return Err(ModelError::Order {
            unit,
            reason:
                "backward must run after the backward of every later segment of the micro-batch"
                    .into(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_run_forward_in_order_and_backward_in_reverse() {
        // Segments of lengths 3 and 5: forward 0 then 1, backward 1 then 0.
        let (u0, u1) = (Unit::new(0, 0), Unit::new(0, 1));
        check_forward(u0, 0, 0).unwrap();
        assert!(
            matches!(check_forward(u1, 0, 3), Err(ModelError::Order { unit, .. }) if unit == u1)
        );
        check_forward(u1, 3, 3).unwrap();
        assert!(
            check_forward(u0, 8, 0).is_err(),
            "a segment's forward twice"
        );
        assert!(
            check_backward(u0, 8, 0, 3).is_err(),
            "segment 0 before segment 1"
        );
        check_backward(u1, 8, 3, 5).unwrap();
        check_backward(u0, 3, 0, 3).unwrap();
    }
}
