//! What this process has cost the machine so far (`getrusage`): minor page faults and user and
//! system CPU time. Steady-state training should fault no pages (its buffers are reused) and spend
//! little time in the kernel; workers report the difference per step, `bench step` per timed step.

use std::time::Duration;

/// Resource usage of this process (all its threads) since it started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProcessUsage {
    /// Minor page faults: pages the kernel had to map in (fresh memory, or memory given back).
    pub minor_faults: u64,
    /// CPU time in user mode.
    pub user: Duration,
    /// CPU time in the kernel (system calls, page faults).
    pub system: Duration,
}

impl ProcessUsage {
    /// The usage so far; zero if the kernel does not say.
    pub fn now() -> Self {
        // SAFETY: an all-zero rusage is a valid value, and `getrusage` only writes into it.
        let mut r: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: `r` is a valid, exclusively borrowed rusage.
        if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut r) } != 0 {
            return Self::default();
        }
        let time = |t: libc::timeval| {
            Duration::new(
                t.tv_sec.max(0) as u64,
                (t.tv_usec.clamp(0, 999_999) * 1000) as u32,
            )
        };
        Self {
            minor_faults: r.ru_minflt.max(0) as u64,
            user: time(r.ru_utime),
            system: time(r.ru_stime),
        }
    }

    /// What was used between `earlier` and `self`.
    pub fn since(&self, earlier: &Self) -> Self {
        Self {
            minor_faults: self.minor_faults.saturating_sub(earlier.minor_faults),
            user: self.user.saturating_sub(earlier.user),
            system: self.system.saturating_sub(earlier.system),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn touching_fresh_memory_counts_faults_and_time_only_grows() {
        let before = ProcessUsage::now();
        // 64 MiB of fresh pages, each touched once: at least one fault per 2 MiB huge page.
        let mut v = vec![0u8; 64 << 20];
        for i in (0..v.len()).step_by(4096) {
            v[i] = 1;
        }
        std::hint::black_box(&v);
        let used = ProcessUsage::now().since(&before);
        assert!(used.minor_faults >= 32, "{used:?}");
        assert!(used.user + used.system > Duration::ZERO, "{used:?}");
        assert_eq!(before.since(&ProcessUsage::now()), ProcessUsage::default());
    }
}
