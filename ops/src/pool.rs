//! The compute pool a training process runs its kernels in.
//!
//! The kernels' parallel loops (rayon) and `gemm`'s threads run on the pool of the thread that
//! calls them. Called from a thread outside any pool, every loop is handed to the global pool's
//! threads while the caller blocks, and the pool's idle threads then spin (`sched_yield`) before
//! they sleep: with one compute thread per worker, as on a small machine with several stage
//! workers, that is a cross-thread hand-off per kernel and CPU time taken from the other workers.
//! [`run_in_pool`] runs a whole job *inside* a pool instead: with one thread every loop runs inline
//! on the calling thread; with more, the caller is one of the pool's threads and takes part.
//! The arithmetic does not change: every kernel splits its work by the shapes, never by threads.

use std::io;

/// Runs `job` on a new pool of `threads` compute threads (0: rayon's default, which honours
/// `RAYON_NUM_THREADS`), named `name-N`, and returns its result. The calling thread waits.
pub fn run_in_pool<R: Send>(
    name: &str,
    threads: usize,
    job: impl FnOnce() -> R + Send,
) -> io::Result<R> {
    let prefix = name.to_string();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(move |i| format!("{prefix}-{i}"))
        .build()
        .map_err(|e| io::Error::other(format!("starting {threads} compute threads: {e}")))?;
    Ok(pool.install(job))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rayon::prelude::*;

    #[test]
    fn one_thread_runs_parallel_loops_on_the_calling_thread() {
        let (outer, inner) = run_in_pool("t", 1, || {
            let me = std::thread::current().id();
            let seen: Vec<_> = (0..64)
                .into_par_iter()
                .map(|_| std::thread::current().id())
                .collect();
            (me, seen)
        })
        .unwrap();
        assert!(inner.iter().all(|&id| id == outer));
    }

    #[test]
    fn results_come_back_and_two_threads_share_the_work() {
        let sum = run_in_pool("t", 2, || {
            assert_eq!(rayon::current_num_threads(), 2);
            (0..1000u64).into_par_iter().sum::<u64>()
        })
        .unwrap();
        assert_eq!(sum, 499_500);
    }
}
