//! A stage's state at a step boundary that may still be on its way off the device. The worker
//! takes one between steps without waiting for the copy; the threads that upload checkpoints and
//! send peer snapshots wait for it. Clones share one copy, resolved once by whichever asks first.

use std::sync::{Arc, Mutex, OnceLock};

use candle_core::Tensor;

use super::error::ModelError;

/// Named host tensors: parameters, then AdamW's moments (see `StageCompute::state`).
pub type NamedTensors = Vec<(String, Tensor)>;

type Resolve = Box<dyn FnOnce() -> Result<NamedTensors, ModelError> + Send>;

/// The state after one update: ready, or a copy in flight.
#[derive(Clone)]
pub struct StateSnapshot {
    cell: Arc<Cell>,
}

struct Cell {
    pending: Mutex<Option<Resolve>>,
    done: OnceLock<Result<NamedTensors, String>>,
}

impl StateSnapshot {
    /// A snapshot already on the host.
    pub fn ready(tensors: NamedTensors) -> Self {
        let done = OnceLock::new();
        let _ = done.set(Ok(tensors));
        Self::from_cell(None, done)
    }

    /// A snapshot that `resolve` waits for (it runs once, on the first thread that asks).
    pub fn pending(
        resolve: impl FnOnce() -> Result<NamedTensors, ModelError> + Send + 'static,
    ) -> Self {
        Self::from_cell(Some(Box::new(resolve)), OnceLock::new())
    }

    fn from_cell(pending: Option<Resolve>, done: OnceLock<Result<NamedTensors, String>>) -> Self {
        StateSnapshot {
            cell: Arc::new(Cell {
                pending: Mutex::new(pending),
                done,
            }),
        }
    }

    /// The tensors, waiting for the copy if it is still running. A failed copy fails every
    /// clone with the same message.
    pub fn tensors(&self) -> Result<NamedTensors, ModelError> {
        self.cell
            .done
            .get_or_init(|| {
                let resolve = self
                    .cell
                    .pending
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .take();
                match resolve {
                    Some(resolve) => resolve().map_err(|e| e.to_string()),
                    // Only reachable if a resolve panicked inside `get_or_init`.
                    None => Err("the copy of this snapshot was abandoned".into()),
                }
            })
            .clone()
            .map_err(ModelError::StateCopy)
    }
}

impl std::fmt::Debug for StateSnapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match self.cell.done.get() {
            None => "in flight",
            Some(Ok(_)) => "ready",
            Some(Err(_)) => "failed",
        };
        f.debug_struct("StateSnapshot")
            .field("copy", &state)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn one() -> NamedTensors {
        vec![(
            "w".into(),
            Tensor::new(&[1.0f32, 2.0], &Device::Cpu).unwrap(),
        )]
    }

    #[test]
    fn clones_share_one_copy_resolved_once_on_any_thread() {
        let runs = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&runs);
        let snap = StateSnapshot::pending(move || {
            counted.fetch_add(1, Ordering::SeqCst);
            Ok(one())
        });
        let clones: Vec<_> = (0..4).map(|_| snap.clone()).collect();
        let handles: Vec<_> = clones
            .into_iter()
            .map(|s| std::thread::spawn(move || s.tensors().unwrap()))
            .collect();
        for h in handles {
            let t = h.join().unwrap();
            assert_eq!(t[0].1.to_vec1::<f32>().unwrap(), vec![1.0, 2.0]);
        }
        assert_eq!(snap.tensors().unwrap().len(), 1);
        assert_eq!(runs.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_failed_copy_fails_every_clone_with_its_message() {
        let snap =
            StateSnapshot::pending(|| Err(ModelError::Device("the DMA engine caught fire".into())));
        let other = snap.clone();
        for s in [snap, other] {
            let e = s.tensors().unwrap_err().to_string();
            assert!(e.contains("the DMA engine caught fire"), "{e}");
        }
    }

    #[test]
    fn a_ready_snapshot_needs_no_copy() {
        let snap = StateSnapshot::ready(one());
        assert_eq!(format!("{snap:?}"), "StateSnapshot { copy: \"ready\" }");
        assert_eq!(snap.tensors().unwrap()[0].0, "w");
    }
}
