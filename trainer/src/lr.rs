//! Learning-rate schedule: linear warm-up, then cosine decay to the minimum at the last step.

/// The learning rate of step `step` (1-based) of a schedule `total` steps long (later steps stay at `min`).
pub fn learning_rate(step: u64, total: u64, peak: f64, min: f64, warmup: u64) -> f64 {
    if step <= warmup {
        return peak * step as f64 / warmup as f64;
    }
    if total <= warmup + 1 {
        return peak;
    }
    let progress = (step - warmup - 1) as f64 / (total - warmup - 1) as f64;
    min + 0.5 * (peak - min) * (1.0 + (std::f64::consts::PI * progress.min(1.0)).cos())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warms_up_then_decays_to_min() {
        assert_eq!(learning_rate(1, 100, 1.0, 0.1, 10), 0.1);
        assert_eq!(learning_rate(10, 100, 1.0, 0.1, 10), 1.0);
        assert_eq!(learning_rate(11, 100, 1.0, 0.1, 10), 1.0);
        assert!((learning_rate(100, 100, 1.0, 0.1, 10) - 0.1).abs() < 1e-12);
        let mid = learning_rate(55, 100, 1.0, 0.1, 10);
        assert!(mid < 1.0 && mid > 0.1);
        assert_eq!(learning_rate(1, 1, 1.0, 0.1, 0), 1.0);
    }
}
